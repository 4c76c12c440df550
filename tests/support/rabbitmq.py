"""RabbitMQ for the broker tests: a vhost of the test's own on the machine's node, or a node
of the test's own.

``Vhost`` adds a vhost (``rabbitmqctl add_vhost``) on the RabbitMQ that runs on this machine
(guest/guest on 127.0.0.1:5672) and deletes it afterwards, so that parallel runs never share
a queue. ``RabbitNode`` starts a second, private node from the same installation, on free
ports and a directory of its own, for what RabbitMQ 3.10 sets only per node: its
``consumer_timeout`` (per queue, ``x-consumer-timeout`` or a policy, only from 3.11.15) and
how often channels check it (``channel_tick_interval``, 60 s by default, so a short
timeout would otherwise be noticed up to a minute late).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

from tests.support.redis_server import free_port

RABBITMQ_HOME = Path("/usr/lib/rabbitmq/bin")
SHARED_PORT = 5672


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def unavailable() -> str | None:
    """Why RabbitMQ cannot be used here, or None when it can."""
    if shutil.which("rabbitmqctl") is None:
        return "rabbitmqctl is not installed"
    if not _port_open(SHARED_PORT):
        return f"no RabbitMQ listens on 127.0.0.1:{SHARED_PORT}"
    return None


class Vhost:
    """A vhost of its own on the machine's RabbitMQ, for guest; removed by ``delete``."""

    def __init__(self, prefix: str = "roundhouse-test") -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:10]}"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{SHARED_PORT}/{self.name}"

    def create(self) -> Vhost:
        self._ctl("add_vhost", self.name)
        self._ctl("set_permissions", "-p", self.name, "guest", ".*", ".*", ".*")
        return self

    def delete(self) -> None:
        self._ctl("delete_vhost", self.name, check=False)

    def queues(self) -> dict[str, tuple[int, int]]:
        """``{queue: (ready, unacknowledged)}`` in this vhost."""
        return _queues(self._ctl("list_queues", "-p", self.name, *_QUEUE_COLUMNS))

    @staticmethod
    def _ctl(*args: str, check: bool = True) -> str:
        run = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=120)
        if check and run.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {run.stdout}{run.stderr}")
        return run.stdout


_QUEUE_COLUMNS = ("name", "messages_ready", "messages_unacknowledged")


def _queues(listing: str) -> dict[str, tuple[int, int]]:
    found = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit():
            found[parts[0]] = (int(parts[1]), int(parts[2]))
    return found


class RabbitNode:
    """A RabbitMQ node of the test's own: free AMQP and distribution ports, its own data,
    logs and Erlang cookie under ``directory``, and the given ``consumer_timeout``."""

    def __init__(self, directory: Path, *, consumer_timeout_ms: int, tick_interval_ms: int = 500) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"rh{uuid.uuid4().hex[:10]}@localhost"
        self.consumer_timeout_ms = consumer_timeout_ms
        self.process: subprocess.Popen[bytes] | None = None
        (directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            f"consumer_timeout = {consumer_timeout_ms}\n"
            "log.file.level = info\n"
        )
        # channel_tick_interval has no rabbitmq.conf key; advanced.config sets it.
        (directory / "advanced.config").write_text(
            f"[{{rabbit, [{{channel_tick_interval, {tick_interval_ms}}}]}}].\n"
        )
        (directory / "enabled_plugins").write_text("[].\n")
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin:/usr/sbin"),
            "HOME": str(directory),  # the Erlang cookie lives here, not in root's home
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(directory / "log"),
            "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(directory / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(directory / "rabbitmq.pid"),
            # Not the machine's rabbitmq-env.conf: it names the machine's own node.
            "RABBITMQ_CONF_ENV_FILE": str(directory / "rabbitmq-env.conf"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout_s: float = 90) -> RabbitNode:
        with open(self.directory / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [str(RABBITMQ_HOME / "rabbitmq-server")], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not _port_open(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.directory / "server.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"RabbitMQ node {self.node} did not start:\n{tail}")
            time.sleep(0.2)
        return self

    def ctl(self, *args: str) -> str:
        run = subprocess.run(
            [str(RABBITMQ_HOME / "rabbitmqctl"), "-q", "-n", self.node, *args],
            env=self.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if run.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {run.stdout}{run.stderr}")
        return run.stdout

    def queues(self) -> dict[str, tuple[int, int]]:
        return _queues(self.ctl("list_queues", *_QUEUE_COLUMNS))

    def set_consumer_timeout(self, timeout_ms: int) -> None:
        """For channels opened from now on (a channel reads it when it opens)."""
        self.ctl("eval", f"application:set_env(rabbit, consumer_timeout, {int(timeout_ms)}).")

    def log(self) -> str:
        logs = sorted((self.directory / "log").glob("*.log"))
        return "".join(path.read_text(errors="replace") for path in logs)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.ctl("stop")
                self.process.wait(timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired):
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=10)
        self.process = None
