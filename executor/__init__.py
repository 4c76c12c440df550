"""Roundhouse's engine: everything a worker does, usable as a plain library (no Celery).

``Executor`` is imported on first use: importing the package (its errors and results)
must not import torch, so that the Celery MainProcess stays free of it.
"""

from typing import TYPE_CHECKING, Any

from executor.errors import (
    BadArtifact,
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


def __getattr__(name: str) -> Any:
    if name == "Executor":
        from executor.core import Executor

        return Executor
    raise AttributeError(f"module 'executor' has no attribute {name!r}")


__all__ = [
    "ApplyOutcome",
    "BadArtifact",
    "DeltaInfo",
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
