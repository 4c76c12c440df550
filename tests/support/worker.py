"""A real ``roundhouse worker`` (``celery -A tasks worker -P prefork -c 1``) as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    def __init__(
        self,
        host_id: str,
        redis_url: str,
        directory: Path,
        *,
        cache_dir: Path | None = None,
        env: dict[str, str] | None = None,
        celery_args: tuple[str, ...] = ("--without-mingle", "--without-gossip"),
    ) -> None:
        self.host_id = host_id
        self.redis_url = redis_url
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_path = directory / f"worker-{host_id}.log"
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "ROUNDHOUSE_BROKER_URL": redis_url,
            "ROUNDHOUSE_HOST_ID": host_id,
            "ROUNDHOUSE_WORK_DIR": str(directory / "work"),
            "ROUNDHOUSE_CACHE_DIR": str(cache_dir or directory / "cache"),
            "ROUNDHOUSE_DOWNLOAD_BACKOFF_S": "0.05",
            "ROUNDHOUSE_HEARTBEAT_INTERVAL_S": "0.5",
            "ROUNDHOUSE_HEARTBEAT_TTL_S": "5",
            **(env or {}),
        }
        self.celery_args = celery_args
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120) -> WorkerProcess:
        argv = [sys.executable, "-m", "tasks.cli", "worker", "--", "--loglevel=INFO", *self.celery_args]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 120) -> None:
        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"worker {self.host_id} exited:\n{self.log()[-3000:]}")
            try:
                beat = client.get(f"roundhouse:hosts:{self.host_id}")
            except redis.RedisError:
                beat = None
            if beat is not None and " ready." in self.log():
                return
            time.sleep(0.2)
        raise TimeoutError(f"worker {self.host_id} not ready:\n{self.log()[-3000:]}")

    @property
    def main_pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def heartbeat(self) -> dict[str, Any]:
        raw = redis.Redis.from_url(self.redis_url).get(f"roundhouse:hosts:{self.host_id}")
        assert raw is not None, "no heartbeat"
        return dict(json.loads(raw))

    def child_pid(self) -> int:
        return int(self.heartbeat()["pid"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
