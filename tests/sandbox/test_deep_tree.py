"""A tenant that nests thousands of directories in its task dir cannot blind the watchdog or
brick the worker (issue 25, item 1; DESIGN §10).

Once, 1,500 nested directories (6 MB, under any quota) made ``os.walk`` in the watchdog raise
``RecursionError``: the watchdog thread died, the tenant then wrote far past its disk quota
and slept past its wall time, and the round "completed"; ``reset`` raised the same way and
left the tree, so the next ``load_model`` (and a replacement worker child's start) failed too:
the worker crash-looped until someone removed the dir by hand. Here the same attack runs
through the engine's ``Executor`` and through a real `celery worker`: the round fails on the
quota, ``reset`` removes the tree, and the next tenant is served.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from executor import Executor
from executor.delta import state_hash
from executor.fileio import remove_tree
from executor.results import RoundStatus
from executor.sandbox import _supervisor
from settings import Settings
from tests.support.engine import mlp_state
from tests.support.sandboxed import sandboxed_executor, serving_mlp

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(300)]

DISPATCH = 'exec(compile(params["attack"], "<attack>", "exec"))\n'
UIDS = range(67300, 67390)  # this module's own: no other test's sandbox runs as these
WORKER_UID = 67390
QUOTA_MB = 16
WALL_TIME_S = 6.0
# 1,500 levels first (the walk that recursed once per level met them at every poll), then
# three times the quota, then past the wall time: each limit the dead watchdog no longer held.
DEEP_THEN_FILL = """
import os, time
open('/task/started', 'w').write('yes')
os.chdir('/task')
for _ in range(1500):
    os.mkdir('d')
    os.chdir('d')
for n in range(24):
    with open(f'fill-{n}', 'wb') as f:
        f.write(b'x' * (2 << 20))
time.sleep(10)
save_report({'survived': True})
"""
HEALTHY = "save_report({'ok': True})"


@pytest.fixture(autouse=True)
def _removed_after(tmp_path: Path) -> Iterator[None]:
    # Whatever a failed test left: pytest removes old temp dirs with shutil.rmtree, which recurses.
    yield
    remove_tree(str(tmp_path), ignore_errors=True, keep_root=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with serving_mlp(tmp_path_factory.mktemp("deep") / "srv") as (server, descriptors):
        yield SimpleNamespace(server=server, descriptors=descriptors)


def assert_quota_failure(status: str, error: dict[str, Any] | None) -> None:
    # Not "completed" after the tenant's sleep: the watchdog ended it on the quota, at once.
    assert status == "failed" and error is not None, (status, error)
    assert error["code"] == "sandbox_runner_error" and "quota" in error["message"], error


def sandboxed(tmp_path: Path) -> Executor:
    return sandboxed_executor(
        tmp_path,
        "deep-tree",
        UIDS,
        sandbox_memory_mb=1024,
        sandbox_disk_mb=QUOTA_MB,
        sandbox_wall_time_s=WALL_TIME_S,
        sandbox_stop_grace_s=1.0,
        sandbox_spare=False,
    )


def test_a_deep_tree_fails_the_round_and_reset_removes_it(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    executor = sandboxed(tmp_path)
    model_url = served.server.url("model.safetensors")
    try:
        executor.load(model_url, served.descriptors, DISPATCH, params={"attack": DEEP_THEN_FILL})
        started = time.monotonic()
        result = executor.run_round(steps=1, mode="inference")
        out = result.to_json()
        assert_quota_failure(out["status"], out["error"])
        assert time.monotonic() - started < WALL_TIME_S
        task = Path(executor.work_dir) / "sandbox" / "task"
        assert (task / "started").exists(), "the attack never ran"
        assert (task / "d" / "d").is_dir(), "the tenant's tree is not there to be removed"
        executor.reset()  # once a RecursionError that left the tree (and every later start) behind
        assert not task.exists()
        assert os.listdir(executor.work_dir) == []
        executor.load(model_url, served.descriptors, DISPATCH, params={"attack": HEALTHY})
        healthy = executor.run_round(steps=1, mode="inference")
        assert healthy.status is RoundStatus.COMPLETED and healthy.report == {"ok": True}, healthy
    finally:
        executor.shutdown()


def test_a_watchdog_that_fails_ends_the_sandbox(served, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Fail closed: whatever breaks the watchdog (here the RecursionError of issue 25, raised by
    # hand), the round it watched does not run on unwatched; the next round gets a fresh runner.
    def broken(_path: str) -> int:
        raise RecursionError("maximum recursion depth exceeded")

    executor = sandboxed(tmp_path)
    model_url = served.server.url("model.safetensors")
    try:
        slow = "open('/task/started', 'w').write('yes')\nimport time\ntime.sleep(10)\nsave_report({'on': 1})"
        executor.load(model_url, served.descriptors, DISPATCH, params={"attack": slow})
        with monkeypatch.context() as patched:
            patched.setattr(_supervisor, "tree_size", broken)
            started = time.monotonic()
            out = executor.run_round(steps=1, mode="inference").to_json()
        assert out["status"] == "failed" and out["error"]["code"] == "sandbox_runner_error", out
        assert "watchdog failed: RecursionError" in out["error"]["message"], out
        assert time.monotonic() - started < WALL_TIME_S
        assert (Path(executor.work_dir) / "sandbox" / "task" / "started").exists(), "the round never ran"
        session = executor.session
        assert session is not None
        executor.update_model(model_url, params={"attack": HEALTHY}, result_hash=session.model_hash)
        healthy = executor.run_round(steps=1, mode="inference")
        assert healthy.status is RoundStatus.COMPLETED and healthy.report == {"ok": True}, healthy
    finally:
        executor.shutdown()


def test_a_real_worker_keeps_serving_after_a_deep_tree(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tasks.client import RoundClient
    from tests.support.redis_server import RedisServer
    from tests.support.worker import WorkerProcess

    host = "deep-tree-w"
    redis_server = RedisServer(tmp_path / "redis").start()
    env = {
        "ROUNDHOUSE_SANDBOX": "bwrap",
        "ROUNDHOUSE_SANDBOX_UID": str(WORKER_UID),
        "ROUNDHOUSE_SANDBOX_MEMORY_MB": "1024",
        "ROUNDHOUSE_SANDBOX_DISK_MB": str(QUOTA_MB),
        "ROUNDHOUSE_SANDBOX_WALL_TIME_S": str(WALL_TIME_S),
        "ROUNDHOUSE_SANDBOX_STOP_GRACE_S": "1",
    }
    worker = WorkerProcess(host, redis_server.url, tmp_path / host, env=env)
    try:
        worker.start()
        client = RoundClient(Settings(broker_url=redis_server.url, host_id="deep-tree-client"))
        model_url = served.server.url("model.safetensors")
        attack = {"attack": textwrap.dedent(DEEP_THEN_FILL)}
        loaded = client.load_model(host, model_url, served.descriptors, DISPATCH, params=attack)
        assert loaded.get(timeout=120)["model_hash"] == state_hash(mlp_state())
        child = client.status(host).get(timeout=30)["pid"]
        result = client.run_round(host, steps=1, mode="inference").get(timeout=120)
        assert_quota_failure(result["status"], result["error"])
        task = tmp_path / host / "work" / host / "session" / "sandbox" / "task"
        assert (task / "started").exists(), "the attack never ran"
        assert "wiped_bytes" in client.reset(host).get(timeout=120)
        assert not task.exists()
        # The next tenant: a fresh load (a fresh sandbox) and a round, by the same worker child.
        loaded = client.load_model(host, model_url, served.descriptors, DISPATCH, params={"attack": HEALTHY})
        assert loaded.get(timeout=120)["model_hash"] == state_hash(mlp_state())
        healthy = client.run_round(host, steps=1, mode="inference").get(timeout=120)
        assert healthy["status"] == "completed" and healthy["report"] == {"ok": True}, healthy
        status = client.status(host).get(timeout=30)
        assert status["state"] == "loaded" and status["pid"] == child, status
    finally:
        worker.stop()
        redis_server.stop()
