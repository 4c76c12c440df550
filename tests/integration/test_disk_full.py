"""A full disk under the cache dir and under the work dir: a clear error, nothing half-written,
and the executor recovers once space is back. Small real tmpfs mounts (needs root)."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from executor import Executor
from executor.errors import StorageFull
from executor.results import ExecutorState, RoundStatus
from settings import Settings
from tests.support.engine import mlp_state
from tests.support.http_server import FaultServer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path: Path):
    mounted: list[Path] = []

    def make(name: str, megabytes: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)])
        if result.returncode != 0:
            pytest.skip("tmpfs cannot be mounted here")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path, leave_mb: int) -> Path:
    """A filler file that leaves about ``leave_mb`` free on the mount."""
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    filler = directory / "filler"
    with open(filler, "wb") as file:
        file.truncate(0)
        remaining = max(0, free - leave_mb * 1024 * 1024)
        chunk = b"\0" * (1 << 20)
        while remaining > 0:
            file.write(chunk[: min(len(chunk), remaining)])
            remaining -= len(chunk)
    return filler


def big_shard(megabytes: int) -> bytes:
    g = torch.Generator().manual_seed(1)
    buffer = io.BytesIO()
    torch.save({"x": torch.randn(megabytes * 1024 * 256 // 8, 8, generator=g)}, buffer)
    return zstandard.ZstdCompressor(level=1).compress(buffer.getvalue())


@pytest.fixture
def served(tmp_path: Path):
    root = tmp_path / "srv"
    root.mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    save_file({f"w{i}": torch.randn(1024, 1024) for i in range(6)}, str(root / "big.safetensors"))  # 24 MB
    (root / "shard.pt.zst").write_bytes(big_shard(6))
    with FaultServer(root) as server:
        yield server, root


def test_a_full_cache_dir_is_a_clear_error_and_recovers(small_disk, served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, root = served
    cache = small_disk("cache", 32)
    settings = Settings(
        work_dir=str(tmp_path / "work"), cache_dir=str(cache), download_backoff_s=0.01, host_id="d"
    )
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings, stage_first_shard=False)
    shard = {
        "url": server.url("shard.pt.zst"),
        "compression": "zstd",
        "size_bytes": (root / "shard.pt.zst").stat().st_size,
    }
    ex.load(server.url("model.safetensors"), [shard], "get_shard(0)\nsave_report({'ok': True})")
    filler = fill(cache, leave_mb=3)
    result = ex.run_round(steps=1, mode="inference")
    assert result.status is RoundStatus.FAILED and result.error.code == "download_failed", result
    assert "No space left on device" in result.error.message
    entries = [p for p in (cache / "tenants").rglob("*") if p.is_file() and p.suffix != ".lock"]
    assert entries == [], f"half-written cache files stayed: {entries}"
    filler.unlink()  # space is back
    again = ex.run_round(steps=1, mode="inference")
    assert again.status is RoundStatus.COMPLETED and again.report == {"ok": True}
    ex.shutdown()


def test_a_full_work_dir_is_a_clear_error_and_keeps_the_session(small_disk, served) -> None:  # type: ignore[no-untyped-def]
    server, _root = served
    work = small_disk("work", 48)
    settings = Settings(
        work_dir=str(work), cache_dir=str(work.parent / "cache"), download_backoff_s=0.01, host_id="d"
    )
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    ex.load(server.url("model.safetensors"), [], "save_report({'ok': True})")
    model_before = Path(ex.session.model_path).read_bytes()
    filler = fill(work, leave_mb=8)
    with pytest.raises(StorageFull) as caught:
        ex.load(server.url("big.safetensors"), [], "pass")
    assert caught.value.code == "download_failed" and "No space left on device" in caught.value.message
    assert ex.state is ExecutorState.LOADED and Path(ex.session.model_path).read_bytes() == model_before
    assert ex.run_round(steps=1).status is RoundStatus.COMPLETED  # the old session still works
    filler.unlink()
    assert ex.load(server.url("big.safetensors"), [], "pass").model_keys == 6  # and space came back
    ex.shutdown()
