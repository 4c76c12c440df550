"""Events to the orchestrator: Redis pub/sub plus a capped stream for replay (DESIGN §5).

Every message goes to the channel ``roundhouse:events:<host>`` and to the stream
``roundhouse:events:<host>:log`` (``XADD MAXLEN ~``), with a ``seq`` that increases
per host across processes and restarts. One Lua script assigns the seq and writes
both at once, so a subscriber never sees a gap; a retry after a lost reply is
recognised and not written twice. (The names are in :mod:`tasks.names`.)

Publishing never blocks or fails a round: :meth:`EventPublisher.emit` appends to a
bounded buffer and returns; one thread drains it, reconnecting with backoff while
Redis is away. When the buffer overflows, the oldest events are dropped and counted,
and the count is itself published once Redis is back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from tasks.names import channel_name, last_sent_key, seq_key, stream_name

logger = logging.getLogger(__name__)

EVENT_VERSION = 1
SEQ_PLACEHOLDER = '"__roundhouse_seq__"'

# KEYS: seq counter, stream, last-sent marker of this publisher.
# ARGV: channel, message with SEQ_PLACEHOLDER, stream maxlen, event id, marker ttl.
_PUBLISH_LUA = """
local last = redis.call('GET', KEYS[3])
if last then
  local sep = string.find(last, ' ', 1, true)
  if string.sub(last, 1, sep - 1) == ARGV[4] then
    return tonumber(string.sub(last, sep + 1))
  end
end
local seq = redis.call('INCR', KEYS[1])
local at = string.find(ARGV[2], ARGV[6], 1, true)
local message = string.sub(ARGV[2], 1, at - 1) .. seq .. string.sub(ARGV[2], at + string.len(ARGV[6]))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'msg', message)
redis.call('PUBLISH', ARGV[1], message)
redis.call('SET', KEYS[3], ARGV[4] .. ' ' .. seq, 'EX', ARGV[5])
return seq
"""


@dataclass(frozen=True)
class Event:
    """One message: ``{"v", "type", "host", "task_id", "task", "round", "seq", "ts", "data"}``."""

    type: str
    host: str
    data: dict[str, Any]
    task_id: str | None = None
    task: str | None = None
    round: int | None = None
    ts: float = 0.0
    seq: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "v": EVENT_VERSION,
            "type": self.type,
            "host": self.host,
            "task_id": self.task_id,
            "task": self.task,
            "round": self.round,
            "seq": self.seq,
            "ts": self.ts,
            "data": self.data,
        }

    def encode_template(self) -> str:
        """JSON with the seq left as a placeholder for the server to fill in."""
        body = self.to_json()
        body["seq"] = "__roundhouse_seq__"
        # seq goes first: user data cannot hold the placeholder before it.
        ordered = {"seq": body.pop("seq"), **body}
        return json.dumps(ordered, separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Event:
        body = json.loads(raw)
        return cls(
            type=body["type"],
            host=body["host"],
            data=body.get("data") or {},
            task_id=body.get("task_id"),
            task=body.get("task"),
            round=body.get("round"),
            ts=body.get("ts", 0.0),
            seq=body.get("seq"),
        )


class EventPublisher:
    """Buffers events and publishes them from one background thread, in order."""

    def __init__(
        self,
        redis_url: str,
        host_id: str,
        *,
        stream_maxlen: int = 10_000,
        buffer_size: int = 10_000,
        retry_max_s: float = 2.0,
    ) -> None:
        self.host_id = host_id
        self._client = redis.Redis.from_url(
            redis_url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=15
        )
        self._script = self._client.register_script(_PUBLISH_LUA)
        self._marker = last_sent_key(host_id, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._maxlen = stream_maxlen
        self._buffer: deque[tuple[str, Event]] = deque()
        self._buffer_size = buffer_size
        self._cond = threading.Condition()
        self._retry_max_s = retry_max_s
        self._closed = False
        self._inflight = 0
        self.dropped = 0
        self._dropped_reported = 0
        self.published = 0
        self.last_seq: int | None = None
        self._thread = threading.Thread(target=self._run, name="roundhouse-events", daemon=True)
        self._thread.start()

    def emit(
        self,
        kind: str,
        data: dict[str, Any],
        *,
        task_id: str | None = None,
        task: str | None = None,
        round_num: int | None = None,
    ) -> None:
        """Queue one event; never blocks, never raises for Redis trouble."""
        event = Event(kind, self.host_id, data, task_id, task, round_num, time.time())
        with self._cond:
            if len(self._buffer) >= self._buffer_size:
                self._buffer.popleft()
                self.dropped += 1
            self._buffer.append((uuid.uuid4().hex, event))
            self._cond.notify()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far is published (False on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._buffer or self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _next(self) -> tuple[str, Event] | None:
        with self._cond:
            while not self._buffer and not self._closed:
                self._cond.wait(1.0)
            if not self._buffer:
                return None
            self._inflight += 1
            return self._buffer.popleft()

    def _run(self) -> None:
        delay = 0.05
        while True:
            item = self._next()
            if item is None:
                return
            while True:
                try:
                    self._report_drops()
                    self._publish(*item)
                    delay = 0.05
                    break
                except redis.RedisError as exc:
                    # Keep the event and its id: the retry is deduplicated server-side.
                    logger.debug("event publish failed (%s); retrying in %.2fs", exc, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, self._retry_max_s)
                    if self._closed:
                        break
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _publish(self, event_id: str, event: Event) -> None:
        seq = self._script(
            keys=[seq_key(self.host_id), stream_name(self.host_id), self._marker],
            args=[
                channel_name(self.host_id),
                event.encode_template(),
                self._maxlen,
                event_id,
                24 * 3600,
                SEQ_PLACEHOLDER,
            ],
        )
        self.last_seq = int(seq)
        self.published += 1

    def _report_drops(self) -> None:
        if self.dropped == self._dropped_reported:
            return
        count = self.dropped
        notice = Event(
            "state", self.host_id, {"event": "events_dropped", "dropped_total": count}, ts=time.time()
        )
        self._publish(f"drops-{count}-{self._marker}", notice)
        self._dropped_reported = count
