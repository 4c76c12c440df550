"""Downloads and uploads by URL: ``fetch``, ``upload``, ``remote_size``, ``redact_url``.

The public surface of the transfer layer. Everything behind it (HTTP sessions and
retries, the partial file and its sidecar, one-stream and ranged GETs, body copying,
the hash follower) lives in private modules that nothing outside this package imports.
"""

from executor.transfer._fetch import (
    FetchResult,
    Progress,
    TransferConfig,
    fetch,
    partial_paths,
    redact_url,
    remote_size,
    upload,
)

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
