"""``fetch`` and ``remote_size``: a download from the policy's verdict on the URL to the
verified file moved into place (the picture is in the package docstring)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# Module-qualified so that hash_file is looked up at call time: a test replaces it there
# to prove that a followed download is not hashed a second time.
import executor.transfer._local as _local
from executor.errors import DownloadFailed, HashMismatch, StorageFull, map_exceptions
from executor.transfer._cancel import Cancel, track_response, tracking
from executor.transfer._config import DigestFactory, FetchResult, Head, Progress, RemoteInfo, TransferConfig
from executor.transfer._http import (
    Refused,
    announced_total,
    check_status,
    request_headers,
    run_attempts,
    send,
    unsatisfied_total,
)
from executor.transfer._limits import Limits
from executor.transfer._partial import ProgressMeter, discard, partial_paths
from executor.transfer._policy import FilePath
from executor.transfer._session import thread_session
from executor.transfer._stream import download
from executor.urls import Url


def fetch(
    url: str | Url,
    dest: str,
    *,
    config: TransferConfig,
    abort: threading.Event | None = None,
    sha256: str | None = None,
    size: int | None = None,
    max_bytes: int | None = None,
    head: Head | None = None,
    progress: Progress | None = None,
    follow: DigestFactory | None = None,
) -> FetchResult:
    """Download ``url`` (http(s)://, or file:// under a file root) to ``dest``, verified, atomically.

    ``max_bytes`` caps the body: a larger announced size is refused before anything is
    written, a body growing past it once it does; a body of unknown length is capped by
    ``config.max_unknown_bytes`` when neither ``max_bytes`` nor ``size`` is given. ``head``
    is ``(n_bytes, check)``: ``check`` gets the first ``n_bytes`` once they are on disk (all
    of a shorter body at its end) and may raise a RoundhouseError to refuse the download.

    Raises ``InvalidRequest`` for a URL the policy refuses (nothing is written),
    ``DownloadFailed`` (also for an address refused at connect time), the head check's error,
    ``HashMismatch``, ``Stopped`` when ``abort`` is set (what each leaves: ``_left_clean``).
    ``follow`` makes a digest fed every byte in order as it lands: ``FetchResult.followed``.
    """
    started = time.monotonic()
    url = Url.of(url)
    target = config.policy.target(url)
    partial, sidecar_path = partial_paths(dest)
    unknown_cap = config.max_unknown_bytes if size is None else None
    limits = Limits(url, partial, max_bytes=max_bytes, unknown_cap=unknown_cap, head=head)
    try:
        limits.announced(size, "the task names")
    except Refused as refused:
        raise refused.error from None
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    meter = ProgressMeter(progress)
    digest: str | None = None
    followed: str | None = None
    with (
        _left_clean(partial, sidecar_path),
        Cancel(abort, url) as cancel,
        map_exceptions({}, where=os.path.dirname(os.path.abspath(dest))),
    ):
        if isinstance(target, FilePath):
            resumed_bytes, connections = 0, 0
            hashed = sha256 is not None
            digest = _local.copy_local(target, dest, config, cancel, meter, limits, hashed=hashed)
        else:
            got = download(
                url, dest, config, cancel, meter, size, limits, hashed=sha256 is not None, follow=follow
            )
            resumed_bytes, connections, digest, followed = got
        limits.finish()
        total_bytes, checked = _commit(url, dest, size, sha256, digest, config, cancel)
    meter.finish()
    return FetchResult(total_bytes, time.monotonic() - started, resumed_bytes, connections, checked, followed)


@contextmanager
def _left_clean(partial: str, sidecar_path: str) -> Iterator[None]:
    """What a failed download leaves: a partial to resume, unless it is over its cap, failed
    its head check or hash, or nothing was written (refused at connect, a 404); and nothing
    half-written on a full disk."""
    try:
        yield
    except StorageFull:
        discard(partial, sidecar_path)
        raise
    except Refused as refused:
        discard(partial, sidecar_path)
        raise refused.error from None
    except DownloadFailed:
        with contextlib.suppress(OSError):
            if os.path.getsize(partial) == 0:
                discard(partial, sidecar_path)
        raise


def remote_size(
    url: str | Url, *, config: TransferConfig, abort: threading.Event | None = None
) -> int | None:
    """The size of ``url`` in bytes, or None when the server does not say (chunked, no ranges)."""
    return remote_info(url, config=config, abort=abort).size


def remote_info(
    url: str | Url, *, config: TransferConfig, abort: threading.Event | None = None
) -> RemoteInfo:
    """What ``url`` names now: its size and validators (ETag, Last-Modified), when the server says.

    Asks with ``GET`` + ``Range: bytes=0-0`` rather than HEAD: a presigned URL is
    signed for one method, and GET is the one a download URL allows. Proves too that the
    URL works for this caller (a refusal is ``DownloadFailed``).
    """
    target = config.policy.target(url)
    if isinstance(target, FilePath):
        return RemoteInfo(_local.local_size(target), None, None)
    session = thread_session()

    def attempt(_: int) -> RemoteInfo:
        response = send(
            session,
            "GET",
            target,
            policy=config.policy,
            timeout=config.timeout,
            headers=request_headers(0, 0),
        )
        with contextlib.closing(response):
            track_response(response)
            etag, modified = response.headers.get("ETag"), response.headers.get("Last-Modified")
            if response.status_code == 416:  # an empty file has no byte 0
                return RemoteInfo(unsatisfied_total(response), etag, modified)
            check_status(response)
            return RemoteInfo(announced_total(response), etag, modified)

    with Cancel(abort, target) as cancel, tracking(cancel.registry):
        return run_attempts(attempt, url=target, config=config, cancel=cancel, verb="size check")


def _commit(
    url: Url,
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
    safe_url = str(url)
    if size is not None and total_bytes != size:
        discard(partial, sidecar_path)
        raise DownloadFailed(
            f"download of {safe_url} has {total_bytes} bytes, expected {size}",
            {"url": safe_url, "host": url.host, "status": None, "bytes": total_bytes, "expected": size},
        )
    checked = None
    if sha256 is not None:
        expected = sha256.strip().lower().removeprefix("sha256:")
        actual = digest if digest is not None else _local.hash_file(partial, config, cancel)
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
