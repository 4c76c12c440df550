"""``python -m bench.celery [--rounds 30] [--events 300] [--stops 10]``: Celery latencies.

A real ``roundhouse worker`` (``celery worker -P prefork -c 1``, sandboxed tenant code)
against the embedded ``redis-server`` on loopback, driven by ``tasks.client.RoundClient``:

- dispatch: ``run_round`` sent (``send_task``) to the first line of tenant code running in
  the sandbox, which records ``time.time()`` (one clock: same host, the sandbox shares it);
- events: ``emit_stats`` in tenant code to the event in a subscriber's hands
  (``RoundClient.events``: Redis pub/sub), ``--events`` of them 5 ms apart;
- stop: for each stop path (plain revoke, revoke with terminate, ``RoundClient.stop``, a soft
  time limit), a round spinning in a tight Python loop is stopped; the latency is from the
  stop call (for the time limit: from the limit's expiry) to the ``stopped`` result stored
  in the backend, polled every 5 ms.

Targets: dispatch p50 < 20 ms, event p50 < 5 ms, stop p99 < 1 s for every path.
Writes ``bench/results/celery.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from safetensors.torch import save_file

from bench.common import save, scratch
from orchestrator.local import EmbeddedRedis, LocalWorker
from settings import Settings
from tasks.client import RoundClient
from tasks.names import RUN_ROUND, queue_name
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.rounds import STOP_PATHS, event_seq, stop_task, stored_result, wait_for_log

HOST = "bench"
EVENTS_FROM, SPIN_FROM = 100_000, 200_000  # round numbers select what the code does

CODE = f"""
import time
started = time.time()
if round_num >= {SPIN_FROM}:
    emit_log("spinning")
    while True:
        pass
if round_num >= {EVENTS_FROM}:
    for step in range(steps):
        emit_stats({{"step": step, "t": time.time()}})
        time.sleep(0.005)
save_report({{"started": started}})
"""
SOFT_LIMIT_S = 1.0
LABELS = {
    "revoke": "revoke",
    "terminate": "revoke terminate",
    "client": "RoundClient.stop",
    "soft time limit": "soft time limit",
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) * 1000,
        "p99_ms": percentile(values, 0.99) * 1000,
        "max_ms": max(values) * 1000,
    }


def dispatch(client: RoundClient, rounds: int) -> list[float]:
    latencies = []
    for number in range(rounds):
        sent = time.time()
        result = client.run_round(HOST, steps=1, round_num=number).get(timeout=60)
        assert result["status"] == "completed", result
        latencies.append(result["report"]["started"] - sent)
    return latencies


def events(client: RoundClient, count: int) -> list[float]:
    latencies: list[float] = []
    ready = threading.Event()
    since = event_seq(client, HOST)

    def listen() -> None:
        stream = client.events(HOST, since=since, idle_timeout_s=15)
        ready.set()
        for event in stream:
            if event.type == "stats" and "t" in event.data:
                latencies.append(time.time() - event.data["t"])
                if len(latencies) == count:
                    return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    ready.wait(10)
    time.sleep(0.5)  # the subscription is live before the first event
    result = client.run_round(HOST, steps=count, round_num=EVENTS_FROM).get(timeout=120)
    assert result["status"] == "completed", result
    listener.join(30)
    assert len(latencies) == count, f"{len(latencies)} of {count} events arrived"
    return latencies


def stop_once(client: RoundClient, path: str, number: int) -> float:
    since = event_seq(client, HOST)
    if path == "soft time limit":
        pending = client.app.send_task(
            RUN_ROUND,
            kwargs={"steps": 1, "round_num": SPIN_FROM + number},
            queue=queue_name(HOST),
            soft_time_limit=SOFT_LIMIT_S,
        )
    else:
        pending = client.run_round(HOST, steps=1, round_num=SPIN_FROM + number)
    wait_for_log(client, HOST, since, "spinning")
    if path == "soft time limit":
        # The limit runs from the task's start; its start is the task-started state event.
        started = task_started_at(client, since, pending.id)
        asked = started + SOFT_LIMIT_S
    else:
        asked = time.time()
        stop_task(client, path, pending.id, HOST)
    result = stored_result(pending, poll_s=0.005)
    seen = time.time()
    assert result["status"] == "stopped", result
    return seen - asked


def task_started_at(client: RoundClient, since: int, task_id: str) -> float:
    for event in client.events(HOST, since=since, idle_timeout_s=5):
        if event.task_id == task_id and event.type == "state" and event.data.get("event") == "task-started":
            return event.ts
    raise TimeoutError("no task-started event")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--stops", type=int, default=10)
    args = parser.parse_args()
    with scratch() as base:
        root = base / "srv"
        root.mkdir()
        save_file(mlp_state(), str(root / "model.safetensors"))
        raw = make_shards(root)
        redis_server = EmbeddedRedis(base / "redis").start()
        worker = LocalWorker(
            HOST,
            redis_server.url,
            base / "worker",
            env={"ROUNDHOUSE_METRICS_PORT": "0", "ROUNDHOUSE_URL_ALLOW": "127.0.0.1"},
        )
        try:
            worker.start()
            with FaultServer(root) as server:
                shards = shard_descriptors(server, raw)
                client = RoundClient(Settings(broker_url=redis_server.url, host_id="bench-client"))
                client.load_model(HOST, server.url("model.safetensors"), shards, CODE).get(timeout=120)
                client.run_round(HOST, steps=1, round_num=0).get(timeout=60)  # warm
                dispatch_s = dispatch(client, args.rounds)
                event_s = events(client, args.events)
                stops = {
                    path: [stop_once(client, path, n) for n in range(args.stops)]
                    for path in (*STOP_PATHS, "soft time limit")
                }
        finally:
            worker.stop()
            redis_server.stop()
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m bench.celery", *sys.argv[1:]]),
        "dispatch": summary(dispatch_s),
        "event": summary(event_s),
        "stop": {path: summary(values) for path, values in stops.items()},
        "raw_s": {"dispatch": dispatch_s, "event": event_s, "stop": stops},
    }
    save("celery", record)
    print(f"{'what':<34}{'n':>5}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'target':>16}")
    rows = [("send_task -> tenant code runs", record["dispatch"], "p50 < 20 ms")]
    rows.append(("emit_stats -> subscriber", record["event"], "p50 < 5 ms"))
    rows += [(f"stop: {LABELS[path]}", stats, "p99 < 1000 ms") for path, stats in record["stop"].items()]
    for name, stats, target in rows:
        print(
            f"{name:<34}{stats['n']:>5}{stats['p50_ms']:>9.1f}{stats['p99_ms']:>9.1f}{stats['max_ms']:>9.1f}"
            f"{target:>16}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
