"""A sandboxed Executor of a test's own and the tiny MLP served to it (the load-pipeline and
spare-runner tests; the escape suite shares one warm ``world`` instead, tests/sandbox/conftest.py)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from executor import Executor
from executor.tensorfile import write_state
from settings import Settings
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer


def sandboxed_executor(tmp_path: Path, host_id: str, uids: range, **overrides: Any) -> Executor:
    """Its sandbox runs as a uid drawn from ``uids`` (64000 + …: no other test's), so counting
    that uid's processes counts this executor's sandboxes only; bwrap unless ``sandbox`` names
    another mode."""
    uid = random.choice(uids)
    values: dict[str, Any] = {
        "sandbox": "bwrap",
        "sandbox_memory_mb": 3072,
        "sandbox_disk_mb": 256,
        **overrides,
    }
    settings = Settings(
        work_dir=str(tmp_path / "work"),
        cache_dir=str(tmp_path / "cache"),
        host_id=host_id,
        sandbox_uid=uid,
        sandbox_gid=uid,
        **values,
    )
    return Executor(lambda _s: None, lambda _l: None, settings=settings, sandboxed=True)


@contextlib.contextmanager
def serving_mlp(root: Path) -> Iterator[tuple[FaultServer, list[dict]]]:
    """``root/model.safetensors`` (the tiny MLP) and three shards, served with fault injection."""
    root.mkdir()
    with open(root / "model.safetensors", "wb") as file:
        write_state(file, mlp_state())
    shards = make_shards(root)
    with FaultServer(root) as server:
        yield server, shard_descriptors(server, shards)
