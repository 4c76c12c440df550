"""The hostile tenant of issue 11 once more, through a real worker: `celery worker` (prefork),
Redis, and the orchestrator's own calls (``RoundClient``), as an orchestrator would see it.

``test_hostile.py`` drives the same attacks through the engine's ``Executor``, where the
enforcement lives; this module proves that nothing between the task and the sandbox (the
Celery glue, the child's runtime, the result backend) loses what the engine enforces. One
worker serves every attack: each one switches the tenant's code with a no-op
``apply_delta(params=...)``, proves its attack ran, shows that it failed, and leaves the
worker serving the next round.
"""

from __future__ import annotations

import textwrap
import time
from typing import Any

import pytest
from safetensors.torch import save_file

from executor.delta import state_hash
from settings import Settings
from tasks.client import RoundClient
from tests.sandbox.test_hostile import (
    CHANNEL,
    DAEMON_WITHOUT_CLEANUP,
    DISPATCH,
    FILL_FOREVER,
    FORGED_COMPLETE,
    LATE_LOG,
    QUOTA_MB,
    SHARED_MEMORY_BOMB,
    live_processes,
    task_bytes,
)
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.redis_server import RedisServer
from tests.support.worker import WorkerProcess

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(400)]

HOST = "hostile-w2"
UID = 63950  # a uid of this module's own (test_hostile.py draws from 63000-63899)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("srv")
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        yield server, shard_descriptors(server, shards)


@pytest.fixture(scope="module")
def rig(served, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    server, descriptors = served
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    env = {
        "ROUNDHOUSE_SANDBOX": "bwrap",
        "ROUNDHOUSE_SANDBOX_UID": str(UID),
        "ROUNDHOUSE_SANDBOX_MEMORY_MB": "1024",
        "ROUNDHOUSE_SANDBOX_DISK_MB": str(QUOTA_MB),
        "ROUNDHOUSE_SANDBOX_TMP_MB": "64",
        "ROUNDHOUSE_SANDBOX_MAX_PROCS": "128",
        "ROUNDHOUSE_SANDBOX_STOP_GRACE_S": "1",
    }
    worker = WorkerProcess(HOST, redis_server.url, tmp_path_factory.mktemp(HOST), env=env)
    try:  # a setup that fails must not leave the worker and its Redis running
        worker.start()
        client = RoundClient(Settings(broker_url=redis_server.url, host_id="hostile-client"))
        model_url = server.url("model.safetensors")
        loaded = client.load_model(HOST, model_url, descriptors, DISPATCH, params={"attack": "pass"})
        assert loaded.get(timeout=120)["model_hash"] == state_hash(mlp_state())
        yield client, worker, model_url
    finally:
        worker.stop()
        redis_server.stop()


def attack(rig: Any, code: str, **round_args: Any) -> dict[str, Any]:
    client, _worker, model_url = rig
    applied = client.apply_delta(
        HOST, model_url, params={"attack": textwrap.dedent(code)}, result_hash=state_hash(mlp_state())
    ).get(timeout=60)
    assert applied.get("noop"), applied  # only the tenant's code changed
    return dict(client.run_round(HOST, **{"steps": 1, "mode": "inference", **round_args}).get(timeout=120))


def healthy(rig: Any) -> str:
    """A normal round completes; the runner's start time (a fresh runner has another)."""
    result = attack(rig, "save_report({'ok': True, 'runner': open('/proc/self/stat').read().split()[21]})")
    assert result["status"] == "completed" and result["report"]["ok"], result
    return str(result["report"]["runner"])


def worker_task_bytes(worker: WorkerProcess) -> int:
    return task_bytes(worker.directory / "work" / HOST / "session")


def test_a_forged_complete_cannot_fill_the_disk(rig) -> None:  # type: ignore[no-untyped-def]
    _client, worker, _url = rig
    result = attack(rig, FORGED_COMPLETE + FILL_FOREVER)
    assert result["status"] == "completed" and result["report"] == {"forged": True}, result
    frozen = worker_task_bytes(worker)
    time.sleep(1.5)  # a writer that ran on would add ~1 GB/s here
    assert worker_task_bytes(worker) == frozen and frozen < QUOTA_MB << 20
    thawed = attack(rig, "save_report({'ok': True})")
    assert thawed["status"] == "failed" and thawed["error"]["code"] == "sandbox_runner_error", thawed
    assert "quota" in thawed["error"]["message"]
    healthy(rig)


def test_a_message_after_complete_or_a_nested_frame_fails_the_round(rig) -> None:  # type: ignore[no-untyped-def]
    before = healthy(rig)
    nested = CHANNEL + (
        "channel._out.write(b'[' * 100_000 + b']' * 100_000 + b'\\n'); channel._out.flush()\n"
        "import time; time.sleep(5)\n"
    )
    for code in (FORGED_COMPLETE + LATE_LOG, nested):
        result = attack(rig, code)
        if result["status"] == "completed":  # frozen before its late frame: it fails the next round
            assert result["report"] == {"forged": True}, result
            result = attack(rig, "save_report({'ok': True})")
        assert result["status"] == "failed" and result["error"]["code"] == "sandbox_protocol_error", result
        after = healthy(rig)
        assert after != before, "the runner that broke the protocol was kept"
        before = after


def test_the_runners_cleanup_switched_off_keeps_no_daemon(rig) -> None:  # type: ignore[no-untyped-def]
    result = attack(rig, DAEMON_WITHOUT_CLEANUP)
    assert result["status"] == "completed" and result["report"] == {"beating": True}, result
    live = live_processes(UID)
    assert live <= 1, f"the daemon outlived its round: {live} live processes of the sandbox uid after 60 s"
    later = attack(
        rig,
        "import time\ntime.sleep(1)\nsave_report({'age': time.time() - float(open('/task/beat').read())})",
    )
    assert later["status"] == "completed" and later["report"]["age"] > 1, later


def test_shared_memory_beyond_the_limit_kills_only_the_runner(rig) -> None:  # type: ignore[no-untyped-def]
    client, worker, _url = rig
    if client.status(HOST).get(timeout=30)["sandbox"]["confinement"] == "pidns":
        pytest.skip("no writable cgroup here: shared memory is bounded only by the host")
    result = attack(rig, SHARED_MEMORY_BOMB)
    task = worker.directory / "work" / HOST / "session" / "sandbox" / "task"
    assert (task / "mapped").exists(), "the attack never ran"
    assert result["status"] == "failed" and result["error"]["code"] == "sandbox_runner_error", result
    healthy(rig)


def test_a_runner_that_segfaults_is_replaced(rig) -> None:  # type: ignore[no-untyped-def]
    before = healthy(rig)
    result = attack(rig, "import ctypes\nctypes.string_at(0)\nsave_report({'survived': True})")
    assert result["status"] == "failed" and result["error"]["code"] == "sandbox_runner_error", result
    assert healthy(rig) != before
