"""Transfers that stay on this machine: a ``file://`` URL or a plain path copied into the
partial file, an upload copied atomically to a local path, and the sha256 of a finished
file. All go through one copy loop that reuses one buffer and checks for an abort between
buffers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from typing import Any, Protocol

from executor.errors import DownloadFailed, UploadFailed, describe, map_exceptions
from executor.transfer._body import pwrite_all
from executor.transfer._cancel import Cancel
from executor.transfer._config import TransferConfig
from executor.transfer._partial import ProgressMeter, discard, partial_paths
from executor.transfer._urls import redact_url


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


def hash_file(path: str, config: TransferConfig, cancel: Cancel) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as source:
        _copy_stream(source, None, memoryview(bytearray(config.buffer_bytes)), cancel, lambda _: None, digest)
    return digest.hexdigest()


def copy_local(
    source_path: str, dest: str, config: TransferConfig, cancel: Cancel, meter: ProgressMeter, hashed: bool
) -> str | None:
    """Copy (never link or rename: the source stays the caller's) into the partial file."""
    partial, sidecar_path = partial_paths(dest)
    discard(sidecar_path)
    digest = hashlib.sha256() if hashed else None
    safe_url = redact_url(source_path)
    failed = {
        OSError: lambda exc: DownloadFailed(
            f"copy of {safe_url} failed: {describe(exc)}",
            {"url": safe_url, "host": "", "status": None, "attempts": 1},
        )
    }
    # A full disk is the destination's, not the source's: StorageFull names the directory.
    translated = map_exceptions(failed, where=os.path.dirname(os.path.abspath(partial)))
    with translated, open(source_path, "rb", buffering=0) as source:
        meter.reset(0, os.fstat(source.fileno()).st_size)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            buffer = memoryview(bytearray(config.buffer_bytes))
            _copy_stream(source, fd, buffer, cancel, meter.add, digest)
        finally:
            os.close(fd)
    return digest.hexdigest() if digest is not None else None


def upload_local(path: str, dest: str, config: TransferConfig, cancel: Cancel) -> int:
    directory = os.path.dirname(os.path.abspath(dest))
    tmp_path = None
    failed = {
        OSError: lambda exc: UploadFailed(
            f"upload to {dest} failed: {describe(exc)}", {"url": redact_url(dest)}
        )
    }
    try:
        with map_exceptions(failed):
            os.makedirs(directory, exist_ok=True)
            fd, tmp_path = tempfile.mkstemp(
                dir=directory, prefix=f".{os.path.basename(dest)}.", suffix=".tmp"
            )
            try:
                os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the result from the reader
                with open(path, "rb", buffering=0) as source:
                    buffer = memoryview(bytearray(config.buffer_bytes))
                    sent_bytes = _copy_stream(source, fd, buffer, cancel, lambda _: None)
            finally:
                os.close(fd)
            os.replace(tmp_path, dest)
            return sent_bytes
    finally:
        if tmp_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)
