"""What lives in the prefork child: one Executor, its settings, events, stop paths, heartbeat.

:func:`runtime` builds the :class:`ChildRuntime` once per process, in
``worker_process_init`` — after the fork, so CUDA (which is not fork-safe) is only
ever touched here, never in the MainProcess — and every task the child runs reuses
it. Importing this module imports neither torch nor the executor's engine. The
Executor's session dir is fixed per host, so a replacement child finds the previous
one's files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from celery.exceptions import SoftTimeLimitExceeded

from executor import Stopped
from executor.urls import Url
from executor.workdir import session_dir
from settings import Settings, get_settings
from tasks.control import SignalPipe, StopMailbox, StopWatcher, mailbox_dir
from tasks.events import EventPublisher
from tasks.metrics import WorkerMetrics
from tasks.names import queue_beat
from tasks.overlap import SyncInbox, SyncOrder
from tasks.trust.signing import Refused, Verifier, load_security, open_stop_token, open_sync_token

logger = logging.getLogger(__name__)


@dataclass
class Current:
    """The task the child is running now."""

    task_id: str
    name: str
    round_num: int | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    reason: str | None = None


class ChildRuntime:
    def __init__(self, settings: Settings) -> None:
        from executor import Executor  # imported here: torch stays out of the MainProcess

        self.settings = settings
        self.host_id = settings.host_id
        self.events = EventPublisher.from_settings(settings)
        self._lock = threading.Lock()
        self.current: Current | None = None
        self.executor = Executor(
            self._stats,
            self._log,
            sandboxed=settings.sandbox != "off",
            settings=settings,
            session_dir=session_dir(settings.work_dir, settings.host_id),
            emit_state=self._progress,
        )
        # A replacement child carries on with its predecessor's session: no reload needed.
        self.rehydrated = self.executor.rehydrate()
        self.mailbox = StopMailbox(mailbox_dir(settings.work_dir, settings.host_id))
        self.signals = SignalPipe(self._on_signal)
        self.watcher = StopWatcher(
            settings.redis_events_url,
            settings.host_id,
            self._on_remote_stop,
            **stop_verification(settings, self.emit),
        )
        self._redis = redis.Redis.from_url(
            settings.redis_events_url, socket_timeout=2, socket_connect_timeout=2
        )
        self._sync_verification = sync_verification(settings, self.emit)
        self.metrics = WorkerMetrics(settings.host_id, self.status)
        token = settings.metrics_token.get_secret_value() if settings.metrics_token else None
        self.metrics.serve(settings.metrics_port, settings.metrics_address, token)
        self._heartbeat = threading.Thread(target=self._beat, name="roundhouse-heartbeat", daemon=True)
        self._heartbeat.start()

    # ------------------------------------------------------------ events

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        current = self.current
        self.events.emit(
            kind,
            data,
            task_id=current.task_id if current else None,
            task=current.name if current else None,
            round_num=current.round_num if current else None,
        )

    def _stats(self, data: dict[str, Any]) -> None:
        self.emit("stats", data)

    def _log(self, text: str) -> None:
        self.emit("log", {"text": text})

    def _progress(self, data: dict[str, Any]) -> None:
        self.emit("progress", data)

    # ------------------------------------------------------------ tasks

    @contextlib.contextmanager
    def task(self, task_id: str, name: str, round_num: int | None = None) -> Iterator[Current]:
        """Bracket one task: state events, and the stop paths aimed at it."""
        current = Current(task_id, name, round_num)
        with self._lock:
            self.current = current
        started = time.monotonic()
        # A stop belongs to the task it was aimed at: the previous task's must not abort this one.
        self.executor.abort_event.clear()
        self.emit("state", {"event": "task-started"})
        if self.watcher.requested(task_id) or self.mailbox.holds(task_id):
            self.request_stop("requested before start")
        outcome = "failed"
        try:
            yield current
            outcome = "stopped" if current.stop.is_set() else "succeeded"
        except SoftTimeLimitExceeded:
            # Outside a round's wait (a download, an apply) the soft limit is a stop too.
            outcome = "stopped"
            raise Stopped("soft time limit exceeded") from None
        finally:
            self.emit(
                "state",
                {
                    "event": "task-finished",
                    "outcome": outcome,
                    "seconds": round(time.monotonic() - started, 6),
                },
            )
            self.mailbox.clear(task_id)
            self.metrics.task_done(name, outcome)
            with self._lock:
                self.current = None
            # Before Celery stores the result: whoever reads the result and then the heartbeats
            # (an orchestrator picking idle hosts) must not see this host still "running".
            self.beat()

    def request_stop(self, reason: str) -> None:
        """Stop the current task, whatever phase it is in (thread-safe; not for signal handlers)."""
        with self._lock:
            current = self.current
        if current is None or current.stop.is_set():
            return
        current.reason = reason
        current.stop.set()
        self.metrics.stopped(reason)
        self.emit("state", {"event": "stop-requested", "reason": reason})
        # Downloads on the task's thread abort at once; a running round is stopped by
        # wait_round, on the task's own thread.
        self.executor.abort_event.set()

    def _on_signal(self) -> None:
        current = self.current
        if current is None:
            return
        if self.mailbox.holds(current.task_id) or not self.mailbox.any():
            # A note for this task (plain revoke), or no note at all (Celery's terminate).
            self.request_stop("revoked")

    def _on_remote_stop(self, task_id: str) -> None:
        current = self.current
        if current is not None and current.task_id == task_id:
            self.request_stop("stop requested through Redis")

    def wait_round(self, current: Current) -> None:
        """Wait for the round's thread; re-apply a stop that raced its start."""
        checked = time.monotonic()
        while self.executor.is_running():
            try:
                if current.stop.is_set():
                    self.executor.stop()
                    continue
                self.executor.wait(0.1)
                if time.monotonic() - checked > 1.0:
                    # A Redis stop sent while the watcher was reconnecting is still in its key.
                    checked = time.monotonic()
                    if self.watcher.requested(current.task_id):
                        self.request_stop("stop requested through Redis")
            except SoftTimeLimitExceeded:
                self.request_stop("soft time limit")

    def sync_inbox(self, sync_id: str, current: Current) -> SyncInbox:
        """An overlapped round's inbox for the sync named ``sync_id`` (tasks.overlap), which
        applies it to the global copy beside the round."""
        from executor.session import SyncRequest  # the child's: torch is imported there already

        def apply(order: SyncOrder) -> dict[str, Any]:
            request = SyncRequest.parse(
                order.model_url,
                delta_url=order.delta_url,
                base_hash=order.base_hash,
                result_hash=order.result_hash,
            )
            keeper = self.executor.overlapped
            outcome = keeper.sync_beside(request).to_json()
            if order.eager_url and order.eager_hash:
                try:
                    keeper.fetch_correction(Url(order.eager_url), order.eager_hash)
                except Exception as exc:  # the sync holds; the host's eager step is only rougher
                    logger.warning("eager step's correction not used: %s", exc)
                    outcome["eager_error"] = f"{type(exc).__name__}: {exc}"[:500]
            self.emit("state", {"event": "synced-beside", "round": order.round_num, "via": outcome["via"]})
            return outcome

        return SyncInbox(
            self._redis, self.host_id, sync_id, apply, stop=current.stop, **self._sync_verification
        )

    # ------------------------------------------------------------ heartbeat and status

    def status(self) -> dict[str, Any]:
        ex_status = self.executor.status()
        current = self.current
        return {
            "host_id": self.host_id,
            "pid": os.getpid(),
            "gpu": gpu_info(self.settings),
            "state": ex_status["state"],
            "model_hash": ex_status["model_hash"],
            "tenant": ex_status["tenant"],
            "task_id": current.task_id if current else None,
            "queue": self.settings.queue,
            "cache": ex_status["cache"],
            "sandbox": ex_status["sandbox"],
            "events": {"published": self.events.published, "dropped": self.events.dropped},
            # Overlapped rounds' deltas, PUT beside the next round (the orchestrator folds one
            # once its upload is reported done here).
            "uploads": self.executor.overlapped.overlap.reports(),
            "versions": versions(),
        }

    def beat(self) -> None:
        """Write the heartbeat now (the beat thread does it every interval)."""
        try:
            beat = self.status()
            beat["ts"] = time.time()
            # The beat under its own key (the authority: an ACL lets a worker write only its
            # own), its brief, and its entry in the fleet's index (who to read).
            pipe = self._redis.pipeline(transaction=False)
            queue_beat(pipe, beat, max(1, int(self.settings.heartbeat_ttl_s)))
            pipe.execute()
        except Exception as exc:  # a heartbeat must never take the child down
            logger.debug("heartbeat failed: %s", exc)

    def _beat(self) -> None:
        while True:
            self.beat()
            time.sleep(self.settings.heartbeat_interval_s)


def stop_verification(settings: Settings, emit: Callable[[str, dict[str, Any]], None]) -> dict[str, Any]:
    """On the signed control plane, a Redis stop request counts only when it verifies."""
    return _verification(settings, emit, "stop", open_stop_token)


def sync_verification(settings: Settings, emit: Callable[[str, dict[str, Any]], None]) -> dict[str, Any]:
    """On the signed control plane, an overlapped round's sync order counts only when it verifies."""
    return _verification(settings, emit, "sync", open_sync_token)


def _verification(
    settings: Settings,
    emit: Callable[[str, dict[str, Any]], None],
    kind: str,
    opener: Callable[[Verifier, bytes, str], Any],
) -> dict[str, Any]:
    """``verify`` (a token to what it carries, or :class:`Refused`) and ``on_refused`` (the
    refusal as a ``refused`` state event) for Redis messages of ``kind``; {} when unsigned."""
    security = load_security(settings)
    if security is None or security.verifier is None:
        return {}
    verifier = security.verifier
    verifier.register()  # this process decodes what its parent did not hand it decoded

    def verify(token: bytes) -> Any:
        return opener(verifier, token, settings.host_id)

    def on_refused(refusal: Refused) -> None:
        detail = {"kind": kind, "reason": refusal.reason, "detail": refusal.detail}
        emit("state", {"event": "refused", **detail})

    return {"verify": verify, "on_refused": on_refused}


def gpu_info(settings: Settings) -> dict[str, Any]:
    info: dict[str, Any] = {"index": settings.gpu, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["name"] = torch.cuda.get_device_name(0)
        info["memory_allocated"] = torch.cuda.memory_allocated()
    return info


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for package in ("roundhouse", "torch", "celery"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "unknown"
    return out


_runtime: ChildRuntime | None = None


def runtime() -> ChildRuntime:
    """This process's runtime, from the one Settings (built on first use when a task runs
    outside a prefork child)."""
    global _runtime
    if _runtime is None:
        _runtime = ChildRuntime(get_settings())
    return _runtime


def close_runtime(timeout_s: float = 2.0) -> None:
    """On the child's way out (billiard runs it on every exit it sees, a warm shutdown's and a
    SIGTERM's alike): end its sandboxes, none left frozen behind it, then publish what its events
    still hold."""
    if _runtime is not None:
        from executor.sandbox import end_sandboxes  # the child's: torch is imported there already

        end_sandboxes()
        _runtime.events.close(timeout_s=timeout_s)
