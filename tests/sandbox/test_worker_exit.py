"""No sandbox outlives its worker (issue 25, item 16), through a real `celery worker` (prefork).

An idle sandboxed worker holds a spare runner, frozen: bwrap, its init and the runner (on a GPU
host, maybe a CUDA context). A warm shutdown (SIGTERM to the MainProcess) and a cold one (SIGQUIT)
must end it and remove its groups; a worker killed outright (SIGKILL to the whole worker: nothing
of it runs again) leaves it frozen — cgroup v1 holds even the SIGKILL bwrap's
``--die-with-parent`` sends — until the next worker of the same host id starts, which must end
it before it serves.

What a sandbox left is read from the outside: the processes of the sandbox uid, and the groups
under every ``roundhouse`` group of the cgroup tree whose name starts with the host id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer
from tests.support.worker import WorkerProcess

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(400)]

# This module's own uids: 63960 (warm shutdown), 63961 (killed), 63962 (cold shutdown). Not in
# 61100-61999, where every worker of the suite without ROUNDHOUSE_SANDBOX_UID draws its uid from a
# hash of its host id (Settings.sandbox_ids): a worker of a module running in parallel could run
# its sandbox as one of them, and this module counts processes by uid.
UID = 63960
CGROUPS = Path("/sys/fs/cgroup")


def env(uid: int) -> dict[str, str]:
    return {
        "ROUNDHOUSE_SANDBOX": "bwrap",
        "ROUNDHOUSE_SANDBOX_UID": str(uid),
        "ROUNDHOUSE_SANDBOX_MEMORY_MB": "1024",
        "ROUNDHOUSE_SANDBOX_MAX_PROCS": "64",
        "ROUNDHOUSE_SANDBOX_SPARE": "true",  # the suite turns it off (tests/conftest.py)
    }


@pytest.fixture(scope="module")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def sandbox_pids(uid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-u", str(uid)], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def host_groups(host: str) -> list[Path]:
    """Every sandbox group of ``host``, freezer hierarchy first (a frozen one's processes die thawed)."""
    found = []
    for parent, dirs, _files in os.walk(CGROUPS):
        if os.path.basename(parent) == "roundhouse":
            found += [Path(parent, d) for d in dirs if d.startswith(f"{host}-")]
            dirs.clear()
    return sorted(found, key=lambda group: "freezer" not in group.parts)


def end_leftovers(host: str, uid: int) -> None:
    """What a failed test left, ended (so that it cannot hold this machine's memory)."""
    for group in host_groups(host):
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            if (group / "freezer.state").exists():
                (group / "freezer.state").write_text("THAWED")
    for stray in sandbox_pids(uid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(stray, signal.SIGKILL)
    time.sleep(0.5)
    for group in host_groups(host):
        with contextlib.suppress(OSError):
            group.rmdir()


def spare_ready(worker: WorkerProcess, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(AssertionError):
            if worker.heartbeat()["sandbox"]["spare"] == "ready":
                return
        time.sleep(0.2)
    raise TimeoutError(f"no spare runner:\n{worker.log()[-3000:]}")


def gone(host: str, uid: int, pids: set[int], timeout_s: float = 10) -> tuple[set[int], list[Path]]:
    """What of ``pids`` still lives, and the host's groups, once they had ``timeout_s`` to go."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and ((pids & sandbox_pids(uid)) or host_groups(host)):
        time.sleep(0.1)
    return pids & sandbox_pids(uid), host_groups(host)


def stop_and_check(worker: WorkerProcess, host: str, uid: int, sig: int) -> None:
    """Stop the idle ``worker`` (holding its spare sandbox) with ``sig``: nothing of its
    sandboxes may be left, neither a process of the sandbox uid nor a group of the host."""
    spare_ready(worker)
    held = sandbox_pids(uid)
    assert held and host_groups(host), "the idle worker holds no spare sandbox"
    os.kill(worker.main_pid, sig)
    assert worker.process is not None
    worker.process.wait(timeout=120)
    alive, groups = gone(host, uid, held)
    assert not alive and not groups, f"left behind: processes {alive}, groups {groups}"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT], ids=["warm", "cold"])
def test_a_shutdown_ends_the_workers_sandboxes(redis_url: str, tmp_path: Path, sig: int) -> None:
    # Warm: SIGTERM to the MainProcess, the child leaves its loop. Cold: SIGQUIT, billiard sends
    # the child a SIGTERM (an exit of its own too).
    host, uid = f"exit-{signal.Signals(sig).name.lower()}", UID + (sig == signal.SIGQUIT) * 2
    worker = WorkerProcess(host, redis_url, tmp_path, env=env(uid))
    try:
        worker.start()
        stop_and_check(worker, host, uid, sig)
    finally:
        worker.stop()
        end_leftovers(host, uid)


def kill_holding_a_frozen_spare(
    first: WorkerProcess, host: str, uid: int
) -> tuple[set[int], list[Path], int] | None:
    """Kill ``first`` outright once it holds its spare: its sandbox's pids, groups and child pid,
    or None where another worker's start (any host's: a new sandbox group reclaims every group
    whose owner is gone, as it must) already reclaimed the dead worker's sandbox, which leaves
    this run nothing to prove about the successor."""
    first.start()
    spare_ready(first)
    held, groups, child = sandbox_pids(uid), host_groups(host), first.child_pid()
    first_kind = first.heartbeat()["sandbox"]["confinement"]
    assert held and groups, "the idle worker holds no spare sandbox"
    os.killpg(first.main_pid, signal.SIGKILL)  # the whole worker: MainProcess and child
    assert first.process is not None
    first.process.wait(timeout=30)
    if first_kind.startswith("cgroup1"):  # v1 holds even --die-with-parent's SIGKILL
        time.sleep(1)
        if not held & sandbox_pids(uid):
            # Died: by --die-with-parent (its groups stay: v1 did not hold it, the premise is
            # wrong) or by another worker's reclaim, which removes the groups once the processes
            # are gone (given a few seconds: it may be between the two).
            deadline = time.monotonic() + 10
            while any(group.exists() for group in groups) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(group.exists() for group in groups), (
                "the frozen sandbox did not outlive its worker"
            )
            return None
    return held, groups, child


ATTEMPTS = 8


def test_a_worker_killed_outright_leaves_nothing_to_its_successor(redis_url: str, tmp_path: Path) -> None:
    uid = UID + 1
    # A parallel module's worker may reclaim the orphan first (any new sandbox group reclaims
    # every orphan, as it must); under the whole suite's worker churn three tries in a row were
    # all taken once (a clean-clone run on 2026-12-05), so it tries up to eight times.
    for attempt in range(ATTEMPTS):
        host = f"exit-killed-{attempt}"  # a fresh heartbeat key: the dead worker's outlives it
        first = WorkerProcess(host, redis_url, tmp_path / str(attempt), env=env(uid))
        second = WorkerProcess(host, redis_url, tmp_path / str(attempt), env=env(uid))
        try:
            killed = kill_holding_a_frozen_spare(first, host, uid)
            if killed is None:
                continue
            held, groups, child = killed
            second.start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # its child beats once it has built its executor
                with contextlib.suppress(AssertionError):
                    if second.child_pid() != child:
                        break
                time.sleep(0.1)
            alive = held & sandbox_pids(uid)
            left = [group for group in groups if group.exists()]
            assert not alive and not left, (
                f"the dead worker's sandbox outlived its successor's start: {alive}, {left}"
            )
            stop_and_check(second, host, uid, signal.SIGTERM)
            return
        finally:
            first.stop()
            second.stop()
            end_leftovers(host, uid)
    pytest.fail(
        f"{ATTEMPTS} times another worker reclaimed the killed worker's sandbox before its successor started"
    )
