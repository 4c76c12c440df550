"""RabbitMQ as the broker, for real: the README says another kombu broker works for tasks,
with events, heartbeats and stop requests on Redis (``ROUNDHOUSE_EVENTS_URL``) and results
in Redis (``ROUNDHOUSE_RESULT_BACKEND``).

The machine's RabbitMQ (guest on 127.0.0.1:5672) with a vhost of this module's own for
loading, rounds, events and the three stop paths; a RabbitMQ node of the test's own for a
round that outlives the broker's ``consumer_timeout`` (RabbitMQ 3.10 sets it per node only).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

from executor.delta import read_delta, state_hash
from settings import Settings
from tasks.client import RoundClient
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.rabbitmq import RabbitNode, Vhost, unavailable
from tests.support.redis_server import RedisServer
from tests.support.rounds import STOP_PATHS, event_seq, stop_task, stored_result, wait_for_log
from tests.support.worker import WorkerProcess

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(unavailable() is not None, reason=f"RabbitMQ: {unavailable()}"),
]

SPIN_IN_ROUND_ZERO = """
if round_num == 0:
    emit_log("round zero started")
    while True:
        pass
save_report({"round": round_num})
"""
# One line per execution in params["tally"]; then waits for params["go"] to exist.
TALLY = """
import os, time
with open(params["tally"], "a") as tally:
    tally.write(f"{round_num}\\n")
emit_log(f"round {round_num} tallied")
while not os.path.exists(params["go"]):
    time.sleep(0.02)
save_report({"round": round_num})
"""
CONSUMER_TIMEOUT_MS = 2000


def rabbit_worker(
    host: str, broker: str, redis_server: RedisServer, directory: Path, **env: str
) -> WorkerProcess:
    """A worker whose tasks come from ``broker``; results, events, heartbeats go to Redis."""
    return WorkerProcess(
        host, redis_server.url, directory,
        env={"ROUNDHOUSE_BROKER_URL": broker, "ROUNDHOUSE_RESULT_BACKEND": redis_server.url,
             "ROUNDHOUSE_EVENTS_URL": redis_server.url, **env},
    )  # fmt: skip


def rabbit_client(broker: str, redis_server: RedisServer) -> RoundClient:
    return RoundClient(
        Settings(
            broker_url=broker,
            result_backend=redis_server.url,
            events_url=redis_server.url,
            host_id="rmq-client",
        )
    )


@pytest.fixture(scope="module")
def vhost():
    created = Vhost().create()
    yield created
    created.delete()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("srv")
    (root / "uploads").mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        yield server, root, shard_descriptors(server, shards)


@pytest.fixture(scope="module")
def worker(vhost: Vhost, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    process = rabbit_worker("q1", vhost.url, redis_server, tmp_path_factory.mktemp("q1")).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(vhost: Vhost, redis_server: RedisServer) -> RoundClient:
    return rabbit_client(vhost.url, redis_server)


def test_load_and_a_round_through_rabbitmq_with_events_on_redis(worker, artifacts, client, vhost) -> None:  # type: ignore[no-untyped-def]
    server, root, shards = artifacts
    loaded = client.load_model("q1", server.url("model.safetensors"), shards, TRAIN_CODE).get(timeout=60)
    assert loaded["model_hash"] == state_hash(mlp_state())
    since = event_seq(client, "q1")
    pending = client.run_round("q1", steps=3, round_num=0, delta_url=server.url("uploads/q1.zst"))
    result = pending.get(timeout=120)
    assert result["status"] == "completed", result
    assert state_hash(read_delta(str(root / "uploads" / "q1.zst"))) == result["delta"]["hash"]
    events = [e for e in client.events("q1", since=since, idle_timeout_s=1) if e.task_id == pending.id]
    assert [e.data["step"] for e in events if e.type == "stats"] == [0, 1, 2]
    states = [e.data.get("event") for e in events if e.type == "state"]
    assert states[0] == "task-started" and states[-1] == "task-finished"
    # The task went through RabbitMQ, not through a Redis list of the same name.
    assert "roundhouse.q1" in vhost.queues() and not client.redis.exists("roundhouse.q1")
    assert {beat["host_id"] for beat in client.hosts()} == {"q1"}


@pytest.mark.parametrize("path", STOP_PATHS)
def test_each_stop_path_through_rabbitmq(worker, artifacts, client, path: str) -> None:  # type: ignore[no-untyped-def]
    server, _root, shards = artifacts
    client.load_model("q1", server.url("model.safetensors"), shards, SPIN_IN_ROUND_ZERO).get(timeout=60)
    child = worker.child_pid()
    since = event_seq(client, "q1")
    pending = client.run_round("q1", steps=1, round_num=0)
    wait_for_log(client, "q1", since, "round zero started")
    started = time.monotonic()
    stop_task(client, path, pending.id, "q1")
    result = stored_result(pending)
    print(f"stop via {path} over RabbitMQ: {(time.monotonic() - started) * 1000:.0f} ms")
    assert result["status"] == "stopped", result
    assert worker.child_pid() == child, "the prefork child was replaced"
    after = client.run_round("q1", steps=1, round_num=1).get(timeout=60)
    assert after["status"] == "completed" and after["report"] == {"round": 1}


@pytest.fixture
def node(tmp_path: Path):
    try:
        started = RabbitNode(tmp_path / "rabbit", consumer_timeout_ms=CONSUMER_TIMEOUT_MS).start()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"cannot start a RabbitMQ node of the test's own: {exc}")
    yield started
    started.stop()


def test_a_round_longer_than_the_consumer_timeout_is_neither_lost_nor_run_twice(  # type: ignore[no-untyped-def]
    node, artifacts, redis_server, tmp_path
) -> None:
    """RabbitMQ closes the channel of a delivery unacknowledged past ``consumer_timeout``
    and requeues the message. Celery 5.7 takes the channel error as unrecoverable: the
    worker finishes the running round, stores its result and exits. Restarted (as its
    supervisor would), it receives the message again and settles it without running it (the
    recorded result, or the gate's replay refusal): tenant code ran once, the queue ends
    empty, the stored result stays, the next round runs."""
    server, _root, shards = artifacts
    client = rabbit_client(node.url, redis_server)
    directory = tmp_path / "q2"
    params = {"tally": str(directory / "tally"), "go": str(directory / "go")}
    worker = rabbit_worker("q2", node.url, redis_server, directory, ROUNDHOUSE_SANDBOX="off").start()
    try:
        client.load_model("q2", server.url("model.safetensors"), shards, TALLY, params=params).get(timeout=60)
        since = event_seq(client, "q2")
        pending = client.run_round("q2", steps=1, round_num=6)
        wait_for_log(client, "q2", since, "round 6 tallied")
        deadline = time.monotonic() + 60
        while "delivery acknowledgement on channel 1 timed out" not in worker.log():
            assert time.monotonic() < deadline, "RabbitMQ never timed the delivery out"
            time.sleep(0.1)
        Path(params["go"]).touch()  # the round outlived the timeout; let it end
        first = stored_result(pending)
        assert first["status"] == "completed" and first["report"] == {"round": 6}
        assert worker.process is not None and worker.process.wait(timeout=60) != 0
        assert node.queues()["roundhouse.q2"] == (1, 0), "the message was lost"
        # The restarted worker's child needs seconds to warm up, longer than this test's
        # timeout; with a production timeout (30 min) that is nothing. Channels read the
        # setting when they open, so the new worker's gets the longer one.
        node.set_consumer_timeout(600_000)
        worker = rabbit_worker("q2", node.url, redis_server, directory, ROUNDHOUSE_SANDBOX="off").start()
        # The requeued copy is taken and settled without a second run: answered from the
        # recorded result, or — its nonce already marked finished when the worker tried to
        # acknowledge it — refused by the signed control plane's gate as a replay.
        deadline = time.monotonic() + 60

        def settled() -> bool:
            log = worker.log()
            return log.count(f"[{pending.id}] succeeded") >= 2 or ("refused task" in log and "replay" in log)

        while node.queues()["roundhouse.q2"] != (0, 0) or not settled():
            assert time.monotonic() < deadline, f"the requeued round was not taken: {node.queues()}"
            time.sleep(0.2)
        assert stored_result(pending) == first
        assert (directory / "tally").read_text().split() == ["6"], "tenant code ran twice"
        after = client.run_round("q2", steps=1, round_num=7).get(timeout=60)
        assert after["status"] == "completed" and after["report"] == {"round": 7}
    finally:
        worker.stop()
