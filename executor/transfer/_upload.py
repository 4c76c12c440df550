"""``upload``: a file sent by HTTP ``PUT`` in blocks, abortable between them, or copied
atomically to a ``file://`` URL or a path (:mod:`._local`)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import IO

from executor.errors import UploadFailed, describe, map_exceptions
from executor.transfer._cancel import SEND_BLOCK_BYTES, Cancel, thread_session, tracking
from executor.transfer._config import TransferConfig
from executor.transfer._http import check_status, run_attempts
from executor.transfer._local import upload_local
from executor.transfer._urls import locate, redact_url


def upload(path: str, url: str, *, config: TransferConfig, abort: threading.Event | None = None) -> int:
    """PUT the file at ``path`` to ``url``, or copy it atomically to a file:// URL or path.

    Returns the bytes sent; raises ``UploadFailed`` when retries are spent, ``Stopped``.
    """
    kind, location = locate(url)
    with Cancel(abort, url) as cancel:
        if kind == "local":
            return upload_local(path, location, config, cancel)
        return _upload_http(path, url, config, cancel)


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
    safe_url = redact_url(url)
    unreadable = {
        OSError: lambda exc: UploadFailed(f"upload to {safe_url} failed: {describe(exc)}", {"url": safe_url})
    }
    with map_exceptions(unreadable):
        size_bytes = os.path.getsize(path)
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
