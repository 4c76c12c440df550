"""Event publishing against a real redis-server: order, no gaps, replay, Redis outages."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from settings import Settings
from tasks.client import RoundClient
from tasks.events import Event, EventPublisher
from tasks.names import seq_key, stream_account_keys, stream_name
from tests.support.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def client_for(server: RedisServer) -> RoundClient:
    return RoundClient(Settings(broker_url=server.url, host_id="events-test"))


def test_events_have_contiguous_seqs_and_the_stream_is_capped(redis_server: RedisServer) -> None:
    publisher = EventPublisher(redis_server.url, "h1", stream_maxlen=100)
    for i in range(500):
        publisher.emit("stats", {"i": i}, task_id="t", task="run_round", round_num=2)
    assert publisher.flush(20)
    events = list(client_for(redis_server).events("h1", idle_timeout_s=0.3))
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], 501)), "replay must be contiguous up to the last seq"
    assert len(events) < 500 and redis_server.client().xlen(stream_name("h1")) < 250
    last = events[-1]
    assert (last.type, last.task_id, last.task, last.round, last.data) == (
        "stats",
        "t",
        "run_round",
        2,
        {"i": 499},
    )
    publisher.close()


def test_seq_is_per_host_and_shared_by_processes_of_that_host(redis_server: RedisServer) -> None:
    first, second = EventPublisher(redis_server.url, "h2"), EventPublisher(redis_server.url, "h2")
    for i in range(50):
        (first if i % 2 else second).emit("log", {"text": str(i)})
        first.flush(5)
        second.flush(5)
    other = EventPublisher(redis_server.url, "h3")
    other.emit("log", {"text": "elsewhere"})
    other.flush(5)
    seqs = [e.seq for e in client_for(redis_server).events("h2", idle_timeout_s=0.3)]
    assert seqs == list(range(1, 51))
    assert [e.seq for e in client_for(redis_server).events("h3", idle_timeout_s=0.3)] == [1]
    for publisher in (first, second, other):
        publisher.close()


def test_emit_never_blocks_while_redis_is_down_and_drops_are_counted(redis_server: RedisServer) -> None:
    publisher = EventPublisher(redis_server.url, "h4", buffer_size=50, retry_max_s=0.2)
    publisher.emit("state", {"event": "before"})
    assert publisher.flush(5)
    redis_server.kill()
    started = time.monotonic()
    for i in range(200):
        publisher.emit("stats", {"i": i})
    # Generous on purpose (a loaded CI machine): an emit that waited for Redis would retry its
    # connection with backoff (up to retry_max_s=0.2 s) every time, 200 times: 40 s and more.
    assert time.monotonic() - started < 5.0, "emit blocked while Redis was down"
    # 50 fit in the buffer and one may already be in flight when Redis went away.
    assert publisher.dropped >= 149
    redis_server.start()
    assert publisher.flush(20)
    events = list(client_for(redis_server).events("h4", idle_timeout_s=0.3))
    notices = [e for e in events if e.data.get("event") == "events_dropped"]
    assert notices and notices[-1].data["dropped_total"] == publisher.dropped
    kept = [e.data["i"] for e in events if e.type == "stats"]
    assert kept == sorted(kept) and kept[-50:] == list(range(150, 200)), "the newest are kept, in order"
    assert len(kept) + publisher.dropped == 200, "every event is either published or counted as dropped"
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    publisher.close()


def test_a_live_subscriber_survives_a_redis_restart(redis_server: RedisServer) -> None:
    publisher = EventPublisher(redis_server.url, "h5", retry_max_s=0.2)
    seen: list[int] = []

    def follow() -> None:
        for event in client_for(redis_server).events("h5", idle_timeout_s=8):
            seen.append(event.data["i"])
            if event.data["i"] == 19:
                return

    follower = threading.Thread(target=follow)
    follower.start()
    for i in range(10):
        publisher.emit("stats", {"i": i})
    publisher.flush(5)
    redis_server.kill()
    for i in range(10, 20):
        publisher.emit("stats", {"i": i})
    time.sleep(0.5)  # not for correctness: the outage lasts a while, as a real one would
    redis_server.start()
    publisher.flush(20)
    follower.join(20)
    assert seen == list(range(20))
    publisher.close()


def stream_bytes(server: RedisServer, host: str) -> tuple[int, int]:
    """(entries, bytes of their messages) the host's stream holds, read from the stream itself."""
    entries = server.client().xrange(stream_name(host))
    return len(entries), sum(len(fields[b"msg"]) for _id, fields in entries)


def test_the_stream_is_bounded_in_bytes_and_kept_exactly(redis_server: RedisServer) -> None:
    """DESIGN §5: bounded in bytes as well as entries. 8 MiB of 64 KiB stats (a tenant's full
    message size) into a stream of 1 MiB: the newest ~15 are kept, contiguous, and no more."""
    publisher = EventPublisher(redis_server.url, "hb", stream_max_bytes=1 << 20)
    blob = "x" * (64 * 1024 - 100)
    for i in range(128):
        publisher.emit("stats", {"i": i, "blob": blob})
    assert publisher.flush(30)
    count, held = stream_bytes(redis_server, "hb")
    assert held <= 1 << 20 and held > (1 << 20) - 70_000, held  # full, never over
    events = list(client_for(redis_server).events("hb", idle_timeout_s=0.3))
    assert [e.data["i"] for e in events] == list(range(128 - count, 128))
    # The account beside the stream agrees with what the stream holds.
    _sizes, totals = stream_account_keys("hb")
    assert redis_server.client().get(totals) == f"{count} {held}".encode()
    # Many small ones: the entry bound still holds, exactly.
    small = EventPublisher(redis_server.url, "hb", stream_maxlen=50)
    for i in range(200):
        small.emit("stats", {"i": i})
    assert small.flush(30)
    assert stream_bytes(redis_server, "hb")[0] == 50
    for each in (publisher, small):
        each.close()


def test_every_event_is_capped_where_it_is_published(redis_server: RedisServer) -> None:
    """Whoever supplied an event's content: a refusal's 1 MiB detail, task id and name, a
    tenant's deep data, a million keys; each goes out within the cap, still saying what it is."""
    publisher = EventPublisher(redis_server.url, "hc", event_max_bytes=8192)
    huge = "c" * (1 << 20)
    publisher.emit(
        "state",
        {"event": "refused", "kind": "task", "reason": "unsigned", "detail": f"content type {huge!r}"},
        task_id=huge,
        task=huge,
    )
    publisher.emit("stats", {"nested": {"deep": [huge, huge]}, "step": 3})
    publisher.emit("stats", {str(i): i for i in range(100_000)})
    publisher.emit("log", {"text": "\u2603" * 100_000})  # escaped: 6 bytes a character
    publisher.emit("log", {"text": "small"})
    assert publisher.flush(20)
    raw = [fields[b"msg"] for _id, fields in redis_server.client().xrange(stream_name("hc"))]
    assert len(raw) == 5 and all(len(message) <= 8192 for message in raw), [len(m) for m in raw]
    refused, nested, many, snowmen, small = (Event.from_json(message) for message in raw)
    assert refused.data["event"] == "refused" and refused.data["reason"] == "unsigned"
    assert refused.data["truncated"] > 1 << 20 and refused.data["detail"].startswith("content type 'ccc")
    assert refused.task_id is not None and len(refused.task_id) < 300
    assert nested.data["step"] == 3 and nested.data["truncated"] > 2 << 20
    assert many.data["truncated"] > 100_000 and len(many.data) <= 33
    assert snowmen.data["truncated"] > 600_000 and snowmen.type == "log"
    assert small.data == {"text": "small"}, "an event within the cap goes out as it is"
    publisher.close()


def test_a_cut_leaves_no_replay_and_the_stream_expires(redis_server: RedisServer) -> None:
    publisher = EventPublisher(redis_server.url, "hd", stream_ttl_s=60)
    for i in range(20):
        publisher.emit("stats", {"tenant": "a", "i": i})
    publisher.cut()
    publisher.emit("state", {"event": "task-finished"})
    publisher.emit("stats", {"tenant": "b"})
    assert publisher.flush(10)
    replay = list(client_for(redis_server).events("hd", idle_timeout_s=0.3))
    assert [e.data for e in replay] == [{"event": "task-finished"}, {"tenant": "b"}]
    assert [e.seq for e in replay] == [21, 22], "the seq goes on across the cut"
    client = redis_server.client()
    for key in (stream_name("hd"), *stream_account_keys("hd")):
        assert 0 < client.ttl(key) <= 60, key
    assert client.ttl(seq_key("hd")) == -1, "the seq outlives the stream: it never goes back"
    publisher.close()
