"""A real HTTP/1.1 file server with fault injection, for transfer tests.

Serves the files under ``root`` (GET/HEAD with single ranges, ETag, Last-Modified,
If-Range; PUT writes atomically into ``root``) on a real TCP port, so that the test
process and any subprocess it spawns can talk to it. Faults apply to the next
``times`` matching requests of one path (``times=-1``: forever)::

    with FaultServer(tmp_path) as server:
        server.add_fault("model.bin", "reset", after_bytes=1 << 20)
        fetch(server.url("model.bin", query="X-Amz-Signature=secret"), dest)
        assert server.requests[1].range_start() == 1 << 20

Fault kinds and their options:

- ``status``: answer ``code`` (default 500) with a short body.
- ``reset``: send the headers and ``after_bytes`` of the body (for a PUT: read
  ``after_bytes`` of the request body), wait ``delay_s`` (default 0; lets the client
  read what was sent, since a reset discards unread data), then reset the
  connection (SO_LINGER 0).
- ``truncate``: announce the full Content-Length, send ``after_bytes``, wait
  ``delay_s``, close cleanly.
- ``slow``: send the body in ``chunk_bytes`` pieces with ``delay_s`` between them.
- ``stall``: send ``after_bytes``, then block until ``release_stalls()`` or ``stop()``,
  then close the connection.
- ``ignore_range``: answer 200 with the full body even to a ranged request.
- ``wrong_length``: announce ``length`` as Content-Length, send at most that much, close.
- ``chunked``: send the file with ``Transfer-Encoding: chunked`` (no length announced).
- ``endless``: a chunked body of zeros in ``chunk_bytes`` pieces that never ends (until the
  client goes away or the server stops); the path need not exist.
- ``redirect``: answer ``code`` (default 302) with ``Location: location``, for GET and PUT
  (whose body is read first); the path need not exist.

PUT takes ``redirect``, ``status``, ``reset``, ``slow`` (read the body in ``chunk_bytes`` pieces
with ``delay_s`` between them) and ``stall`` (read ``after_bytes``, then block).

Every fault also takes ``method`` (``None``: any) and ``range_start_min`` (apply only
to ranged requests whose first byte is at least that).

Requests are recorded with their headers and request target, so a test can tell what a
client sent (credentials, an absolute-form target through a proxy): the server also
answers as a forward proxy would, from its own root.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from orchestrator.artifacts import reply, send_file_head

FAULT_KINDS = (
    "status",
    "reset",
    "truncate",
    "slow",
    "stall",
    "ignore_range",
    "wrong_length",
    "chunked",
    "endless",
    "redirect",
)
# Answered whether or not the path exists.
NO_FILE_KINDS = ("endless", "redirect")
SEND_CHUNK_BYTES = 8 * 1024 * 1024
RECV_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str  # relative to the root, without the leading slash
    query: str
    range_header: str | None
    status: int | None  # None until the status line is sent (or when the connection was reset)
    bytes_sent: int  # body bytes sent (GET) or received (PUT) so far
    started: float
    ended: float | None  # None while the request is in flight
    target: str = ""  # the request line's target as sent (absolute-form through a proxy)
    headers: tuple[tuple[str, str], ...] = ()

    def range_start(self) -> int | None:
        """The first byte of a ``bytes=a-[b]`` Range header, else None."""
        return _range_start(self.range_header)

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key.lower() == name.lower()), None)


def _range_start(header: str | None) -> int | None:
    match = re.fullmatch(r"bytes=(\d+)-\d*", (header or "").strip())
    return int(match.group(1)) if match else None


@dataclass
class _Live:
    """A request as it happens; ``FaultServer.requests`` snapshots these."""

    method: str
    path: str
    query: str
    range_header: str | None
    started: float
    status: int | None = None
    bytes_sent: int = 0
    ended: float | None = None
    target: str = ""
    headers: tuple[tuple[str, str], ...] = ()

    def snapshot(self) -> RequestRecord:
        return RequestRecord(
            self.method,
            self.path,
            self.query,
            self.range_header,
            self.status,
            self.bytes_sent,
            self.started,
            self.ended,
            self.target,
            self.headers,
        )


PROBE_RANGE = "bytes=0-0"  # how a client asks for a size and shows its URL works


@dataclass
class _Fault:
    kind: str
    times: int
    method: str | None
    range_start_min: int | None
    options: dict[str, Any] = field(default_factory=dict)
    bodies_only: bool = False  # skip the one-byte ranged GET a cache sends to check a URL

    def matches(self, method: str, range_start: int | None, range_header: str | None = None) -> bool:
        if self.method is not None and self.method.upper() != method:
            return False
        if self.bodies_only and range_header == PROBE_RANGE:
            return False
        return self.range_start_min is None or (
            range_start is not None and range_start >= self.range_start_min
        )


class _StallGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0
        self.entered = 0
        self.stopping = False

    def wait(self) -> None:
        with self._cond:
            self.entered += 1
            generation = self._generation
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._generation != generation or self.stopping)

    def release(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def wait_entered(self, count: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.entered >= count, timeout_s)


class FaultServer:
    """A threaded HTTP/1.1 file server on ``host:port`` (0: any free port)."""

    def __init__(self, root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self._address = (host, port)
        self._lock = threading.Lock()
        self._faults: dict[str, list[_Fault]] = {}
        self._records: list[_Live] = []
        self._connections: set[socket.socket] = set()
        self._stalls = _StallGate()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultServer:
        httpd = _QuietServer(self._address, _Handler)
        httpd.fault_server = self
        self._httpd = httpd
        host, port = httpd.server_address[:2]
        host_text = host if isinstance(host, str) else host.decode()
        self.base_url = f"http://{host_text}:{port}"
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stalls.stop()
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ test API

    def url(self, relpath: str, query: str | None = None) -> str:
        return f"{self.base_url}/{relpath.lstrip('/')}" + (f"?{query}" if query else "")

    def add_fault(
        self,
        relpath: str,
        kind: str,
        *,
        times: int = 1,
        method: str | None = None,
        range_start_min: int | None = None,
        bodies_only: bool = False,
        **options: Any,
    ) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {FAULT_KINDS}")
        fault = _Fault(kind, times, method, range_start_min, dict(options), bodies_only)
        with self._lock:
            self._faults.setdefault(relpath.lstrip("/"), []).append(fault)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request so far in arrival order, in-flight ones included."""
        with self._lock:
            return [live.snapshot() for live in self._records]

    def count(self, relpath: str, method: str = "GET") -> int:
        relpath = relpath.lstrip("/")
        return sum(1 for r in self.requests if r.path == relpath and r.method == method)

    def bodies(self, relpath: str) -> int:
        """GETs of ``relpath`` that asked for its bytes, not the one-byte check of its URL."""
        relpath = relpath.lstrip("/")
        return sum(
            1
            for r in self.requests
            if r.path == relpath and r.method == "GET" and r.range_header != PROBE_RANGE
        )

    def release_stalls(self) -> None:
        self._stalls.release()

    @property
    def stalls_entered(self) -> int:
        """Requests that have entered a stall so far (take it before, then wait for one more)."""
        return self._stalls.entered

    def wait_for_stalls(self, count: int = 1, timeout_s: float = 10.0) -> bool:
        """Wait until ``count`` requests in total have entered a stall."""
        return self._stalls.wait_entered(count, timeout_s)

    # --------------------------------------------------------------- for handlers

    def _take_fault(
        self,
        relpath: str,
        method: str,
        range_start: int | None,
        kinds: tuple[str, ...] = FAULT_KINDS,
        range_header: str | None = None,
    ) -> _Fault | None:
        with self._lock:
            faults = self._faults.get(relpath, [])
            for fault in faults:
                if fault.kind in kinds and fault.matches(method, range_start, range_header):
                    if fault.times > 0:
                        fault.times -= 1
                        if fault.times == 0:
                            faults.remove(fault)
                    return fault
        return None

    def _record(self, live: _Live) -> None:
        with self._lock:
            self._records.append(live)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    fault_server: FaultServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that vanish (resets, killed processes, aborts) are what the tests do.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60  # idle keep-alive connections end eventually
    server: _QuietServer

    # ---------------------------------------------------------------- plumbing

    @property
    def owner(self) -> FaultServer:
        return self.server.fault_server

    def setup(self) -> None:
        super().setup()
        self.owner._track(self.connection, True)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        self.owner._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_response(self, code: int, message: str | None = None) -> None:
        self._live.status = code
        super().send_response(code, message)

    def _handle(self, method: str) -> None:
        parts = urlsplit(self.path)
        relpath = unquote(parts.path).lstrip("/")
        self._live = _Live(method, relpath, parts.query, self.headers.get("Range"), time.time())
        self._live.target = self.path
        self._live.headers = tuple(self.headers.items())
        self.owner._record(self._live)
        try:
            if method == "PUT":
                self._put(relpath)
            else:
                self._get(relpath, head=method == "HEAD")
        except OSError:  # the client went away, or a reset fault closed the socket
            self.close_connection = True
        finally:
            self._live.ended = time.time()

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def _fs_path(self, relpath: str) -> str | None:
        path = os.path.realpath(os.path.join(self.owner.root, relpath))
        return path if path.startswith(self.owner.root + os.sep) else None

    def _simple(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        reply(self, code, body, headers)

    def _reset(self) -> None:
        """Abort the connection with a TCP RST."""
        self.close_connection = True
        sock = self.connection
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # detach + close: the rfile's reference would otherwise keep the socket open.
        os.close(sock.detach())

    # ---------------------------------------------------------------------- GET

    def _get(self, relpath: str, head: bool) -> None:
        range_header = self.headers.get("Range")
        early = self.owner._take_fault(
            relpath, self.command, _range_start(range_header), NO_FILE_KINDS, range_header
        )
        if early is not None and early.kind == "redirect":
            self._redirect(early)
            return
        if early is not None:
            self._send_endless(int(early.options.get("chunk_bytes", 64 * 1024)), head)
            return
        path = self._fs_path(relpath)
        if path is None or not os.path.isfile(path):
            self._simple(404, b"not found\n")
            return
        fault = self.owner._take_fault(
            relpath, self.command, _range_start(range_header), range_header=range_header
        )
        if fault is not None and fault.kind == "status":
            self._simple(int(fault.options.get("code", 500)), b"injected failure\n")
            return
        if fault is not None and fault.kind == "chunked":
            self._send_chunked(path, head)
            return
        with open(path, "rb") as fh:
            span = send_file_head(
                self,
                os.fstat(fh.fileno()),
                ignore_range=fault is not None and fault.kind == "ignore_range",
                length=int(fault.options["length"]) if fault and fault.kind == "wrong_length" else None,
            )
            if span is None:
                return
            start, end = span
            if not head:
                self._send_body(fh, start, end, fault)

    def _send_body(self, fh: Any, start: int, end: int, fault: _Fault | None) -> None:
        kind = fault.kind if fault is not None else None
        options = fault.options if fault is not None else {}
        if kind in ("reset", "truncate", "stall"):
            self._send_range(fh, start, min(end, start + int(options.get("after_bytes", 0))))
            time.sleep(float(options.get("delay_s", 0.0)))
            if kind == "reset":
                self._reset()
                return
            if kind == "stall":
                self.owner._stalls.wait()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_WR)
        elif kind == "slow":
            chunk_bytes = int(options.get("chunk_bytes", 64 * 1024))
            delay_s = float(options.get("delay_s", 0.05))
            for offset in range(start, end, chunk_bytes):
                if offset > start:
                    time.sleep(delay_s)
                self._send_range(fh, offset, min(end, offset + chunk_bytes))
        elif kind == "wrong_length":
            self._send_range(fh, start, min(end, start + int(options["length"])))
            self.close_connection = True
        else:
            self._send_range(fh, start, end)

    def _redirect(self, fault: _Fault) -> None:
        self._simple(int(fault.options.get("code", 302)), b"", {"Location": str(fault.options["location"])})

    def _chunked_head(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _send_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self._live.bytes_sent += len(data)

    def _send_chunked(self, path: str, head: bool) -> None:
        self._chunked_head()
        if head:
            return
        with open(path, "rb") as fh:
            while data := fh.read(RECV_CHUNK_BYTES):
                self._send_chunk(data)
        self.wfile.write(b"0\r\n\r\n")

    def _send_endless(self, chunk_bytes: int, head: bool) -> None:
        self._chunked_head()
        block = bytes(chunk_bytes)
        # Until the client goes away (an OSError ends the request) or the server stops.
        while not head and not self.owner._stalls.stopping:
            self._send_chunk(block)
        self.close_connection = True

    def _send_range(self, fh: Any, start: int, end: int) -> None:
        # socket.sendfile: os.sendfile without a copy through Python, and it copes
        # with the non-blocking descriptor that a socket timeout implies.
        offset = start
        while offset < end:
            sent = self.connection.sendfile(fh, offset, min(SEND_CHUNK_BYTES, end - offset))
            if sent == 0:
                raise ConnectionError("peer closed")
            offset += sent
            self._live.bytes_sent += sent

    # ---------------------------------------------------------------------- PUT

    def _put(self, relpath: str) -> None:
        path = self._fs_path(relpath)
        if path is None:
            self._simple(403, b"outside the root\n")
            return
        fault = self.owner._take_fault(relpath, "PUT", None)
        kind = fault.kind if fault is not None else None
        options = fault.options if fault is not None else {}
        if fault is not None and kind == "redirect":
            self._read_body(None)
            self._redirect(fault)
            return
        if kind in ("reset", "stall"):
            self._read_body(None, limit=int(options.get("after_bytes", 0)))
            time.sleep(float(options.get("delay_s", 0.0)))
            if kind == "stall":
                self.owner._stalls.wait()
                self.close_connection = True
                return
            self._reset()
            return
        if kind == "status":
            self._read_body(None)
            self._simple(int(options.get("code", 500)), b"injected failure\n")
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        existed = os.path.exists(path)
        fd, tmp_path = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".upload.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                if kind == "slow":
                    self._read_body(
                        out,
                        chunk_bytes=int(options.get("chunk_bytes", 64 * 1024)),
                        delay_s=float(options.get("delay_s", 0.05)),
                    )
                else:
                    self._read_body(out)
            os.replace(tmp_path, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)
        self._simple(204 if existed else 201)

    def _read_body(
        self, out: Any, limit: int | None = None, chunk_bytes: int = RECV_CHUNK_BYTES, delay_s: float = 0.0
    ) -> None:
        """Read the request body (Content-Length or chunked) into ``out`` (None: drop it)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._read_chunked(out)
            return
        remaining = int(self.headers.get("Content-Length", "0"))
        if limit is not None:
            remaining = min(remaining, limit)
        while remaining > 0:
            if delay_s and self._live.bytes_sent:
                time.sleep(delay_s)
            data = self.rfile.read(min(chunk_bytes, remaining))
            if not data:
                raise ConnectionError("request body ended early")
            if out is not None:
                out.write(data)
            remaining -= len(data)
            self._live.bytes_sent += len(data)

    def _read_chunked(self, out: Any) -> None:
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return
            data = self.rfile.read(size)
            self.rfile.readline()
            if out is not None:
                out.write(data)
            self._live.bytes_sent += len(data)
