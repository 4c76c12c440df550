"""``reduce_shard``: one shard of a sharded round reduced on this host (docs/SHARDED.md).

The request names the shard, the partition (N and its alignment), the global model the round
stepped from (this host must hold it: its slices of that model are the shard's θ), the round's
contributors in any order (each host's shard object and the hash its host reported), the
shard's velocity of the last round (object and hash; none in the first), the outer rule and the
sync delta's dtype, and where the outcome goes. Each contributor's shard is downloaded within
the shard's bound, its layout checked against the partition this host computes and its hash
against the reported one, then summed in **sorted host order** one at a time; a bad one fails
the reduce with ``bad_artifact`` naming its host (the orchestrator drops it from the round and
redoes the reduce). The sync slices are written as a delta file and PUT (every host waits for
them); the new state's slices and the velocity are written and kept here, named by their hashes,
and PUT beside this host's apply of the round's sync (:class:`DeferredStore`: nothing reads them
before a later round, a join or a resume, so their upload need not hold the round up; the
orchestrator restores what no apply confirms). A request that names ``state_url`` and
``velocity_url`` has them PUT at once instead. The result reports the three hashes.
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
from executor.errors import BadArtifact, HashMismatch, InvalidRequest, error_info
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
from executor.session._requests import EXACT_HASH, StoreOrder, required_url
from executor.session._shipping import keep_file, kept_path
from executor.tensorfile import read_header
from executor.urls import Url
from executor.workdir import SessionDir

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
    state_url: Url | None  # None (with velocity_url): deferred to the apply's ``store`` order
    velocity_url: Url | None

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
        state_url, velocity_url = args.get("state_url"), args.get("velocity_url")
        if (state_url is None) != (velocity_url is None):
            raise InvalidRequest("state_url and velocity_url are given together or not at all (deferred)")
        return cls(
            shard, count, align, base_hash, contributions, velocity, _rule(args.get("outer")), dtype,
            required_url("sync_url", args.get("sync_url")),
            None if state_url is None else required_url("state_url", state_url),
            None if velocity_url is None else required_url("velocity_url", velocity_url),
        )  # fmt: skip


def _integer(name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}]")
    return value


def _hash(name: str, value: object) -> str:
    if not isinstance(value, str) or not EXACT_HASH.match(value):
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
    dirs = SessionDir(work_dir)
    scratch = dirs.reduce
    os.makedirs(scratch, exist_ok=True)
    total = ShardSum()
    for contribution in request.contributions:  # sorted by host: the sum's order
        total.add(_contribution(contribution, split, request.shard, dirs, transfer_config, abort))
    velocity = None
    if request.velocity is not None:
        velocity = _velocity(request.velocity, split, request.shard, dirs, transfer_config, abort)
    reduced = total.reduce(request.rule, theta, velocity, request.sync_dtype)
    shipped = {"sync": _ship(reduced.sync, request.sync_url, scratch, transfer_config, abort)}
    for kind, values, url in (
        ("state", reduced.result, request.state_url),
        ("velocity", reduced.velocity, request.velocity_url),
    ):
        shipped[kind], path = _keep(values, dirs, kind, request.shard)
        if url is not None:  # not deferred: PUT now (the state is not kept then)
            transfer.upload(path, url, config=transfer_config, abort=abort)
            if kind == "state":
                remove_quietly(path)
    return {
        "shard": request.shard,
        "count": request.count,
        "contributors": [c.host for c in request.contributions],
        **shipped,
        "result_hash": shipped["state"]["hash"],
        "deferred": request.state_url is None,
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
    dirs: SessionDir,
    config: transfer.TransferConfig,
    abort: threading.Event,
) -> dict[str, torch.Tensor]:
    host = contribution.host
    # this host's own shard, kept since its round shipped it: read here, checked as any
    path = kept_path(dirs, "delta", shard, contribution.hash)
    own = os.path.exists(path)
    if not own:
        path = _download(
            contribution.url, shard_bound(split, shard), dirs.reduce, "contribution", config, abort
        )
    try:
        return read_delta_shard(path, split, shard, contribution.hash)
    except (BadArtifact, HashMismatch) as exc:  # its host leaves the round: named, as bad_artifact
        raise BadArtifact(f"host {host}'s shard: {exc.message}", {"host": host}) from None
    finally:
        if not own:
            remove_quietly(path)


def _velocity(
    velocity: tuple[Url, str],
    split: Partition,
    shard: int,
    dirs: SessionDir,
    config: transfer.TransferConfig,
    abort: threading.Event,
) -> dict[str, torch.Tensor]:
    url, expected = velocity
    kept = kept_path(dirs, "velocity", shard, expected)
    # this host reduced the shard last round: its own copy, checked as any
    path = (
        kept
        if os.path.exists(kept)
        else _download(url, shard_bound(split, shard), dirs.reduce, "velocity", config, abort)
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


def _keep(
    values: Mapping[str, torch.Tensor], dirs: SessionDir, kind: str, shard: int
) -> tuple[dict[str, Any], str]:
    """``values`` written as the shard's kept ``kind``: its hash and size, and where it is."""
    path = os.path.join(dirs.reduce, kind)
    try:
        written: DeltaFile = write_delta(values, path)
        kept = keep_file(path, dirs, kind, shard, written.hash)
    finally:
        remove_quietly(path)
    return {"hash": written.hash, "bytes": written.bytes}, kept


def _ship(
    values: Mapping[str, torch.Tensor],
    url: Url,
    scratch: str,
    config: transfer.TransferConfig,
    abort: threading.Event,
) -> dict[str, Any]:
    """The sync's slices written as a delta file and PUT."""
    path = os.path.join(scratch, "sync")
    try:
        written = write_delta(values, path)
        transfer.upload(path, url, config=config, abort=abort)
    finally:
        remove_quietly(path)
    return {"hash": written.hash, "bytes": written.bytes}


class DeferredStore:
    """The PUT of what this host's reduces kept for the store (the ``store`` orders of a sharded
    apply), run on a thread beside the apply: the apply downloads, this uploads. Its outcome, one
    entry a shard (``ok``, or why not), is the apply result's ``stored``; the orchestrator
    restores any shard not confirmed (docs/SHARDED.md, "Deferred store")."""

    def __init__(
        self,
        orders: list[tuple[int, str, StoreOrder]],
        work_dir: str,
        config: transfer.TransferConfig,
        abort: threading.Event,
    ) -> None:
        self._orders, self._dirs = orders, SessionDir(work_dir)
        self._config, self._abort = config, abort
        self.outcome: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, name="deferred-store", daemon=True)

    def __enter__(self) -> DeferredStore:
        if self._orders:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._orders:
            self._thread.join()

    def _run(self) -> None:
        for shard, state_hash_, order in self._orders:
            entry: dict[str, Any] = {"shard": shard, "ok": False}
            try:
                state = kept_path(self._dirs, "state", shard, state_hash_)
                velocity = kept_path(self._dirs, "velocity", shard, order.velocity_hash)
                if not (os.path.exists(state) and os.path.exists(velocity)):
                    entry["reason"] = "this host does not hold the shard's state and velocity"
                else:
                    for path, url in ((state, order.state_url), (velocity, order.velocity_url)):
                        transfer.upload(path, url, config=self._config, abort=self._abort)
                    remove_quietly(state)  # the velocity stays: the shard's next reduce reads it
                    entry["ok"] = True
            except Exception as exc:  # reported, not raised: the apply itself holds
                entry["reason"] = f"{error_info(exc).code}: {error_info(exc).message}"
            self.outcome.append(entry)
