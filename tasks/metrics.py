"""Prometheus metrics of one worker, served by its prefork child (``ROUNDHOUSE_METRICS_PORT``).

The child owns the Executor, so it is where rounds, stops and downloads are known. Counters
are updated as tasks run; cache and GPU figures are read from the Executor at scrape time.
A replacement child serves on the same port (the old one is gone). Flower serves its own
task metrics at ``/metrics`` (see the README).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

ROUND_BUCKETS_S = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)


class WorkerMetrics:
    def __init__(self, host_id: str, status: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        labels = ["host"]
        self.host_id = host_id
        self.rounds = Counter(
            "roundhouse_rounds", "Rounds run, by outcome", [*labels, "status"], registry=self.registry
        )
        self.round_seconds = Histogram(
            "roundhouse_round_seconds",
            "Wall time of run_round tasks",
            labels,
            buckets=ROUND_BUCKETS_S,
            registry=self.registry,
        )
        self.tasks = Counter(
            "roundhouse_tasks",
            "Tasks run, by name and outcome",
            [*labels, "task", "outcome"],
            registry=self.registry,
        )
        self.stops = Counter(
            "roundhouse_stops", "Stop requests, by how they came", [*labels, "reason"], registry=self.registry
        )
        self.registry.register(_ExecutorCollector(host_id, status))

    def serve(self, port: int, address: str = "0.0.0.0") -> bool:
        if port <= 0:
            return False
        try:
            start_http_server(port, addr=address, registry=self.registry)
            return True
        except OSError as exc:  # a second worker on the same port: run without metrics, say so
            logger.warning("metrics not served on port %d: %s", port, exc)
            return False

    def task_done(self, task: str, outcome: str) -> None:
        self.tasks.labels(self.host_id, task, outcome).inc()

    def round_done(self, status: str, seconds: float) -> None:
        self.rounds.labels(self.host_id, status).inc()
        self.round_seconds.labels(self.host_id).observe(seconds)

    def stopped(self, reason: str) -> None:
        self.stops.labels(self.host_id, reason).inc()


class _ExecutorCollector(Collector):
    """Cache, state and GPU figures, read from the Executor when Prometheus scrapes."""

    def __init__(self, host_id: str, status: Callable[[], dict[str, Any]]) -> None:
        self._host = host_id
        self._status = status

    def collect(self) -> Iterator[Any]:
        try:
            status = self._status()
        except Exception:  # a scrape must never fail the worker
            logger.debug("metrics: status unavailable", exc_info=True)
            return
        cache = status.get("cache") or {}
        for name, help_text in (
            ("hits", "Shard cache hits"),
            ("misses", "Shard cache misses"),
            ("evictions", "Shard cache evictions"),
            ("downloaded_bytes", "Bytes of shards downloaded"),
        ):
            family = CounterMetricFamily(f"roundhouse_cache_{name}", help_text, labels=["host"])
            family.add_metric([self._host], float(cache.get(name, 0)))
            yield family
        for name, value, help_text in (
            ("cache_used_bytes", cache.get("used_bytes", 0), "Shard cache bytes in use"),
            ("cache_limit_bytes", cache.get("limit_bytes", 0), "Shard cache limit"),
            ("gpu_memory_allocated_bytes", _gpu_allocated(), "GPU memory allocated by this worker"),
        ):
            gauge = GaugeMetricFamily(f"roundhouse_{name}", help_text, labels=["host"])
            gauge.add_metric([self._host], float(value))
            yield gauge
        dropped = CounterMetricFamily(
            "roundhouse_events_dropped", "Events dropped while Redis was away", labels=["host"]
        )
        dropped.add_metric([self._host], float((status.get("events") or {}).get("dropped", 0)))
        yield dropped
        state = GaugeMetricFamily(
            "roundhouse_state", "1 for the executor's current state", labels=["host", "state"]
        )
        for name in ("idle", "loaded", "running"):
            state.add_metric([self._host, name], 1.0 if status.get("state") == name else 0.0)
        yield state


def _gpu_allocated() -> int:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_allocated())
