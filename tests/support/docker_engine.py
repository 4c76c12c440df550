"""A Docker engine of the test's own, and the compose stack built and run on it.

``DockerEngine`` starts Debian's ``dockerd`` on a socket, exec root and data root of its own
(the host's engine, if any, is left alone): no iptables rules, no ``docker0`` bridge (compose
makes its own network), the storage driver dockerd picks (overlay2 on ext4, vfs where the
data root cannot carry overlays). The data root persists between runs so that a second run
reuses the images. ``Stack`` is ``docker-compose`` with ``deploy/compose/no-registry.yml`` on
that engine: no registry is reachable here, so every image is built from the Debian base that
``scripts/docker_base.sh`` makes with debootstrap.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "roundhouse-base:bookworm"
DATA_ROOT = Path(os.environ.get("ROUNDHOUSE_TEST_DOCKER_ROOT", "/var/lib/roundhouse-test-docker"))
TOOLS = ("dockerd", "docker", "docker-compose", "debootstrap")


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


class DockerEngine:
    def __init__(self, data_root: Path = DATA_ROOT) -> None:
        self.data_root = data_root
        # A short path: the engine's sockets live under it (sun_path holds 108 bytes).
        self.run_dir = Path(tempfile.mkdtemp(prefix="rh-docker-"))
        self.socket = self.run_dir / "docker.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}

    def start(self, timeout_s: float = 90) -> DockerEngine:
        argv = [
            "dockerd", f"--host=unix://{self.socket}", f"--data-root={self.data_root}",
            f"--exec-root={self.run_dir / 'exec'}", f"--pidfile={self.run_dir / 'dockerd.pid'}",
            "--iptables=false", "--ip-masq=false", "--bridge=none",
        ]  # fmt: skip
        with open(self.run_dir / "dockerd.log", "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while self.docker("version", check=False).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dockerd did not start:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return (self.run_dir / "dockerd.log").read_text(errors="replace")[-chars:]
        return ""

    def docker(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", *args], env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def ensure_base_image(self) -> None:
        """The Debian base every image here is built from, made once (debootstrap: ~1 min)."""
        if self.docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
            return
        made = subprocess.run(
            [str(REPO / "scripts" / "docker_base.sh"), BASE_IMAGE],
            env=self.env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if made.returncode != 0:
            raise RuntimeError(f"scripts/docker_base.sh failed:\n{made.stdout}\n{made.stderr}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None
        shutil.rmtree(self.run_dir, ignore_errors=True)


class Stack:
    """``docker-compose -f docker-compose.yml -f deploy/compose/no-registry.yml`` as project
    ``name`` on ``engine``, its host ports free ones of this machine."""

    def __init__(self, engine: DockerEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.flower_port = free_port()
        # The stack's secrets have no default (docker-compose.yml): a run of its own.
        self.flower_auth = ("ops", secrets.token_urlsafe(16))
        self.env = {
            **engine.env,
            "BASE_IMAGE": BASE_IMAGE,
            "MINIO_PORT": str(free_port()),
            "MINIO_CONSOLE_PORT": str(free_port()),
            "MINIO_ROOT_PASSWORD": secrets.token_urlsafe(16),
            "FLOWER_PORT": str(self.flower_port),
            "FLOWER_BASIC_AUTH": ":".join(self.flower_auth),
        }

    def compose(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [
            "docker-compose", "-p", self.name, "-f", str(REPO / "docker-compose.yml"),
            "-f", str(REPO / "deploy" / "compose" / "no-registry.yml"), *args,
        ]  # fmt: skip
        result = subprocess.run(argv, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"docker-compose {' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    def logs(self, *services: str, tail: int = 60) -> str:
        result = self.compose("logs", "--no-color", f"--tail={tail}", *services, check=False, timeout=60)
        return result.stdout + result.stderr

    def down(self) -> None:
        self.compose("--profile", "cpu", "--profile", "demo", "down", "-v", "--remove-orphans", check=False)
