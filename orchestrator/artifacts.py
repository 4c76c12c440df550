"""Artifact serving for the reference orchestrator: a directory over HTTP, with signed URLs.

Workers only ever see URLs. :class:`ArtifactServer` serves a directory the way an object
store serves presigned URLs: GET and HEAD with single ``Range`` requests, ``ETag`` and
``If-Range`` (so downloads resume), and PUT written atomically (result deltas). Each URL
carries an expiry and an HMAC of the method, the path and the expiry; a wrong or expired
signature is refused with 403, like a presigned S3 URL. A PUT is capped before its body is
read: a Content-Length over ``max_put_bytes`` (what the largest delta of the run's model can
take, once the orchestrator knows the model) is refused with 413, so a leaked PUT URL fills
no disk. For a real object store (MinIO, S3) see :mod:`orchestrator.s3`. :class:`ArtifactStore`
is what the orchestrator needs of either.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import hmac
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, unquote, urlsplit

from executor.delta import DEFAULT_MAX_DELTA_BYTES, zstd_bound

CHUNK_BYTES = 4 * 1024 * 1024
# What a PUT may carry until the orchestrator narrows it to its model: the compressed size of the
# largest delta a worker reads by default (a delta is the only thing workers upload).
DEFAULT_MAX_PUT_BYTES = zstd_bound(DEFAULT_MAX_DELTA_BYTES)


class ArtifactStore(Protocol):
    """Where the orchestrator keeps artifacts; workers only ever see its URLs."""

    def url_get(self, name: str, expires_s: float = ...) -> str: ...

    def url_put(self, name: str, expires_s: float = ...) -> str: ...

    def publish(self, name: str, source: str | os.PathLike[str]) -> str:
        """Store a local file under ``name``; returns a GET URL for workers."""
        ...

    def fetch(self, name: str, dest: str | os.PathLike[str]) -> None:
        """Copy what is stored under ``name`` (a worker's upload) to a local file."""
        ...


def parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """``(start, end_exclusive)``, ``"unsatisfiable"``, or None (no usable single range)."""
    if not header:
        return None
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if not match or not (match.group(1) or match.group(2)):
        return None
    first, last = match.group(1), match.group(2)
    if not first:
        suffix = int(last)
        return (max(0, size - suffix), size) if suffix > 0 and size > 0 else "unsatisfiable"
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if last and int(last) < start:
        return None
    return (start, end) if start < size else "unsatisfiable"


def reply(
    handler: BaseHTTPRequestHandler, code: int, body: bytes = b"", headers: dict[str, str] | None = None
) -> None:
    """A whole small response (a status page, an error)."""
    handler.send_response(code)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if body and handler.command != "HEAD":
        handler.wfile.write(body)


def send_file_head(
    handler: BaseHTTPRequestHandler,
    st: os.stat_result,
    *,
    ignore_range: bool = False,
    length: int | None = None,
) -> tuple[int, int] | None:
    """Answer a GET/HEAD of a file the way an object store does: a single ``Range`` (honoured
    only while ``If-Range`` still names this version of the file) gets 206, none gets 200, an
    unsatisfiable one 416. Sends the status and headers; returns the body's ``(start, end)``,
    or None when the reply is complete. ``ignore_range`` and ``length`` (a Content-Length
    other than the body's) let a test server misbehave."""
    etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
    modified = email.utils.formatdate(st.st_mtime, usegmt=True)
    wanted = parse_range(handler.headers.get("Range"), st.st_size)
    if_range = handler.headers.get("If-Range")
    if ignore_range or (if_range and if_range not in (etag, modified)):
        wanted = None  # the file changed since the client's partial copy: send it whole
    if wanted == "unsatisfiable":
        reply(handler, 416, b"", {"Content-Range": f"bytes */{st.st_size}", "Accept-Ranges": "bytes"})
        return None
    start, end = wanted if isinstance(wanted, tuple) else (0, st.st_size)
    handler.send_response(206 if isinstance(wanted, tuple) else 200)
    handler.send_header("Content-Type", "application/octet-stream")
    handler.send_header("Content-Length", str(end - start if length is None else length))
    handler.send_header("Accept-Ranges", "bytes")
    handler.send_header("ETag", etag)
    handler.send_header("Last-Modified", modified)
    if isinstance(wanted, tuple):
        handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
    handler.end_headers()
    return start, end


def signature(secret: bytes, method: str, path: str, expires: int) -> str:
    return hmac.new(secret, f"{method}\n{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


class ArtifactServer:
    """Serves ``root`` on ``host:port`` (0: a free port) until :meth:`stop`."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        public_host: str | None = None,
        max_put_bytes: int = DEFAULT_MAX_PUT_BYTES,
    ) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.max_put_bytes = max_put_bytes
        os.makedirs(self.root, exist_ok=True)
        self.secret = secrets.token_bytes(32)
        self._httpd = _Server((host, port), _Handler)
        self._httpd.artifacts = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="artifact-server", daemon=True)
        bound_port = self._httpd.server_address[1]
        # The name workers use to reach us (a compose service name, a routable address).
        self.host = public_host or (host if host not in ("0.0.0.0", "") else socket.gethostname())
        self.port = int(bound_port)
        self.base_url = f"http://{self.host}:{self.port}"
        self.requests: list[tuple[str, str]] = []  # (method, path), for the tests and the demo
        # (method, path, client address, body bytes) of every GET and PUT served: what each host
        # moved through the store (bench.sharded's per-host figures)
        self.traffic: list[tuple[str, str, str, int]] = []

    def __enter__(self) -> ArtifactServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ArtifactServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def path(self, name: str) -> Path:
        return Path(self.root) / name

    def _url(self, name: str, method: str, expires_s: float) -> str:
        path = "/" + quote(name.lstrip("/"))
        expires = int(time.time() + expires_s)
        sig = signature(self.secret, method, path, expires)
        return f"{self.base_url}{path}?X-Expires={expires}&X-Signature={sig}"

    def url_get(self, name: str, expires_s: float = 6 * 3600) -> str:
        return self._url(name, "GET", expires_s)

    def url_put(self, name: str, expires_s: float = 6 * 3600) -> str:
        return self._url(name, "PUT", expires_s)

    def fetch(self, name: str, dest: str | os.PathLike[str]) -> None:
        """Copy a stored file out (what the workers uploaded)."""
        shutil.copyfile(self.path(name), dest)

    def has_copy(self, name: str, source: str | os.PathLike[str]) -> bool:
        """Whether ``name`` holds a copy of ``source`` published earlier (same size and
        modification time: a copy keeps its source's), so that a restarted orchestrator
        need not copy its shards again."""
        try:
            old, src = os.stat(self.path(name)), os.stat(source)
        except FileNotFoundError:
            return False
        return (old.st_size, old.st_mtime_ns) == (src.st_size, src.st_mtime_ns)

    def publish(self, name: str, source: str | os.PathLike[str]) -> str:
        """Put a file in (atomically) and return its GET URL.

        A hard link where ``source`` is on the store's file system (the orchestrator's scratch
        and checkpoint files are: a model-sized copy a round less, bench.goodput "publish"),
        else a copy. A link is safe because every writer of those files replaces them whole
        (``atomic_writer``: a new inode), never in place: what is published never changes.
        """
        target = self.path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".publish.{secrets.token_hex(8)}.tmp"
        try:
            try:
                os.link(source, tmp)
            except OSError:  # another file system, or links refused: copy
                src = os.stat(source)
                shutil.copyfile(source, tmp)
                os.utime(tmp, ns=(src.st_atime_ns, src.st_mtime_ns))
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return self.url_get(name)

    def authorized(self, method: str, raw_path: str, query: str) -> bool:
        values = parse_qs(query)
        try:
            expires = int(values["X-Expires"][0])
            given = values["X-Signature"][0]
        except (KeyError, ValueError, IndexError):
            return False
        wanted = signature(self.secret, "GET" if method == "HEAD" else method, raw_path, expires)
        return expires >= time.time() and hmac.compare_digest(given, wanted)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    artifacts: ArtifactServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that abort downloads are normal


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the URLs carry signatures: no request lines in logs

    def _route(self, method: str) -> str | None:
        parts = urlsplit(self.path)
        store = self.server.artifacts
        store.requests.append((method, unquote(parts.path)))
        if not store.authorized(method, parts.path, parts.query):
            self._reply(403, b"bad or expired signature\n")
            return None
        path = os.path.realpath(os.path.join(store.root, unquote(parts.path).lstrip("/")))
        if not path.startswith(store.root + os.sep):
            self._reply(403, b"outside the store\n")
            return None
        return path

    def _reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        reply(self, code, body, headers)

    def _account(self, method: str, nbytes: int) -> None:
        self.server.artifacts.traffic.append(
            (method, unquote(urlsplit(self.path).path), str(self.client_address[0]), nbytes)
        )

    def do_GET(self) -> None:
        self._get(head=False)

    def do_HEAD(self) -> None:
        self._get(head=True)

    def _get(self, head: bool) -> None:
        path = self._route(self.command)
        if path is None:
            return
        if not os.path.isfile(path):
            self._reply(404, b"not found\n")
            return
        with open(path, "rb") as file:
            span = send_file_head(self, os.fstat(file.fileno()))
            if span is None:
                return
            offset, end = span
            sent = 0 if head else end - offset
            while not head and offset < end:
                offset += self.connection.sendfile(file, offset, min(CHUNK_BYTES, end - offset))
            self._account("GET", sent)

    def do_PUT(self) -> None:
        path = self._route("PUT")
        if path is None:
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._reply(411, b"Content-Length required\n")
            return
        if int(length) > self.server.artifacts.max_put_bytes:
            self.close_connection = True  # the body is never read
            self._reply(413, b"upload is over the store's cap\n")
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".upload.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                remaining = int(length)
                while remaining:
                    chunk = self.rfile.read(min(CHUNK_BYTES, remaining))
                    if not chunk:
                        raise ConnectionError("upload ended early")
                    out.write(chunk)
                    remaining -= len(chunk)
            os.replace(tmp, path)
            self._account("PUT", int(length))
        except OSError:
            self.close_connection = True
            return
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._reply(201)
