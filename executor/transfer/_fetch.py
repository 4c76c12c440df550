"""Downloads and uploads by URL: HTTP(S) GET/PUT, ``file://`` and plain paths.

A download only ever appears under its final name complete and verified::

    fetch(url, dest) ──▶ dest.partial (+ dest.partial.json: what it holds, how far)
                     ──▶ size and sha256 checked ──▶ os.replace ──▶ dest

The partial names are stable so that a later process resumes what a crashed one
left (callers guarantee one writer per ``dest``). Failed attempts are retried with
a ``Range`` resume; large files on range-capable servers come down over several
connections. An abort is noticed between buffer reads, and a
:class:`~executor.stopping.StopSignal` also shuts the sockets down, so a read blocked
on a stalled server returns at once. URLs reach messages and logs only through
:func:`redact_url`: presigned query strings are credentials.

This module is the public face; the parts behind it are :mod:`executor.httpio`
(sessions, abort, retries), :mod:`executor.partial` (partial file, sidecar, progress),
:mod:`executor.stream` (one sequential GET) and :mod:`executor.ranged` (parallel GETs).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

from executor.errors import (
    NO_SPACE_ERRNOS,
    DownloadFailed,
    HashMismatch,
    InvalidRequest,
    UploadFailed,
    storage_full,
)
from executor.transfer._body import pwrite_all
from executor.transfer._http import (
    SEND_BLOCK_BYTES,
    Cancel,
    announced_total,
    check_status,
    describe,
    redact_url,
    request_headers,
    run_attempts,
    thread_session,
    track_response,
    tracking,
    unsatisfied_total,
    url_host,
)
from executor.transfer._partial import ProgressMeter, discard, partial_paths
from executor.transfer._stream import download

if TYPE_CHECKING:
    from settings import Settings

__all__ = [
    "FetchResult",
    "Progress",
    "TransferConfig",
    "fetch",
    "partial_paths",
    "redact_url",
    "remote_size",
    "upload",
]

logger = logging.getLogger(__name__)

# What a transfer reports as it goes: (bytes done, total bytes or None when unknown).
Progress = Callable[[int, int | None], None]


@dataclass(frozen=True)
class TransferConfig:
    """How transfers behave; built from :class:`~settings.Settings` (``from_settings``), the one
    place where the values and their defaults are written down."""

    retries: int  # attempts per transfer (and per parallel segment)
    backoff_s: float  # sleep backoff_s * attempt between attempts
    connect_timeout_s: float
    read_timeout_s: float  # a read stalled longer than this fails the attempt
    # Files are copied and hashed through one reused buffer of this size; network reads take
    # at most this much per call, into the same kind of buffer (body.body_reader).
    buffer_bytes: int
    parallel_min_bytes: int
    parallel_connections: int
    # Split only when the first connection ran slower than this over its first 16 MiB
    # (stream.PROBE_BYTES); 0: always split.
    parallel_below_bytes_s: int
    # A server that trickles below this rate for this long fails the attempt (slow loris).
    low_speed_bytes_s: int
    low_speed_time_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> TransferConfig:
        return cls(
            retries=settings.download_retries,
            backoff_s=settings.download_backoff_s,
            connect_timeout_s=settings.connect_timeout_s,
            read_timeout_s=settings.read_timeout_s,
            buffer_bytes=settings.download_buffer_bytes,
            parallel_min_bytes=settings.parallel_min_bytes,
            parallel_connections=settings.parallel_connections,
            parallel_below_bytes_s=settings.parallel_below_bytes_s,
            low_speed_bytes_s=settings.download_low_speed_bytes_s,
            low_speed_time_s=settings.download_low_speed_time_s,
        )

    @property
    def timeout(self) -> tuple[float, float]:
        return (self.connect_timeout_s, self.read_timeout_s)


@dataclass(frozen=True)
class FetchResult:
    bytes: int
    seconds: float
    resumed_bytes: int  # already on disk from an earlier attempt or process
    connections: int  # HTTP streams used; 0 for a local copy
    sha256: str | None  # hex digest, only when it was checked

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "seconds": self.seconds,
            "resumed_bytes": self.resumed_bytes,
            "connections": self.connections,
            "sha256": self.sha256,
        }


def fetch(
    url: str,
    dest: str,
    *,
    config: TransferConfig,
    abort: threading.Event | None = None,
    sha256: str | None = None,
    size: int | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> FetchResult:
    """Download ``url`` (http(s)://, file:// or a path) to ``dest``, verified, atomically.

    Raises ``DownloadFailed`` (partial kept for a later resume), ``HashMismatch``
    (partial removed), ``Stopped`` when ``abort`` is set, ``InvalidRequest`` for an
    unsupported URL scheme.
    """
    started = time.monotonic()
    kind, location = _locate(url)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    meter = ProgressMeter(progress)
    digest: str | None = None
    try:
        with Cancel(abort, url) as cancel:
            if kind == "local":
                resumed_bytes, connections = 0, 0
                digest = _copy_local(location, dest, config, cancel, meter, hashed=sha256 is not None)
            else:
                resumed_bytes, connections, digest = download(
                    url, dest, config, cancel, meter, size, hashed=sha256 is not None
                )
            total_bytes, checked = _commit(url, dest, size, sha256, digest, config, cancel)
    except OSError as exc:
        if exc.errno not in NO_SPACE_ERRNOS:
            raise
        # A full disk: free what the attempt took (nothing half-written stays) and say where.
        discard(*partial_paths(dest))
        raise storage_full(exc, os.path.dirname(os.path.abspath(dest))) from None
    meter.finish()
    return FetchResult(total_bytes, time.monotonic() - started, resumed_bytes, connections, checked)


def upload(path: str, url: str, *, config: TransferConfig, abort: threading.Event | None = None) -> int:
    """PUT the file at ``path`` to ``url``, or copy it atomically to a file:// URL or path.

    Returns the bytes sent; raises ``UploadFailed`` when retries are spent, ``Stopped``.
    """
    kind, location = _locate(url)
    with Cancel(abort, url) as cancel:
        if kind == "local":
            return _upload_local(path, location, config, cancel)
        return _upload_http(path, url, config, cancel)


def remote_size(url: str, *, config: TransferConfig, abort: threading.Event | None = None) -> int | None:
    """The size of ``url`` in bytes, or None when the server does not say (chunked, no ranges).

    Asks with ``GET`` + ``Range: bytes=0-0`` rather than HEAD: a presigned URL is
    signed for one method, and GET is the one a download URL allows.
    """
    kind, location = _locate(url)
    if kind == "local":
        try:
            return os.path.getsize(location)
        except OSError as exc:
            safe_url = redact_url(location)
            raise DownloadFailed(f"size of {safe_url}: {describe(exc)}", {"url": safe_url}) from None
    session = thread_session()

    def attempt(_: int) -> int | None:
        response = session.get(url, headers=request_headers(0, 0), stream=True, timeout=config.timeout)
        with contextlib.closing(response):
            track_response(response)
            if response.status_code == 416:  # an empty file has no byte 0
                return unsatisfied_total(response)
            check_status(response)
            return announced_total(response)

    with Cancel(abort, url) as cancel, tracking(cancel.registry):
        return run_attempts(attempt, url=url, config=config, cancel=cancel, verb="size check")


def _locate(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        return "http", url
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequest(f"file URL with a remote host: {redact_url(url)}")
        return "local", unquote(parts.path)
    if "://" in url:
        raise InvalidRequest(f"unsupported URL scheme {parts.scheme!r}: {redact_url(url)}")
    return "local", url


def _commit(
    url: str,
    dest: str,
    size: int | None,
    sha256: str | None,
    digest: str | None,
    config: TransferConfig,
    cancel: Cancel,
) -> tuple[int, str | None]:
    """Check the finished partial file, then move it into place; returns (bytes, checked sha256)."""
    partial, sidecar_path = partial_paths(dest)
    total_bytes = os.path.getsize(partial)
    safe_url = redact_url(url)
    if size is not None and total_bytes != size:
        discard(partial, sidecar_path)
        raise DownloadFailed(
            f"download of {safe_url} has {total_bytes} bytes, expected {size}",
            {"url": safe_url, "host": url_host(url), "status": None, "bytes": total_bytes, "expected": size},
        )
    checked = None
    if sha256 is not None:
        expected = sha256.strip().lower().removeprefix("sha256:")
        actual = digest if digest is not None else _hash_file(partial, config, cancel)
        if actual != expected:
            discard(partial, sidecar_path)
            raise HashMismatch(
                f"sha256 of {safe_url} does not match",
                {"url": safe_url, "expected": expected, "actual": actual},
            )
        checked = actual
    os.replace(partial, dest)
    discard(sidecar_path)
    return total_bytes, checked


# -------------------------------------------------------------- local files, hashing


class _Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def _copy_stream(
    source: _Readable,
    fd: int | None,
    buffer: memoryview,
    cancel: Cancel,
    on_written: Callable[[int], None],
    digest: Any = None,
) -> int:
    """Copy ``source`` to ``fd`` (None: only hash), checking for an abort between buffers."""
    pos = 0
    while True:
        cancel.check()
        count = source.readinto(buffer)
        if not count:
            return pos
        chunk = buffer[:count]
        if fd is not None:
            pwrite_all(fd, chunk, pos)
        if digest is not None:
            digest.update(chunk)
        pos += count
        on_written(count)


def _hash_file(path: str, config: TransferConfig, cancel: Cancel) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as source:
        _copy_stream(source, None, memoryview(bytearray(config.buffer_bytes)), cancel, lambda _: None, digest)
    return digest.hexdigest()


def _copy_local(
    source_path: str, dest: str, config: TransferConfig, cancel: Cancel, meter: ProgressMeter, hashed: bool
) -> str | None:
    """Copy (never link or rename: the source stays the caller's) into the partial file."""
    partial, sidecar_path = partial_paths(dest)
    discard(sidecar_path)
    digest = hashlib.sha256() if hashed else None
    try:
        with open(source_path, "rb", buffering=0) as source:
            meter.reset(0, os.fstat(source.fileno()).st_size)
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                buffer = memoryview(bytearray(config.buffer_bytes))
                _copy_stream(source, fd, buffer, cancel, meter.add, digest)
            finally:
                os.close(fd)
    except OSError as exc:
        raise DownloadFailed(
            f"copy of {redact_url(source_path)} failed: {describe(exc)}",
            {"url": redact_url(source_path), "host": "", "status": None, "attempts": 1},
        ) from None
    return digest.hexdigest() if digest is not None else None


# ------------------------------------------------------------------------- upload


class _UploadBody:
    """A file body for requests: sent in blocks (never loaded whole), abortable between them."""

    def __init__(self, source: IO[bytes], size_bytes: int, cancel: Cancel) -> None:
        self._source = source
        self._size_bytes = size_bytes
        self._cancel = cancel

    def __len__(self) -> int:  # requests derives Content-Length from it
        return self._size_bytes

    def read(self, count: int = -1) -> bytes:
        self._cancel.check()
        return self._source.read(count if count > 0 else SEND_BLOCK_BYTES)


def _upload_http(path: str, url: str, config: TransferConfig, cancel: Cancel) -> int:
    try:
        size_bytes = os.path.getsize(path)
    except OSError as exc:
        raise UploadFailed(
            f"upload to {redact_url(url)} failed: {describe(exc)}", {"url": redact_url(url)}
        ) from None
    session = thread_session()

    def attempt(_: int) -> None:
        with open(path, "rb") as source:
            response = session.put(
                url,
                data=_UploadBody(source, size_bytes, cancel),
                headers={"Content-Type": "application/octet-stream"},
                timeout=config.timeout,
            )
        with contextlib.closing(response):
            check_status(response, body=False)
            response.content  # noqa: B018 - drain the small body so the connection is reused

    with tracking(cancel.registry):
        run_attempts(attempt, url=url, config=config, cancel=cancel, verb="upload", failure=UploadFailed)
    return size_bytes


def _upload_local(path: str, dest: str, config: TransferConfig, cancel: Cancel) -> int:
    directory = os.path.dirname(os.path.abspath(dest))
    tmp_path = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(dest)}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the result from the reader
            with open(path, "rb", buffering=0) as source:
                buffer = memoryview(bytearray(config.buffer_bytes))
                sent_bytes = _copy_stream(source, fd, buffer, cancel, lambda _: None)
        finally:
            os.close(fd)
        os.replace(tmp_path, dest)
        return sent_bytes
    except OSError as exc:
        raise UploadFailed(f"upload to {dest} failed: {describe(exc)}", {"url": redact_url(dest)}) from None
    finally:
        if tmp_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)
