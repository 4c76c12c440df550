"""``reduce_shard``: one shard of a sharded round reduced on this host (docs/SHARDED.md).

The request names the shard, the partition (N and its alignment), the global model the round
stepped from (this host must hold it: its slices of that model are the shard's θ), the round's
contributors in any order (each host's shard object and the hash its host reported), the
shard's velocity of the last round (object and hash; none in the first), the outer rule and the
sync delta's dtype, and where the outcome goes. Each contributor's shard is downloaded within
the shard's bound, its layout checked against the partition this host computes and its hash
against the reported one, then summed in **sorted host order** one at a time; a bad one fails
the reduce with ``bad_artifact`` naming its host (the orchestrator drops it from the round and
redoes the reduce). The sync slices, the new state's slices and the velocity are each written
as a delta file and PUT; the result reports their hashes.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from executor import transfer
from executor.delta import DeltaFile, write_delta, zstd_bound
from executor.errors import BadArtifact, HashMismatch, InvalidRequest
from executor.fileio import remove_quietly
from executor.reduce import (
    MAX_SHARDS,
    SHARD_ALIGN,
    OuterRule,
    Partition,
    ShardSum,
    model_partition,
    read_delta_shard,
    read_slice,
    shard_bound,
)
from executor.session._requests import required_url
from executor.tensorfile import read_header
from executor.urls import Url

HASH = re.compile(r"^(sha256|blake3):[0-9a-f]{64}$")
HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_ALIGN = 1 << 24
SYNC_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Contribution:
    host: str
    url: Url
    hash: str


@dataclass(frozen=True)
class ReduceRequest:
    """One ``reduce_shard`` task, checked once where it enters."""

    shard: int
    count: int
    align: int
    base_hash: str
    contributions: tuple[Contribution, ...]  # sorted by host
    velocity: tuple[Url, str] | None
    rule: OuterRule
    sync_dtype: torch.dtype
    sync_url: Url
    state_url: Url
    velocity_url: Url

    @classmethod
    def parse(cls, args: Mapping[str, Any]) -> ReduceRequest:
        count = _integer("count", args.get("count"), 1, MAX_SHARDS)
        shard = _integer("shard", args.get("shard"), 0, count - 1)
        align = _integer("align", args.get("align", SHARD_ALIGN), SHARD_ALIGN, MAX_ALIGN)
        if align % SHARD_ALIGN:
            raise InvalidRequest(f"align must be a multiple of {SHARD_ALIGN}")
        base_hash = _hash("base_hash", args.get("base_hash"))
        contributions = _contributions(args.get("contributions"))
        velocity = args.get("velocity")
        if velocity is not None:
            if not isinstance(velocity, dict):
                raise InvalidRequest("velocity must be an object with url and hash")
            url = required_url("velocity.url", velocity.get("url"))
            velocity = (url, _hash("velocity.hash", velocity.get("hash")))
        dtype = SYNC_DTYPES.get(str(args.get("sync_dtype", "float16")))
        if dtype is None:
            raise InvalidRequest(f"sync_dtype must be one of {sorted(SYNC_DTYPES)}")
        return cls(
            shard, count, align, base_hash, contributions, velocity, _rule(args.get("outer")), dtype,
            required_url("sync_url", args.get("sync_url")), required_url("state_url", args.get("state_url")),
            required_url("velocity_url", args.get("velocity_url")),
        )  # fmt: skip


def _integer(name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}]")
    return value


def _hash(name: str, value: object) -> str:
    if not isinstance(value, str) or not HASH.match(value):
        raise InvalidRequest(f"{name} must be a '<sha256|blake3>:<64 hex>' hash")
    return value


def _contributions(value: object) -> tuple[Contribution, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_SHARDS:
        raise InvalidRequest(f"contributions must be a list of 1-{MAX_SHARDS} objects")
    out: dict[str, Contribution] = {}
    for item in value:
        host = item.get("host") if isinstance(item, dict) else None
        if not isinstance(host, str) or not HOST.match(host):
            raise InvalidRequest("each contribution needs a host id (letters, digits, . _ -)")
        if host in out:
            raise InvalidRequest(f"host {host!r} contributes twice")
        url = required_url("contribution url", item.get("url"))
        out[host] = Contribution(host, url, _hash("contribution hash", item.get("hash")))
    return tuple(out[host] for host in sorted(out))


def _rule(value: object) -> OuterRule:
    if value is None:
        return OuterRule()
    if not isinstance(value, dict):
        raise InvalidRequest("outer must be an object: lr, momentum, nesterov")
    lr, momentum, nesterov = value.get("lr", 0.7), value.get("momentum", 0.9), value.get("nesterov", True)
    for name, number, top in (("lr", lr, 100.0), ("momentum", momentum, 1.0)):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise InvalidRequest(f"outer.{name} must be a number")
        if not 0 <= number <= top:
            raise InvalidRequest(f"outer.{name} must be in [0, {top:g}]")
    if not isinstance(nesterov, bool):
        raise InvalidRequest("outer.nesterov must be true or false")
    return OuterRule(float(lr), float(momentum), nesterov)


def reduce_on_host(
    request: ReduceRequest,
    model_path: str,
    model_hash: str,
    *,
    work_dir: str,
    transfer_config: transfer.TransferConfig,
    abort: threading.Event,
) -> dict[str, Any]:
    """The shard reduced against this host's model (which must be ``base_hash``); its outcome
    PUT; the result's JSON."""
    started = time.monotonic()
    if model_hash != request.base_hash:
        raise HashMismatch(
            "this host does not hold the model the round stepped from",
            {"expected": request.base_hash, "held": model_hash},
        )
    with open(model_path, "rb") as model:
        header = read_header(model)
        split = model_partition(header.specs, request.count, request.align)
        pieces = split.shard(request.shard)
        theta = {p.key: read_slice(model, header, header.specs[p.key], p) for p in pieces}
    scratch = os.path.join(work_dir, "reduce")
    os.makedirs(scratch, exist_ok=True)
    total = ShardSum()
    for contribution in request.contributions:  # sorted by host: the sum's order
        total.add(_contribution(contribution, split, request.shard, scratch, transfer_config, abort))
    velocity = None
    if request.velocity is not None:
        velocity = _velocity(request.velocity, split, request.shard, scratch, transfer_config, abort)
    reduced = total.reduce(request.rule, theta, velocity, request.sync_dtype)
    shipped = {
        name: _ship(values, url, scratch, name, transfer_config, abort, shard)
        for name, values, url, shard in (
            ("sync", reduced.sync, request.sync_url, None),
            ("state", reduced.result, request.state_url, None),
            ("velocity", reduced.velocity, request.velocity_url, request.shard),
        )
    }
    return {
        "shard": request.shard,
        "count": request.count,
        "contributors": [c.host for c in request.contributions],
        **shipped,
        "result_hash": shipped["state"]["hash"],
        "seconds": round(time.monotonic() - started, 6),
    }


def _download(
    url: Url, bound: int, scratch: str, name: str, config: transfer.TransferConfig, abort: threading.Event
) -> str:
    path = os.path.join(scratch, name)
    transfer.fetch(url, path, config=config, abort=abort, max_bytes=zstd_bound(bound))
    return path


def _contribution(
    contribution: Contribution,
    split: Partition,
    shard: int,
    scratch: str,
    config: transfer.TransferConfig,
    abort: threading.Event,
) -> dict[str, torch.Tensor]:
    host = contribution.host
    path = _download(contribution.url, shard_bound(split, shard), scratch, "contribution", config, abort)
    try:
        return read_delta_shard(path, split, shard, contribution.hash)
    except (BadArtifact, HashMismatch) as exc:  # its host leaves the round: named, as bad_artifact
        raise BadArtifact(f"host {host}'s shard: {exc.message}", {"host": host}) from None
    finally:
        remove_quietly(path)


def _velocity(
    velocity: tuple[Url, str],
    split: Partition,
    shard: int,
    scratch: str,
    config: transfer.TransferConfig,
    abort: threading.Event,
) -> dict[str, torch.Tensor]:
    url, expected = velocity
    kept = _kept_velocity(scratch, shard, expected)
    # this host reduced the shard last round: its own copy, checked as any
    path = (
        kept
        if os.path.exists(kept)
        else _download(url, shard_bound(split, shard), scratch, "velocity", config, abort)
    )
    try:
        values = read_delta_shard(path, split, shard, expected)
    except HashMismatch:
        raise BadArtifact("the shard's velocity does not match its recorded hash") from None
    finally:
        if path != kept:
            remove_quietly(path)
    for key, value in values.items():
        if value.dtype != torch.float32:
            raise BadArtifact(f"the shard's velocity has an entry that is not float32: {key!r}")
    return values


def _kept_velocity(scratch: str, shard: int, velocity_hash: str) -> str:
    """Where this host keeps the velocity it last made for ``shard`` (named by its hash): the
    partition is fixed for the session, so while S is stable the shard's next reduce is here
    and reads it instead of GETting it back (one of its objects less on the critical path)."""
    return os.path.join(scratch, f"kept-velocity-{shard}-{velocity_hash.partition(':')[2]}.zst")


def _ship(
    values: Mapping[str, torch.Tensor],
    url: Url,
    scratch: str,
    name: str,
    config: transfer.TransferConfig,
    abort: threading.Event,
    shard: int | None = None,
) -> dict[str, Any]:
    """``values`` written as a delta file and PUT; ``shard``: a velocity, kept afterwards (the
    shard's earlier one removed)."""
    path = os.path.join(scratch, name)
    try:
        written: DeltaFile = write_delta(values, path)
        transfer.upload(path, url, config=config, abort=abort)
        if shard is not None:
            for old in os.listdir(scratch):
                if old.startswith(f"kept-velocity-{shard}-"):
                    remove_quietly(os.path.join(scratch, old))
            os.replace(path, _kept_velocity(scratch, shard, written.hash))
    finally:
        remove_quietly(path)
    return {"hash": written.hash, "bytes": written.bytes}
