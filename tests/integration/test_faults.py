"""Faults and load, for real: killed children and workers, Redis outages, bad servers, load.

Real redis-server, real ``celery worker`` processes (sandboxed), a real HTTP server with
fault injection. Each test says what the orchestrator would see and checks that nothing
is lost, corrupted or run twice.
"""

from __future__ import annotations

import io
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from executor.delta import file_state_hash, make_sync_delta, read_delta, state_hash, write_delta
from orchestrator.artifacts import ArtifactServer
from settings import Settings
from tasks.client import RoundClient
from tasks.names import stream_name
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.redis_server import RedisServer
from tests.support.rounds import event_seq, wait_for_log
from tests.support.worker import WorkerProcess

pytestmark = pytest.mark.timeout(400)

CODE = """
import time
if round_num == 5:
    emit_log("long round started")
    time.sleep(4)
if round_num == 9:
    emit_log("shard round started")
    get_shard(num_shards - 1)
if round_num == 7:
    open("/task/round7-started", "w").close()
    for step in range(steps):
        time.sleep(0.25)
        emit_stats({"step": step})
    open("/task/round7-done", "w").close()
emit_stats({"executions": 1})
save_report({"round": round_num})
"""

EXPIRY_S = 15  # presigned URLs that expire during the test
WORKER_ENV = {
    "ROUNDHOUSE_DOWNLOAD_LOW_SPEED_BYTES_S": "4096",
    "ROUNDHOUSE_DOWNLOAD_LOW_SPEED_TIME_S": "1",
    "ROUNDHOUSE_EVENTS_STREAM_MAXLEN": "2000",
}


# Big enough that its sync-delta apply lasts well beyond the time a test takes to kill it
# (the apply runs at ~0.75 GB/s on 2 cores: 0.25 s).
def big_state(megabytes: int = 192) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"layer{i}.weight": torch.randn(1024, 2048, generator=g) for i in range(megabytes // 8)}


def shard_of(rows: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    buffer = io.BytesIO()
    torch.save({"x": torch.randn(rows, 8, generator=g), "y": torch.randn(rows, 1, generator=g)}, buffer)
    return zstandard.ZstdCompressor().compress(buffer.getvalue())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    root = tmp_path_factory.mktemp("srv")
    (root / "uploads").mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    save_file(big_state(), str(root / "big.safetensors"))
    shards = make_shards(root)
    f1 = WorkerProcess("f1", redis_server.url, tmp_path_factory.mktemp("f1"), env=WORKER_ENV).start()
    with FaultServer(root) as server:
        descriptors = shard_descriptors(server, shards, "X-Signature=secret")
        client = RoundClient(Settings(broker_url=redis_server.url, host_id="fault-client"))
        yield {
            "redis": redis_server, "server": server, "root": root, "shards": descriptors, "f1": f1,
            "client": client, "tmp": tmp_path_factory,
        }  # fmt: skip
    f1.stop()
    redis_server.stop()


def gets(server: FaultServer, name: str) -> int:
    """Downloads of ``name``: not the one-byte GET that shows a cached shard's URL still works."""
    return server.bodies(name)


def kill_child(worker: WorkerProcess, pid: int | None = None) -> int:
    """SIGKILL the prefork child (``pid`` when the caller looked it up beforehand, to kill
    without a Redis round trip) and wait for its replacement."""
    old = pid if pid is not None else worker.child_pid()
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if worker.child_pid() != old:
                return old
        except AssertionError:
            pass
        time.sleep(0.2)
    raise AssertionError("no replacement child")


def wait_for_file(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def task_events(client: RoundClient, host: str, since: int, task_id: str) -> list:
    return [e for e in client.events(host, since=since, idle_timeout_s=1) if e.task_id == task_id]


def wait_partial(directory: Path, nbytes: int, timeout_s: float = 60) -> None:
    """Wait until a download under ``directory`` has ``nbytes`` in its partial file: a stalled
    server has *sent* them when it stalls, but a kill before they are *written* would leave
    nothing to resume."""

    def size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:  # renamed or removed between the listing and the stat
            return 0

    deadline = time.monotonic() + timeout_s
    while not any(size(p) >= nbytes for p in directory.rglob("*.partial")):
        assert time.monotonic() < deadline, f"no partial file of {nbytes} bytes under {directory}"
        time.sleep(0.01)


def session_dir(worker: WorkerProcess) -> Path:
    return worker.directory / "work" / worker.host_id / "session"


def test_child_killed_mid_download_retries_and_resumes(world) -> None:  # type: ignore[no-untyped-def]
    server, client, f1 = world["server"], world["client"], world["f1"]
    # Twice: a stalled read ends after this worker's speed-floor window (1 s) and resumes, so
    # a second stall keeps the download going when a slow machine kills the child late.
    server.add_fault("model.safetensors", "stall", times=2, after_bytes=300)
    stalls = server.stalls_entered
    pending = client.load_model("f1", server.url("model.safetensors", "X-Signature=s"), world["shards"], CODE)
    assert server.wait_for_stalls(stalls + 1, timeout_s=60)
    wait_partial(f1.directory, 300)
    kill_child(f1)
    server.release_stalls()
    loaded = pending.get(timeout=180)  # run again on the replacement child
    assert loaded["model_hash"] == state_hash(mlp_state())
    resumed = [r for r in server.requests if r.path == "model.safetensors" and (r.range_start() or 0) > 0]
    assert resumed, "the retried download started over instead of resuming"
    leftovers = [p.name for p in (session_dir(f1) / "model").iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_child_killed_mid_training_rehydrates_and_runs_the_round_once_more(world) -> None:  # type: ignore[no-untyped-def]
    server, client, f1 = world["server"], world["client"], world["f1"]
    client.load_model("f1", server.url("model.safetensors"), world["shards"], CODE).get(timeout=120)
    model_gets = gets(server, "model.safetensors")
    since = event_seq(client, "f1")
    pending = client.run_round("f1", steps=1, round_num=5)
    wait_for_log(client, "f1", since, "long round started")
    kill_child(f1)
    result = pending.get(timeout=180)
    assert result["status"] == "completed" and result["report"] == {"round": 5}
    assert gets(server, "model.safetensors") == model_gets, "the replacement child reloaded the model"
    status = client.status("f1").get(timeout=60)
    assert status["state"] == "loaded" and status["model_hash"] == state_hash(mlp_state())


def test_child_killed_mid_upload_ships_the_delta_once_retried(world) -> None:  # type: ignore[no-untyped-def]
    server, client, f1, root = world["server"], world["client"], world["f1"], world["root"]
    client.load_model("f1", server.url("model.safetensors"), world["shards"], TRAIN_CODE).get(timeout=120)
    name = f"uploads/{uuid.uuid4().hex}.zst"
    server.add_fault(name, "stall", method="PUT", after_bytes=50)
    stalls = server.stalls_entered
    pending = client.run_round("f1", steps=2, delta_url=server.url(name, "X-Signature=s"))
    assert server.wait_for_stalls(stalls + 1, timeout_s=120)
    kill_child(f1)
    server.release_stalls()
    result = pending.get(timeout=180)
    assert result["status"] == "completed"
    assert state_hash(read_delta(str(root / name))) == result["delta"]["hash"]


def test_child_killed_mid_apply_write_leaves_the_model_intact(world) -> None:  # type: ignore[no-untyped-def]
    server, client, f1, root = world["server"], world["client"], world["f1"], world["root"]
    base = big_state()
    client.load_model("f1", server.url("big.safetensors"), world["shards"], CODE).get(timeout=180)
    sync = make_sync_delta(base, {k: v + 0.5 for k, v in base.items()})
    write_delta(sync.delta, str(root / "big-sync.zst"))
    save_file(sync.result, str(root / "big-full.safetensors"))
    model_dir = session_dir(f1) / "model"
    child = f1.child_pid()
    pending = client.apply_delta(
        "f1", server.url("big-full.safetensors"), delta_url=server.url("big-sync.zst"),
        base_hash=sync.base_hash, result_hash=sync.result_hash,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(".tmp") for p in model_dir.iterdir()):
        assert time.monotonic() < deadline, "the apply never started writing"
        time.sleep(0.001)
    kill_child(f1, child)
    assert file_state_hash(str(model_dir / "model.safetensors")) == sync.base_hash, (
        "the model file was damaged"
    )
    applied = pending.get(timeout=180)
    assert applied["model_hash"] == sync.result_hash and applied["via"] == "delta"
    assert file_state_hash(str(model_dir / "model.safetensors")) == sync.result_hash
    assert not [p.name for p in model_dir.iterdir() if p.name.endswith(".tmp")], (
        "a dead child's temp file stayed"
    )
    again = client.apply_delta(
        "f1", server.url("big-full.safetensors"), delta_url=server.url("big-sync.zst"),
        base_hash=sync.base_hash, result_hash=sync.result_hash,
    ).get(timeout=60)  # fmt: skip
    assert again.get("noop"), "a redelivered apply_delta applied twice"


def test_whole_worker_killed_and_restarted_reuses_its_cache_and_resumes(world) -> None:  # type: ignore[no-untyped-def]
    server, client, root, redis_server = world["server"], world["client"], world["root"], world["redis"]
    directory = world["tmp"].mktemp("f2")
    stall_name = "stall-shard.pt.zst"
    (root / stall_name).write_bytes(shard_of(20_000, 9))
    shards = [
        *world["shards"],
        {
            "url": server.url(stall_name),
            "compression": "zstd",
            "size_bytes": (root / stall_name).stat().st_size,
        },
    ]
    f2 = WorkerProcess("f2", redis_server.url, directory, env=WORKER_ENV).start()
    try:
        client.load_model("f2", server.url("model.safetensors"), shards, CODE).get(timeout=120)
        assert client.run_round("f2", steps=1, round_num=1).get(timeout=120)["status"] == "completed"
        counts = {
            name: gets(server, name) for name in ("model.safetensors", "shard0.pt.zst", "shard1.pt.zst")
        }
        server.add_fault(stall_name, "stall", after_bytes=20_000, bodies_only=True)
        stalls = server.stalls_entered
        client.run_round("f2", steps=1, round_num=9)
        assert server.wait_for_stalls(stalls + 1, timeout_s=60)
        wait_partial(directory, 20_000)
        os.killpg(f2.main_pid, signal.SIGKILL)  # MainProcess, child, sandbox: everything at once
        f2.process.wait(timeout=30)
        server.release_stalls()
        f2 = WorkerProcess("f2", redis_server.url, directory, env=WORKER_ENV).start()
        # The restarted worker carries on with its session, from its own disk.
        assert client.run_round("f2", steps=1, round_num=2).get(timeout=120)["status"] == "completed"
        assert {name: gets(server, name) for name in counts} == counts, "something was downloaded again"
        assert client.run_round("f2", steps=1, round_num=9).get(timeout=120)["status"] == "completed"
        resumed = [r for r in server.requests if r.path == stall_name and (r.range_start() or 0) > 0]
        assert resumed, "the partial shard download did not resume"
    finally:
        f2.stop()


def test_redis_down_at_the_end_of_a_round_loses_nothing_and_runs_nothing_twice(world) -> None:  # type: ignore[no-untyped-def]
    server, client, redis_server = world["server"], world["client"], world["redis"]
    client.load_model("f1", server.url("model.safetensors"), world["shards"], CODE).get(timeout=120)
    since = event_seq(client, "f1")
    task_dir = world["f1"].directory / "work" / "f1" / "session" / "sandbox" / "task"
    for marker in ("round7-started", "round7-done"):
        (task_dir / marker).unlink(missing_ok=True)
    pending = client.run_round("f1", steps=8, round_num=7)  # about 2 s of work
    wait_for_file(task_dir / "round7-started")
    redis_server.kill()
    # The round ends while Redis is away (tenant code got past its last step), so its events
    # and its result had to wait for Redis in the worker.
    wait_for_file(task_dir / "round7-done")
    redis_server.start()
    deadline = time.monotonic() + 120
    while (meta := pending.backend.get_task_meta(pending.id, cache=False))["status"] != "SUCCESS":
        assert time.monotonic() < deadline, meta
        time.sleep(0.2)
    assert meta["result"]["status"] == "completed"
    time.sleep(2.0)  # room for a redelivery, were there one
    events = task_events(client, "f1", since, pending.id)
    assert [e.data["step"] for e in events if "step" in e.data] == list(range(8)), "events lost or doubled"
    assert sum(1 for e in events if "executions" in e.data) == 1, "the round ran twice"
    seqs = [e.seq for e in client.events("f1", since=since, idle_timeout_s=1)]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_a_trickling_server_fails_the_download_clearly(world) -> None:  # type: ignore[no-untyped-def]
    server, client, root = world["server"], world["client"], world["root"]
    name = "slow-shard.pt.zst"
    (root / name).write_bytes(shard_of(2000, 3))
    server.add_fault(name, "slow", times=-1, chunk_bytes=256, delay_s=0.3)  # ~850 B/s: a slow loris
    shards = [
        *world["shards"],
        {
            "url": server.url(name, "X-Signature=secret"),
            "compression": "zstd",
            "size_bytes": (root / name).stat().st_size,
        },
    ]
    client.load_model("f1", server.url("model.safetensors"), shards, CODE).get(timeout=120)
    started = time.monotonic()
    result = client.run_round("f1", steps=1, round_num=9).get(timeout=120)
    server.clear_faults()
    assert result["status"] == "failed" and result["error"]["code"] == "download_failed", result
    assert "slower than" in result["error"]["message"] and "secret" not in str(result)
    assert time.monotonic() - started < 60


def test_truncated_and_mislabelled_bodies_are_recovered(world) -> None:  # type: ignore[no-untyped-def]
    server, client, root = world["server"], world["client"], world["root"]
    names = []
    for kind, options in (("truncate", {"after_bytes": 500}), ("wrong_length", {"length": 100})):
        name = f"{kind}-{uuid.uuid4().hex[:6]}.pt.zst"
        (root / name).write_bytes(shard_of(1000, 4))
        server.add_fault(name, kind, **options)
        names.append(name)
    shards = [
        {"url": server.url(n), "compression": "zstd", "size_bytes": (root / n).stat().st_size} for n in names
    ]
    code = "for i in range(num_shards):\n    get_shard(i)\nsave_report({'ok': True})"
    client.load_model("f1", server.url("model.safetensors"), shards, code).get(timeout=120)
    assert client.run_round("f1", steps=1).get(timeout=120)["report"] == {"ok": True}


def test_an_expired_presigned_url_is_a_clear_failure_without_the_token(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, f1 = world["client"], world["f1"]
    with ArtifactServer(tmp_path / "store") as store:
        published = []
        for i in range(3):
            path = tmp_path / f"s{i}.zst"
            path.write_bytes(shard_of(500, 20 + i))
            store.publish(f"s{i}.zst", path)
            published.append(
                {
                    "url": store.url_get(f"s{i}.zst", expires_s=EXPIRY_S),
                    "compression": "zstd",
                    "size_bytes": path.stat().st_size,
                }
            )
        (tmp_path / "m.safetensors").write_bytes((world["root"] / "model.safetensors").read_bytes())
        model_url = store.publish("m.safetensors", tmp_path / "m.safetensors")
        code = "get_shard(2)"
        expires_at = time.time() + EXPIRY_S
        # The load must finish while the URLs are good: EXPIRY_S leaves a loaded machine room.
        client.load_model("f1", model_url, published, code, initial_shard_index=0).get(timeout=120)
        time.sleep(max(0.0, expires_at - time.time()) + 1.5)  # every shard URL has expired now
        since = event_seq(client, "f1")
        pending = client.run_round("f1", steps=1)
        result = pending.get(timeout=120)
    error = result["error"]
    assert result["status"] == "failed" and error["code"] == "download_failed", result
    assert "403" in error["message"] and "127.0.0.1" in error["message"]
    assert "X-Signature" not in str(result) and "X-Expires" not in str(result)
    events = task_events(client, "f1", since, pending.id)
    assert events and not any("X-Signature" in str(e.to_json()) for e in events)
    assert "X-Signature" not in f1.log(), "a presigned token reached the worker's log"
    raw = client.redis.xrange(stream_name("f1"))
    assert not any(b"X-Signature" in fields[b"msg"] for _id, fields in raw)


def test_many_small_tasks_across_two_workers_none_lost_none_twice(world) -> None:  # type: ignore[no-untyped-def]
    server, client, redis_server = world["server"], world["client"], world["redis"]
    f3 = WorkerProcess("f3", redis_server.url, world["tmp"].mktemp("f3"), env=WORKER_ENV).start()
    try:
        hosts = ("f1", "f3")
        for host in hosts:
            client.load_model(host, server.url("model.safetensors"), world["shards"], "pass").get(timeout=120)
        since = {host: event_seq(client, host) for host in hosts}
        pending = [client.run_round(hosts[i % 2], steps=1, mode="inference") for i in range(1000)]
        rss: dict[str, list[int]] = {host: [] for host in hosts}
        for index, result in enumerate(pending):
            assert result.get(timeout=300)["status"] == "completed"
            if index in (20, 999):
                for host, worker in (("f1", world["f1"]), ("f3", f3)):
                    rss[host].append(tree_rss(worker.child_pid()))
        for host in hosts:
            finished = [
                e.task_id for e in client.events(host, since=since[host], idle_timeout_s=2)
                if e.type == "state" and e.data.get("event") == "task-finished" and e.task == "run_round"
            ]  # fmt: skip
            ours = {r.id for i, r in enumerate(pending) if hosts[i % 2] == host}
            assert len(finished) == len(set(finished)), "a task ran twice"
            assert ours <= set(finished) and len(ours) == 500
            length = client.redis.xlen(stream_name(host))
            assert length <= 2000 * 1.2, f"the event stream grew to {length}"
            early, late = rss[host]
            mb = f"{early / 1e6:.0f} MB at round 20, {late / 1e6:.0f} MB at 500"
            print(f"{host}: RSS of child + sandbox: {mb}")
            assert late < early * 1.10 + 20e6, f"memory grew: {early} -> {late}"
    finally:
        f3.stop()


def tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants (the child, bwrap, the runner)."""
    total = 0
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += (
                int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) * 1024
            )
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return total


def test_a_round_longer_than_the_visibility_timeout_is_not_run_twice(world) -> None:  # type: ignore[no-untyped-def]
    server, client, redis_server = world["server"], world["client"], world["redis"]
    env = {**WORKER_ENV, "ROUNDHOUSE_VISIBILITY_TIMEOUT_S": "2"}
    f4 = WorkerProcess("f4", redis_server.url, world["tmp"].mktemp("f4"), env=env).start()
    try:
        client.load_model("f4", server.url("model.safetensors"), world["shards"], CODE).get(timeout=120)
        since = event_seq(client, "f4")
        pending = client.run_round("f4", steps=24, round_num=7)  # ~6 s, three visibility timeouts
        assert pending.get(timeout=120)["status"] == "completed"
        time.sleep(12)  # kombu restores unacked messages past the timeout: let it, then count
        events = task_events(client, "f4", since, pending.id)
        assert sum(1 for e in events if "executions" in e.data) == 1, "the round ran twice"
    finally:
        f4.stop()
