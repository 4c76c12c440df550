"""What the sandbox tests share: whether this host can run them at all, and the tenant's world.

A test marked ``needs_sandbox`` runs tenant code in the real sandbox, which needs root (it
drops to a uid of its own) and a working bubblewrap. Where either is missing the test is
skipped, with the true reason — except in CI (``CI=true``), where it fails: a CI run that
skipped the whole escape suite would look green while proving nothing.

``world`` is one warm sandboxed :class:`~executor.Executor` shared by the package's tests.
Its sandbox runs as a uid of its own (64000 + a random offset), so counting that uid's
processes counts this suite's sandbox only, never another worker's on the same host.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import subprocess
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from executor import Executor
from executor.results import RoundResult, RoundStatus
from executor.sandbox import bwrap_works
from settings import Settings
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer

# Tenant code is ``params["attack"]``, so one load serves every attack (update_model swaps it).
DISPATCH = 'exec(compile(params["attack"], "<attack>", "exec"))\n'
UID_BASE = 64000

# The runner as a report names it: its pid in the sandbox (the same number for every fresh
# runner of a pid namespace) and its start time in clock ticks since boot (not namespaced).
RUNNER_IDENTITY = (
    "(__import__('os').getpid(), int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]))"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_sandbox: runs tenant code in the real sandbox (root, bwrap)")


@functools.cache
def sandbox_problem() -> str | None:
    """Why the real sandbox cannot run here, or None."""
    if os.geteuid() != 0:
        return "the sandbox drops to a dedicated uid: run as root"
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap is not installed (no bwrap on PATH; apt-get install bubblewrap)"
    if bwrap_works():
        return None
    return f"bubblewrap is installed ({exe}) but fails to run: {_bwrap_probe(exe)}"


def _bwrap_probe(exe: str) -> str:
    """What bwrap says when asked for the namespaces the sandbox needs (the product's probe)."""
    argv = [exe, "--unshare-net", "--unshare-pid", "--ro-bind", "/", "/", "--dev", "/dev"]
    argv += ["--proc", "/proc", "true"]
    try:
        done = subprocess.run(argv, env={}, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(argv)}: {exc}"
    if done.returncode == 0:
        return f"bwrap_works() is false, though `{' '.join(argv)}` exits 0"
    said = (done.stderr or done.stdout).strip() or "(no output)"
    return f"`{' '.join(argv)}` exits {done.returncode}: {said}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_sandbox") is None:
        return
    problem = sandbox_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"the sandbox cannot run in CI: {problem}", pytrace=False)
    pytest.skip(problem)


def _free_uid() -> int:
    """A uid of the suite's own, with no process on this host (others may run sandboxes too)."""
    for _ in range(100):
        uid = UID_BASE + random.randrange(1000)
        if not _pids_of(uid):
            return uid
    raise RuntimeError(f"no free uid in {UID_BASE}..{UID_BASE + 999}")


def _pids_of(uid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-u", str(uid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


class World:
    """The shared warm sandbox, and what its tenant said during the last round."""

    def __init__(
        self, base: Path, server: FaultServer, descriptors: list[dict], uid: int, secret: str
    ) -> None:
        self.base = base
        self.server = server
        self.descriptors = descriptors
        self.uid = uid
        self.secret = secret  # in the worker's environment and in ``canary``: never for the tenant
        self.canary = base / "canary.txt"  # a world-readable file of the host holding the secret
        self.dispatch = DISPATCH
        self.runner_identity = RUNNER_IDENTITY
        self.stats: list[dict[str, Any]] = []
        self.logs: list[str] = []
        self.settings = Settings(
            work_dir=str(base / "work"),
            cache_dir=str(base / "cache"),
            host_id="sandbox-test",
            sandbox="bwrap",
            sandbox_uid=uid,
            sandbox_gid=uid,
            sandbox_max_procs=256,
            sandbox_memory_mb=3072,
            sandbox_disk_mb=256,
            sandbox_tmp_mb=64,
            sandbox_stop_grace_s=1.0,
            download_backoff_s=0.01,
        )
        self.executor = Executor(self.stats.append, self.logs.append, settings=self.settings, sandboxed=True)

    @property
    def task_dir(self) -> Path:
        return Path(self.executor.work_dir) / "sandbox" / "task"

    def attack(self, code: str, **round_args: Any) -> RoundResult:
        """Run ``code`` as the tenant's next round (the warm runner, when it is still alive)."""
        self.arm(code)
        return self.executor.run_round(**{"steps": 1, **round_args})

    def arm(self, code: str) -> None:
        """Make ``code`` the tenant's code for the next round, and forget the last round's words."""
        session = self.executor.session
        assert session is not None
        self.executor.update_model(
            self.server.url("model.safetensors"),
            params={"attack": textwrap.dedent(code)},
            result_hash=session.model_hash,
        )
        self.stats.clear()
        self.logs.clear()

    def attempts(self) -> list[dict[str, Any]]:
        """What the last round's tenant said it tried (``emit_stats({'attempt': ...})``)."""
        return [data for data in self.stats if "attempt" in data]

    def proved(self, what: str) -> dict[str, Any]:
        """The tenant's own word (``emit_stats({'attempt': what, ...})``) that it got to ``what``."""
        said = [data for data in self.attempts() if data["attempt"] == what]
        assert said, f"the attack never got to {what!r}: stats {self.stats}, logs {self.logs[-5:]}"
        return said[-1]

    @staticmethod
    def completed(result: RoundResult) -> dict[str, Any]:
        """The report of a round that ran to its end (the attack did not crash on the way)."""
        assert result.status is RoundStatus.COMPLETED and isinstance(result.report, dict), result
        return result.report

    def healthy(self) -> RoundResult:
        """A normal round completes, and its report names the runner that served it."""
        result = self.attack(f"save_report({{'ok': True, 'runner': {self.runner_identity}}})")
        assert result.status is RoundStatus.COMPLETED and result.report["ok"], result
        return result

    def processes(self, settle_s: float = 10.0) -> list[int]:
        """Host pids of the sandbox uid's processes (the warm runner is one), once the killed
        ones are gone: a process killed in a frozen group exits only as the kill thaws it, which
        takes a moment per process on a loaded machine (a live stray stays: the wait ends)."""
        deadline = time.monotonic() + settle_s
        pids = _pids_of(self.uid)
        while len(pids) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = _pids_of(self.uid)
        return pids


@pytest.fixture(scope="package")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    problem = sandbox_problem()
    if problem is not None:  # only reached by a test that is not marked needs_sandbox
        pytest.skip(problem)
    base = tmp_path_factory.mktemp("sandbox")
    root = base / "srv"
    root.mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    secret = "canary-" + uuid.uuid4().hex
    os.environ["ROUNDHOUSE_TEST_CANARY"] = secret
    try:
        with FaultServer(root) as server:
            world = World(base, server, shard_descriptors(server, shards), _free_uid(), secret)
            world.canary.write_text(secret)
            world.canary.chmod(0o644)
            try:
                world.executor.load(
                    server.url("model.safetensors"), world.descriptors, DISPATCH, params={"attack": "pass"}
                )
                yield world
            finally:
                world.executor.shutdown()
    finally:
        os.environ.pop("ROUNDHOUSE_TEST_CANARY", None)
