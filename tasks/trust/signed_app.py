"""The signed Celery app of Roundhouse's processes (DESIGN §11), built on :mod:`tasks.trust.signing`.

- :class:`SignedCelery`: with signing settings, every task it sends (``send_task``, and so
  ``apply_async``, Flower's task API, ``celery call``) is signed and carries its envelope;
  without them it is plain Celery.
- :class:`SignedControl` / :class:`SignedMailbox`: control commands (``revoke``,
  ``shutdown``, ``inspect`` …) signed with their envelope, replies as JSON both ways (a
  worker has no key, and what it answers is not a command).
- :class:`GatedNode`: the worker's end of the mailbox, which hands every command to the
  worker's gate (:mod:`tasks.trust.gate`) before it runs.
- :func:`app_settings`: the Settings an app was built with, which its bootsteps read (Celery
  builds them itself, from the app, so the app is how they reach the settings).
"""

from __future__ import annotations

import datetime
import time
import uuid
from typing import Any

from celery import Celery
from celery.app.control import Control
from celery.exceptions import ImproperlyConfigured
from celery.utils.log import get_logger
from kombu.pidbox import Mailbox, Node

from settings import Settings
from settings.celery import AUTH_CONTENT_TYPE
from tasks.names import ENVELOPE_KEY
from tasks.trust.signing import (
    NO_KEY,
    ControlEnvelope,
    Security,
    SigningError,
    TaskEnvelope,
    load_security,
    new_nonce,
)

logger = get_logger(__name__)


def _absolute(seconds: float | None, moment: object, now: datetime.datetime) -> str | None:
    """A countdown or an eta/expiry (datetime or ISO text) as the ISO text Celery puts in headers."""
    if seconds is not None:
        return (now + datetime.timedelta(seconds=float(seconds))).isoformat()
    if isinstance(moment, (int, float)):
        return (now + datetime.timedelta(seconds=float(moment))).isoformat()
    if isinstance(moment, datetime.datetime):
        return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)).isoformat()
    return None if moment is None else str(moment)


class SignedCelery(Celery):
    """The Celery app of Roundhouse's processes: with signing settings, what it sends is
    signed and carries its envelope (``send_task``, and so ``apply_async``, Flower,
    ``celery call``), and its control commands too (``SignedControl``); without them it is
    plain Celery."""

    control_cls = "tasks.trust.signed_app:SignedControl"
    roundhouse_security: Security | None = None
    roundhouse_settings: Settings | None = None

    def use_settings(self, settings: Settings) -> SignedCelery:
        self.roundhouse_settings = settings
        security = load_security(settings)
        self.roundhouse_security = security
        if security is not None and security.verifier is not None:
            security.verifier.register()
        if security is not None and security.signer is not None:
            self.conf.task_serializer = security.signer.serializer_name
        return self

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        security = self.roundhouse_security
        if security is None:
            return super().send_task(name, args, kwargs, **options)
        if security.signer is None:
            raise SigningError(NO_KEY)
        now = datetime.datetime.now(datetime.UTC)
        task_id = options.pop("task_id", None) or str(uuid.uuid4())
        eta = _absolute(options.pop("countdown", None), options.pop("eta", None), now)
        if eta is not None:
            options["eta"] = eta
        if "expires" in options:
            options["expires"] = _absolute(None, options["expires"], now)
        queue = options.get("queue") or self.conf.task_default_queue
        issued = now.timestamp()
        envelope = TaskEnvelope(
            task=name, id=task_id, queue=getattr(queue, "name", queue), iat=issued,
            exp=issued + security.max_age_s, nonce=new_nonce(), eta=eta, expires=options.get("expires"),
            timelimit=(options.get("time_limit"), options.get("soft_time_limit")),
            ignore_result=options.get("ignore_result"),
        )  # fmt: skip
        signed_kwargs = {**(kwargs or {}), ENVELOPE_KEY: envelope.to_json()}
        return super().send_task(name, args, signed_kwargs, task_id=task_id, **options)


def app_settings(app: Any) -> Settings:
    """The Settings ``app`` was built with (:meth:`SignedCelery.use_settings`): a bootstep's
    ``parent.app`` carries them, not the process's global ones, which a test or a second app
    in one process may not share."""
    settings = getattr(app, "roundhouse_settings", None)
    if settings is None:
        # Every app whose worker runs Roundhouse's bootsteps is built by tasks.app.create_app.
        raise ImproperlyConfigured(
            f"the Celery app {app.main!r} carries no Roundhouse settings (use_settings)"
        )
    return settings


class GatedNode(Node):
    """The worker's end of the control mailbox: a gate (``tasks.trust.gate``), when the worker has
    one, sees every command before it runs, and takes its envelope off."""

    def handle_message(self, body: Any, message: Any = None) -> Any:
        gate = getattr(self.mailbox, "gate", None)
        if gate is not None and not gate.admits_control_message(body, message):
            return None
        return super().handle_message(body, message)

    def dispatch(
        self, method: str, arguments: Any = None, reply_to: Any = None, ticket: Any = None, **kwargs: Any
    ) -> Any:
        gate = getattr(self.mailbox, "gate", None)
        if gate is not None:
            # kombu ran it because its signed destination names this node, or because it
            # names none (a pattern too reaches any worker whose name matches: a broadcast).
            broadcast = not kwargs.get("destination")
            arguments = gate.admit_control(method, arguments, broadcast=broadcast)
            if arguments is None:
                return None  # refused: no reply either, its reply_to may not be the signer's
        return super().dispatch(method, arguments, reply_to, ticket, **kwargs)


class SignedMailbox(Mailbox):
    """Commands out signed with their envelope; replies in and out as JSON (a worker has no
    key: what it answers is not a command)."""

    node_cls = GatedNode
    security_source: Any = None  # the app, whose roundhouse_security is read when sending

    def _publish(self, type: str, arguments: Any, destination: Any = None, reply_ticket: Any = None,
                 channel: Any = None, timeout: Any = None, serializer: Any = None, producer: Any = None,
                 pattern: Any = None, matcher: Any = None) -> Any:  # fmt: skip
        security = getattr(self.security_source, "roundhouse_security", None)
        if security is not None:
            if security.signer is None:
                if type == "hello":  # a worker's mingle at start-up: it has no key to say hello with
                    logger.info("mingle skipped: this worker cannot sign control commands")
                    return None
                raise SigningError(NO_KEY)
            issued = time.time()
            envelope = ControlEnvelope(type, issued, issued + security.max_age_s, new_nonce())
            arguments = {**(arguments or {}), ENVELOPE_KEY: envelope.to_json()}
            serializer = security.signer.serializer_name
        return super()._publish(type, arguments, destination, reply_ticket, channel, timeout,
                                serializer, producer, pattern, matcher)  # fmt: skip

    def _collect(self, ticket: Any, limit: Any = None, timeout: Any = 1, callback: Any = None,
                 channel: Any = None, accept: Any = None) -> Any:  # fmt: skip
        if accept is None and getattr(self.security_source, "roundhouse_security", None) is not None:
            accept = ["application/json"]
        return super()._collect(ticket, limit, timeout, callback, channel, accept)


class SignedControl(Control):
    Mailbox = SignedMailbox

    def __init__(self, app: Any = None) -> None:
        super().__init__(app)
        self.mailbox.security_source = app
        if app.conf.get("security_cert_store") or app.conf.get("security_key"):
            self.mailbox.accept = [AUTH_CONTENT_TYPE]  # what the worker's node takes
            self.mailbox.serializer = "json"  # what it replies in
