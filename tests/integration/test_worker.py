"""The Celery worker for real: a redis-server of the test's own, ``celery -A tasks worker -P
prefork -c 1`` subprocesses, an HTTP server with a request log (DESIGN §1, §3, §5, §6)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import zstandard
from celery import Celery
from celery.security.certificate import Certificate
from celery.security.key import PrivateKey
from celery.security.serialization import SecureSerializer
from kombu.serialization import registry
from safetensors.torch import save_file

from executor.delta import make_sync_delta, read_delta, state_hash, write_delta
from settings import Settings
from tasks.client import RoundClient
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.redis_server import RedisServer, free_port
from tests.support.rounds import STOP_PATHS, event_seq, stop_task, stored_result, wait_for_log
from tests.support.worker import REPO, WorkerProcess

pytestmark = pytest.mark.timeout(300)

ROUND_ZERO_THEN_TRAIN = """
if round_num == 0:
    emit_log("round zero started")
{stall}
save_report({{"round": round_num}})
"""
SPIN = "    while True:\n        pass"
BLOCK_ON_SHARD = "    get_shard(3)"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("srv")
    (root / "uploads").mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        descriptors = shard_descriptors(server, shards, "sig=abc")
        yield server, root, descriptors


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer, shared_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    process = WorkerProcess("w1", redis_server.url, tmp_path_factory.mktemp("w1"), cache_dir=shared_cache)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def plain_celery(redis_server: RedisServer) -> Celery:
    """A client that imports nothing of the project: names, JSON results, a queue, and for the
    signed control plane Celery's own auth serializer with the orchestrator's key (the
    session's, tests/conftest.py) plus the envelope that DESIGN §11 documents (:func:`send`)."""
    key, cert = Path(os.environ["ROUNDHOUSE_SIGNING_KEY"]), Path(os.environ["ROUNDHOUSE_SIGNING_CERT"])
    signing = (PrivateKey(key.read_text()), Certificate(cert.read_text()))
    signer = SecureSerializer(*signing, None, "sha256", "json")
    registry.register("auth-plain", signer.serialize, None, "application/data", "utf-8")
    app = Celery("plain", broker=redis_server.url, backend=redis_server.url)
    app.conf.update(task_serializer="auth-plain", accept_content=["json"], result_serializer="json")
    return app


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> RoundClient:
    return RoundClient(Settings(broker_url=redis_server.url, host_id="test-client"))


def send(app: Celery, host: str, name: str, **kwargs: object):  # type: ignore[no-untyped-def]
    task_id, queue, now = str(uuid.uuid4()), f"roundhouse.{host}", time.time()
    envelope = {
        "v": 1, "task": name, "id": task_id, "queue": queue, "iat": now, "exp": now + 600,
        "nonce": uuid.uuid4().hex, "eta": None, "expires": None, "timelimit": [None, None],
        "ignore_result": None,
    }  # fmt: skip
    signed = {**kwargs, "roundhouse_envelope": envelope}
    return app.send_task(name, kwargs=signed, queue=queue, task_id=task_id)


def count_gets(server: FaultServer, name: str) -> int:
    """Downloads of ``name``: not the one-byte GET that shows a cached shard's URL still works."""
    return server.bodies(name)


def stall_shard(root: Path, server: FaultServer) -> dict:
    """A fourth shard, unique to the caller, whose download stalls after 10 bytes."""
    name = f"stall-{uuid.uuid4().hex[:8]}.pt.zst"
    buffer = io.BytesIO()
    torch.save({"x": torch.zeros(4)}, buffer)
    packed = zstandard.ZstdCompressor().compress(buffer.getvalue())
    (root / name).write_bytes(packed)
    server.add_fault(name, "stall", after_bytes=10, bodies_only=True)
    return {"url": server.url(name), "compression": "zstd", "size_bytes": len(packed)}


def test_main_process_never_touches_cuda_or_torch(worker: WorkerProcess) -> None:
    main_maps = Path(f"/proc/{worker.main_pid}/maps").read_text()
    child_maps = Path(f"/proc/{worker.child_pid()}/maps").read_text()
    assert "libtorch" not in main_maps and "libcuda" not in main_maps
    assert "libtorch" in child_maps  # the child is where the engine (and CUDA) lives


def test_tenant_code_runs_sandboxed_without_the_workers_environment(worker, artifacts, client) -> None:  # type: ignore[no-untyped-def]
    server, _root, descriptors = artifacts
    code = "import os\nsave_report({'env': sorted(os.environ), 'uid': os.getuid(), 'pid': os.getpid()})"
    client.load_model("w1", server.url("model.safetensors"), descriptors, code).get(timeout=60)
    report = client.run_round("w1", steps=1, mode="inference").get(timeout=60)["report"]
    assert not [key for key in report["env"] if key.startswith("ROUNDHOUSE_")], report
    # The worker's own sandbox uid (w1 has no GPU: the base plus a hash of its host id).
    assert report["uid"] == Settings(host_id="w1").sandbox_ids[0] and report["pid"] != worker.child_pid()
    assert client.status("w1").get(timeout=30)["state"] == "loaded"


def test_tasks_by_name_reuse_the_loaded_model(worker, artifacts, plain_celery) -> None:  # type: ignore[no-untyped-def]
    server, root, descriptors = artifacts
    model_gets = count_gets(server, "model.safetensors")
    loaded = send(
        plain_celery, "w1", "roundhouse.load_model",
        model_url=server.url("model.safetensors", "sig=1"), dataset_shards=descriptors, code=TRAIN_CODE,
        params={"lr": 0.1},
    ).get(timeout=60)  # fmt: skip
    assert loaded["model_hash"] == state_hash(mlp_state()) and loaded["staged_shard"] == 0
    first = send(
        plain_celery,
        "w1",
        "roundhouse.run_round",
        steps=4,
        round_num=0,
        delta_url=server.url("uploads/a.zst"),
    ).get(timeout=120)
    assert first["status"] == "completed", first
    delta = read_delta(str(root / "uploads" / "a.zst"))
    assert state_hash(delta) == first["delta"]["hash"]
    base = mlp_state()
    sync = make_sync_delta(base, {k: v + delta[k].float() for k, v in base.items()})
    write_delta(sync.delta, str(root / "sync1.zst"))
    save_file(sync.result, str(root / "full1.safetensors"))
    applied = send(
        plain_celery, "w1", "roundhouse.apply_delta", model_url=server.url("full1.safetensors"),
        delta_url=server.url("sync1.zst"), base_hash=sync.base_hash, result_hash=sync.result_hash,
    ).get(timeout=60)  # fmt: skip
    assert applied["via"] == "delta" and applied["model_hash"] == sync.result_hash
    second = send(plain_celery, "w1", "roundhouse.run_round", steps=4, round_num=1).get(timeout=120)
    assert second["status"] == "completed", second
    # One model download for the whole session; the second round reused the loaded model.
    assert count_gets(server, "model.safetensors") == model_gets + 1
    assert count_gets(server, "full1.safetensors") == 0
    assert all(count_gets(server, f"shard{i}.pt.zst") == 1 for i in range(3))


def test_a_redelivered_round_is_not_run_twice(worker, artifacts, client) -> None:  # type: ignore[no-untyped-def]
    server, _root, descriptors = artifacts
    client.load_model("w1", server.url("model.safetensors"), descriptors, TRAIN_CODE).get(timeout=60)
    task_id = str(uuid.uuid4())
    kwargs = {"steps": 3, "round_num": 0}
    first = client.app.send_task(
        "roundhouse.run_round", kwargs=kwargs, queue="roundhouse.w1", task_id=task_id
    )
    result = first.get(timeout=120)
    # Sent again under the same id, as an orchestrator resends: a new message (a new nonce, so
    # the gate admits it) that only the recorded result keeps from running. The broker's own
    # redelivery of one message: test_faults.py's visibility-timeout and Redis-down tests.
    stats_before = [e for e in client.events("w1", idle_timeout_s=0.5) if e.task_id == task_id]
    again = client.app.send_task(
        "roundhouse.run_round", kwargs=kwargs, queue="roundhouse.w1", task_id=task_id
    )
    assert again.get(timeout=60) == result  # the same delivery again: the recorded result, no new round
    stats_after = [
        e for e in client.events("w1", idle_timeout_s=0.5) if e.task_id == task_id and e.type == "stats"
    ]
    assert len(stats_after) == len([e for e in stats_before if e.type == "stats"]) == 3


def test_an_int8_round_ships_a_delta_close_to_the_fp16_one(worker, artifacts, client) -> None:  # type: ignore[no-untyped-def]
    # The same round (model, shards, round number) twice: as float16, then quantised to int8.
    server, root, descriptors = artifacts
    client.load_model("w1", server.url("model.safetensors"), descriptors, TRAIN_CODE).get(timeout=60)
    deltas = {}
    for dtype in ("float16", "int8"):
        name = f"uploads/same-round-{dtype}.zst"
        result = client.run_round(
            "w1", steps=4, round_num=2, delta_url=server.url(name), delta_dtype=dtype
        ).get(timeout=120)
        assert result["status"] == "completed", result
        assert result["delta"]["dtype"] == dtype and result["delta"]["keys"] == 4
        deltas[dtype] = read_delta(str(root / name))
        assert state_hash(deltas[dtype]) == result["delta"]["hash"]  # int8: of the float32 it stands for
    for key, half in deltas["float16"].items():
        quantised = deltas["int8"][key]
        assert quantised.dtype == torch.float32 and quantised.shape == half.shape
        # Each within half an int8 step of its block's absmax of the key's, plus fp16's rounding.
        assert float((quantised - half.float()).abs().max()) <= float(half.float().abs().max()) / 127, key


def test_events_arrive_in_order_without_gaps_and_replay(worker, artifacts, client) -> None:  # type: ignore[no-untyped-def]
    server, _root, descriptors = artifacts
    client.load_model("w1", server.url("model.safetensors"), descriptors, TRAIN_CODE).get(timeout=60)
    live: list = []
    sent: list[str] = []  # this round's task id: an earlier test's round may end after the load
    started = threading.Event()

    def listen() -> None:
        stream = client.events("w1", since=event_seq(client, "w1"), idle_timeout_s=60)  # a slow start
        started.set()
        for event in stream:
            live.append(event)
            if event.type == "state" and event.data.get("event") == "task-finished" and event.task_id in sent:
                return

    listener = threading.Thread(target=listen)
    listener.start()
    started.wait(5)
    pending = client.run_round("w1", steps=5, round_num=3)
    sent.append(pending.id)
    result = pending.get(timeout=120)
    listener.join(30)
    assert result["status"] == "completed"
    seqs = [e.seq for e in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gaps or disorder: {seqs}"
    kinds = {e.type for e in live if e.task_id == pending.id}
    assert {"stats", "log", "state"} <= kinds
    stats = [e for e in live if e.type == "stats" and e.task_id == pending.id]
    assert [e.data["step"] for e in stats] == [0, 1, 2, 3, 4] and all(e.round == 3 for e in stats)
    # A late subscriber replays exactly what the live one saw.
    replayed = [e for e in client.events("w1", since=seqs[0] - 1, idle_timeout_s=0.5) if e.seq <= seqs[-1]]
    assert [e.to_json() for e in replayed] == [e.to_json() for e in live]


@pytest.mark.parametrize("scenario", ["loop", "download"])
@pytest.mark.parametrize("path", STOP_PATHS)
def test_each_stop_path_stops_a_round_and_the_child_lives_on(  # type: ignore[no-untyped-def]
    worker, artifacts, client, path: str, scenario: str
) -> None:
    server, root, descriptors = artifacts
    stall = SPIN if scenario == "loop" else BLOCK_ON_SHARD
    shards = [*descriptors, stall_shard(root, server)]
    code = ROUND_ZERO_THEN_TRAIN.format(stall=stall)
    client.load_model("w1", server.url("model.safetensors"), shards, code).get(timeout=60)
    pid = worker.child_pid()
    model_gets = count_gets(server, "model.safetensors")
    since = event_seq(client, "w1")
    stalls = server.stalls_entered
    pending = client.run_round("w1", steps=1, round_num=0)
    wait_for_log(client, "w1", since, "round zero started")
    if scenario == "download":
        assert server.wait_for_stalls(stalls + 1, timeout_s=30)
    started = time.monotonic()
    stop_task(client, path, pending.id, "w1")
    result = stored_result(pending)
    latency = time.monotonic() - started
    server.release_stalls()
    print(f"stop via {path} of a {scenario}: {latency * 1000:.0f} ms")
    assert result["status"] == "stopped", result
    assert worker.child_pid() == pid, "the prefork child was replaced"
    after = client.run_round("w1", steps=1, round_num=1).get(timeout=60)
    assert after["status"] == "completed" and after["report"] == {"round": 1}
    assert count_gets(server, "model.safetensors") == model_gets, "the next round reloaded the model"


def test_soft_time_limit_is_a_stop(worker, artifacts, client) -> None:  # type: ignore[no-untyped-def]
    server, _root, descriptors = artifacts
    code = ROUND_ZERO_THEN_TRAIN.format(stall=SPIN)
    client.load_model("w1", server.url("model.safetensors"), descriptors, code).get(timeout=60)
    pid = worker.child_pid()
    pending = client.app.send_task(
        "roundhouse.run_round", kwargs={"steps": 1, "round_num": 0}, queue="roundhouse.w1", soft_time_limit=1
    )
    assert pending.get(timeout=60)["status"] == "stopped"
    assert worker.child_pid() == pid


def test_two_workers_share_the_cache_and_keep_their_queues(  # type: ignore[no-untyped-def]
    worker, artifacts, client, redis_server, shared_cache, tmp_path_factory
) -> None:
    server, _root, descriptors = artifacts
    client.load_model("w1", server.url("model.safetensors"), descriptors, TRAIN_CODE).get(timeout=60)
    assert client.run_round("w1", steps=3).get(timeout=120)["status"] == "completed"  # touches all 3 shards
    shard_gets = [count_gets(server, f"shard{i}.pt.zst") for i in range(3)]
    assert all(shard_gets)
    second = WorkerProcess(
        "w2", redis_server.url, tmp_path_factory.mktemp("w2"), cache_dir=shared_cache
    ).start()
    try:
        client.load_model("w2", server.url("model.safetensors"), descriptors, TRAIN_CODE).get(timeout=60)
        assert client.run_round("w2", steps=3).get(timeout=120)["status"] == "completed"
        # w2 read every shard from the cache w1 filled: no new shard download.
        assert [count_gets(server, f"shard{i}.pt.zst") for i in range(3)] == shard_gets
        ids = {client.status(host).get(timeout=30)["host_id"]: host for host in ("w1", "w2")}
        assert ids == {"w1": "w1", "w2": "w2"}
        on_w2 = [client.run_round("w2", steps=1).id for _ in range(3)]
        for task_id in on_w2:
            client.app.AsyncResult(task_id).get(timeout=60)
        assert not any(task_id in worker.log() for task_id in on_w2)
        assert all(task_id in second.log() for task_id in on_w2)
        hosts = {beat["host_id"] for beat in client.hosts()}
        assert {"w1", "w2"} <= hosts
    finally:
        second.stop()


def test_redis_restart_mid_round(worker, artifacts, client, redis_server) -> None:  # type: ignore[no-untyped-def]
    server, _root, descriptors = artifacts
    # The round cannot end before the test releases it, so the restart is mid-round whatever
    # the machine's speed; it emits stats all along, during the outage too.
    code = (
        "import os, time\n"
        "open('/task/started', 'w').close()\n"
        "step = 0\n"
        "while step < steps or not os.path.exists('/task/release'):\n"
        "    emit_stats({'step': step})\n"
        "    step += 1\n"
        "    time.sleep(0.05)\n"
        "save_report({'done': step})\n"
    )
    client.load_model("w1", server.url("model.safetensors"), descriptors, code).get(timeout=60)
    task_dir = worker.directory / "work" / "w1" / "session" / "sandbox" / "task"
    since = event_seq(client, "w1")
    pending = client.run_round("w1", steps=24, round_num=7)
    deadline = time.monotonic() + 60
    while not (task_dir / "started").exists():
        assert time.monotonic() < deadline, "the round never started"
        time.sleep(0.05)
    redis_server.kill()
    time.sleep(1.0)  # not for correctness: lets the outage span some stats events
    redis_server.start()
    (task_dir / "release").touch()
    result = stored_result(pending, timeout_s=120)
    done = result["report"]["done"]
    assert result["status"] == "completed" and done >= 24, result
    events = [e for e in client.events("w1", since=since, idle_timeout_s=3) if e.task_id == pending.id]
    steps = [e.data["step"] for e in events if e.type == "stats"]
    assert steps == list(range(done)), f"events lost across the restart: {steps}"
    seqs = [e.seq for e in client.events("w1", since=since, idle_timeout_s=1)]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_celery_inspect_and_flower_see_the_worker(worker, redis_server) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "ROUNDHOUSE_BROKER_URL": redis_server.url, "ROUNDHOUSE_HOST_ID": "inspector"}
    celery = [sys.executable, "-m", "celery", "-A", "tasks"]
    ping = subprocess.run(
        [*celery, "inspect", "ping", "--timeout", "5"], env=env, cwd=REPO, capture_output=True
    )
    assert b"w1@" in ping.stdout and b"pong" in ping.stdout, ping.stdout + ping.stderr
    active = subprocess.run(
        [*celery, "inspect", "active", "--timeout", "5"], env=env, cwd=REPO, capture_output=True
    )
    assert b"w1@" in active.stdout, active.stdout + active.stderr
    port = free_port()
    flower = subprocess.Popen(
        [*celery, "flower", f"--port={port}", "--address=127.0.0.1", "--basic-auth=ops:secret"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        import requests

        deadline = time.monotonic() + 60
        workers: dict = {}
        while time.monotonic() < deadline and not any(name.startswith("w1@") for name in workers):
            try:
                url = f"http://127.0.0.1:{port}/api/workers?refresh=1"
                workers = requests.get(url, auth=("ops", "secret"), timeout=10).json()
            except (requests.RequestException, ValueError):
                time.sleep(0.5)
        assert any(name.startswith("w1@") for name in workers), workers
    finally:
        flower.terminate()
        flower.wait(timeout=20)


def test_a_real_crash_after_a_survived_terminate_is_a_failure(  # type: ignore[no-untyped-def]
    artifacts, client, redis_server, tmp_path_factory
) -> None:
    # Tenant code can crash the Celery child only without the sandbox: a worker of its own.
    server, _root, descriptors = artifacts
    worker = WorkerProcess(
        "w3", redis_server.url, tmp_path_factory.mktemp("w3"), env={"ROUNDHOUSE_SANDBOX": "off"}
    ).start()
    code = (
        "import os\n"
        "if round_num == 0:\n"
        "    emit_log('round zero started')\n"
        "    while True:\n"
        "        pass\n"
        "if round_num == 9:\n"
        "    os.kill(os.getpid(), 9)\n"
    )
    client.load_model("w3", server.url("model.safetensors"), descriptors, code).get(timeout=60)
    since = event_seq(client, "w3")
    pending = client.run_round("w3", steps=1, round_num=0)
    wait_for_log(client, "w3", since, "round zero started")
    client.app.control.revoke(pending.id, terminate=True, signal="SIGUSR2")
    assert stored_result(pending)["status"] == "stopped"
    crash = client.run_round("w3", steps=1, round_num=9)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        meta = crash.backend.get_task_meta(crash.id, cache=False)
        if meta["status"] in ("FAILURE", "REVOKED", "SUCCESS"):
            break
        time.sleep(0.2)
    # Not REVOKED: the crash is a failure. The task ran once more on the replacement child
    # (retry_on_worker_lost), which has no session yet, so it failed there with a clear error.
    assert meta["status"] == "FAILURE", meta
    assert type(meta["result"]).__name__ in ("WorkerLostError", "InvalidRequest"), meta
    # Delivered twice: the crash, then once more (the stored meta keeps no retry count: results
    # are not extended, so that they keep no presigned URLs).
    assert worker.log().count(f"[{crash.id}] received") == 2, worker.log()[-3000:]
    worker.stop()
