"""The fixed split of a model's floating elements into N shards (docs/SHARDED.md).

The floating keys of the model, sorted by name and each flattened, are laid end to end; the
cut before shard ``j`` is the element ``j * total // N`` of that line, moved back to the start
of its ``align``-element block *within its key* (so a quantised block or a top-k chunk, which
are counted from each key's first element, never straddles two shards). A shard is the
contiguous run of slices between two cuts: at most one slice per key, a key cut in at most N
places. Every host, every reducer and the orchestrator compute the same partition from the
same model header and N; nothing about it travels in a file or a message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from executor.tensorfile import TensorSpec

# Elements: a multiple of the int8/int4 default block (64) and of a 64 x 64 top-k chunk.
SHARD_ALIGN = 4096
MAX_SHARDS = 1024  # a fleet's sharded round; the orchestrator signs N x N URLs a round


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of the flattened key ``key``."""

    key: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Partition:
    """N shards, each a tuple of slices in key order; together every floating element once."""

    shards: tuple[tuple[Slice, ...], ...]
    align: int

    def __len__(self) -> int:
        return len(self.shards)

    def shard(self, index: int) -> tuple[Slice, ...]:
        if not 0 <= index < len(self.shards):
            raise ValueError(f"shard {index} is not one of the partition's {len(self.shards)}")
        return self.shards[index]

    def numel(self, index: int) -> int:
        return sum(piece.numel for piece in self.shard(index))


def align_for(block_sizes: Iterable[int]) -> int:
    """The partition's alignment for a session whose delta formats cut blocks of these sizes."""
    out = SHARD_ALIGN
    for size in block_sizes:
        out = math.lcm(out, int(size))
    return out


def floating_keys(specs: Mapping[str, TensorSpec]) -> list[tuple[str, int]]:
    """(name, element count) of a model's floating keys, sorted: the line the cuts are made in."""
    out = []
    for name in sorted(specs):
        spec = specs[name]
        if spec.dtype.is_floating_point:
            out.append((name, math.prod(spec.shape)))
    return out


def partition(keys: list[tuple[str, int]], count: int, align: int = SHARD_ALIGN) -> Partition:
    """The partition of ``keys`` ((name, numel), sorted by name) into ``count`` shards."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"a sharded round has 1-{MAX_SHARDS} shards, not {count!r}")
    if align < 1:
        raise ValueError("the partition's alignment must be positive")
    if [name for name, _ in keys] != sorted({name for name, _ in keys}):
        raise ValueError("the partition's keys must be distinct and sorted")
    starts, total = [], 0
    for _, numel in keys:
        starts.append(total)
        total += numel
    cuts = [0]
    index = 0
    for j in range(1, count):
        target = j * total // count
        while index + 1 < len(keys) and starts[index + 1] <= target:
            index += 1
        offset = target - starts[index] if keys else 0
        cuts.append(max(cuts[-1], (starts[index] if keys else 0) + offset - offset % align))
    cuts.append(total)
    shards = []
    for j in range(count):
        lo, hi = cuts[j], cuts[j + 1]
        pieces = []
        for (name, numel), start in zip(keys, starts, strict=True):
            a, b = max(lo, start), min(hi, start + numel)
            if a < b:
                pieces.append(Slice(name, a - start, b - start))
        shards.append(tuple(pieces))
    return Partition(tuple(shards), align)


def model_partition(specs: Mapping[str, TensorSpec], count: int, align: int = SHARD_ALIGN) -> Partition:
    return partition(floating_keys(specs), count, align)


def flat_slice(tensor: torch.Tensor, piece: Slice) -> torch.Tensor:
    """The elements of ``piece`` of a whole key's tensor (a view where it can be)."""
    return tensor.reshape(-1)[piece.start : piece.stop]
