"""``RoundClient``: what an orchestrator uses to drive Roundhouse workers.

Every call is routed to one host's own queue (``roundhouse.<host_id>``); tasks are
sent by name (``send_task``), so the client needs none of the worker's code. Live
hosts come from their heartbeat keys; events are replayed from the capped stream
and then followed live, without gaps or repeats.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import orjson
import redis
from celery import Celery
from celery.result import AsyncResult

from executor.urls import Url, redact_url
from settings import Settings, celery_config, get_settings
from tasks.control import send_stop
from tasks.events import Event
from tasks.names import (
    APPLY_DELTA,
    BRIEF_FIELDS,
    HEARTBEAT_INDEX,
    HEARTBEAT_PATTERN,
    HOST_ID,
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


# How far behind the reader's clock a worker's may run and its beats still be listed: the index's
# scores are the workers' clocks; the beat's own key (its TTL kept by Redis) says who is alive.
INDEX_SLACK_S = 300.0


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

    def hosts(self, *, idle_only: bool = False, brief: bool = False) -> list[dict[str, Any]]:
        """Live workers (those whose heartbeat has not expired), optionally only idle ones;
        ``brief``: each beat's brief (``tasks.names.BRIEF_FIELDS``: what choosing hosts reads,
        a tenth of the bytes to fetch and parse at fleet size).

        Two round trips whatever the fleet and the keyspace: the fleet's index of beats and one
        ``MGET`` of the beats it names (a third, where this user may, removes the entries whose
        host has no beat of its own). The index only says whom to read: a beat speaks for the host its key
        names, and only that one (an ACL lets a worker write its own key alone); one whose JSON
        claims another ``host_id`` is skipped, as is an entry with no beat under its key. Its
        scores (a beat's expiry by its worker's clock) only bound what is read: entries older
        than ``INDEX_SLACK_S`` are pruned, so a worker whose clock runs behind by less is
        listed. A fleet whose workers write no index yet (an older release) is listed by
        ``SCAN`` instead."""
        floor = time.time() - INDEX_SLACK_S
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(HEARTBEAT_INDEX, "-inf", f"({floor}")
        pipe.zrangebyscore(HEARTBEAT_INDEX, floor, "+inf")
        pipe.exists(HEARTBEAT_INDEX)
        _pruned, members, indexed = pipe.execute(raise_on_error=False)  # pruning needs write access
        for answer in (members, indexed):
            if isinstance(answer, Exception):
                raise answer
        junk: list[Any] = []  # entries no host id spells: removed, never read
        if indexed:
            names = []
            for member in members:  # one pass: 10,000 of them at fleet size
                text = _text(member)
                if HOST_ID.match(text):
                    names.append(text)
                else:
                    junk.append(member)
        else:
            prefix = heartbeat_key("")
            scanned = (
                _text(key)[len(prefix) :] for key in self.redis.scan_iter(match=HEARTBEAT_PATTERN, count=1000)
            )
            names = [name for name in scanned if HOST_ID.match(name)]  # not the briefs' keys
        # An older fleet (no index) writes no briefs either: its whole beats, cut to the brief.
        beats = self.beats(names, brief=brief and bool(indexed))
        if brief and not indexed:
            beats = {n: b and {k: b.get(k) for k in BRIEF_FIELDS} for n, b in beats.items()}
        found = [
            b for b in beats.values() if b is not None and not (idle_only and b.get("state") == "running")
        ]
        gone = [*junk, *(name for name, beat in beats.items() if beat is None)]
        if indexed and gone:  # a worker that beats meanwhile is back with its next beat
            with contextlib.suppress(redis.exceptions.NoPermissionError):
                self.redis.zrem(HEARTBEAT_INDEX, *gone)
        return sorted(found, key=lambda beat: str(beat.get("host_id")))

    def heartbeat(self, host: str) -> dict[str, Any] | None:
        """``host``'s last beat; None when it has none, or when what is under its key is not a
        beat of ``host`` (not JSON, or naming another host: logged)."""
        return self._beat_of(host, self.redis.get(heartbeat_key(host)))

    def beats(self, hosts: list[str], *, brief: bool = False) -> dict[str, dict[str, Any] | None]:
        """Each of ``hosts``' last beat (None as :meth:`heartbeat` says), or its brief, in one
        round trip."""
        raw = self.redis.mget([heartbeat_key(host, brief=brief) for host in hosts]) if hosts else []
        return {host: self._beat_of(host, value) for host, value in zip(hosts, raw, strict=True)}

    @staticmethod
    def _beat_of(host: str, raw: Any) -> dict[str, Any] | None:
        if raw is None:
            return None
        try:
            beat = orjson.loads(raw)  # 6 x json's speed: a fleet's listing parses 10,000 of them
        except (ValueError, TypeError):
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


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
