"""``upload``: a file sent by HTTP ``PUT`` in blocks, abortable between them, or copied
atomically to a ``file://`` URL under a file root (:mod:`._local`)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import IO

from executor.errors import UploadFailed, describe, map_exceptions
from executor.transfer._cancel import Cancel, tracking
from executor.transfer._config import TransferConfig
from executor.transfer._http import check_status, run_attempts, send
from executor.transfer._local import upload_local
from executor.transfer._policy import FilePath
from executor.transfer._session import SEND_BLOCK_BYTES, thread_session
from executor.urls import Url


def upload(path: str, url: str | Url, *, config: TransferConfig, abort: threading.Event | None = None) -> int:
    """PUT the file at ``path`` to ``url``, or copy it atomically to a file:// URL under a root.

    Returns the bytes sent; raises ``InvalidRequest`` for a URL the policy refuses (nothing
    is written), ``UploadFailed`` when retries are spent or the address is refused, ``Stopped``.
    """
    target = config.policy.target(url)
    with Cancel(abort, url) as cancel:
        if isinstance(target, FilePath):
            return upload_local(path, target, config, cancel)
        return _upload_http(path, target, config, cancel)


def check_url(url: str | Url, *, config: TransferConfig) -> None:
    """Refuse now a URL that :func:`upload` or :func:`fetch` would refuse before connecting
    (another scheme, a plain path, a ``file://`` URL outside the roots): ``InvalidRequest``.

    A round checks its ``delta_url`` with this before it trains, so a refused upload never
    costs a round's work. Addresses are still checked at connect time, on every hop.
    """
    config.policy.target(url)


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


def _upload_http(path: str, url: Url, config: TransferConfig, cancel: Cancel) -> int:
    unreadable = {
        OSError: lambda exc: UploadFailed(f"upload to {url} failed: {describe(exc)}", {"url": str(url)})
    }
    with map_exceptions(unreadable):
        size_bytes = os.path.getsize(path)
    session = thread_session()

    def attempt(_: int) -> None:
        with contextlib.ExitStack() as sources:

            def body() -> _UploadBody:  # afresh for each redirect hop
                return _UploadBody(sources.enter_context(open(path, "rb")), size_bytes, cancel)

            response = send(
                session,
                "PUT",
                url,
                policy=config.policy,
                timeout=config.timeout,
                headers={"Content-Type": "application/octet-stream"},
                body=body,
            )
        with contextlib.closing(response):
            check_status(response, body=False)
            response.content  # noqa: B018 - drain the small body so the connection is reused

    with tracking(cancel.registry):
        run_attempts(attempt, url=url, config=config, cancel=cancel, verb="upload", failure=UploadFailed)
    return size_bytes
