"""Event publishing against a real redis-server: order, no gaps, replay, Redis outages."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from settings import Settings
from tasks.client import RoundClient
from tasks.events import EventPublisher
from tasks.names import stream_name
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
