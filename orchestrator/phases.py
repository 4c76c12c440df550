"""Where a round's wall time goes, phase by phase.

The orchestrator's loop is a sequence of phases (dispatch the rounds, wait for the workers,
fold the last deltas, the outer step, build the sync delta, publish it and the global model,
bring every host to it); each is timed here and kept in the round's summary (``phases``),
so that ``bench.goodput`` and an operator reading the checkpoint's history see which one a
round waited on. The workers time their own side (the delta's write and upload, in the
round's result; the apply, in the sync's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# In loop order; a round that skips one (no sync when the model is kept) leaves it out.
# "reduce": a sharded round's reduce_shard tasks on the hosts (orchestrator.sharded).
PHASES = ("dispatch", "wait", "fold", "reduce", "outer", "sync_build", "publish", "apply")


class PhaseClock:
    """Seconds per phase of one round."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}")
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started

    def to_json(self) -> dict[str, float]:
        return {name: round(self.seconds[name], 6) for name in PHASES if name in self.seconds}


def seconds(value: object) -> float | None:
    """A duration a worker reported, or None: its results are data from the broker, so only a
    finite, non-negative number counts (not a string, a bool, NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def worker_phases(result: Mapping[str, Any] | None) -> dict[str, float]:
    """A worker's own account of its round, from ``run_round``'s result: the tenant code's time
    (``training``), and the trained delta's write and upload (seconds); what it did not say, or
    said as something else than a duration, is left out."""
    if not result:
        return {}
    delta = result.get("delta")
    delta = delta if isinstance(delta, Mapping) else {}
    # An overlapped round's end (orchestrator.overlap): the wait for its sync (idle), the working
    # copy's rebuild (idle), and the sync's apply, which ran beside the round.
    overlap = result.get("overlap")
    overlap = overlap if isinstance(overlap, Mapping) else {}
    sync = overlap.get("sync")
    sync = sync if isinstance(sync, Mapping) else {}
    said = [
        ("training", result.get("training_time")),
        ("delta_write", delta.get("write_s")),
        ("upload", delta.get("upload_s")),
        ("sync_wait", overlap.get("sync_wait_s")),
        ("rebase", overlap.get("rebase_s")),
        ("upload_wait", overlap.get("upload_wait_s")),
        ("apply", sync.get("seconds")),
    ]
    return {name: value for name, raw in said if (value := seconds(raw)) is not None}
