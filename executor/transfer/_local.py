"""Transfers that stay on this machine: a ``file://`` URL copied into the partial file, an
upload copied atomically to a ``file://`` URL, and the sha256 of a finished file. All go
through one copy loop that reuses one buffer and checks for an abort between buffers.

Both ends are :class:`~._policy.FilePath` values the policy accepted, opened below their
root without following links; an upload's temp file and rename stay in the directory
descriptor so opened (a link where the file goes is replaced, never followed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from executor.errors import DownloadFailed, UploadFailed, describe, map_exceptions
from executor.transfer._body import pwrite_all
from executor.transfer._cancel import Cancel
from executor.transfer._config import TransferConfig
from executor.transfer._limits import Limits
from executor.transfer._partial import ProgressMeter, discard, partial_paths
from executor.transfer._policy import FilePath


class _Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def _copy_stream(
    source: _Readable,
    fd: int | None,
    buffer: memoryview,
    cancel: Cancel,
    on_written: Callable[[int], None],
    digest: Any = None,
    end: int | None = None,
) -> int:
    """Copy ``source`` to ``fd`` (None: only hash) up to ``end`` bytes (None: EOF), checking
    for an abort between buffers."""
    pos = 0
    while end is None or pos < end:
        cancel.check()
        count = source.readinto(buffer if end is None else buffer[: min(len(buffer), end - pos)])
        if not count:
            break
        chunk = buffer[:count]
        if fd is not None:
            pwrite_all(fd, chunk, pos)
        if digest is not None:
            digest.update(chunk)
        pos += count
        on_written(count)
    return pos


def hash_file(path: str, config: TransferConfig, cancel: Cancel) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as source:
        _copy_stream(source, None, memoryview(bytearray(config.buffer_bytes)), cancel, lambda _: None, digest)
    return digest.hexdigest()


def local_size(source: FilePath) -> int:
    url = source.url
    unknown = {OSError: lambda exc: DownloadFailed(f"size of {url}: {describe(exc)}", {"url": str(url)})}
    with map_exceptions(unknown):
        fd = source.open_read()
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)


def copy_local(
    source: FilePath,
    dest: str,
    config: TransferConfig,
    cancel: Cancel,
    meter: ProgressMeter,
    limits: Limits,
    hashed: bool,
) -> str | None:
    """Copy (never link or rename: the source stays the caller's) into the partial file."""
    partial, sidecar_path = partial_paths(dest)
    discard(sidecar_path)
    digest = hashlib.sha256() if hashed else None
    url = source.url
    failed = {
        OSError: lambda exc: DownloadFailed(
            f"copy of {url} failed: {describe(exc)}",
            {"url": str(url), "host": "", "status": None, "attempts": 1},
        )
    }
    # A full disk is the destination's, not the source's: StorageFull names the directory.
    with map_exceptions(failed, where=os.path.dirname(os.path.abspath(partial))):
        with open(source.open_read(), "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            limits.announced(size, "the file holds")
            meter.reset(0, size)

            def written(count: int) -> None:
                meter.add(count)
                limits.add(count)

            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                buffer = memoryview(bytearray(config.buffer_bytes))
                # The size it had when opened, like a Content-Length; none (procfs): capped.
                end = size if size > 0 else limits.copy_end(None)
                copied = _copy_stream(file, fd, buffer, cancel, written, digest, end)
            finally:
                os.close(fd)
        limits.written(copied)
    return digest.hexdigest() if digest is not None else None


def upload_local(path: str, dest: FilePath, config: TransferConfig, cancel: Cancel) -> int:
    url = dest.url
    failed = {
        OSError: lambda exc: UploadFailed(f"upload to {url} failed: {describe(exc)}", {"url": str(url)})
    }
    with map_exceptions(failed):
        dir_fd = dest.open_parent(create=True)
        tmp_name = f".{dest.name}.{secrets.token_hex(6)}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp_name, flags, 0o644, dir_fd=dir_fd)
            try:
                os.fchmod(fd, 0o644)  # whatever the umask: the result is for its reader
                with open(path, "rb", buffering=0) as source:
                    buffer = memoryview(bytearray(config.buffer_bytes))
                    sent_bytes = _copy_stream(source, fd, buffer, cancel, lambda _: None)
            finally:
                os.close(fd)
            os.replace(tmp_name, dest.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return sent_bytes
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name, dir_fd=dir_fd)
            os.close(dir_fd)
