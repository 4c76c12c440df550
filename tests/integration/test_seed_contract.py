"""A caller of the seed keeps working (DESIGN §9): its call sequence, written only against the
seed's signatures — positional constructor, ``load``/``run``/``wait``, the attributes it reads,
``update_model`` with and without a delta, ``reset`` — and the exception names it catches."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from executor import Executor
from executor.delta import make_sync_delta, state_hash
from executor.errors import CleanupFailed, DownloadAborted, Stopped
from settings import get_settings
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer


@pytest.fixture
def seed_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    # The seed's constructor names no cache dir: the one Settings object gives it.
    monkeypatch.setenv("ROUNDHOUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ROUNDHOUSE_DOWNLOAD_BACKOFF_S", "0.01")
    get_settings.cache_clear()
    root = tmp_path / "srv"
    root.mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        yield server, root, shard_descriptors(server, shards)
    get_settings.cache_clear()


def _seed_format_delta(delta: dict[str, torch.Tensor]) -> bytes:
    """The seed's wire format: zstd of a ``torch.save`` dict of fp16 tensors."""
    buffer = io.BytesIO()
    torch.save(delta, buffer)
    return zstandard.ZstdCompressor().compress(buffer.getvalue())


def test_the_seeds_call_sequence_works_unchanged(seed_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, root, descriptors = seed_env
    stats: list[dict] = []
    logs: list[str] = []
    # Executor(emit_stats, emit_log, host_id, shard_cache_max_mb, stage_first_shard, work_dir, sandboxed)
    executor = Executor(stats.append, logs.append, "seed-host", 64, True, str(tmp_path / "work"), False)
    assert executor.work_dir.startswith(str(tmp_path / "work")) and not executor.abort_event.is_set()

    executor.load(server.url("model.safetensors"), descriptors, TRAIN_CODE, 32, {"lr": 0.05}, 0)
    assert executor.get_shard(0)["x"].shape == (256, 8)
    executor.run(3, 0, 2, "training", 0)
    executor.wait()
    assert not executor.is_running()
    assert executor.execution_error is None, executor.execution_error
    assert executor.report == {"final_loss": pytest.approx(executor.report["final_loss"]), "steps": 3}
    assert executor.training_time > 0 and executor.modified_state is not None
    assert [event["step"] for event in stats] == [0, 1, 2]
    assert logs[-1] == "done 3 steps on cpu"

    # update_model with the seed's own sync-delta format, then without a delta (full download).
    base = executor.get_original_state()
    assert base is not None
    trained = executor.modified_state
    sync = make_sync_delta(base, trained)
    (root / "sync.pt.zst").write_bytes(_seed_format_delta(sync.delta))
    model_url, delta_url = server.url("model.safetensors"), server.url("sync.pt.zst")
    applied = executor.update_model(model_url, None, None, delta_url, sync.base_hash, sync.result_hash)
    assert applied.via.value == "delta", applied  # the seed's format, applied (no silent fallback)
    assert state_hash(executor.get_original_state()) == sync.result_hash
    save_file(sync.result, str(root / "full.safetensors"))
    executor.update_model(server.url("full.safetensors"), {"lr": 0.01})
    assert state_hash(executor.get_original_state()) == sync.result_hash

    executor.run(2, 1, 2, "training", 3)
    executor.wait()
    assert executor.execution_error is None and executor.report["steps"] == 2
    assert [event["step"] for event in stats[-2:]] == [3, 4]

    executor.reset()
    assert executor.get_original_state() is None and not executor.is_running()
    executor.shutdown()


def test_the_seeds_exception_names_still_catch() -> None:
    # A stopped transfer was DownloadAborted; a cleanup that cannot be proven a RuntimeError.
    assert issubclass(DownloadAborted, Stopped)
    with pytest.raises(DownloadAborted):
        raise DownloadAborted("transfer of http://h/x stopped")
    assert issubclass(CleanupFailed, RuntimeError)
    with pytest.raises(RuntimeError):
        raise CleanupFailed("cannot prove task cleanup")
