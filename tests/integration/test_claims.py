"""What the README and docs/OPERATIONS.md claim about whole workers, each proved through
real parts: a redis-server of the test's own, real ``roundhouse worker`` processes killed
and signalled as an operator or a host failure would, Flower's own HTTP API.

Tenant code that must be counted runs unsandboxed (``ROUNDHOUSE_SANDBOX=off``) and appends
to a file: one line per execution, whatever Celery, Redis or the events say. Where a test
needs the round to still be running at some moment, the round waits for a file the test
creates, so no step depends on how fast this machine is.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import zstandard
from safetensors.torch import save_file

from executor.delta import state_hash
from orchestrator.local import LocalWorker
from settings import Settings
from tasks.client import RoundClient
from tasks.names import heartbeat_key
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.redis_server import RedisServer, free_port
from tests.support.rounds import event_seq, stored_result, unacked_since, wait_for_log
from tests.support.waiting import wait_until
from tests.support.worker import REPO, WorkerProcess

pytestmark = pytest.mark.timeout(300)

# Appends one line per execution to params["tally"], then waits for params["go"] to exist.
TALLY = """
import os, time
with open(params["tally"], "a") as tally:
    tally.write(f"{round_num}\\n")
emit_log(f"round {round_num} tallied")
while not os.path.exists(params["go"]):
    time.sleep(0.02)
save_report({"round": round_num})
"""
# Round 0 spins until stopped; any other round ends at once.
SPIN_IN_ROUND_ZERO = """
if round_num == 0:
    emit_log("round zero started")
    while True:
        pass
save_report({"round": round_num})
"""
VISIBILITY_TIMEOUT_S = 2
HEARTBEAT_TTL_S = 2


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("srv")
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        yield server, root, shard_descriptors(server, shards)


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> RoundClient:
    return RoundClient(Settings(broker_url=redis_server.url, host_id="claims-client"))


@pytest.fixture(scope="module")
def sandboxed(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    """A worker as deployed (sandbox on), with a shard cache of 1 MiB."""
    worker = WorkerProcess(
        "c1", redis_server.url, tmp_path_factory.mktemp("c1"), env={"ROUNDHOUSE_SHARD_CACHE_MAX_MB": "1"}
    ).start()
    yield worker
    worker.stop()


def unsandboxed(host: str, redis_server: RedisServer, directory: Path, **env: str) -> WorkerProcess:
    return WorkerProcess(host, redis_server.url, directory, env={"ROUNDHOUSE_SANDBOX": "off", **env})


def tally_params(directory: Path) -> dict[str, str]:
    return {"tally": str(directory / "tally"), "go": str(directory / "go")}


def executions(directory: Path) -> list[str]:
    path = directory / "tally"
    return path.read_text().split() if path.exists() else []


def received(worker: LocalWorker, task_id: str) -> int:
    """Deliveries of ``task_id`` that Celery logged (a restarted worker appends to the same log)."""
    return worker.log().count(f"[{task_id}] received")


def stored_meta(client: RoundClient, task_id: str) -> dict:
    """The task's result as Redis holds it: what an orchestrator in any language reads."""
    raw = client.redis.get(f"celery-task-meta-{task_id}")
    return json.loads(raw) if raw else {}


def task_events(client: RoundClient, host: str, since: int, task_id: str) -> list:
    return [e for e in client.events(host, since=since, idle_timeout_s=1) if e.task_id == task_id]


def kill_whole(worker: LocalWorker) -> None:
    """SIGKILL the MainProcess and its child at once, as a host failure would."""
    os.killpg(worker.main_pid, signal.SIGKILL)
    assert worker.process is not None
    worker.process.wait(timeout=30)


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (the child's sandbox: bwrap and the runner)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                children = [int(c) for c in (task / "children").read_text().split()]
                found.update(children)
                todo += children
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def big_shards(root: Path) -> list[dict]:
    """Two real shards of about 600 KB each: one fits a 1 MiB cache, two do not."""
    g = torch.Generator().manual_seed(11)
    descriptors = []
    for i in range(2):
        buffer = io.BytesIO()
        torch.save({"x": torch.randn(150_000, generator=g)}, buffer)
        packed = zstandard.ZstdCompressor().compress(buffer.getvalue())
        (root / f"big{i}.pt.zst").write_bytes(packed)
        descriptors.append({"name": f"big{i}.pt.zst", "size_bytes": len(packed)})
    return descriptors


# ---------------------------------------------------------------- redelivery by the broker


def test_a_round_finished_but_unacked_when_the_worker_dies_is_redelivered_and_not_run_again(  # type: ignore[no-untyped-def]
    artifacts, client, redis_server, tmp_path_factory
) -> None:
    """The narrowest window of acks_late: the child has run the round and stored its result,
    the MainProcess has not acknowledged the message yet (it is stopped here), and the whole
    worker dies. Redis restores the message after the visibility timeout; the restarted
    worker receives it a second time and answers from its recorded result."""
    server, _root, shards = artifacts
    directory = tmp_path_factory.mktemp("r1")
    env = {"ROUNDHOUSE_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S)}
    worker = unsandboxed("r1", redis_server, directory, **env).start()
    try:
        params = tally_params(directory)
        client.load_model("r1", server.url("model.safetensors"), shards, TALLY, params=params).get(timeout=60)
        since = event_seq(client, "r1")
        pending = client.run_round("r1", steps=1, round_num=4)
        wait_for_log(client, "r1", since, "round 4 tallied")
        os.kill(worker.main_pid, signal.SIGSTOP)  # from now on nothing acknowledges the message
        Path(params["go"]).touch()
        first = stored_result(pending)  # the child stores the result itself
        delivered_at = unacked_since(client, pending.id)
        assert first["status"] == "completed" and delivered_at is not None, "the message was not left unacked"
        kill_whole(worker)
        # kombu restores unacked messages older than the visibility timeout when a worker
        # starts (and then only every 100 s): start the twin once the timeout has passed.
        wait_until(lambda: time.time() > delivered_at + VISIBILITY_TIMEOUT_S + 0.2, 30, "the timeout")
        worker = unsandboxed("r1", redis_server, directory, **env).start()
        wait_until(lambda: unacked_since(client, pending.id) is None and received(worker, pending.id) == 2,
                   60, "the second delivery to be acknowledged")  # fmt: skip
        assert client.redis.llen("roundhouse.r1") == 0
        assert stored_result(pending) == first
        starts = [
            e for e in task_events(client, "r1", since, pending.id) if e.data.get("event") == "task-started"
        ]
        assert len(starts) == 2, "the second delivery never reached the child"
        assert executions(directory) == ["4"], "tenant code ran again for a delivered-twice round"
    finally:
        worker.stop()


def test_a_heartbeat_expires_within_its_ttl_once_the_worker_is_gone(  # type: ignore[no-untyped-def]
    client, redis_server, tmp_path_factory
) -> None:
    """A worker killed whole leaves ``RoundClient.hosts()`` at most ``HEARTBEAT_TTL_S`` after
    its last beat, and not before its beats stop being renewed.

    Proved by what Redis does, not by the test's clock (on a loaded machine the test notices
    late, by however long it waited for a core): every beat is written with the TTL, once the
    worker is gone the key leaves by expiry (no deletion, no renewal: Redis's own keyspace
    events say so), and ``hosts()`` no longer lists the host as soon as Redis says it expired."""
    env = {"ROUNDHOUSE_HEARTBEAT_TTL_S": str(HEARTBEAT_TTL_S), "ROUNDHOUSE_HEARTBEAT_INTERVAL_S": "0.25"}
    worker = unsandboxed("h1", redis_server, tmp_path_factory.mktemp("h1"), **env).start()
    key = heartbeat_key("h1")
    changes = client.redis.pubsub()
    try:
        listed = lambda: any(beat["host_id"] == "h1" for beat in client.hosts())  # noqa: E731
        assert listed()
        first = client.heartbeat("h1")
        # Alive, the key outlives its TTL: it is renewed, not merely long-lived.
        time.sleep(HEARTBEAT_TTL_S + 0.5)
        renewed = client.heartbeat("h1")
        assert listed() and first is not None and renewed is not None and renewed["ts"] > first["ts"]
        # Every change Redis makes to the key from here on: "set"/"expire" for a beat, "del" for
        # a deletion, "expired" when its TTL ends it.
        client.redis.config_set("notify-keyspace-events", "Kg$x")
        changes.subscribe(f"__keyspace@0__:{key}")
        wait_until(lambda: (m := changes.get_message(timeout=0.5)) is not None and m["type"] == "subscribe",
                   30, "Redis to confirm the subscription to the key's events")  # fmt: skip
        killed_at = time.monotonic()
        kill_whole(worker)
        # The last beat's TTL: at most HEARTBEAT_TTL_S left (-2: it has expired already).
        left_ms = client.redis.pttl(key)
        assert left_ms == -2 or 0 <= left_ms <= HEARTBEAT_TTL_S * 1000, f"{left_ms} ms left on the heartbeat"
        seen: list[str] = []
        deadline = time.monotonic() + HEARTBEAT_TTL_S + 60
        while not {"expired", "del"} & set(seen):
            assert time.monotonic() < deadline, f"the heartbeat never left Redis: events {seen}"
            message = changes.get_message(timeout=0.5)
            if message is not None and message["type"] == "message":
                seen.append(message["data"].decode())
        assert seen[-1] == "expired", f"the heartbeat was deleted, not left to expire: events {seen}"
        assert not listed(), "hosts() still lists a host whose heartbeat Redis expired"
        gone_after = time.monotonic() - killed_at
        print(f"heartbeat expired, seen {gone_after:.2f} s after the kill (TTL {HEARTBEAT_TTL_S} s)")
    finally:
        changes.close()
        client.redis.config_set("notify-keyspace-events", "")
        worker.stop()


# ---------------------------------------------------------------- shutdown and Flower


def test_sigterm_is_a_warm_shutdown_that_finishes_the_round_and_stores_its_result(  # type: ignore[no-untyped-def]
    artifacts, client, redis_server, tmp_path_factory
) -> None:
    """SIGTERM to the MainProcess (what ``docker stop`` sends to PID 1): Celery stops taking
    tasks, waits for the running round, stores its result, acknowledges it, exits 0."""
    server, _root, shards = artifacts
    directory = tmp_path_factory.mktemp("g1")
    worker = unsandboxed("g1", redis_server, directory).start()
    try:
        params = tally_params(directory)
        client.load_model("g1", server.url("model.safetensors"), shards, TALLY, params=params).get(timeout=60)
        since = event_seq(client, "g1")
        pending = client.run_round("g1", steps=1, round_num=2)
        wait_for_log(client, "g1", since, "round 2 tallied")
        os.kill(worker.main_pid, signal.SIGTERM)
        assert worker.process is not None
        began = lambda: "shutdown (MainProcess)" in worker.log() or worker.process.poll() is not None  # noqa: E731
        wait_until(began, 30, "the shutdown to begin")
        assert worker.process.poll() is None, "the worker did not wait for the round"
        assert executions(directory) == ["2"] and stored_meta(client, pending.id)["status"] == "STARTED"
        Path(params["go"]).touch()  # the round may end now
        assert worker.process.wait(timeout=60) == 0
        assert "Warm shutdown" in worker.log()
        meta = stored_meta(client, pending.id)
        assert meta["status"] == "SUCCESS" and meta["result"]["status"] == "completed", meta
        assert meta["result"]["report"] == {"round": 2}
        assert unacked_since(client, pending.id) is None and client.redis.llen("roundhouse.g1") == 0
        assert executions(directory) == ["2"]
    finally:
        worker.stop()


def test_sigterm_to_the_whole_process_group_kills_the_round_which_runs_again_after_restart(  # type: ignore[no-untyped-def]
    artifacts, client, redis_server, tmp_path_factory
) -> None:
    """What systemd's default ``KillMode=control-group`` does: SIGTERM reaches the child too,
    billiard's handler ends it, the task goes ``RETRY`` (``WorkerLostError``) and runs once
    more after the restart: not a warm shutdown (docs/OPERATIONS.md says use ``mixed``)."""
    server, _root, shards = artifacts
    directory = tmp_path_factory.mktemp("m1")
    worker = unsandboxed("m1", redis_server, directory).start()
    try:
        params = tally_params(directory)
        client.load_model("m1", server.url("model.safetensors"), shards, TALLY, params=params).get(timeout=60)
        since = event_seq(client, "m1")
        pending = client.run_round("m1", steps=1, round_num=8)
        wait_for_log(client, "m1", since, "round 8 tallied")
        os.killpg(worker.main_pid, signal.SIGTERM)
        assert worker.process is not None and worker.process.wait(timeout=60) == 0
        meta = stored_meta(client, pending.id)
        assert meta["status"] == "RETRY" and meta["result"]["exc_type"] == "WorkerLostError", meta
        Path(params["go"]).touch()
        worker = unsandboxed("m1", redis_server, directory).start()
        result = stored_result(pending, timeout_s=90)
        assert result["status"] == "completed" and executions(directory) == ["8", "8"]
    finally:
        worker.stop()


def test_cold_shutdown_still_kills_the_round_and_leaves_it_for_redelivery(  # type: ignore[no-untyped-def]
    artifacts, client, redis_server, tmp_path_factory
) -> None:
    """SIGQUIT (Celery's cold shutdown) cancels running requests with SIGTERM through the
    same pool call that Flower's Terminate reaches: here the child must die, the round must
    not be recorded as stopped, and the restarted worker must run it again."""
    server, _root, shards = artifacts
    directory = tmp_path_factory.mktemp("d1")
    env = {"ROUNDHOUSE_VISIBILITY_TIMEOUT_S": str(VISIBILITY_TIMEOUT_S)}
    worker = unsandboxed("d1", redis_server, directory, **env).start()
    try:
        params = tally_params(directory)
        client.load_model("d1", server.url("model.safetensors"), shards, TALLY, params=params).get(timeout=60)
        since = event_seq(client, "d1")
        pending = client.run_round("d1", steps=1, round_num=3)
        wait_for_log(client, "d1", since, "round 3 tallied")
        child = worker.child_pid()
        os.kill(worker.main_pid, signal.SIGQUIT)
        assert worker.process is not None and worker.process.wait(timeout=60) is not None
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
        meta = stored_meta(client, pending.id)
        assert meta.get("status") != "SUCCESS", f"a cold shutdown recorded a result: {meta}"
        Path(params["go"]).touch()
        # Celery requeued it at shutdown, or Redis will after the visibility timeout.
        if (delivered_at := unacked_since(client, pending.id)) is not None:
            wait_until(lambda: time.time() > delivered_at + VISIBILITY_TIMEOUT_S + 0.2, 30, "the timeout")
        worker = unsandboxed("d1", redis_server, directory, **env).start()
        result = stored_result(pending, timeout_s=90)
        assert result["status"] == "completed" and result["report"] == {"round": 3}
        assert executions(directory) == ["3", "3"], "the cut-short round was not run again"
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def flower(redis_server: RedisServer):
    """Flower as operators run it (``celery -A tasks flower``), with basic auth for its API."""
    port = free_port()
    env = {**os.environ, "ROUNDHOUSE_BROKER_URL": redis_server.url, "ROUNDHOUSE_HOST_ID": "flower"}
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tasks", "flower", f"--port={port}", "--address=127.0.0.1",
         "--basic-auth=ops:secret"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(f"{base}/api/workers", auth=("ops", "secret"), timeout=5).ok
        except requests.RequestException:
            return False

    try:
        wait_until(up, 60, "Flower to answer", poll_s=0.5)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_flowers_terminate_button_stops_the_round_and_keeps_the_child_and_its_runner(  # type: ignore[no-untyped-def]
    sandboxed, artifacts, client, flower
) -> None:
    """Flower's Terminate posts ``terminate=true`` to ``/api/task/revoke/<id>``: a revoke with
    terminate and Celery's default SIGTERM. It ends as a stop: the child, its loaded model
    and its warm sandbox runner stay; the stored state ends ``SUCCESS`` with
    ``status="stopped"`` (``REVOKED`` in between), and Flower shows the same."""
    server, _root, shards = artifacts
    loaded = client.load_model("c1", server.url("model.safetensors"), shards, SPIN_IN_ROUND_ZERO).get(
        timeout=60
    )
    assert client.run_round("c1", steps=1, round_num=1).get(timeout=60)["status"] == "completed"
    child = sandboxed.child_pid()
    runner = descendants(child)
    assert runner, "no sandbox runner under the child"
    since = event_seq(client, "c1")
    pending = client.run_round("c1", steps=1, round_num=0)
    wait_for_log(client, "c1", since, "round zero started")
    # Exactly what the button's script sends.
    answer = requests.post(
        f"{flower}/api/task/revoke/{pending.id}",
        data={"terminate": "true"},
        auth=("ops", "secret"),
        timeout=30,
    )
    assert answer.ok, answer.text
    result = stored_result(pending)
    assert result["status"] == "stopped", result
    assert sandboxed.child_pid() == child, "the prefork child was replaced"
    after = client.run_round("c1", steps=1, round_num=1).get(timeout=60)
    assert after["status"] == "completed" and after["report"] == {"round": 1}
    assert descendants(child) == runner, "the warm sandbox runner was lost"
    status = client.status("c1").get(timeout=30)
    assert status["model_hash"] == loaded["model_hash"] == state_hash(mlp_state())
    revoked = [
        e for e in task_events(client, "c1", since, pending.id) if e.data.get("event") == "stop-requested"
    ]
    assert [e.data["reason"] for e in revoked] == ["revoked"]

    def flower_task() -> dict:
        return dict(
            requests.get(f"{flower}/api/task/info/{pending.id}", auth=("ops", "secret"), timeout=10).json()
        )

    wait_until(lambda: flower_task().get("state") == "SUCCESS", 30, "Flower to show the stored outcome", 0.2)
    shown = flower_task()
    assert shown["revoked"] is not None and "stopped" in str(shown["result"]), shown


# ---------------------------------------------------------------- the shard cache


def test_a_cache_too_small_for_two_shards_fails_load_model_clearly(  # type: ignore[no-untyped-def]
    sandboxed, artifacts, client
) -> None:
    """``CacheTooSmall`` (code ``invalid_request``) at ``load_model``, before any shard is
    downloaded; the worker serves the next load as before."""
    server, root, shards = artifacts
    big = big_shards(root)
    sizes = [s["size_bytes"] for s in big]
    assert max(sizes) < 1 << 20 < sum(sizes), sizes
    descriptors = [
        {"url": server.url(s["name"]), "compression": "zstd", "size_bytes": s["size_bytes"]} for s in big
    ]
    pending = client.load_model("c1", server.url("model.safetensors"), descriptors, "pass")
    with pytest.raises(Exception) as caught:
        pending.get(timeout=60)
    assert "cannot hold two consecutive shards" in str(caught.value)
    meta = stored_meta(client, pending.id)
    assert meta["status"] == "FAILURE" and meta["result"]["exc_type"] == "CacheTooSmall", meta
    message, details = meta["result"]["exc_message"]
    assert details == {"code": "invalid_request", "limit_bytes": 1 << 20, "need_bytes": sum(sizes)}
    assert "ROUNDHOUSE_SHARD_CACHE_MAX_MB" in message
    assert not [r for r in server.requests if r.path.startswith("big") and r.method == "GET"], (
        "a shard was downloaded before the refusal"
    )
    loaded = client.load_model("c1", server.url("model.safetensors"), shards, "pass").get(timeout=60)
    assert loaded["model_hash"] == state_hash(mlp_state())
