"""Roundhouse's engine: everything a worker does, usable as a plain library (no Celery)."""

from executor.core import Executor
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
