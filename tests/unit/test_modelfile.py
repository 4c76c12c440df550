"""Installing a model file: the replacement off the caller's path (``fileio.replace_retiring``)
and a recorded hash trusted only for the file, and the boot, it was recorded in."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

from executor.configs import model_limits, transfer_config
from executor.delta import state_hash
from executor.fileio import RETIRED_SUFFIX, replace_retiring
from executor.session import ModelFiles, model_fingerprint
from settings import Settings
from tests.support.engine import mlp_state


def _model_files(work_dir: Path) -> ModelFiles:
    settings = Settings()
    return ModelFiles(
        str(work_dir),
        model_limits(settings),
        transfer_config=transfer_config(settings),
        abort=threading.Event(),
    )


def _retired(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(RETIRED_SUFFIX)]


def _gone_soon(directory: Path, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _retired(directory):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_old_file_is_renamed_away_then_unlinked_beside_the_caller(tmp_path: Path) -> None:
    target, new = tmp_path / "model.safetensors", tmp_path / "incoming"
    target.write_bytes(b"old" * 1000)
    new.write_bytes(b"new" * 1000)
    old_inode = target.stat().st_ino
    with open(target, "rb") as reader:  # a reader of the old file keeps reading it
        replace_retiring(str(new), str(target))
        assert target.read_bytes() == b"new" * 1000 and target.stat().st_ino != old_inode
        assert not new.exists()
        assert reader.read() == b"old" * 1000
    assert _gone_soon(tmp_path), "the retired file was never unlinked"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_nothing_to_replace_and_a_failed_replace_leave_the_target(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    first = tmp_path / "first"
    first.write_bytes(b"first")
    replace_retiring(str(first), str(target))  # no file under the name yet
    assert target.read_bytes() == b"first" and _retired(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        replace_retiring(str(tmp_path / "missing"), str(target))
    assert target.read_bytes() == b"first", "a failed replace lost the installed file"
    assert _retired(tmp_path) == []


def test_start_up_removes_a_file_left_retired_by_a_crash(tmp_path: Path) -> None:
    models = _model_files(tmp_path)
    left = Path(models.model_dir) / f".model.safetensors.0123456789ab{RETIRED_SUFFIX}"
    left.write_bytes(b"x")
    assert models.clean_leftovers() == 1 and not left.exists()


def test_a_recorded_hash_is_trusted_only_for_its_file_in_its_boot(tmp_path: Path) -> None:
    models = _model_files(tmp_path)
    state = mlp_state()
    save_file(state, models.model_path)
    recorded = list(model_fingerprint(models.model_path))
    claimed = "sha256:" + "ab" * 32  # not the file's: it shows whether it was trusted or recomputed
    same = models.installed(claimed, recorded, {})
    assert same is not None and same.model_hash == claimed
    other_boot = [*recorded[:3], "another-boot-id"]
    rebooted = models.installed(claimed, other_boot, {})
    assert rebooted is not None and rebooted.model_hash == state_hash(state)
    older_manifest = recorded[:3]  # written before the boot was part of the fingerprint
    upgraded = models.installed(claimed, older_manifest, {})
    assert upgraded is not None and upgraded.model_hash == state_hash(state)
