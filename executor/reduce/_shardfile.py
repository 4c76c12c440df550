"""A trained delta's shard: written by each host, read back by the shard's reducer.

A shard file is a delta file in the wire's format (zstd-framed safetensors, ``write_delta``):
one 1-D entry per slice of the shard, named by its key, holding the slice's elements of
``trained - start`` (a float dtype, or ``int8``/``int4`` blocks counted from the slice's first
element: the partition's cuts fall on block boundaries within each key, so these are the blocks
the whole key's delta would have). A reader trusts nothing in it but its hash (checked against
the one its writer reported, as every delta's is) and its layout, checked against the partition
it computes itself: every entry a slice of this shard, 1-D, of the slice's length; its decode is
bounded by the shard's size in float32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from executor.delta import (
    DEFAULT_SCHEME,
    DeltaFile,
    QuantizedDelta,
    QuantScheme,
    QuantTensor,
    ResidualUpdate,
    max_delta_bytes,
    quantize_key,
    read_delta,
    residual_keys,
    scheme_of,
    state_hash,
    trained_diff,
    trained_keys,
    trained_shapes,
    write_delta,
)
from executor.errors import BadArtifact, HashMismatch
from executor.reduce._partition import Partition, Slice, flat_slice
from executor.tensorfile import Header, TensorSpec, read_header, read_into, tensor_bytes


def read_slice(file: object, header: Header, spec: TensorSpec, piece: Slice) -> torch.Tensor:
    """Elements ``piece`` of one key of an open safetensors file, as a fresh 1-D tensor."""
    out = torch.empty(piece.numel, dtype=spec.dtype)
    if piece.numel:
        offset = header.data_offset + spec.start + piece.start * spec.dtype.itemsize
        read_into(file, offset, tensor_bytes(out))  # type: ignore[arg-type]  # an open binary file
    return out


def write_delta_shards(
    start_path: str,
    trained: Mapping[str, torch.Tensor],
    partition: Partition,
    dtype: torch.dtype | QuantScheme,
    paths: Sequence[str],
    feedback: ResidualUpdate | None = None,
) -> list[DeltaFile]:
    """``trained - start`` as the partition's shard files (``paths[j]`` for shard ``j``), each
    hashed as it is written. A float delta is made one shard at a time; a quantised one key by
    key (with ``feedback``, the previous residual added to each key first and the next staged
    whole: its blocks are the whole key's, cut where the shards are), its codes held until the
    shards are written. A shape change, or a non-finite value in a quantised delta, is a
    ``ValueError``; so is a quantised format whose block the partition's cuts do not respect."""
    if len(paths) != len(partition):
        raise ValueError(f"{len(partition)} shards need as many paths, got {len(paths)}")
    if isinstance(dtype, QuantScheme):
        if partition.align % dtype.block_size:
            raise ValueError(f"the partition's alignment {partition.align} cuts {dtype.name} blocks")
        return _quantized_shards(start_path, trained, partition, dtype, paths, feedback)
    written = []
    with open(start_path, "rb") as start:
        header = read_header(start)
        shipped = set(trained_keys(header, trained))
        cached: tuple[str, torch.Tensor] | None = None  # a key cut between two shards is read once
        for index, path in enumerate(paths):
            values: dict[str, torch.Tensor] = {}
            for piece in partition.shard(index):
                if piece.key not in shipped:
                    continue
                if cached is None or cached[0] != piece.key:
                    cached = (piece.key, trained[piece.key])
                base = read_slice(start, header, header.specs[piece.key], piece)
                values[piece.key] = trained_diff(flat_slice(cached[1], piece), base, dtype)
            written.append(write_delta(values, path))
    return written


def _quantized_shards(
    start_path: str,
    trained: Mapping[str, torch.Tensor],
    partition: Partition,
    scheme: QuantScheme,
    paths: Sequence[str],
    feedback: ResidualUpdate | None,
) -> list[DeltaFile]:
    codes: list[dict[str, QuantTensor]] = [{} for _ in paths]
    where: dict[str, list[tuple[int, Slice]]] = {}
    for index in range(len(partition)):
        for piece in partition.shard(index):
            where.setdefault(piece.key, []).append((index, piece))
    with open(start_path, "rb") as start:
        header = read_header(start)
        shapes = trained_shapes(header, trained)
        for name, value, dequantized in residual_keys(start, header, shapes, trained, feedback):
            for index, piece in where.get(name, []):  # the whole key's blocks, cut where the shards are
                codes[index][name] = quantize_key(
                    name, flat_slice(value, piece), scheme, flat_slice(dequantized, piece)
                )
    return [write_delta(QuantizedDelta(scheme, c), path) for c, path in zip(codes, paths, strict=True)]


def shard_bound(partition: Partition, index: int) -> int:
    """The most a shard file may decode to: its slices in float32, with their header."""
    pieces = partition.shard(index)
    return max_delta_bytes({p.key: torch.empty(p.numel, dtype=torch.float32, device="meta") for p in pieces})


def read_delta_shard(
    path: str, partition: Partition, index: int, expected: str | None = None
) -> dict[str, torch.Tensor]:
    """A host's shard ``index`` (a downloaded file), its layout checked against the partition:
    key -> 1-D float32 slice (a key the host did not train is absent: zero). ``BadArtifact`` for
    anything else; with ``expected`` (the hash its writer reported, its prefix naming the
    scheme), ``HashMismatch`` unless its values hash to it."""
    pieces = {piece.key: piece for piece in partition.shard(index)}
    values = read_delta(path, max_bytes=shard_bound(partition, index), allow_torch=False)
    for key, value in values.items():
        piece = pieces.get(key)
        if piece is None:
            raise BadArtifact(f"shard {index} has an entry for {key!r}, which is not one of its slices")
        if value.dim() != 1 or value.numel() != piece.numel or not value.dtype.is_floating_point:
            raise BadArtifact(
                f"shard {index}'s {key!r} is {value.dtype} {tuple(value.shape)}, not {piece.numel} floats"
            )
    if expected is not None and state_hash(values, scheme=scheme_of(expected, DEFAULT_SCHEME)) != expected:
        raise HashMismatch(f"shard {index} does not match the hash its writer reported", {"shard": index})
    return values
