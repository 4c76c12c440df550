"""What one round may say: its stats, logs and report, budgeted in the worker (DESIGN §11).

Tenant code's own helpers bound each message (``emit_stats`` 64 KiB, a log line 16 KiB,
``save_report`` 256 KiB), but in the sandbox those helpers run in the tenant's interpreter,
where they can be switched off. So the worker counts again, outside the tenant's reach,
before anything goes to Redis: per round, a number of stats events and their bytes, the
bytes of log lines, and the report's size. What goes over is dropped, counted, reported in
the round's result (``"dropped"``) and announced once per kind in the log.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor.rounds._namespace import MAX_LOG_CHARS, MAX_REPORT_BYTES, MAX_STATS_BYTES


@dataclass(frozen=True)
class BudgetLimits:
    """Per round; the ``max_`` of one message are the namespace's own bounds."""

    stats_events: int
    stats_bytes: int
    log_bytes: int
    report_bytes: int = MAX_REPORT_BYTES


class RoundBudget:
    """The callbacks runners emit through, and what they had to drop this round."""

    def __init__(
        self,
        limits: BudgetLimits,
        emit_stats: Callable[[dict[str, Any]], None],
        emit_log: Callable[[str], None],
    ) -> None:
        self.limits = limits
        self._emit_stats = emit_stats
        self._emit_log = emit_log
        self._lock = threading.Lock()
        self.start_round()

    def start_round(self) -> None:
        with self._lock:
            self._stats_events = self._stats_bytes = self._log_bytes = 0
            self._dropped: dict[str, int] = {}

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped)

    def stats(self, data: dict[str, Any]) -> None:
        try:
            size = len(json.dumps(data, separators=(",", ":"), default=str))
        except (TypeError, ValueError, RecursionError):
            self._drop("stats", "a stats event that is not JSON")
            return
        with self._lock:
            fits = (
                size <= MAX_STATS_BYTES
                and self._stats_events < self.limits.stats_events
                and self._stats_bytes + size <= self.limits.stats_bytes
            )
            if fits:
                self._stats_events += 1
                self._stats_bytes += size
        if fits:
            self._emit_stats(data)
        else:
            self._drop("stats", "stats beyond the round's budget are dropped")

    def log(self, text: str) -> None:
        line = str(text)[:MAX_LOG_CHARS]
        size = len(line.encode("utf-8", "replace"))
        with self._lock:
            fits = self._log_bytes + size <= self.limits.log_bytes
            if fits:
                self._log_bytes += size
        if fits:
            self._emit_log(line)
        else:
            self._drop("log", "log lines beyond the round's budget are dropped")

    def report(self, report: dict[str, Any] | None) -> dict[str, Any] | None:
        """The round's report, or None (counted as dropped) when it is over its limit."""
        if report is None:
            return None
        try:
            size = len(json.dumps(report, separators=(",", ":"), default=str))
        except (TypeError, ValueError, RecursionError):
            size = self.limits.report_bytes + 1
        if size <= self.limits.report_bytes:
            return report
        self._drop("report", f"the report ({size} bytes) is over its limit of {self.limits.report_bytes}")
        return None

    def _drop(self, kind: str, notice: str) -> None:
        with self._lock:
            first = kind not in self._dropped
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
        if first:  # said once per round and kind, outside the log budget
            self._emit_log(f"[budget] {notice}")
