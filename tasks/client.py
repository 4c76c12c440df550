"""``RoundClient``: what an orchestrator uses to drive Roundhouse workers.

Every call is routed to one host's own queue (``roundhouse.<host_id>``); tasks are
sent by name (``send_task``), so the client needs none of the worker's code. Live
hosts come from their heartbeat keys; events are replayed from the capped stream
and then followed live, without gaps or repeats.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult

from executor.urls import Url, redact_url
from settings import Settings, celery_config, get_settings
from tasks.control import send_stop
from tasks.events import Event
from tasks.names import (
    APPLY_DELTA,
    HEARTBEAT_PATTERN,
    LOAD_MODEL,
    REDUCE_SHARD,
    RESET,
    RUN_ROUND,
    STATUS,
    channel_name,
    heartbeat_key,
    queue_name,
    stream_name,
)
from tasks.overlap import SyncOrder, send_sync
from tasks.trust.signed_app import SignedCelery
from tasks.trust.signing import NO_KEY, SigningError

logger = logging.getLogger(__name__)

REFUSAL_PAGE = 2000  # events-stream entries read per call of ``refusals``


def redacted(value: Any) -> Any:
    """``value`` with every URL's query string (and userinfo) removed, for display."""
    if isinstance(value, Url):
        return str(value)
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(item) for item in value]
    return value


class RoundClient:
    def __init__(self, settings: Settings | None = None, *, app: Celery | None = None) -> None:
        self.settings = settings or get_settings()
        if app is None:
            # Signs what it sends when the settings name a signing key (DESIGN §11).
            signed = SignedCelery("roundhouse-client", set_as_current=False)
            signed.conf.update(celery_config(self.settings))
            app = signed.use_settings(self.settings)
        self.app = app
        self.redis = redis.Redis.from_url(
            self.settings.redis_events_url, socket_timeout=10, socket_connect_timeout=5
        )
        self._hosts_of: dict[str, str] = {}

    # ------------------------------------------------------------ hosts

    def hosts(self, *, idle_only: bool = False) -> list[dict[str, Any]]:
        """Live workers (those whose heartbeat has not expired), optionally only idle ones.

        A beat speaks for the host its key names, and only that one (an ACL lets a worker
        write its own key alone): one whose JSON claims another ``host_id`` is skipped."""
        found = []
        prefix = heartbeat_key("")
        for key in self.redis.scan_iter(match=HEARTBEAT_PATTERN, count=100):
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            beat = self.heartbeat(name[len(prefix) :])
            if beat is None or (idle_only and beat.get("state") == "running"):
                continue
            found.append(beat)
        return sorted(found, key=lambda beat: str(beat.get("host_id")))

    def heartbeat(self, host: str) -> dict[str, Any] | None:
        """``host``'s last beat; None when it has none, or when what is under its key is not a
        beat of ``host`` (not JSON, or naming another host: logged)."""
        raw = self.redis.get(heartbeat_key(host))
        if raw is None:
            return None
        try:
            beat = json.loads(raw)
        except ValueError:
            beat = None
        if not isinstance(beat, dict) or beat.get("host_id") != host:
            claimed = beat.get("host_id") if isinstance(beat, dict) else None
            logger.warning("ignored the heartbeat under %s: it names host %r", heartbeat_key(host), claimed)
            return None
        return beat

    # ------------------------------------------------------------ tasks

    def _send(self, host: str, name: str, kwargs: dict[str, Any]) -> AsyncResult:
        queue = queue_name(host)
        # Task events (Flower) and Celery's logs show kwargsrepr, not the kwargs: presigned
        # URLs are credentials, so they appear there without their query strings.
        result = self.app.send_task(
            name, kwargs=kwargs, queue=queue, routing_key=queue, kwargsrepr=repr(redacted(kwargs))
        )
        self._hosts_of[result.id] = host
        return result

    def load_model(
        self,
        host: str,
        model_url: str,
        dataset_shards: list[Any],
        code: str,
        batch_size: int = 32,
        params: dict[str, Any] | None = None,
        initial_shard_index: int = 0,
        tenant: str = "default",
        hash_scheme: str = "sha256",
    ) -> AsyncResult:
        kwargs = {
            "model_url": model_url,
            "dataset_shards": dataset_shards,
            "code": code,
            "batch_size": batch_size,
            "params": params,
            "initial_shard_index": initial_shard_index,
            "tenant": tenant,
        }
        if hash_scheme != "sha256":  # a worker of before the schemes takes the task as it was
            kwargs["hash_scheme"] = hash_scheme
        return self._send(host, LOAD_MODEL, kwargs)

    def run_round(
        self,
        host: str,
        steps: int = 100,
        round_num: int = 0,
        total_rounds: int = 1,
        mode: str = "training",
        step_offset: int = 0,
        delta_url: str | list[Any] | None = None,
        delta_dtype: str = "float16",
        overlap: dict[str, Any] | None = None,
    ) -> AsyncResult:
        """One round on ``host``; its trained delta is PUT to ``delta_url`` as ``delta_dtype``:
        ``"float16"``, ``"bfloat16"``, ``"float32"``, or quantised ``"int8"`` / ``"int4"``
        (blockwise absmax, with error feedback kept on the worker; ``read_delta`` returns
        float32 either way). ``overlap`` (``{"base_hash", "sync_id", "sync_wait_s"}``): a round
        of an overlapped session, which awaits the sync :meth:`send_sync` names ``sync_id``."""
        kwargs: dict[str, Any] = {
            "steps": steps,
            "round_num": round_num,
            "total_rounds": total_rounds,
            "mode": mode,
            "step_offset": step_offset,
            "delta_url": delta_url,
            "delta_dtype": delta_dtype,
        }
        if overlap is not None:  # absent otherwise: a worker of an older release takes the call
            kwargs["overlap"] = overlap
        return self._send(host, RUN_ROUND, kwargs)

    def send_sync(self, host: str, order: SyncOrder) -> None:
        """The sync an overlapped round on ``host`` awaits (signed on the signed control plane)."""
        security = getattr(self.app, "roundhouse_security", None)
        if security is not None and security.signer is None:
            raise SigningError(NO_KEY)
        send_sync(self.redis, host, order, security.signer if security is not None else None)

    def reduce_shard(self, host: str, **arguments: Any) -> AsyncResult:
        """Shard ``arguments["shard"]`` of a sharded round reduced on ``host`` (the arguments of
        ``tasks.rounds.reduce_shard``; docs/SHARDED.md)."""
        return self._send(host, REDUCE_SHARD, dict(arguments))

    def apply_delta(
        self,
        host: str,
        model_url: str,
        delta_url: str | list[Any] | None = None,
        base_hash: str | None = None,
        result_hash: str | None = None,
        params: dict[str, Any] | None = None,
        dataset_shards: list[Any] | None = None,
    ) -> AsyncResult:
        return self._send(
            host,
            APPLY_DELTA,
            {
                "model_url": model_url,
                "delta_url": delta_url,
                "base_hash": base_hash,
                "result_hash": result_hash,
                "params": params,
                "dataset_shards": dataset_shards,
            },
        )

    def reset(self, host: str, tenant: str | None = None) -> AsyncResult:
        return self._send(host, RESET, {"tenant": tenant})

    def status(self, host: str) -> AsyncResult:
        return self._send(host, STATUS, {})

    def stop(self, task_id: str, host: str | None = None) -> None:
        """Stop a task through Redis: works before it starts, and whatever the broker does."""
        target = host or self._hosts_of.get(task_id)
        if target is None:
            raise ValueError(f"which host runs {task_id}? pass host=")
        security = getattr(self.app, "roundhouse_security", None)
        if security is not None and security.signer is None:
            raise SigningError(NO_KEY)
        send_stop(self.redis, target, task_id, security.signer if security is not None else None)

    # ------------------------------------------------------------ events

    def events(
        self, host: str, since: int | None = None, *, idle_timeout_s: float | None = None
    ) -> Iterator[Event]:
        """Events of ``host`` with ``seq > since`` (all kept, when None): replay, then live.

        Subscribes before replaying, so nothing published in between is lost; what both
        deliver is yielded once. When Redis goes away the subscription is renewed and the
        stream replayed from the last seq seen. Ends after ``idle_timeout_s`` without an event.
        """
        last = since if since is not None else 0
        quiet_since = time.monotonic()
        while idle_timeout_s is None or time.monotonic() - quiet_since < idle_timeout_s:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(channel_name(host))
                for event in self._replay(host, last):
                    last = event.seq or last
                    quiet_since = time.monotonic()
                    yield event
                while idle_timeout_s is None or time.monotonic() - quiet_since < idle_timeout_s:
                    message = pubsub.get_message(timeout=0.2)
                    if message is None or message.get("type") != "message":
                        continue
                    event = Event.from_json(message["data"])
                    if event.seq is None or event.seq <= last:
                        continue
                    last = event.seq
                    quiet_since = time.monotonic()
                    yield event
            except redis.ConnectionError:
                time.sleep(0.2)  # Redis is away: subscribe and replay again when it is back
            finally:
                pubsub.close()

    def refusals(self, host: str, after: str) -> tuple[list[Event], str]:
        """The task refusals of ``host``'s gate in its events stream after the entry ``after``
        (exclusive; ``"<unix ms>-0"`` names a time), at most ``REFUSAL_PAGE`` entries read,
        and the id of the last entry read (``after`` when none). A refusal's task id is what
        the refused message claimed: anyone who can write to the queue can claim any id."""
        entries = self.redis.xrange(stream_name(host), min=f"({after}", count=REFUSAL_PAGE) or []
        found = []
        for _entry_id, fields in entries:
            event = Event.from_json(fields[b"msg"])  # type: ignore[index]
            if (
                event.type == "state"
                and event.data.get("event") == "refused"
                and event.data.get("kind") == "task"
            ):
                found.append(event)
        last = entries[-1][0] if entries else after
        return found, last.decode() if isinstance(last, bytes) else str(last)

    def _replay(self, host: str, after: int) -> Iterator[Event]:
        for _entry_id, fields in self.redis.xrange(stream_name(host)) or []:
            event = Event.from_json(fields[b"msg"])  # type: ignore[index]
            if event.seq is not None and event.seq > after:
                yield event
