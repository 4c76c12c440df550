"""A throwaway nginx serving one directory on a loopback port, for the download benchmark.

nginx is what users put in front of model files; it serves from the page cache with
``sendfile``, so it is never the bottleneck being measured. Its access log records the
bytes sent per request, which is how the resume benchmark counts bytes fetched twice.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

CONFIG = """
daemon off;
master_process on;
worker_processes 2;
user root;
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 256; }}
http {{
    sendfile on;
    tcp_nopush on;
    keepalive_requests 10000;
    types {{ }}
    default_type application/octet-stream;
    client_body_temp_path {state}/body;
    proxy_temp_path {state}/proxy;
    fastcgi_temp_path {state}/fastcgi;
    uwsgi_temp_path {state}/uwsgi;
    scgi_temp_path {state}/scgi;
    log_format sent '$request_uri $status $bytes_sent';
    access_log {state}/access.log sent;
    server {{
        listen {address}:{port};
        root {root};
        {limit}
        location /slow/ {{
            alias {root}/;
            limit_rate {slow_rate};
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Nginx:
    """``with Nginx(binary, root, state) as server: server.url("file")``."""

    def __init__(
        self,
        binary: str,
        root: Path,
        state: Path,
        slow_rate: str = "8m",
        *,
        address: str = "127.0.0.1",
        rate: str | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """``rate``: nginx's ``limit_rate`` on every response (an object store's per-connection
        cap); ``prefix``: what nginx runs under (``ip netns exec NAME``: inside a namespace)."""
        self.binary = binary
        self.address = address
        self.prefix = prefix
        self.root = root.resolve()  # nginx reads relative paths against its own prefix
        self.state = state.resolve()
        state = self.state
        self.port = free_port()
        self.config = state / "nginx.conf"
        state.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            CONFIG.format(
                state=state,
                port=self.port,
                root=self.root,
                slow_rate=slow_rate,
                address=address,
                limit=f"limit_rate {rate};" if rate else "",
            )
        )
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, name: str, slow: bool = False) -> str:
        return f"http://{self.address}:{self.port}/{'slow/' if slow else ''}{name}"

    def start(self) -> None:
        # -e: the error log before the config is read (Debian's default is not writable for all)
        self.process = subprocess.Popen(
            [
                *self.prefix,
                *[self.binary, "-e", str(self.state / "error.log"), "-p", str(self.state)],
                *["-c", str(self.config)],
            ],
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.address, self.port), timeout=0.2).close()
                return
            except OSError:
                if self.process.poll() is not None:
                    _, stderr = self.process.communicate()
                    raise RuntimeError(f"nginx exited: {stderr.decode(errors='replace')}") from None
                time.sleep(0.02)
        raise RuntimeError("nginx did not start listening")

    def stop(self) -> None:
        """Fast shutdown (SIGTERM): open connections are dropped mid-body."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)
        self.process = None

    def bytes_sent(self) -> int:
        """Bytes sent (headers and bodies) over all requests logged so far."""
        log = self.state / "access.log"
        if not log.exists():
            return 0
        return sum(int(line.rsplit(" ", 1)[1]) for line in log.read_text().splitlines() if line.strip())

    def reset_log(self) -> None:
        log = self.state / "access.log"
        if log.exists():
            # nginx keeps its descriptor; truncating keeps appends landing at the start.
            os.truncate(log, 0)

    def __enter__(self) -> Nginx:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
