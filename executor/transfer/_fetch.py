"""``fetch`` and ``remote_size``: a download from locating the URL to the verified file
moved into place (the picture is in the package docstring)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

# Module-qualified so that hash_file is looked up at call time: a test replaces it there
# to prove that a followed download is not hashed a second time.
import executor.transfer._local as _local
from executor.errors import DownloadFailed, HashMismatch, StorageFull, describe, map_exceptions
from executor.transfer._cancel import Cancel, thread_session, track_response, tracking
from executor.transfer._config import FetchResult, Progress, TransferConfig
from executor.transfer._http import (
    announced_total,
    check_status,
    request_headers,
    run_attempts,
    unsatisfied_total,
)
from executor.transfer._partial import ProgressMeter, discard, partial_paths
from executor.transfer._stream import download
from executor.transfer._urls import locate, redact_url, url_host


def fetch(
    url: str,
    dest: str,
    *,
    config: TransferConfig,
    abort: threading.Event | None = None,
    sha256: str | None = None,
    size: int | None = None,
    progress: Progress | None = None,
) -> FetchResult:
    """Download ``url`` (http(s)://, file:// or a path) to ``dest``, verified, atomically.

    Raises ``DownloadFailed`` (partial kept for a later resume), ``HashMismatch``
    (partial removed), ``Stopped`` when ``abort`` is set, ``InvalidRequest`` for an
    unsupported URL scheme.
    """
    started = time.monotonic()
    kind, location = locate(url)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    meter = ProgressMeter(progress)
    digest: str | None = None
    try:
        with Cancel(abort, url) as cancel, map_exceptions({}, where=os.path.dirname(os.path.abspath(dest))):
            if kind == "local":
                resumed_bytes, connections = 0, 0
                digest = _local.copy_local(location, dest, config, cancel, meter, hashed=sha256 is not None)
            else:
                resumed_bytes, connections, digest = download(
                    url, dest, config, cancel, meter, size, hashed=sha256 is not None
                )
            total_bytes, checked = _commit(url, dest, size, sha256, digest, config, cancel)
    except StorageFull:
        # Free what the attempt took: nothing half-written stays on a full disk.
        discard(*partial_paths(dest))
        raise
    meter.finish()
    return FetchResult(total_bytes, time.monotonic() - started, resumed_bytes, connections, checked)


def remote_size(url: str, *, config: TransferConfig, abort: threading.Event | None = None) -> int | None:
    """The size of ``url`` in bytes, or None when the server does not say (chunked, no ranges).

    Asks with ``GET`` + ``Range: bytes=0-0`` rather than HEAD: a presigned URL is
    signed for one method, and GET is the one a download URL allows.
    """
    kind, location = locate(url)
    if kind == "local":
        safe_url = redact_url(location)
        unknown = {
            OSError: lambda exc: DownloadFailed(f"size of {safe_url}: {describe(exc)}", {"url": safe_url})
        }
        with map_exceptions(unknown):
            return os.path.getsize(location)
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
