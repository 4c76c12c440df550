"""What the executor returns: frozen dataclasses with ``to_json()``, and its states.

These are the JSON results of the task contract (DESIGN §3); ``tasks/`` returns
``result.to_json()`` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from executor.errors import ErrorInfo


class ExecutorState(StrEnum):
    IDLE = "idle"
    LOADED = "loaded"
    RUNNING = "running"


class RoundStatus(StrEnum):
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"


class ApplyVia(StrEnum):
    DELTA = "delta"
    FULL = "full"


@dataclass(frozen=True)
class LoadResult:
    model_hash: str
    model_keys: int
    model_bytes: int
    staged_shard: int | None
    seconds: float
    source_format: str = "safetensors"

    def to_json(self) -> dict[str, Any]:
        return {
            "model_hash": self.model_hash,
            "model_keys": self.model_keys,
            "model_bytes": self.model_bytes,
            "staged_shard": self.staged_shard,
            "seconds": round(self.seconds, 6),
            "source_format": self.source_format,
        }


@dataclass(frozen=True)
class DeltaInfo:
    """The trained delta of a round: uploaded to ``url`` or kept at ``path``."""

    bytes: int
    hash: str | None  # None: an overlapped round's, made beside the next round (in the heartbeat)
    dtype: str
    keys: int
    url: str | None = None
    path: str | None = None
    # Where shipping it went: ``trained - original`` computed, cast and written; the PUT.
    write_s: float = 0.0
    upload_s: float = 0.0
    # An overlapped round's: PUT beside the next round, its end reported in the heartbeat.
    deferred: bool = False
    # A sharded round's: each shard's {"hash", "bytes"}, in shard order (``hash`` is None then).
    shards: tuple[dict[str, Any], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes": self.bytes, "hash": self.hash, "dtype": self.dtype, "keys": self.keys}
        out.update(write_s=round(self.write_s, 6), upload_s=round(self.upload_s, 6))
        if self.deferred:
            out["upload"] = "deferred"
        if self.url is not None:
            out["url"] = self.url
        if self.path is not None:
            out["path"] = self.path
        if self.shards is not None:
            out["shards"] = list(self.shards)
        return out


@dataclass(frozen=True)
class RoundResult:
    status: RoundStatus
    training_time: float
    report: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    delta: DeltaInfo | None = None
    round_num: int = 0
    # What the round's budget dropped (stats, log, report: how many), when it dropped anything.
    dropped: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "status": self.status.value,
            "training_time": round(self.training_time, 6),
            "report": self.report,
            "error": self.error.to_json() if self.error else None,
            "delta": self.delta.to_json() if self.delta else None,
            "round": self.round_num,
        }
        if self.dropped:
            out["dropped"] = dict(self.dropped)
        return out


@dataclass(frozen=True)
class ApplyOutcome:
    via: ApplyVia
    model_hash: str
    seconds: float
    # Why the delta path was not used, when it was not: the error it met (``hash_mismatch``,
    # ``bad_artifact``, ``download_failed``, ...), or ``delta_not_offered`` / ``no_base_model``.
    fallback: ErrorInfo | None = None
    noop: bool = False
    # A sharded apply's ``store`` orders: each shard's deferred state and velocity PUT, or why not.
    stored: list[dict[str, Any]] | None = None

    @property
    def fallback_reason(self) -> str | None:
        """The fallback as one line, ``"code: message"``: the 0.x result's string, kept for one
        release beside ``fallback`` (which an orchestrator reads without parsing text)."""
        return f"{self.fallback.code}: {self.fallback.message}" if self.fallback else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "via": self.via.value,
            "model_hash": self.model_hash,
            "seconds": round(self.seconds, 6),
        }
        if self.fallback is not None:
            out["fallback"] = self.fallback.to_json()
            out["fallback_reason"] = self.fallback_reason
        if self.noop:
            out["noop"] = True
        if self.stored is not None:
            out["stored"] = self.stored
        return out
