"""The star path as a sharded round's fallback (docs/SHARDED.md): when a sharded round cannot
close (its reduces keep failing) or fewer than two hosts contributed, the orchestrator folds the
round itself, from the same objects the hosts wrote.

The global model and the outer optimiser's velocity are assembled from the store's state and
velocity shards (each checked against the partition and its recorded hash; the non-floating keys
from the session's first model, which no sync changes), each contributor's delta from its P
shards (checked against the hashes its round reported; a host whose shard does not hold is left
out), summed in sorted host order. After the star sync the new model and velocity are written
back as shards, so the next round is sharded again.

:func:`restore_shard` makes one shard's state and velocity again when its reducer's deferred
store was not confirmed (its host lost between its reduce and its apply, its PUT failed, or the
orchestrator resumed in between): from the shard's previous state and velocity, the round's
contributions and its sync object, all immutable in the store, by the reducer's own functions.
These two paths, both for failures, are the only ones that move tensor bytes through the
orchestrator.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from executor.delta import DEFAULT_SCHEME, apply_rule, scheme_of, state_hash, write_delta
from executor.errors import BadArtifact, HashMismatch
from executor.reduce import OuterRule, Partition, ShardSum, flat_slice, partition, read_delta_shard
from orchestrator.aggregate import RunningMean
from orchestrator.artifacts import ArtifactStore


def model_split(model: Mapping[str, torch.Tensor], count: int) -> Partition:
    """The session's partition, from its first model (the layout every round keeps)."""
    keys = [(name, model[name].numel()) for name in sorted(model) if model[name].is_floating_point()]
    return partition(keys, count)


def _fetch_shard(
    store: ArtifactStore, scratch: str, name: str, expected: str, split: Partition, index: int
) -> dict[str, torch.Tensor]:
    local = os.path.join(scratch, "fallback-shard.zst")
    store.fetch(name, local)
    try:
        return read_delta_shard(local, split, index, expected)
    finally:
        os.unlink(local)


def assemble(
    store: ArtifactStore,
    scratch: str,
    layout: Mapping[str, torch.Tensor],
    split: Partition,
    objects: list[dict[str, str]],
    *,
    floats_only: bool = False,
) -> dict[str, torch.Tensor]:
    """A whole state (fp32 floating keys) from its shard objects; the non-floating keys from
    ``layout`` unless ``floats_only`` (the velocity)."""
    out = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in layout.items() if v.is_floating_point()}
    for index, item in enumerate(objects):
        values = _fetch_shard(store, scratch, item["name"], item["hash"], split, index)
        for piece in split.shard(index):
            if piece.key in values:
                flat_slice(out[piece.key], piece).copy_(values[piece.key])
    if not floats_only:
        out.update({k: v for k, v in layout.items() if not v.is_floating_point()})
    return out


def fold(
    store: ArtifactStore,
    scratch: str,
    layout: Mapping[str, torch.Tensor],
    split: Partition,
    shards_of: Mapping[str, list[tuple[str, str]]],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The mean of the contributors' deltas (``host -> [(object name, hash)]`` by shard), each
    assembled from its shards and added in sorted host order; and why the others were left out."""
    mean, refused = RunningMean(layout), {}
    for host in sorted(shards_of):
        delta: dict[str, torch.Tensor] = {}
        try:
            for index, (name, expected) in enumerate(shards_of[host]):
                for key, value in _fetch_shard(store, scratch, name, expected, split, index).items():
                    if key not in delta:
                        delta[key] = torch.zeros(layout[key].shape, dtype=value.dtype)
                    piece = next(p for p in split.shard(index) if p.key == key)
                    flat_slice(delta[key], piece).copy_(value)
        except (BadArtifact, HashMismatch, OSError) as exc:
            refused[host] = f"its shard was refused by the fallback fold: {exc}"
            continue
        mean.add(delta)
    return (mean.mean() if mean.count else {}), refused


def publish_split(
    store: ArtifactStore,
    scratch: str,
    state: Mapping[str, torch.Tensor],
    split: Partition,
    name_of: Any,
) -> list[dict[str, str]]:
    """``state``'s floating keys written as the partition's shard objects (fp32 slices), named
    ``name_of(index)``: their names and hashes."""
    out = []
    for index in range(len(split)):
        values = {
            p.key: flat_slice(state[p.key].to(torch.float32), p).contiguous()
            for p in split.shard(index)
            if p.key in state
        }
        out.append({"name": name_of(index), "hash": publish_values(store, scratch, name_of(index), values)})
    return out


def publish_values(store: ArtifactStore, scratch: str, name: str, values: Mapping[str, torch.Tensor]) -> str:
    """``values`` written as a delta file and published as ``name``: its hash."""
    local = os.path.join(scratch, "fallback-out.zst")
    try:
        written = write_delta(values, local)
        store.publish(name, local)
    finally:
        if os.path.exists(local):
            os.unlink(local)
    return written.hash


def restore_shard(
    store: ArtifactStore,
    scratch: str,
    layout: Mapping[str, torch.Tensor],
    split: Partition,
    index: int,
    objects: Mapping[str, Any],
    rule: OuterRule,
    sync_dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Shard ``index``'s new state and velocity, made again. ``objects``: ``theta`` (the previous
    state shard, or None: the session's first model, ``layout``), ``velocity`` (the previous one,
    or None), ``contributions`` (in sorted host order) and ``sync``, each ``{name, hash}``; and
    ``result_hash``, what every host checked the sync makes. The state is the sync applied to
    theta (what the hosts hold: checked against ``result_hash``), the velocity the reducer's
    outer step on the contributions' mean (deterministic: the sum in the same order)."""

    def fetch(item: Mapping[str, str]) -> dict[str, torch.Tensor]:
        return _fetch_shard(store, scratch, item["name"], item["hash"], split, index)

    pieces = split.shard(index)
    theta = (
        fetch(objects["theta"])
        if objects.get("theta")
        else {p.key: flat_slice(layout[p.key], p).clone() for p in pieces}
    )
    total = ShardSum()
    for item in objects["contributions"]:
        total.add(fetch(item))
    velocity = fetch(objects["velocity"]) if objects.get("velocity") else None
    sync = fetch(objects["sync"])
    state = {p.key: apply_rule(theta[p.key], sync.get(p.key)) for p in pieces}
    if state_hash(state, scheme=scheme_of(objects["result_hash"], DEFAULT_SCHEME)) != objects["result_hash"]:
        raise HashMismatch(f"shard {index}'s sync does not make the state its hosts hold", {"shard": index})
    return state, total.reduce(rule, theta, velocity, sync_dtype).velocity
