"""A real ``roundhouse worker`` subprocess, with settings that make tests quick."""

from __future__ import annotations

from pathlib import Path

from orchestrator.local import REPO, LocalWorker

__all__ = ["REPO", "WorkerProcess"]

TEST_ENV = {
    "ROUNDHOUSE_DOWNLOAD_BACKOFF_S": "0.05",
    "ROUNDHOUSE_HEARTBEAT_INTERVAL_S": "0.5",
    # 16 intervals: a 2-core CI machine under the whole suite has stalled every worker's beats for
    # over 5 s at once (the test Redis fsyncs each write: appendfsync always) and lost them all.
    "ROUNDHOUSE_HEARTBEAT_TTL_S": "8",
    "ROUNDHOUSE_METRICS_PORT": "0",
    # A worker verifies, it does not sign: it gets the session's trust store (tests/conftest.py),
    # not the orchestrator's key.
    "ROUNDHOUSE_SIGNING_KEY": "",
    "ROUNDHOUSE_SIGNING_CERT": "",
}


class WorkerProcess(LocalWorker):
    def __init__(
        self,
        host_id: str,
        redis_url: str,
        directory: Path,
        *,
        cache_dir: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(host_id, redis_url, directory, cache_dir=cache_dir, env={**TEST_ENV, **(env or {})})
