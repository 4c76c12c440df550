"""The stop button: three ways to stop a running round, one way it ends (DESIGN §6).

1. ``app.control.revoke(task_id)`` — Celery 5.7 leaves a running task alone, so
   :class:`RevokeForwarder`, a bootstep in the MainProcess, compares
   ``celery.worker.state.revoked`` with the active requests every
   ``ROUNDHOUSE_REVOKE_POLL_S``; for a revoked running task it drops a note in the
   host's stop mailbox (a file named for the task) and sends SIGUSR2 to the child.
   The note makes the stop exact: the child stops only the task it names.
2. ``revoke(task_id, terminate=True, signal="SIGUSR2")`` — Celery signals the child
   itself. billiard replaces handlers for SIGTERM/SIGHUP/SIGQUIT/SIGUSR1 in the
   child; a SIGUSR2 handler installed in ``worker_process_init`` survives. Since the
   child survives too, the forwarder clears billiard's ``_job_terminated`` flag after
   such a terminate, so that a later real crash of that child is still reported as a
   failure and not as REVOKED.
   ``revoke(task_id, terminate=True)`` with Celery's default SIGTERM (Flower's Terminate
   button, ``celery control terminate``) is turned into the same stop in the
   MainProcess, before any signal is sent: the pool's ``terminate_job`` sees that the
   pid's request was revoked, posts the note and sends SIGUSR2 instead. The child itself
   cannot tell a revoke's SIGTERM from billiard's own: cold shutdown (SIGQUIT to the
   worker) cancels its requests with SIGTERM through the same ``terminate_job``, and those
   must die and be redelivered, not end as "stopped". Requests that were not revoked keep
   Celery's SIGTERM, and so does a SIGTERM sent to the child from outside.
3. :meth:`tasks.client.RoundClient.stop` — a key ``roundhouse:stop:<host>:<task_id>`` and a
   message on ``roundhouse:control:<host>``, watched by a thread in the child
   (:class:`StopWatcher`), so it works whatever the broker is doing. On the signed control
   plane both hold a signed stop token naming the host and the task (``tasks.trust.signing``);
   the child acts only on one that verifies against its trust store.

In the child the signal handler only writes one byte to a pipe (nothing else is safe
in a handler that may interrupt a lock holder); a thread reads it and acts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import bootsteps
from celery.worker import state as worker_state

from tasks.names import control_channel, stop_key
from tasks.trust.signed_app import app_settings
from tasks.trust.signing import Refused, Signer, stop_token

logger = logging.getLogger(__name__)

STOP_SIGNAL = signal.SIGUSR2
STOP_KEY_TTL_S = 24 * 3600


def send_stop(client: redis.Redis, host_id: str, task_id: str, signer: Signer | None = None) -> None:
    """Path 3: ask ``host_id`` to stop ``task_id`` through Redis (before or after it started).

    With a signer both the key and the message are a signed token (the signed control
    plane); without, the key holds ``1`` and the message is the task id."""
    token = stop_token(signer, host_id, task_id) if signer is not None else None
    client.set(stop_key(host_id, task_id), token or "1", ex=STOP_KEY_TTL_S)
    client.publish(control_channel(host_id), token or task_id)


class StopMailbox:
    """Notes from the MainProcess to its child, one file per task to stop."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, task_id: str) -> str:
        return os.path.join(self.directory, "stop-" + task_id.replace("/", "_"))

    def post(self, task_id: str) -> None:
        with open(self._path(task_id), "w", encoding="ascii") as note:
            note.write(str(time.time()))

    def holds(self, task_id: str) -> bool:
        return os.path.exists(self._path(task_id))

    def any(self) -> bool:
        return any(name.startswith("stop-") for name in os.listdir(self.directory))

    def clear(self, task_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(task_id))


class RevokeForwarder(bootsteps.StartStopStep):
    """MainProcess: turn a plain revoke of a running task into a stop of the child."""

    requires = ("celery.worker.components:Timer", "celery.worker.components:Pool")

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self._forwarded: set[str] = set()
        self._tref: Any = None

    def start(self, worker: Any) -> None:
        # Celery builds its bootsteps itself: the settings are the ones its app was built with.
        settings = app_settings(worker.app)
        self._mailbox = StopMailbox(mailbox_dir(settings.work_dir, settings.host_id))
        self._guard_terminate(worker)
        self._tref = worker.timer.call_repeatedly(settings.revoke_poll_s, self._tick, (), priority=10)

    def stop(self, worker: Any) -> None:
        if self._tref is not None:
            self._tref.cancel()

    def _tick(self) -> None:
        for request in list(worker_state.active_requests):
            task_id = request.id
            if task_id in self._forwarded or task_id not in worker_state.revoked:
                continue
            pid = request.worker_pid
            if not pid:
                continue
            self._forward(task_id, pid)
        active = {request.id for request in worker_state.active_requests}
        self._forwarded &= active

    def _forward(self, task_id: str, pid: int) -> None:
        self._forwarded.add(task_id)
        self._mailbox.post(task_id)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STOP_SIGNAL)
        logger.info("revoked task %s is running in pid %d: stop forwarded", task_id, pid)

    def _guard_terminate(self, worker: Any) -> None:
        pool = worker.pool
        original = pool.terminate_job

        def terminate_job(pid: int, sig: Any = None) -> None:
            signum = _signum(sig) if sig is not None else signal.SIGTERM
            revoked = _revoked_request_in(pid) if signum == signal.SIGTERM else None
            if revoked is not None:
                # billiard's SIGTERM handler would end the child, and with it the loaded
                # model, the warm sandbox runner and the CUDA context.
                self._forward(revoked, pid)
                return
            original(pid, sig)
            if signum == STOP_SIGNAL:
                # The child handles SIGUSR2 and lives on: billiard must not keep treating it
                # as "terminated", or its next real crash would be reported as REVOKED.
                proc = pool._pool._process_by_pid(pid)[0]
                if proc is not None:
                    proc._job_terminated = False
                    proc._controlled_termination = False

        pool.terminate_job = terminate_job


def _revoked_request_in(pid: int) -> str | None:
    """The id of the revoked request that pool process ``pid`` runs, if any."""
    for request in list(worker_state.active_requests):
        if request.worker_pid == pid and request.id in worker_state.revoked:
            return str(request.id)
    return None


def _signum(sig: Any) -> int:
    if isinstance(sig, int):
        return sig
    name = str(sig).upper()
    return int(getattr(signal, name if name.startswith("SIG") else "SIG" + name))


def mailbox_dir(work_dir: str, host_id: str) -> str:
    return os.path.join(work_dir, host_id, "control")


class SignalPipe:
    """Child: SIGUSR2 writes a byte to a pipe; a thread turns it into ``on_signal()``."""

    def __init__(self, on_signal: Callable[[], None]) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._on_signal = on_signal
        self._thread = threading.Thread(target=self._run, name="roundhouse-signals", daemon=True)
        self._thread.start()
        signal.signal(STOP_SIGNAL, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"s")

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            try:
                self._on_signal()
            except Exception:
                logger.exception("stop on signal failed")


class StopWatcher:
    """Child: watches ``roundhouse:control:<host>`` and calls ``on_stop(task_id)``.

    With ``verify`` (the signed control plane) a stop counts only when ``verify(token)``
    returns its task id; a token it refuses goes to ``on_refused``."""

    def __init__(
        self,
        redis_url: str,
        host_id: str,
        on_stop: Callable[[str], None],
        *,
        verify: Callable[[bytes], str] | None = None,
        on_refused: Callable[[Refused], None] | None = None,
    ) -> None:
        self._client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, health_check_interval=15)
        self._host = host_id
        self._channel = control_channel(host_id)
        self._on_stop = on_stop
        self._verify = verify
        self._on_refused = on_refused
        self._thread = threading.Thread(target=self._run, name="roundhouse-stop-watch", daemon=True)
        self._thread.start()

    def requested(self, task_id: str) -> bool:
        """Whether a stop for ``task_id`` was sent before we were listening (False if Redis is away)."""
        try:
            value = self._client.get(stop_key(self._host, task_id))
        except redis.RedisError:
            return False
        if value is None or self._verify is None:
            return value is not None
        return self._task_of(value if isinstance(value, bytes) else value.encode()) == task_id

    def _task_of(self, data: bytes) -> str | None:
        """The task a stop message names (None: refused)."""
        if self._verify is None:
            return data.decode(errors="replace")
        try:
            return self._verify(data)
        except Refused as refusal:
            logger.warning("refused stop request: %s", refusal)
            if self._on_refused is not None:
                self._on_refused(refusal)
            return None

    def _run(self) -> None:
        delay = 0.1
        while True:
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                delay = 0.1
                for message in pubsub.listen():
                    data = message.get("data")
                    if isinstance(data, bytes) and (task_id := self._task_of(data)) is not None:
                        self._on_stop(task_id)
            except redis.RedisError as exc:
                logger.debug("stop watcher lost Redis (%s); reconnecting", exc)
            except Exception:
                logger.exception("stop watcher failed")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
