"""A Redis as deployed off loopback (DESIGN §11): TLS only, ACL users from ``tasks.trust.acl``.

It needs a ``redis-server`` with TLS and ACL selectors (Redis 7: Debian's; ``make test``
installs it). The server certificate is the session's development one (tests/conftest.py),
so every process of the suite, which trusts that CA, can connect. Users: one
``worker-<host>`` per host, ``orchestrator``, ``admin`` (the test's own eyes: ``ACL LOG``).
"""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import redis

from orchestrator.local import free_port
from settings.config import with_tls_ca
from tasks.embedded_redis import tls_binary, tls_flags
from tasks.trust.acl import acl_file
from tasks.trust.keys import DevKeys

__all__ = ["SecureRedis", "tls_binary"]


class SecureRedis:
    def __init__(self, directory: Path, keys: DevKeys, hosts: tuple[str, ...]) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keys = keys
        self.hosts = hosts
        self.port = free_port()
        users = [f"worker-{host}" for host in hosts] + ["orchestrator", "admin"]
        self.passwords = {user: secrets.token_urlsafe(16) for user in users}
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, user: str, *, db: int = 0) -> str:
        return f"rediss://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/{db}"

    def client(self, user: str, **options: object) -> redis.Redis:
        return redis.Redis.from_url(with_tls_ca(self.url(user), str(self.keys.ca_cert)), **options)  # type: ignore[arg-type]

    def start(self) -> SecureRedis:
        binary = tls_binary()
        assert binary is not None, "no redis-server with TLS"
        acl = self.directory / "users.acl"
        acl.write_text(acl_file(dict(self.passwords), list(self.hosts)), encoding="utf-8")
        argv = [
            binary, "--port", "0", "--tls-port", str(self.port), *tls_flags(self.keys),
            "--bind", "127.0.0.1", "--dir", str(self.directory), "--save", "", "--appendonly", "no",
            "--aclfile", str(acl), "--maxmemory-policy", "noeviction",
            # Allowed by the server, so that only the ACL stands between a worker and DEBUG.
            "--enable-debug-command", "yes",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        admin = self.client("admin", socket_connect_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:
            try:
                admin.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the secure redis-server did not start:\n{log}") from None
                time.sleep(0.05)

    def acl_log(self) -> list[dict[str, object]]:
        """Every command the ACL refused since the last reset (users, commands, keys)."""
        entries = self.client("admin").execute_command("ACL", "LOG", "128")
        return [_entry(entry) for entry in entries]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None


def _entry(entry: object) -> dict[str, object]:
    if isinstance(entry, dict):
        return {_text(k): _text(v) for k, v in entry.items()}
    items = list(entry)  # type: ignore[call-overload]
    return {_text(items[i]): _text(items[i + 1]) for i in range(0, len(items), 2)}


def _text(value: object) -> object:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
