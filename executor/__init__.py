"""Roundhouse's engine: everything a worker does, usable as a plain library (no Celery).

``Executor`` is imported on first use: importing the package (its errors and results)
must not import torch, so that the Celery MainProcess stays free of it.

Its parts, bottom up (``tests/unit/test_layout.py`` holds each to importing only lower ones):

- the ground floor: ``errors`` (the one error tree), ``fileio`` (atomic writes, tree walks),
  ``workdir`` (every path of a work dir), ``urls`` (a URL that redacts itself),
  ``results`` (what the executor returns),
  ``stopping`` (the stop signal), ``tensorfile`` (streaming safetensors), ``torchzip``
  (a ``torch.save`` zip checked before it is loaded);
- ``placement`` (the model on the GPU, or split by accelerate) and ``preprocess`` (image
  inputs as the bundle says);
- ``transfer`` (downloads and uploads by URL), then ``delta`` (the sync delta and the trained
  one), ``artifacts`` (model formats) and ``shards`` (the shared shard cache);
- ``rounds`` (what tenant code sees, how a round ends) and ``reduce`` (the sharded round's
  partition, shard files and reduction), then ``sandbox`` (the sandboxed runner);
- ``session``: the session's owner (typed requests, the model file, the manifest, the load
  pipeline, a round's delta shipped);
- ``configs`` (every part's config, built once from the settings: the only engine module
  below the facade that reads them) and ``assembly`` (the parts wired from it);
- ``core``: the ``Executor``, one per process, the seed's facade.

A caller of the seed imports its names from here (DESIGN §9): ``Executor``, ``StopExecution``,
``DownloadAborted``, ``CleanupFailed``, and the seed's tuning constants, which are now the
defaults of settings (``DOWNLOAD_RETRIES`` is ``ROUNDHOUSE_DOWNLOAD_RETRIES``'s default) or
the engine's own bounds (``MAX_IPC_FRAME``), read on first use.
"""

from typing import TYPE_CHECKING, Any

from executor.errors import (
    BadArtifact,
    CleanupFailed,
    DownloadAborted,
    DownloadFailed,
    ErrorInfo,
    GpuOutOfMemory,
    HashMismatch,
    InvalidRequest,
    RoundhouseError,
    StopExecution,
    Stopped,
    UserCodeError,
)
from executor.results import ApplyOutcome, DeltaInfo, ExecutorState, LoadResult, RoundResult, RoundStatus

if TYPE_CHECKING:
    from executor.core import Executor


# The seed's module constants: the setting whose default each one became.
SEED_SETTINGS = {
    "DOWNLOAD_RETRIES": "download_retries",
    "DOWNLOAD_RETRY_BACKOFF": "download_backoff_s",
    "DOWNLOAD_CHUNK_SIZE": "download_buffer_bytes",
    "STOP_JOIN_TIMEOUT": "stop_join_timeout_s",
}


def __getattr__(name: str) -> Any:
    if name == "Executor":
        from executor.core import Executor

        return Executor
    if name in SEED_SETTINGS:
        from settings import Settings

        return Settings.model_fields[SEED_SETTINGS[name]].default
    if name == "MAX_IPC_FRAME":
        from executor.sandbox import MAX_FRAME_BYTES

        return MAX_FRAME_BYTES
    raise AttributeError(f"module 'executor' has no attribute {name!r}")


__all__ = [
    "DOWNLOAD_CHUNK_SIZE",
    "DOWNLOAD_RETRIES",
    "DOWNLOAD_RETRY_BACKOFF",
    "MAX_IPC_FRAME",
    "STOP_JOIN_TIMEOUT",
    "ApplyOutcome",
    "BadArtifact",
    "CleanupFailed",
    "DeltaInfo",
    "DownloadAborted",
    "DownloadFailed",
    "ErrorInfo",
    "Executor",
    "ExecutorState",
    "GpuOutOfMemory",
    "HashMismatch",
    "InvalidRequest",
    "LoadResult",
    "RoundResult",
    "RoundStatus",
    "RoundhouseError",
    "StopExecution",
    "Stopped",
    "UserCodeError",
]
