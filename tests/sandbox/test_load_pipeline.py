"""``load_model``'s parallel pipeline (executor/session/_loading.py) with the real sandbox: the runner
started beside the download is the one the rounds use, and every way a load can end badly
(a bad model, a bad shard, a stop mid-download) leaves the previous session working, no
helper thread behind and no runner but the session's."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from executor import Executor
from executor.delta import file_state_hash
from executor.errors import BadArtifact, DownloadFailed, Stopped
from executor.results import RoundStatus
from executor.tensorfile import write_state
from tests.support.engine import mlp_state
from tests.support.http_server import FaultServer
from tests.support.sandboxed import sandboxed_executor, serving_mlp

pytestmark = pytest.mark.needs_sandbox

HELPERS = ("load-shard", "load-runner", "hash-follower", "roundhouse-segment")
REPORT = "save_report({'ok': True, 'keys': len(load_model(model_path))})"


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[FaultServer, list[dict]]]:
    root = tmp_path / "srv"
    with serving_mlp(root) as served:
        with open(root / "other.safetensors", "wb") as file:
            write_state(file, mlp_state(seed=1))
        # A valid header (so the runner starts) over a body that is not all there.
        good = (root / "other.safetensors").read_bytes()
        (root / "cut.safetensors").write_bytes(good[: len(good) - 40])
        yield served


def _executor(tmp_path: Path) -> Executor:
    return sandboxed_executor(
        tmp_path, "load-test", range(65000, 65900), download_backoff_s=0.01, download_retries=1
    )


def _runner_starts(caplog: pytest.LogCaptureFixture) -> int:
    return sum("sandboxed runner ready" in r.getMessage() for r in caplog.records)


def _no_helpers_left() -> None:
    left = [t.name for t in threading.enumerate() if t.name.startswith(HELPERS)]
    assert not left, left


def _runners_of(ex: Executor, within_s: float = 30) -> list[int]:
    """The sandbox uid's processes once they had ``within_s`` to go (a killed process in a frozen
    group leaves as the kill thaws it, later on a loaded machine; a live stray stays)."""
    deadline = time.monotonic() + within_s
    while True:
        out = subprocess.run(["pgrep", "-u", str(ex.settings.sandbox_uid)], capture_output=True, text=True)
        pids = [int(pid) for pid in out.stdout.split()]
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def test_the_runner_started_beside_the_download_serves_the_rounds(
    tmp_path: Path, served: tuple[FaultServer, list[dict]], caplog: pytest.LogCaptureFixture
) -> None:
    server, shards = served
    caplog.set_level(logging.INFO, logger="executor")
    ex = _executor(tmp_path)
    try:
        loaded = ex.load(server.url("model.safetensors"), shards, REPORT)
        assert loaded.model_hash == file_state_hash(ex.session.model_path)
        assert loaded.staged_shard == 0
        assert _runner_starts(caplog) == 1  # started once, beside the download, and adopted
        result = ex.run_round(steps=1, mode="inference")
        assert result.status is RoundStatus.COMPLETED and result.report == {"ok": True, "keys": 4}
        assert _runner_starts(caplog) == 1
        _no_helpers_left()
    finally:
        ex.shutdown()


@pytest.mark.parametrize("bad", ["model", "shard"])
def test_a_bad_model_or_shard_leaves_the_previous_session_working(
    tmp_path: Path, served: tuple[FaultServer, list[dict]], bad: str
) -> None:
    server, shards = served
    ex = _executor(tmp_path)
    try:
        first = ex.load(server.url("model.safetensors"), shards, REPORT)
        model_before = Path(ex.session.model_path).read_bytes()
        if bad == "model":
            with pytest.raises(BadArtifact):
                ex.load(server.url("cut.safetensors"), shards, "save_report({'new': True})")
        else:
            server.add_fault(shards[1]["url"].rsplit("/", 1)[1], "status", code=404, times=-1)
            with pytest.raises(DownloadFailed):
                ex.load(server.url("other.safetensors"), shards, "pass", initial_shard_index=1)
        _no_helpers_left()
        assert ex.session.model_hash == first.model_hash
        assert Path(ex.session.model_path).read_bytes() == model_before
        # The old session's code, on its model, in a runner started again for it.
        result = ex.run_round(steps=1, mode="inference")
        assert result.status is RoundStatus.COMPLETED and result.report == {"ok": True, "keys": 4}
    finally:
        ex.shutdown()
    assert _runners_of(ex) == []


def test_a_stop_mid_download_calls_everything_off(
    tmp_path: Path, served: tuple[FaultServer, list[dict]]
) -> None:
    server, shards = served
    root = tmp_path / "srv"
    big = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB: the stall comes mid-body
    with open(root / "big.safetensors", "wb") as file:
        write_state(file, big)
    ex = _executor(tmp_path)
    try:
        first = ex.load(server.url("model.safetensors"), shards, REPORT)
        server.add_fault("big.safetensors", "stall", after_bytes=2 << 20)
        outcome: list[BaseException | None] = []

        def load() -> None:
            try:
                ex.load(server.url("big.safetensors"), shards, "pass")
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=load)
        thread.start()
        assert server.wait_for_stalls(1)
        time.sleep(0.3)  # the runner is starting beside the stalled download now
        ex.stop()
        thread.join(timeout=30)
        server.release_stalls()
        assert outcome and isinstance(outcome[0], Stopped), outcome
        _no_helpers_left()
        assert ex.session.model_hash == first.model_hash
        ex.abort_event.clear()
        result = ex.run_round(steps=1, mode="inference")
        assert result.status is RoundStatus.COMPLETED and result.report == {"ok": True, "keys": 4}
    finally:
        ex.shutdown()
    assert _runners_of(ex) == []
