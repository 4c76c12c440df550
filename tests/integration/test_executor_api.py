"""The seed's public API keeps working, and the namespace tenant code sees is the contract's."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from executor import Executor
from executor.errors import ShardIndexError
from executor.results import RoundStatus
from executor.rounds import NAMESPACE_NAMES
from tests.support.engine import TRAIN_CODE, mlp_state

CHECK_NAMES = """
missing = [n for n in NAMES if n not in globals()]
assert not missing, missing
assert callable(get_shard) and callable(should_stop) and should_stop() is False
assert isinstance(num_shards, int) and device in ("cpu", "cuda", "mps")
save_report({"names": sorted(n for n in NAMES), "round": round_num, "steps": steps, "offset": step_offset})
"""


def test_seed_constructor_and_thread_api(env, tmp_path: Path) -> None:
    server, _root, settings, descriptors = env
    stats: list = []
    logs: list = []
    # The seed's positional order: emit_stats, emit_log, host_id, shard_cache_max_mb,
    # stage_first_shard, work_dir, sandboxed.
    ex = Executor(
        stats.append, logs.append, "seed-host", 64, True, str(tmp_path / "w"), False, settings=settings
    )
    assert isinstance(ex.abort_event, threading.Event)
    assert Path(ex.work_dir).is_dir() and Path(ex.work_dir).parent == tmp_path / "w"
    ex.load(server.url("model.safetensors"), descriptors, TRAIN_CODE, 8, {"lr": 0.1}, 1)
    original = ex.get_original_state()
    assert original is not None and torch.equal(original["0.weight"], mlp_state()["0.weight"])
    assert int(ex.get_shard(0)["x"].shape[0]) == 256
    assert Path(ex.get_shard_path(2)).is_file()
    with pytest.raises(IndexError):  # seed callers catch IndexError
        ex.get_shard(3)
    ex.run(steps=3, round_num=0, total_rounds=1, mode="training", step_offset=10)
    assert ex.wait(60), "the round did not end"
    assert not ex.is_running()
    assert ex.execution_error is None and ex.report is not None and ex.training_time > 0
    assert ex.modified_state is not None and set(ex.modified_state) == set(original)
    assert [s["step"] for s in stats] == [10, 11, 12]
    ex.stop()
    ex.reset()
    ex.shutdown()
    ex.shutdown()  # idempotent


def test_run_returns_while_the_round_runs_and_wait_reports_it(env) -> None:
    # The seed's run() starts the round in a thread and returns; tenant code that only ends
    # when stopped proves it (no timing: the round cannot have finished on its own).
    server, _root, settings, descriptors = env
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    ex.load(server.url("model.safetensors"), descriptors, "while True:\n    should_stop()\n")
    ex.run(steps=1)
    assert ex.is_running()
    assert ex.wait(0.2) is False and ex.is_running()  # a timed-out wait says so
    ex.stop()
    assert ex.wait(60) and not ex.is_running()
    assert ex.finish_round().status is RoundStatus.STOPPED
    ex.shutdown()


def test_namespace_is_the_contract(env) -> None:
    server, _root, settings, descriptors = env
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    ex.load(
        server.url("model.safetensors"), descriptors, f"NAMES = {list(NAMESPACE_NAMES)!r}\n" + CHECK_NAMES
    )
    result = ex.run_round(steps=4, round_num=2, total_rounds=3, step_offset=8, mode="inference")
    assert result.status is RoundStatus.COMPLETED, result.error
    assert result.report == {"names": sorted(NAMESPACE_NAMES), "round": 2, "steps": 4, "offset": 8}
    assert result.delta is None  # inference rounds ship no delta
    ex.shutdown()


def test_bad_emit_arguments_fail_the_round_clearly(env) -> None:
    server, _root, settings, descriptors = env
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    ex.load(server.url("model.safetensors"), descriptors, "emit_stats([1, 2])")
    result = ex.run_round(steps=1)
    assert result.status is RoundStatus.FAILED and result.error.code == "user_code_error"
    assert "emit_stats takes a dict" in result.error.message
    ex.shutdown()


def test_cache_disabled_keeps_only_the_current_shard_in_the_work_dir(env, tmp_path: Path) -> None:
    server, _root, settings, descriptors = env
    ex = Executor(lambda _s: None, lambda _l: None, shard_cache_max_mb=0, settings=settings)
    ex.load(server.url("model.safetensors"), descriptors, "for i in range(num_shards):\n    get_shard(i)\n")
    assert str(ex.get_shard_path(0)).startswith(ex.work_dir)
    assert ex.run_round(steps=1).status is RoundStatus.COMPLETED
    entries = [p for p in Path(ex.work_dir).rglob("*.bin")]
    assert len(entries) == 1, entries  # the last shard only: nothing kept, nothing prefetched
    assert not (tmp_path / "cache" / "tenants").exists() or not list(
        (tmp_path / "cache" / "tenants").rglob("*.bin")
    )
    assert server.bodies("shard1.pt.zst") == 1
    ex.shutdown()


def test_stage_first_shard_off_and_initial_index(env) -> None:
    server, _root, settings, descriptors = env
    ex = Executor(lambda _s: None, lambda _l: None, stage_first_shard=False, settings=settings)
    loaded = ex.load(server.url("model.safetensors"), descriptors, "pass")
    assert loaded.staged_shard is None and all(server.bodies(f"shard{i}.pt.zst") == 0 for i in range(3))
    ex.shutdown()
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    assert (
        ex.load(server.url("model.safetensors"), descriptors, "pass", initial_shard_index=4).staged_shard == 1
    )
    with pytest.raises(ShardIndexError):
        ex.get_shard(-1)
    ex.shutdown()
