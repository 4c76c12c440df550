"""Listing a fleet (issue 30) against a real redis-server: ``RoundClient.hosts()`` reads the
fleet's index of beats and one ``MGET``, the same few commands for 10 hosts as for 2,000 among
100,000 unrelated keys (counted by the server's own ``INFO commandstats``), never a ``SCAN``;
it lists exactly the hosts whose own key holds their beat, and drops from the index the
entries that have none (dead hosts, forged names, scores past the slack). A fleet whose
workers write no index (an older release) is still listed, by ``SCAN``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from settings import Settings
from tasks.client import INDEX_SLACK_S, RoundClient
from tasks.names import BRIEF_FIELDS, HEARTBEAT_INDEX, heartbeat_key, queue_beat
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[redis.Redis, RoundClient]]:
    server = RedisServer(tmp_path / "redis").start()
    admin = redis.Redis.from_url(server.url)
    client = RoundClient(Settings(broker_url=server.url, host_id="fleet-orchestrator"))
    yield admin, client
    client.redis.close()
    admin.close()
    server.stop()


def beat(admin: redis.Redis, hosts: list[str], *, index: bool = True, ttl: int = 60) -> None:
    """What each worker's beat writes (``tasks.names.queue_beat``, as ``tasks.runtime`` calls
    it); ``index=False``: what an older release's wrote, its key alone."""
    pipe = admin.pipeline(transaction=False)
    now = time.time()
    for host in hosts:
        beat = {"host_id": host, "state": "idle", "ts": now, "cache": {"entries": 3}}
        if index:
            queue_beat(pipe, beat, ttl)
        else:
            pipe.set(heartbeat_key(host), json.dumps(beat), ex=ttl)
    pipe.execute()


def commands(admin: redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def counted(admin: redis.Redis, client: RoundClient) -> tuple[list[str], dict[str, int]]:
    before = commands(admin)
    listed = [str(b["host_id"]) for b in client.hosts()]
    after = commands(admin)
    spent = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    spent["info"] = spent.get("info", 0) - 1  # the count's own INFO
    connecting = {"client", "hello", "auth", "select", "ping"}  # a new connection's, not the listing's
    return listed, {name: n for name, n in spent.items() if n and name not in connecting}


def test_hosts_are_listed_in_the_same_few_commands_whatever_the_fleet_and_the_keyspace(fleet) -> None:  # type: ignore[no-untyped-def]
    admin, client = fleet
    small = [f"gpu-{n}" for n in range(10)]
    beat(admin, small)
    listed, small_cost = counted(admin, client)
    assert listed == sorted(small)
    large = [f"gpu-{n}" for n in range(2000)]
    beat(admin, large)
    pipe = admin.pipeline(transaction=False)
    for n in range(100_000):
        pipe.set(f"celery-task-meta-{n}", "x")
    pipe.execute()
    listed, large_cost = counted(admin, client)
    assert listed == sorted(large)
    assert large_cost == small_cost, (small_cost, large_cost)
    assert "scan" not in large_cost and large_cost.get("mget") == 1, large_cost
    assert sum(large_cost.values()) <= 4, large_cost


def test_an_entry_without_its_hosts_beat_is_not_listed_and_leaves_the_index(fleet) -> None:  # type: ignore[no-untyped-def]
    admin, client = fleet
    beat(admin, ["live-0", "live-1"])
    now = time.time()
    admin.zadd(
        HEARTBEAT_INDEX,
        {
            "dead-0": now + 30,  # its key expired (or never was): a dead host, or a forged entry
            "no*such host": now + 1e9,  # no host id spells it
            "ancient": now - INDEX_SLACK_S - 10,  # older than any clock skew the listing allows
        },
    )
    admin.set(heartbeat_key("liar"), json.dumps({"host_id": "live-0", "state": "idle"}), ex=60)
    admin.zadd(HEARTBEAT_INDEX, {"liar": now + 30})  # its beat names another host
    # A worker whose clock runs behind (its entry's score in the reader's past, within the slack).
    admin.set(heartbeat_key("slow-clock"), json.dumps({"host_id": "slow-clock", "state": "idle"}), ex=60)
    admin.zadd(HEARTBEAT_INDEX, {"slow-clock": now - 120})
    assert [b["host_id"] for b in client.hosts()] == ["live-0", "live-1", "slow-clock"]
    left = {m.decode() for m in admin.zrange(HEARTBEAT_INDEX, 0, -1)}
    assert left == {"live-0", "live-1", "slow-clock"}, left
    # The next listing removes nothing more: they are gone (the liar's entry too: its own beat,
    # were it to write one, would put it back).
    assert "zrem" not in counted(admin, client)[1]


def test_a_fleet_that_writes_no_index_is_listed_by_scan(fleet) -> None:  # type: ignore[no-untyped-def]
    admin, client = fleet
    beat(admin, ["old-0", "old-1"], index=False)  # no index, no briefs
    listed, cost = counted(admin, client)
    assert listed == ["old-0", "old-1"] and cost.get("scan", 0) >= 1, cost
    briefs = client.hosts(brief=True)
    assert [b["host_id"] for b in briefs] == ["old-0", "old-1"] and set(briefs[0]) == set(BRIEF_FIELDS)


def test_a_brief_listing_reads_the_briefs_and_is_as_strict(fleet) -> None:  # type: ignore[no-untyped-def]
    """``hosts(brief=True)`` (what choosing hosts reads) lists the same hosts from their briefs:
    the brief fields only, none from another host's brief, a fleet's briefs in one MGET."""
    admin, client = fleet
    beat(admin, ["b-0", "b-1", "b-2"])
    admin.set(heartbeat_key("b-2", brief=True), json.dumps({"host_id": "b-0", "state": "idle"}), ex=60)
    before = commands(admin)
    briefs = client.hosts(brief=True)
    assert commands(admin)["mget"] - before.get("mget", 0) == 1
    assert [b["host_id"] for b in briefs] == ["b-0", "b-1"]  # b-2's brief names another host
    assert all(set(b) == set(BRIEF_FIELDS) for b in briefs), briefs
    # b-2's entry went with its brief (its worker's next beat puts it back); its whole beat holds.
    assert b"b-2" not in admin.zrange(HEARTBEAT_INDEX, 0, -1) and client.heartbeat("b-2") is not None
