"""The worker's gate (DESIGN §11): on a signed worker nothing runs that the gate did not admit.

In the MainProcess, before Celery builds a request: a task message must be Celery's
``auth`` content type, verify against the trust store, carry an envelope that names this
task, this id and this worker's queue, be within its lifetime, and not be a message this
worker has already finished (its nonce: :mod:`tasks.trust.replay`, a ledger on the worker's own
disk first, Redis second; a message neither can record is refused). A copy of a message
that has not finished is the broker's redelivery (``acks_late``) and runs again under the
tasks' idempotency rules; each delivery is counted, and the count is the request's
``retries``, so ``worker_lost_retries`` still bounds a task that kills its child. The
envelope's eta, expiry and time limits replace the headers'. Control commands pass the same
checks in :class:`tasks.trust.signed_app.GatedNode`; a broadcast (no destination in its signed
body) must also have been issued after this worker started. A message naming a task this
worker does not have is refused too (``unknown_task``).

A refused message is acknowledged and dropped, never run: a ``WARNING`` in the worker log
and a ``state`` event ``{"event": "refused", "kind", "reason", "detail", "name"}`` on the
host's events channel say so (task id and name there are what the message claimed). Nothing
is written to the result backend: the id of a refused message is not to be trusted.

At start-up the gate also refuses to run a worker without a trust store when a broker,
backend or events URL is not on loopback, unless ``ROUNDHOUSE_INSECURE=1``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import bootsteps
from celery.exceptions import ImproperlyConfigured
from celery.utils.log import get_logger
from celery.worker.request import Request
from kombu.exceptions import ContentDisallowed

from settings import Settings
from settings.celery import AUTH_CONTENT_TYPE
from tasks.events import EventPublisher
from tasks.names import ENVELOPE_KEY
from tasks.trust.replay import NonceLedger, ReplayStore, ledger_dir
from tasks.trust.signed_app import app_settings
from tasks.trust.signing import Refused, Security, Verifier, check_control, check_task, replay_ttl_s

logger = get_logger(__name__)

REPORTS_PER_MINUTE = 30  # per reason; beyond it refusals are counted, not each logged


# ---------------------------------------------------------------- start-up policy


def is_loopback(url: str) -> bool:
    scheme = url.split("://", 1)[0]
    if scheme in ("redis+socket", "unix", "memory"):
        return True
    for part in url.split(";"):  # sentinel://a:26379;sentinel://b:26379
        host = urlsplit(part).hostname
        if host in (None, "", "localhost"):
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return True


def _urls(settings: Settings) -> list[str]:
    return list(
        dict.fromkeys(u for u in (settings.broker_url, settings.results_url, settings.events_url) if u)
    )


def startup_problem(settings: Settings) -> str | None:
    """Why this worker must not start, or None."""
    if settings.trusted_certs or settings.insecure:
        return None
    remote = [url for url in _urls(settings) if not is_loopback(url)]
    if not remote:
        return None
    where = urlsplit(remote[0]).hostname
    return (
        f"refusing to start: the broker or backend at {where} is not on loopback and "
        "ROUNDHOUSE_TRUSTED_CERTS is not set. Unsigned, anyone who can reach that Redis could "
        "make this worker download and run any code, read its tasks and shut it down. Give the "
        "worker the orchestrator's certificate (ROUNDHOUSE_TRUSTED_CERTS; `roundhouse keys init "
        "DIR` makes a development set), or set ROUNDHOUSE_INSECURE=1 to run unsigned anyway."
    )


def startup_warnings(settings: Settings) -> list[str]:
    warnings = []
    for url in _urls(settings):
        if is_loopback(url):
            continue
        parts = urlsplit(url)
        if parts.scheme == "redis":
            warnings.append(f"{parts.hostname}: Redis without TLS off loopback (use rediss://)")
        if parts.scheme in ("redis", "rediss") and not parts.password:
            warnings.append(f"{parts.hostname}: Redis without a password or ACL user")
    # ROUNDHOUSE_KEYS_DIR is no excuse: it hands this worker the orchestrator's key too.
    if settings.trusted_certs and settings.signing_key:
        warnings.append(
            "this worker holds a signing key: whoever reads it can command every worker that "
            "trusts it; a worker needs ROUNDHOUSE_TRUSTED_CERTS only (`roundhouse worker --keys "
            "DIR` gives it DIR/worker/ alone, not ROUNDHOUSE_KEYS_DIR)"
        )
    return warnings


# ---------------------------------------------------------------- refusals


class Refusals:
    """Log and publish refusals, at most ``REPORTS_PER_MINUTE`` a minute for each reason."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._events: EventPublisher | None = None
        self._window: dict[str, tuple[float, int, int]] = {}  # reason: (window start, shown, hidden)
        self.total = 0

    def report(self, kind: str, refusal: Refused, *, name: Any = None, task_id: Any = None) -> None:
        self.total += 1
        now = time.monotonic()
        start, shown, hidden = self._window.get(refusal.reason, (now, 0, 0))
        if now - start > 60:
            if hidden:
                logger.warning("%d more %s refusals in the last minute", hidden, refusal.reason)
            start, shown, hidden = now, 0, 0
        if shown >= REPORTS_PER_MINUTE:
            self._window[refusal.reason] = (start, shown, hidden + 1)
            return
        self._window[refusal.reason] = (start, shown + 1, hidden)
        logger.warning("refused %s %s[%s]: %s", kind, name, task_id, refusal)
        shown_name = None if name is None else str(name)[:200]
        data = {"event": "refused", "kind": kind, "reason": refusal.reason, "detail": refusal.detail}
        self._publisher().emit(
            "state",
            {**data, "name": shown_name},
            task_id=None if task_id is None else str(task_id)[:200],
            task=shown_name,
        )

    def _publisher(self) -> EventPublisher:
        if self._events is None:  # first refusal: a thread in the MainProcess, only then
            self._events = EventPublisher.from_settings(self._settings, buffer_size=1000)
        return self._events


# ---------------------------------------------------------------- the gate


_active: Gate | None = None  # the MainProcess's gate, for GatedRequest


class Gate(bootsteps.StartStopStep):
    """Consumer bootstep: checks the start-up policy, then (signed) gates every task and
    control message."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        global _active
        super().__init__(c, **kwargs)
        settings = app_settings(c.app)  # the app's own, as built: Celery builds its bootsteps itself
        if problem := startup_problem(settings):
            raise ImproperlyConfigured(problem)
        for warning in startup_warnings(settings):
            logger.warning("control plane: %s", warning)
        security: Security | None = getattr(c.app, "roundhouse_security", None)
        self.verifier: Verifier | None = security.verifier if security else None
        self._connection_errors = c.connection_errors
        if self.verifier is None:
            logger.warning(
                "control plane: unsigned (no ROUNDHOUSE_TRUSTED_CERTS): any client of Redis commands it"
            )
            return
        assert security is not None
        self.max_age_s = security.max_age_s
        self.queue = settings.queue
        # Before the control mailbox subscribes: a broadcast issued before this cannot be
        # one this worker was sent (pub/sub keeps nothing for a late subscriber).
        self.started = time.time()
        client = redis.Redis.from_url(settings.redis_events_url, socket_timeout=5, socket_connect_timeout=5)
        try:
            ledger = NonceLedger(ledger_dir(settings.work_dir, settings.host_id))
        except OSError as exc:
            raise ImproperlyConfigured(f"control plane: cannot keep the replay ledger: {exc}") from None
        self.store = ReplayStore(client, settings.host_id, ledger)
        self.refusals = Refusals(settings)
        c.app.control.mailbox.gate = self
        c.on_decode_error = self.on_decode_error  # the pidbox consumer reads it when it starts
        c.on_unknown_task = self.on_unknown_task  # read when the task handler is built
        _active = self
        logger.info("control plane: signed; trusting %s", "; ".join(self.verifier.trusted))
        if self.verifier.control_only:
            logger.info("control plane: for control commands only: %s", "; ".join(self.verifier.control_only))

    def start(self, c: Any) -> None:
        if self.verifier is None:
            return
        for name, strategy in list(c.strategies.items()):
            if not getattr(strategy, "roundhouse_gated", False):
                c.strategies[name] = self._gated(strategy)

    # ------------------------------------------------------------ tasks

    def _gated(self, strategy: Callable[..., Any]) -> Callable[..., Any]:
        def gated(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any) -> Any:
            try:
                nonce, ttl_s = self.admit_task(message)
            except Refused as refusal:
                headers = message.headers or {}
                self.refusals.report("task", refusal, name=headers.get("task"), task_id=headers.get("id"))
                message.reject_log_error(logger, self._connection_errors, requeue=False)
                return None

            def acknowledge(*args: Any, **kw: Any) -> Any:
                self.store.done(nonce, ttl_s)  # acknowledged: finished, revoked or expired
                return ack(*args, **kw)

            return strategy(message, body, acknowledge, reject, callbacks, **kwargs)

        gated.roundhouse_gated = True  # type: ignore[attr-defined]
        return gated

    def admit_task(self, message: Any) -> tuple[str, int]:
        """Check one task message; bind its headers to its envelope. Returns the nonce and how
        long to remember it."""
        assert self.verifier is not None
        if message.content_type != AUTH_CONTENT_TYPE:
            raise Refused("unsigned", f"content type {message.content_type!r}")
        body = self.verifier.open(message.body)
        if not (isinstance(body, (list, tuple)) and len(body) == 3 and isinstance(body[1], dict)):
            raise Refused("malformed", "not a task body (args, kwargs, embed)")
        headers = message.headers
        envelope = check_task(body[1].get(ENVELOPE_KEY), headers, queue=self.queue, max_age_s=self.max_age_s)
        headers.update(
            eta=envelope.eta,
            expires=envelope.expires,
            timelimit=list(envelope.timelimit),
            ignore_result=envelope.ignore_result,
        )
        ttl_s = replay_ttl_s(envelope.exp)
        deliveries = self.store.admit(envelope.nonce, ttl_s)
        headers["retries"] = deliveries - 1  # what bounds a task that keeps killing its child
        return envelope.nonce, ttl_s

    # ------------------------------------------------------------ control

    def admits_control_message(self, body: Any, message: Any) -> bool:
        content_type = getattr(message, "content_type", None)
        if content_type == AUTH_CONTENT_TYPE and isinstance(body, dict):
            return True
        refusal = Refused(
            "unsigned" if content_type != AUTH_CONTENT_TYPE else "malformed", f"content type {content_type!r}"
        )
        self.refusals.report("control", refusal, name=body.get("method") if isinstance(body, dict) else None)
        return False

    def admit_control(self, method: str, arguments: Any, *, broadcast: bool = False) -> dict[str, Any] | None:
        """The command's arguments without their envelope, or None when it is refused.

        ``broadcast``: sent to every worker (no destination list in its signed body), so not
        bound to this one; it must have been issued after this worker started, or a captured
        one would replay to every worker that joins later."""
        arguments = dict(arguments or {})
        try:
            envelope = check_control(arguments.pop(ENVELOPE_KEY, None), method, max_age_s=self.max_age_s)
            if broadcast and envelope.iat < self.started:
                raise Refused(
                    "before_start",
                    f"a broadcast issued {self.started - envelope.iat:.1f} s before this worker started",
                )
            self.store.admit(envelope.nonce, replay_ttl_s(envelope.exp), once=True)
        except Refused as refusal:
            self.refusals.report("control", refusal, name=method)
            return None
        return arguments

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        """A message naming a task this worker does not have: refused like any other, with no
        result and no event under its id (Celery's own handler writes FAILURE under whatever
        id the message claims, another host's running task included)."""
        headers = message.headers if isinstance(message.headers, dict) else {}
        refusal = Refused("unknown_task", f"no task named {str(headers.get('task'))[:200]!r}")
        if message.content_type != AUTH_CONTENT_TYPE:
            refusal = Refused("unsigned", f"content type {message.content_type!r}")
        else:
            try:
                assert self.verifier is not None
                self.verifier.open(message.body)
            except Refused as found:
                refusal = found
        self.refusals.report("task", refusal, name=headers.get("task"), task_id=headers.get("id"))
        message.reject_log_error(logger, self._connection_errors, requeue=False)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        """kombu could not decode a message (the control mailbox decodes before its callback)."""
        if isinstance(exc, ContentDisallowed):
            refusal = Refused("unsigned", f"content type {message.content_type!r}")
        else:
            try:
                assert self.verifier is not None
                self.verifier.open(message.body)
                refusal = Refused("malformed", str(exc)[:200])
            except Refused as found:
                refusal = found
        self.refusals.report("control", refusal)
        with contextlib.suppress(*self._connection_errors, Exception):
            message.ack()


class GatedRequest(Request):
    """The MainProcess's request of a Roundhouse task.

    On a signed worker it hands the prefork child the body the gate verified, without its
    envelope (the child need not verify again, and tasks never see the envelope); and
    because a worker cannot sign, a task whose child died is retried by delivering the same
    signed message again (``reject(requeue=True)``) instead of sending a new one. Unsigned,
    it is Celery's Request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._roundhouse_signed = _active is not None and isinstance(self._kwargs, dict)
        if self._roundhouse_signed:
            self._kwargs.pop(ENVELOPE_KEY, None)
            self._body = (self._args, self._kwargs, self._payload[2])
            self._decoded = True
            self._content_type = self._content_encoding = None

    def _retry_worker_lost(self, exc: Any, exc_info: Any) -> bool:
        if not self._roundhouse_signed:
            return bool(super()._retry_worker_lost(exc, exc_info))
        if self.store_errors:
            self.task.backend.mark_as_retry(self.id, exc, exc_info.traceback, request=self._context)
        self.reject(requeue=True)
        self.send_event("task-retried", exception=repr(exc)[:1000])
        logger.info(
            "Task %s[%s] retry: the worker was lost; the signed message is delivered again",
            self.task_name,
            self.id,
        )
        return True
