"""Prometheus metrics of one worker, served by its prefork child (``ROUNDHOUSE_METRICS_PORT``).

The child owns the Executor, so it is where rounds, stops and downloads are known. Counters
are updated as tasks run; cache and GPU figures are read from the Executor at scrape time.
A replacement child serves on the same port (the old one is gone). Flower serves its own
task metrics at ``/metrics`` (see the README).

The figures tell who runs what when (round outcomes, stops, cache traffic): the endpoint
listens on loopback unless ``ROUNDHOUSE_METRICS_ADDRESS`` says otherwise, and with
``ROUNDHOUSE_METRICS_TOKEN`` set it answers only a request that presents the token, as a bearer
token or as the password of HTTP basic auth (what Prometheus's ``authorization`` and
``basic_auth`` send); anything else gets 401.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
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

    def serve(self, port: int, address: str = "127.0.0.1", token: str | None = None) -> bool:
        """Serve ``/metrics`` from a daemon thread; ``token``: what a request must present."""
        if port <= 0:
            return False
        app = make_wsgi_app(self.registry)
        if token:
            app = _require_token(app, token)
        elif not _is_loopback(address):
            logger.warning(
                "metrics served on %s:%d without ROUNDHOUSE_METRICS_TOKEN: whoever reaches it "
                "sees this worker's tenant activity",
                address,
                port,
            )
        try:
            server = make_server(address, port, app, _server_class(address), handler_class=_QuietHandler)
        except OSError as exc:  # a second worker on the same port: run without metrics, say so
            logger.warning("metrics not served on port %d: %s", port, exc)
            return False
        threading.Thread(target=server.serve_forever, name="roundhouse-metrics", daemon=True).start()
        return True

    def task_done(self, task: str, outcome: str) -> None:
        self.tasks.labels(self.host_id, task, outcome).inc()

    def round_done(self, status: str, seconds: float) -> None:
        self.rounds.labels(self.host_id, status).inc()
        self.round_seconds.labels(self.host_id).observe(seconds)

    def stopped(self, reason: str) -> None:
        self.stops.labels(self.host_id, reason).inc()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a line on stderr


def _server_class(address: str) -> type[ThreadingWSGIServer]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


def _presented(header: str) -> str | None:
    """The token in an ``Authorization`` header: a bearer token, or basic auth's password."""
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2]
    return None


def _require_token(app: WSGIApplication, token: str) -> WSGIApplication:
    expected = token.encode("utf-8")

    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        presented = _presented(environ.get("HTTP_AUTHORIZATION", ""))
        # compare_digest: how much of the token a guess got right does not show in the timing.
        if presented is not None and hmac.compare_digest(presented.encode("utf-8"), expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="roundhouse metrics"')],
        )
        return [b"a token is needed (ROUNDHOUSE_METRICS_TOKEN)\n"]

    return guarded


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
