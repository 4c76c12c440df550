"""``python -m bench.fleet``: the control plane at fleet size (issue 30) — host listing.

A real redis-server of its own on loopback holds ``--unrelated`` keys (results' keys, as a busy
broker holds) and the beats of ``--hosts`` hosts (each comma-separated count in turn), written
as a worker's beat writes them (its key with its TTL, its entry in the fleet's index). The hosts
are **simulated** (their beats written here, no worker behind them: a listing reads nothing
else). Side by side, ``--runs`` times each, medians:

- ``brief``: ``RoundClient.hosts(brief=True)`` (the index of beats, one ``MGET`` of their
  briefs: what the orchestrator's membership and ``roundhouse train`` read to choose hosts);
- ``index``: ``RoundClient.hosts()`` (the same, whole beats: ``roundhouse status``);
- ``scan``: the listing it replaced, ``SCAN roundhouse:hosts:*`` and one ``GET`` per key (the
  code of the last release, kept here to measure against).

With ``--worker`` (the default), one **real** worker (``celery worker``, prefork, ``-c 1``,
unsandboxed, unsigned on loopback) is started against the same Redis and left idle; its Redis
connections are counted from ``CLIENT LIST`` (every client but the bench's own, named), each
with the last command it ran (what it is for).

Not built yet of the issue's bench: dispatch latency across 1,000 queues, Redis memory per
worker, connections while a round runs, Flower's cost. Writes ``bench/results/fleet.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from bench.common import save, scratch
from settings import Settings
from tasks.client import RoundClient
from tasks.names import HEARTBEAT_INDEX, HEARTBEAT_PATTERN, queue_beat
from tests.support.redis_server import RedisServer

BATCH = 10_000
BENCH_NAME = "bench-fleet"  # the bench's own connections, left out of a worker's count
# A worker's beat in its fields' shapes (``tasks.runtime.ChildRuntime.status``), idle with a
# model loaded: what each simulated host's key holds (about 700 bytes of JSON).
BEAT: dict[str, Any] = {
    "gpu": {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mb": 81559, "memory_used_mb": 1024},
    "state": "idle",
    "model_hash": "sha256:" + "5e" * 32,
    "tenant": "tenant-0042",
    "task_id": None,
    "cache": {"entries": 64, "bytes": 6_871_947_673, "limit_bytes": 53_687_091_200, "pinned": 2,
              "hits": 1024, "misses": 64, "evictions": 3},
    "sandbox": {"mechanism": "bwrap", "cgroup": "v2", "seccomp": True, "network": "none",
                "uid": 61000, "spare": "ready"},
    "events": {"published": 18_233, "dropped": 0},
    "uploads": [],
    "versions": {"python": "3.11.7", "roundhouse": "0.9.0", "torch": "2.14.1", "celery": "5.5.3"},
}  # fmt: skip


def fill_unrelated(admin: redis.Redis, count: int) -> None:
    for start in range(0, count, BATCH):
        pipe = admin.pipeline(transaction=False)
        for n in range(start, min(count, start + BATCH)):
            pipe.set(f"celery-task-meta-{n:08d}", '{"status": "SUCCESS"}')
        pipe.execute()


def beat_all(admin: redis.Redis, hosts: int) -> None:
    now = time.time()
    for start in range(0, hosts, BATCH):
        pipe = admin.pipeline(transaction=False)
        for n in range(start, min(hosts, start + BATCH)):
            host = f"sim-{n:05d}"
            beat = {**BEAT, "host_id": host, "ts": now, "queue": f"roundhouse.{host}", "pid": 1000 + n}
            queue_beat(pipe, beat, 600)  # what a worker's beat writes
        pipe.execute()


def scan_listing(r: redis.Redis) -> list[dict[str, Any]]:
    """The last release's ``RoundClient.hosts()``: SCAN, then one GET per key."""
    found = []
    for key in r.scan_iter(match=HEARTBEAT_PATTERN, count=100):
        if key.endswith(b":brief"):  # not there in that release: its listing read beats only
            continue
        raw = r.get(key)
        if raw is not None:
            found.append(json.loads(raw))
    return found


def timed(fn: Any, runs: int) -> tuple[float, int]:
    seconds, listed = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        listed = len(fn())
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), listed


def worker_connections(url: str, root: Path, admin: redis.Redis, idle_s: float) -> list[dict[str, Any]]:
    """One real worker started and left idle ``idle_s``: its connections (last command, age)."""
    from bench.redis_idle import ENV
    from orchestrator.local import LocalWorker

    worker = LocalWorker("fleet-real-0", url, root / "worker", env=ENV)
    worker.start()
    try:
        time.sleep(idle_s)
        return [
            {"cmd": c.get("cmd"), "age_s": int(c.get("age", 0)), "addr": c.get("addr")}
            for c in admin.client_list()
            if c.get("name") != BENCH_NAME
        ]
    finally:
        worker.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="1000,10000", help="fleet sizes, comma-separated")
    p.add_argument("--unrelated", type=int, default=1_000_000, help="unrelated keys in the keyspace")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scratch", default=None)
    p.add_argument("--no-worker", dest="worker", action="store_false", help="skip the real worker")
    p.add_argument("--idle-s", type=float, default=30.0, help="how long the real worker idles")
    args = p.parse_args(argv)
    connections: list[dict[str, Any]] = []
    rows = []
    with scratch(args.scratch) as root:
        server = RedisServer(Path(root) / "redis").start()
        try:
            admin = redis.Redis.from_url(server.url, client_name=BENCH_NAME)
            if args.worker:
                connections = worker_connections(server.url, Path(root), admin, args.idle_s)
                print(f"an idle worker holds {len(connections)} connections:", flush=True)
                for c in connections:
                    print(f"  last command {c['cmd']}, {c['age_s']} s old", flush=True)
            fill_unrelated(admin, args.unrelated)
            client = RoundClient(Settings(broker_url=server.url, host_id="bench-fleet"))
            client.redis = redis.Redis.from_url(server.url, client_name=BENCH_NAME)
            for hosts in (int(h) for h in args.hosts.split(",")):
                admin.delete(HEARTBEAT_INDEX)
                beat_all(admin, hosts)
                brief_s, brief_n = timed(lambda: client.hosts(brief=True), args.runs)
                index_s, index_n = timed(client.hosts, args.runs)
                scan_s, scan_n = timed(lambda: scan_listing(client.redis), args.runs)
                keys = int(admin.dbsize())
                rows.append(
                    {"hosts": hosts, "keys": keys, "brief_ms": brief_s * 1e3, "index_ms": index_s * 1e3,
                     "scan_ms": scan_s * 1e3, "listed": [brief_n, index_n, scan_n]}
                )  # fmt: skip
                print(
                    f"{hosts} hosts among {keys} keys: brief {brief_s * 1e3:.1f} ms, "
                    f"index {index_s * 1e3:.1f} ms, scan {scan_s * 1e3:.1f} ms "
                    f"(listed {brief_n} / {index_n} / {scan_n})",
                    flush=True,
                )
        finally:
            server.stop()
    print(
        "\n| hosts | keys in Redis | `hosts(brief=True)` ms | `hosts()` ms | SCAN + GET (last release) ms |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        cells = [row["hosts"], row["keys"], *(f"{row[k]:.1f}" for k in ("brief_ms", "index_ms", "scan_ms"))]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    save("fleet", {"rows": rows, "unrelated": args.unrelated, "runs": args.runs, "connections": connections})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
