"""How a round ends, whichever runner ran it: its outcome, its result and the trained delta.

Both runners — in a thread of the worker (:mod:`executor.rounds._inthread`) and in the
sandbox (:mod:`executor.sandbox`) — meet the :class:`RoundRunner` protocol and hand back
one :class:`RoundOutcome`, which :func:`round_result` turns into the task's result. A
round's delta is ``trained - original`` (DESIGN §3), written next to the work dir and PUT
to the orchestrator's URL when one is given (:mod:`executor.session` ships it).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import CodeType
from typing import Any, Protocol

import torch

from executor import placement
from executor.errors import ErrorInfo, RoundhouseError, Stopped, UserCodeError
from executor.results import DeltaInfo, RoundResult, RoundStatus
from executor.rounds._namespace import RoundSpec
from executor.shards import ShardSession

TRACEBACK_CHARS = 8000


@dataclass(frozen=True)
class RoundOutcome:
    """How a round ended, whichever runner ran it."""

    stopped: bool
    error: ErrorInfo | None
    trained: Mapping[str, torch.Tensor] | None
    report: dict[str, Any] | None
    training_time: float

    @classmethod
    def failed(cls, error: ErrorInfo, training_time: float = 0.0) -> RoundOutcome:
        return cls(False, error, None, None, training_time)


def failure(exc: BaseException) -> ErrorInfo:
    """The error of a round that raised ``exc``, with its stable code."""
    if placement.is_oom(exc):
        return placement.oom_error(exc).info()
    if isinstance(exc, RoundhouseError):
        return exc.info()
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return UserCodeError(f"{type(exc).__name__}: {exc}", {"traceback": tail[-TRACEBACK_CHARS:]}).info()


class RoundSession(Protocol):
    """What a runner needs of the loaded session (:class:`executor.session.Session` has it)."""

    @property
    def code(self) -> str: ...
    @property
    def compiled(self) -> CodeType: ...
    @property
    def model_path(self) -> str: ...
    @property
    def start_path(self) -> str:
        """The model file a round starts from (an overlapped session's working copy)."""
        ...

    @property
    def bundle_root(self) -> str | None: ...
    @property
    def preprocessor_config(self) -> Mapping[str, Any]: ...
    @property
    def params(self) -> dict[str, Any]: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def dataset(self) -> ShardSession: ...


class RoundRunner(Protocol):
    """Where tenant code runs: in a thread of the worker, or in the sandboxed runner.

    The Executor drives either through these calls and nothing else.
    """

    @property
    def mode(self) -> str:
        """``off`` (in-thread), ``bwrap`` or ``unshare``."""
        ...

    def prepare(
        self, code: str, model_path: str, model_bytes: int, *, abort: threading.Event | None = None
    ) -> None:
        """A session is about to begin: start what will run its tenant code now, while its
        model (a safetensors file of ``model_bytes``, at ``model_path``) is still arriving.
        The previous session's runner ends. ``open`` adopts what this started when the
        session matches; ``close`` (or ``abort`` set beforehand) calls it off."""
        ...

    def open(self, session: RoundSession, *, warm: bool) -> None:
        """A session begins (``load_model``; ``warm=False`` for a rehydrated one, whose
        runner may start with its first round)."""
        ...

    def run_round(self, spec: RoundSpec, stop: threading.Event) -> RoundOutcome:
        """Run one round to its end on the calling thread; never raises for tenant faults."""
        ...

    def interrupt(self) -> None:
        """Deliver the stop to running tenant code (called again until the round ends)."""
        ...

    def replenish(self) -> None:
        """Start, in the background, what the next session's tenant code will run in, when
        none is ready (called while the worker is between tasks). Never raises."""
        ...

    def close(self, *, spare: bool = False) -> None:
        """The session is over: end whatever runs tenant code (``spare``: also what was
        started ahead for the next session; a reset or shutdown). Idempotent."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where tenant code runs and what confines it, for ``status``."""
        ...


def round_result(
    outcome: RoundOutcome,
    *,
    round_num: int,
    ship: Callable[[], DeltaInfo] | None,
    dropped: Mapping[str, int] | None = None,
) -> RoundResult:
    """The result of a finished round; ``ship`` (training rounds) runs only when it completed."""
    info = outcome.error
    status = (
        RoundStatus.STOPPED if outcome.stopped else (RoundStatus.FAILED if info else RoundStatus.COMPLETED)
    )
    delta: DeltaInfo | None = None
    if status is RoundStatus.COMPLETED and ship is not None:
        try:
            delta = ship()
        except Stopped:
            status = RoundStatus.STOPPED
        except RoundhouseError as exc:
            status, info = RoundStatus.FAILED, exc.info()
        except ValueError as exc:  # the trained state does not fit the model (a shape changed)
            status, info = RoundStatus.FAILED, UserCodeError(str(exc)).info()
    return RoundResult(status, outcome.training_time, outcome.report, info, delta, round_num, dropped or {})
