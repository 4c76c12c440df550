"""Where a round's wall time goes, phase by phase.

The orchestrator's loop is a sequence of phases (dispatch the rounds, wait for the workers,
fold the last deltas, the outer step, build the sync delta, publish it and the global model,
bring every host to it); each is timed here and kept in the round's summary (``phases``),
so that ``bench.goodput`` and an operator reading the checkpoint's history see which one a
round waited on. The workers time their own side (the delta's write and upload, in the
round's result; the apply, in the sync's).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# In loop order; a round that skips one (no sync when the model is kept) leaves it out.
PHASES = ("dispatch", "wait", "fold", "outer", "sync_build", "publish", "apply")


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


def worker_phases(result: Mapping[str, Any] | None) -> dict[str, float]:
    """A worker's own account of its round, from ``run_round``'s result: the tenant code's time
    (``training``), and the trained delta's write and upload (seconds)."""
    if not result:
        return {}
    out = {"training": float(result.get("training_time") or 0.0)}
    delta = result.get("delta") or {}
    for key, name in (("write_s", "delta_write"), ("upload_s", "upload")):
        if isinstance(delta.get(key), int | float):
            out[name] = float(delta[key])
    return out
