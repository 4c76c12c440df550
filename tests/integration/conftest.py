"""Fixtures for the engine's end-to-end tests: a real HTTP server serving a model and shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from settings import Settings
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer


@pytest.fixture
def env(tmp_path: Path):
    root = tmp_path / "srv"
    (root / "uploads").mkdir(parents=True)
    save_file(mlp_state(), str(root / "model.safetensors"))
    torch.save(mlp_state(), root / "model.pt")
    shards = make_shards(root)
    settings = Settings(
        work_dir=str(tmp_path / "work"),
        cache_dir=str(tmp_path / "cache"),
        download_backoff_s=0.01,
        host_id="test-host",
    )
    with FaultServer(root) as server:
        descriptors = shard_descriptors(server, shards, "X-Amz-Signature=secret")
        yield server, root, settings, descriptors
