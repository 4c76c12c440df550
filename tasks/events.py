"""Events to the orchestrator: Redis pub/sub plus a capped stream for replay (DESIGN §5).

Every message goes to the channel ``roundhouse:events:<host>`` and to the stream
``roundhouse:events:<host>:log`` (bounded, see below), with a ``seq`` that increases
per host across processes and restarts. One Lua script assigns the seq and writes
both at once, so a subscriber never sees a gap; a retry after a lost reply is
recognised and not written twice. (The names are in :mod:`tasks.names`.)

Publishing never blocks or fails a round: :meth:`EventPublisher.emit` appends to a
bounded buffer and returns; one thread drains it, reconnecting with backoff while
Redis is away. When the buffer overflows, the oldest events are dropped and counted,
and the count is itself published once Redis is back.

Bounded broker memory per worker (DESIGN §5, §12), whoever supplies an event's content (a
tenant's stats and logs, an unsigned message's headers in a refusal):

- every event is capped where it is published (:func:`capped_template`, in :meth:`emit`, so
  the buffer holds capped events too): over ``event_max_bytes`` its long strings are cut and
  it is marked ``"truncated"``;
- the stream keeps at most ``stream_maxlen`` entries and ``stream_max_bytes`` bytes of
  messages, trimmed exactly, oldest first, by the same script that appends. Redis has no
  byte-bounded XADD, so the script keeps an account: a sorted set of ``"<entry id> <bytes>"``
  by seq, and ``"<entries> <bytes>"`` in a key (:func:`~tasks.names.stream_account_keys`);
- the stream and its account expire ``stream_ttl_s`` after the last publish (the seq counter
  stays: it outlives restarts);
- :meth:`EventPublisher.cut` (at ``reset``, the tenant boundary) empties the stream when the
  next event is published: the next tenant replays nothing of the last one's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import redis

from tasks.names import channel_name, last_sent_key, seq_key, stream_account_keys, stream_name

if TYPE_CHECKING:
    from settings import Settings

logger = logging.getLogger(__name__)

EVENT_VERSION = 1
SEQ_PLACEHOLDER = '"__roundhouse_seq__"'

# KEYS: seq counter, stream, last-sent marker of this publisher, the stream's account (sorted
# set of "<id> <bytes>" by seq), its totals ("<entries> <bytes>").
# ARGV: channel, message with SEQ_PLACEHOLDER, stream maxlen, event id, marker ttl, placeholder,
# stream max bytes, stream ttl (ms), "1" to empty the stream first (cut).
# Only commands a worker's ACL user has (tasks/trust/acl.py): GET SET DEL EXISTS INCR XADD PUBLISH
# ZADD ZRANGE ZREM PEXPIRE. XADD's own MINID trims; what to trim the account says.
_PUBLISH_LUA = """
local last = redis.call('GET', KEYS[3])
if last then
  local sep = string.find(last, ' ', 1, true)
  if string.sub(last, 1, sep - 1) == ARGV[4] then
    return tonumber(string.sub(last, sep + 1))
  end
end
if ARGV[9] == '1' or redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[2], KEYS[4], KEYS[5])
end
local seq = redis.call('INCR', KEYS[1])
local at = string.find(ARGV[2], ARGV[6], 1, true)
local message = string.sub(ARGV[2], 1, at - 1) .. seq .. string.sub(ARGV[2], at + string.len(ARGV[6]))
local count, total = 0, 0
local held = redis.call('GET', KEYS[5])
if held then
  local sep = string.find(held, ' ', 1, true)
  count, total = tonumber(string.sub(held, 1, sep - 1)), tonumber(string.sub(held, sep + 1))
end
count, total = count + 1, total + string.len(message)
local maxlen, maxbytes = tonumber(ARGV[3]), tonumber(ARGV[7])
local upto = nil
while count > 1 and (count > maxlen or total > maxbytes) do
  local oldest = redis.call('ZRANGE', KEYS[4], 0, 63)
  if #oldest == 0 then
    -- The account lost track of the stream: start both afresh rather than trust either.
    redis.call('DEL', KEYS[2], KEYS[4])
    count, total, upto = 1, string.len(message), nil
    break
  end
  local gone = {}
  for _, entry in ipairs(oldest) do
    if count <= 1 or (count <= maxlen and total <= maxbytes) then break end
    local sep = string.find(entry, ' ', 1, true)
    upto = string.sub(entry, 1, sep - 1)
    total, count = total - tonumber(string.sub(entry, sep + 1)), count - 1
    gone[#gone + 1] = entry
  end
  redis.call('ZREM', KEYS[4], unpack(gone))
end
local id
if upto then
  -- MINID keeps ids >= the one given: the entry just after the last one trimmed.
  local dash = string.find(upto, '-', 1, true)
  local minid = string.sub(upto, 1, dash - 1) .. '-' .. (tonumber(string.sub(upto, dash + 1)) + 1)
  id = redis.call('XADD', KEYS[2], 'MINID', minid, '*', 'msg', message)
else
  id = redis.call('XADD', KEYS[2], '*', 'msg', message)
end
redis.call('ZADD', KEYS[4], seq, id .. ' ' .. string.len(message))
redis.call('SET', KEYS[5], count .. ' ' .. total)
for i = 2, 5 do
  if i ~= 3 then redis.call('PEXPIRE', KEYS[i], ARGV[8]) end
end
redis.call('PUBLISH', ARGV[1], message)
redis.call('SET', KEYS[3], ARGV[4] .. ' ' .. seq, 'EX', ARGV[5])
return seq
"""

# A cut string's tail, and how long the strings of an over-size event are cut to at most.
TRUNCATION_MARK = "...[truncated]"
SHORT_TEXT_CHARS = 200


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


def _cut(text: str | None, chars: int) -> str | None:
    if text is None or len(text) <= chars:
        return text
    return text[:chars] + TRUNCATION_MARK


def capped_template(event: Event, max_bytes: int) -> str:
    """The event's template (:meth:`Event.encode_template`) in at most ``max_bytes`` bytes.

    Within the cap it is unchanged. Over it, its ``data`` keeps its first keys with scalars
    as they are and strings (or the JSON of anything else) cut to a few hundred characters,
    and gains ``"truncated": <bytes it had>``, so a consumer still routes on ``data["event"]``
    and ``kind``/``reason``; ``task_id`` and ``task`` are cut alike. When even that is over
    (escaped text: one character can take twelve bytes), only the event's type and its cut
    ``data["event"]`` are left.
    """
    template = event.encode_template()
    if len(template) <= max_bytes:
        return template
    chars = max(16, min(SHORT_TEXT_CHARS, max_bytes // 64))
    data: dict[str, Any] = {}
    for key, value in list(event.data.items())[:32]:
        name = _cut(str(key), chars) or ""
        if value is None or isinstance(value, bool | int | float):
            data[name] = value
        elif isinstance(value, str):
            data[name] = _cut(value, chars)
        else:
            data[name] = _cut(json.dumps(value, separators=(",", ":"), default=str), chars)
    data["truncated"] = len(template)
    shrunk = replace(event, data=data, task_id=_cut(event.task_id, chars), task=_cut(event.task, chars))
    template = shrunk.encode_template()
    if len(template) <= max_bytes:
        return template
    kind = event.data.get("event")
    marker = {"event": _cut(str(kind), 16) if kind is not None else None, "truncated": data["truncated"]}
    return replace(event, data=marker, task_id=None, task=None).encode_template()


@dataclass
class _Pending:
    event_id: str
    template: str
    fresh: bool = False  # empty the stream before this one goes in (EventPublisher.cut)


class EventPublisher:
    """Buffers events and publishes them from one background thread, in order."""

    def __init__(
        self,
        redis_url: str,
        host_id: str,
        *,
        stream_maxlen: int = 10_000,
        stream_max_bytes: int = 32 << 20,
        event_max_bytes: int = 128 << 10,
        stream_ttl_s: float = 24 * 3600,
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
        self._max_bytes = stream_max_bytes
        self._event_max_bytes = event_max_bytes
        self._ttl_ms = max(1, int(stream_ttl_s * 1000))
        self._fresh_next = False
        self._buffer: deque[_Pending] = deque()
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

    @classmethod
    def from_settings(cls, settings: Settings, **options: Any) -> EventPublisher:
        """A publisher with the bounds the operator set (``options``: buffer size, retry)."""
        options.setdefault("buffer_size", settings.events_buffer_size)
        return cls(
            settings.redis_events_url,
            settings.host_id,
            stream_maxlen=settings.events_stream_maxlen,
            stream_max_bytes=settings.events_stream_max_mb << 20,
            event_max_bytes=settings.events_max_event_bytes,
            stream_ttl_s=settings.events_stream_ttl_s,
            **options,
        )

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
        template = capped_template(event, self._event_max_bytes)
        with self._cond:
            pending = _Pending(uuid.uuid4().hex, template, self._fresh_next)
            self._fresh_next = False
            if len(self._buffer) >= self._buffer_size:
                oldest = self._buffer.popleft()
                self.dropped += 1
                # A cut outlives the event that was to carry it.
                (self._buffer[0] if self._buffer else pending).fresh |= oldest.fresh
            self._buffer.append(pending)
            self._cond.notify()

    def cut(self) -> None:
        """The tenant boundary: the stream is emptied when the next event is published, so a
        replay after it shows nothing from before (what is queued now is published first)."""
        with self._cond:
            self._fresh_next = True

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

    def _next(self) -> _Pending | None:
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
                    self._publish(item)
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

    def _publish(self, item: _Pending) -> None:
        seq = self._script(
            keys=[
                seq_key(self.host_id),
                stream_name(self.host_id),
                self._marker,
                *stream_account_keys(self.host_id),
            ],
            args=[
                channel_name(self.host_id),
                item.template,
                self._maxlen,
                item.event_id,
                24 * 3600,
                SEQ_PLACEHOLDER,
                self._max_bytes,
                self._ttl_ms,
                "1" if item.fresh else "0",
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
        self._publish(_Pending(f"drops-{count}-{self._marker}", notice.encode_template()))
        self._dropped_reported = count
