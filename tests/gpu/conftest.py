"""The GPU checks: skipped without CUDA. With it, a real ``roundhouse worker`` (prefork,
sandboxed where the machine allows) on the embedded Redis, and an HTTP server with the
models and shards of ``tests/support/gpu_models.py``.

Each check appends what it measured to ``$ROUNDHOUSE_GPU_RESULTS`` (JSON lines, default
``var/gpu/results.jsonl``), which ``python -m bench.gpu --table`` prints."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.local import EmbeddedRedis
from settings import Settings
from tasks.client import RoundClient
from tests.support.gpu_models import GpuCase, make_cases, sandbox_mode
from tests.support.http_server import FaultServer
from tests.support.worker import WorkerProcess

HOST = "gpu"

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the GPU checks run on a GPU machine (scripts/gpu_check.sh)",
)


RESULTS = Path(os.environ.get("ROUNDHOUSE_GPU_RESULTS", "var/gpu/results.jsonl"))


@pytest.fixture(scope="session")
def record() -> Callable[..., None]:
    path = RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(check: str, result: str, **figures: Any) -> None:
        with path.open("a") as out:
            out.write(json.dumps({"check": check, "result": result, **figures}) + "\n")

    return write


@pytest.fixture(scope="session")
def gpu_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("gpu")
    root = base / "srv"
    root.mkdir()
    cases: dict[str, GpuCase] = make_cases(root)
    mode = sandbox_mode()
    redis_server = EmbeddedRedis(base / "redis").start()
    worker = WorkerProcess(
        HOST, redis_server.url, base / "worker", env={"ROUNDHOUSE_SANDBOX": mode, "ROUNDHOUSE_GPU": "0"}
    )
    try:
        with FaultServer(root) as server:
            worker.start()
            client = RoundClient(Settings(broker_url=redis_server.url, host_id="gpu-client"))
            yield {
                "root": root,
                "server": server,
                "cases": cases,
                "client": client,
                "worker": worker,
                "sandbox": mode,
            }
    finally:
        worker.stop()
        redis_server.stop()
        # The worker's log travels back with the results: a GPU machine is lent for minutes.
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        (RESULTS.parent / "worker.log").write_text(worker.log())


def shards_of(server: FaultServer, root: Path, names: list[str]) -> list[dict[str, Any]]:
    return [
        {"url": server.url(name), "compression": "zstd", "size_bytes": (root / name).stat().st_size}
        for name in names
    ]


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()
