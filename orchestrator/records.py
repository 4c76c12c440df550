"""What a session trains (``Session``, checkpointed whole) and what each round did (``RoundSummary``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RoundSummary:
    round_num: int
    losses: dict[str, float]
    included: list[str]
    excluded: dict[str, str]  # host -> why (failed, stopped, straggler, lost, bad delta)
    via: dict[str, str]  # host -> "delta" | "full"
    model_hash: str
    seconds: float
    kept: bool = False  # fewer than min_hosts completed: the model stayed as it was
    lost: list[str] = field(default_factory=list)
    members: list[str] = field(default_factory=list)  # active after the round's sync
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (orchestrator.phases)
    # Each host's own account: training, delta_write, upload (its round), apply (its sync).
    host_phases: dict[str, dict[str, float]] = field(default_factory=dict)
    # Overlapped: the outer step, sync build and publish ran while the next round trained.
    overlap: bool = False

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses.values()) / len(self.losses) if self.losses else None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundSummary:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Session:
    """What a session trains and how its rounds end (all of it is checkpointed).

    ``shards`` are descriptors (DESIGN §3); one with a ``name`` lives in the artifact store
    and gets a freshly signed URL whenever a host (re)joins, one with a ``url`` is used as
    given. ``hosts`` are the starting hosts; ``max_hosts`` (default: as many) bounds the
    active ones as hosts come and go, ``allowed_hosts`` (if given) names the only ones that
    may join."""

    hosts: list[str]
    shards: list[dict[str, Any]]
    code: str
    params: dict[str, Any] = field(default_factory=dict)
    steps: int = 20
    batch_size: int = 32
    tenant: str = "default"
    delta_dtype: str = "float16"
    sync_delta_dtype: str = "float16"  # or "int8" / "int4": quantised, with error feedback
    round_deadline_s: float = 600.0
    quorum: float = 1.0
    grace_s: float = 30.0
    min_hosts: int = 1
    max_hosts: int | None = None
    allowed_hosts: list[str] | None = None
    join_wait_s: float = 30.0
    sync_timeout_s: float = 600.0
    url_ttl_s: float = 6 * 3600.0
    # Round k+1 trains while round k's deltas are folded (orchestrator.overlap, docs/OVERLAP.md).
    overlap: bool = False
    # "star": the orchestrator folds every delta; "sharded": the hosts reduce the round among
    # themselves over ``shard_count`` shards (default: max_hosts, else the starting hosts;
    # orchestrator.sharded, docs/SHARDED.md).
    aggregation: str = "star"
    shard_count: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Session:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
