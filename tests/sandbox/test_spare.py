"""The spare runner (executor/sandbox/_spare.py), in the real bwrap sandbox: started while the
executor waits, adopted by ``load_model`` and by the round after a killed runner (no start of
their own), replaced after; its tenant — the first it ever runs — under the session's file
size limit although the spare was started without one; discarded by a reset and a shutdown;
and never visible to the session's tenant while it waits."""

from __future__ import annotations

import errno
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor import Executor
from executor.fileio import MIB
from executor.results import RoundStatus
from tests.support.http_server import FaultServer
from tests.support.sandboxed import sandboxed_executor, serving_mlp

pytestmark = pytest.mark.needs_sandbox

DISK_MB = 256
SPARE_WAIT_S = 120.0
# The tenant's whole view: its file size limit, whether it can lift it, what a file one byte
# over it does, and every process it can see.
PROBE = """
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    lifted = True
except (ValueError, OSError):
    lifted = False
with open('/task/over', 'wb') as f:
    try:
        os.ftruncate(f.fileno(), hard + 1)  # sparse: one byte over, no disk used
        over = 'written'
    except OSError as exc:
        over = exc.errno
os.unlink('/task/over')
if round_num == 1:
    os._exit(3)  # the runner dies with the round
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
save_report({'soft': soft, 'hard': hard, 'lifted': lifted, 'over': over, 'pids': pids,
             'root': sorted(os.listdir('/'))})
"""


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[FaultServer, list[dict]]]:
    with serving_mlp(tmp_path / "srv") as served:
        yield served


def _executor(tmp_path: Path) -> Executor:
    return sandboxed_executor(tmp_path, "spare-test", range(65900, 66800), sandbox_spare=True)


def _spare_ready(ex: Executor) -> None:
    deadline = time.monotonic() + SPARE_WAIT_S
    while ex.status()["sandbox"]["spare"] != "ready":
        assert time.monotonic() < deadline, ex.status()["sandbox"]
        time.sleep(0.05)


def _processes(ex: Executor) -> set[int]:
    """Every process of the executor's sandbox uid: the session's sandbox and the spare's."""
    out = subprocess.run(["pgrep", "-u", str(ex.settings.sandbox_uid)], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def _starts(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """(runners started for a session, spares started), from the supervisor's log."""
    messages = [r.getMessage() for r in caplog.records]
    return (
        sum(m.startswith("sandboxed runner ready") for m in messages),
        sum(m.startswith("spare sandboxed runner ready") for m in messages),
    )


def test_load_model_adopts_the_spare_and_its_tenant_gets_the_sessions_limits(
    tmp_path: Path, served: tuple[FaultServer, list[dict]], caplog: pytest.LogCaptureFixture
) -> None:
    server, shards = served
    caplog.set_level(logging.INFO, logger="executor")
    ex = _executor(tmp_path)
    try:
        _spare_ready(ex)
        spare = _processes(ex)
        assert spare and _starts(caplog) == (0, 1)
        ex.load(server.url("model.safetensors"), shards, PROBE)
        assert _starts(caplog)[0] == 0, "load_model started no runner: it adopted the spare"
        assert spare <= _processes(ex)
        result = ex.run_round(steps=1, mode="inference", round_num=0)
        assert result.status is RoundStatus.COMPLETED, result
        report = result.report
        # Started with no file size limit, its first tenant runs under the session's: the task
        # dir's quota here, soft and hard, beyond the tenant's reach.
        assert (report["soft"], report["hard"]) == (DISK_MB * MIB, DISK_MB * MIB), report
        assert report["lifted"] is False and report["over"] == errno.EFBIG, report
        # Its own pid namespace and root: no trace of the next spare, started after the load.
        assert max(report["pids"]) <= 3, report
        assert not [name for name in report["root"] if "spare" in name or "sandbox" in name], report
        _spare_ready(ex)
        assert _starts(caplog) == (0, 2)
        assert len(_processes(ex)) > len(spare), "the session's sandbox and a new spare"
    finally:
        ex.shutdown()
    time.sleep(0.2)
    assert _processes(ex) == set(), "a shutdown leaves neither the session's runner nor the spare"


def test_the_round_after_a_dead_runner_adopts_the_spare(
    tmp_path: Path, served: tuple[FaultServer, list[dict]], caplog: pytest.LogCaptureFixture
) -> None:
    server, shards = served
    caplog.set_level(logging.INFO, logger="executor")
    ex = _executor(tmp_path)
    try:
        ex.load(server.url("model.safetensors"), shards, PROBE)
        _spare_ready(ex)
        died = ex.run_round(steps=1, mode="inference", round_num=1)
        assert died.status is RoundStatus.FAILED and died.error.code == "sandbox_runner_error", died
        before = _starts(caplog)
        result = ex.run_round(steps=1, mode="inference", round_num=2)
        assert result.status is RoundStatus.COMPLETED, result
        assert result.report["hard"] == DISK_MB * MIB, result.report
        after = _starts(caplog)
        assert after[0] == before[0], "the round started no runner: it adopted the spare"
        _spare_ready(ex)
        assert _starts(caplog)[1] == after[1] + 1, "and a new spare followed"
    finally:
        ex.shutdown()


def test_a_reset_discards_the_spare_and_starts_another(tmp_path: Path) -> None:
    ex = _executor(tmp_path)
    try:
        _spare_ready(ex)
        first = _processes(ex)
        ex.reset(tenant="someone")
        time.sleep(0.2)
        assert not first & _processes(ex), "the spare of the last tenant's time is gone"
        _spare_ready(ex)
        assert _processes(ex) and not first & _processes(ex)
        assert not (Path(ex.work_dir) / "sandbox").exists()
    finally:
        ex.shutdown()
    time.sleep(0.2)
    assert _processes(ex) == set()
