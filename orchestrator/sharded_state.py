"""The global model as the store holds it in a sharded session, and its deferred store
(docs/SHARDED.md).

``ShardedState``: the state and velocity shards' names and hashes, the round that made them,
and until they are known to be in the store, what they can be made again from. A reducer keeps
its shard's new state and velocity and PUTs them beside its apply of the round's sync (its
``store`` order); the orchestrator reads each apply's ``stored`` and restores any shard that no
apply confirmed (its reducer lost in between, its PUT failed, or the orchestrator resumed in
between), from the store's immutable objects by the reducer's own functions
(:func:`~orchestrator.fallback.restore_shard`): the one case where a sharded round's tensor bytes
pass through the orchestrator besides the star fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.reduce import MAX_SHARDS, OuterRule
from orchestrator.artifacts import ArtifactStore
from orchestrator.collect import Ending, Outcome
from orchestrator.fallback import model_split, publish_values, restore_shard
from orchestrator.records import Session


@dataclass(frozen=True)
class Restore:
    """What a restore needs of the orchestrator: its store and scratch dir, the session's first
    model (the layout; round 0's theta), the outer rule, the sync's dtype and its event log."""

    store: ArtifactStore
    scratch: str
    layout: Mapping[str, torch.Tensor]
    rule: OuterRule
    dtype: torch.dtype
    note: Callable[..., None]


FLOAT_DTYPES = ("float16", "bfloat16", "float32")


def checked_sharding(session: Session) -> int:
    """The session's shard count (1 in a star session); a sharded session it cannot run is a
    ``ValueError``."""
    if session.aggregation not in ("star", "sharded"):
        raise ValueError(f"aggregation must be 'star' or 'sharded', got {session.aggregation!r}")
    if session.aggregation == "star":
        return 1
    if session.overlap:
        raise ValueError("a sharded session is not overlapped yet (docs/SHARDED.md)")
    if session.sync_delta_dtype not in FLOAT_DTYPES:
        raise ValueError("a sharded session's syncs are float (float16, bfloat16, float32)")
    count = session.shard_count or session.max_hosts or len(session.hosts)
    if not isinstance(count, int) or not 2 <= count <= MAX_SHARDS:
        raise ValueError(f"a sharded session has 2-{MAX_SHARDS} shards, not {count!r}")
    return count


@dataclass
class ShardedState:
    """The global model as the store holds it after a sharded round: its state shards and the
    outer optimiser's velocity shards (object name and hash each), in shard order; checkpointed
    once the round's reduces are done (``global_hash`` None until its hosts agreed on it)."""

    count: int
    run_id: str
    state: list[dict[str, str]] = field(default_factory=list)
    velocity: list[dict[str, str]] = field(default_factory=list)
    round: int = -1  # the round whose reduce made ``state``
    global_hash: str | None = None
    summary: dict[str, Any] | None = None  # that round's contributors and losses, until its sync
    # Until every shard's deferred state and velocity is confirmed in the store: who reduced each
    # shard, the round's sync objects, the previous state and velocity and the contributions'
    # hashes (``host -> [hash by shard]``): what a restore makes them again from.
    pending: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count, "state": self.state, "velocity": self.velocity, "round": self.round,
            "global_hash": self.global_hash, "summary": self.summary, "pending": self.pending,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any], run_id: str) -> ShardedState:
        return cls(
            int(data["count"]), run_id, list(data["state"]), list(data["velocity"]), int(data["round"]),
            data.get("global_hash"), data.get("summary"), data.get("pending"),
        )  # fmt: skip

    def name(
        self, round_num: int, kind: str, shard: int, host: str | None = None, run_id: str | None = None
    ) -> str:
        """An object's name; ``run_id``: another process's (a resumed one names its own)."""
        where = f"{kind}/{host}" if host is not None else kind
        return f"sharded/{run_id or self.run_id}/round-{round_num}/{where}/{shard}.safetensors.zst"

    def sync_shards(
        self, store: ArtifactStore, sync: list[dict[str, str]] | None = None, host: str | None = None
    ) -> list[dict[str, Any]]:
        """``apply_delta``'s ``delta_url`` for the model these shards make: each shard's sync
        object (when given: the round's) and its state object, with their hashes; for ``host``,
        the ``store`` order of each shard it reduced (its deferred state and velocity PUT)."""
        out: list[dict[str, Any]] = []
        reducers = (self.pending or {}).get("reducers", {})
        for j, state in enumerate(self.state):
            entry: dict[str, Any] = {"result_hash": state["hash"], "state_url": store.url_get(state["name"])}
            if sync is not None:
                entry.update(url=store.url_get(sync[j]["name"]), hash=sync[j]["hash"])
                if host is not None and reducers.get(str(j)) == host:
                    entry["store"] = {
                        "state_url": store.url_put(state["name"]),
                        "velocity_url": store.url_put(self.velocity[j]["name"]),
                        "velocity_hash": self.velocity[j]["hash"],
                    }
            else:  # no sync to apply: the state itself, applied to nothing (assembled)
                entry.update(url=entry["state_url"], hash=state["hash"])
            out.append(entry)
        return out

    def settle_store(self, round_num: int, outcomes: Mapping[str, Outcome], restore: Restore) -> None:
        """Each shard's deferred state and velocity: confirmed by its reducer's apply (in
        ``outcomes``), or made again from the store (:func:`~orchestrator.fallback.restore_shard`)
        and PUT; then nothing is pending."""
        pending = self.pending
        if pending is None:
            return
        confirmed = {
            entry.get("shard")
            for host, out in outcomes.items()
            if out.ending is Ending.RESULT and out.result is not None
            for entry in out.result.get("stored") or []
            if isinstance(entry, dict)
            and entry.get("ok")
            and pending["reducers"].get(str(entry.get("shard"))) == host
        }
        missing = [j for j in range(self.count) if j not in confirmed]
        if missing:
            self._restore(round_num, pending, missing, restore)
        self.pending = None

    def _restore(self, round_num: int, pending: Mapping[str, Any], shards: list[int], how: Restore) -> None:
        split, hosts, run = model_split(how.layout, self.count), sorted(pending["hashes"]), pending["run"]
        for j in shards:
            objects = {
                "theta": pending["theta"][j] if pending["theta"] else None,
                "velocity": pending["velocity"][j] if pending["velocity"] else None,
                "contributions": [
                    {"name": self.name(round_num, "delta", j, h, run), "hash": pending["hashes"][h][j]}
                    for h in hosts
                ],
                "sync": pending["sync"][j], "result_hash": self.state[j]["hash"],
            }  # fmt: skip
            state, velocity = restore_shard(
                how.store, how.scratch, how.layout, split, j, objects, how.rule, how.dtype
            )
            publish_values(how.store, how.scratch, self.state[j]["name"], state)
            made = publish_values(how.store, how.scratch, self.velocity[j]["name"], velocity)
            if made != self.velocity[j]["hash"]:  # its reducer reported another: this one is true
                self.velocity[j]["hash"] = made
            how.note(None, "shard-restored", round_num, shard=j, reducer=pending["reducers"].get(str(j)))
