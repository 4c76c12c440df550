"""One round of tenant code in a thread of the worker process (sandbox ``off``).

The thread runs the script in its namespace, classifies how it ended (completed,
stopped, failed with a stable code) and resolves the trained state. A stop
arrives as ``StopExecution`` at the next bytecode of tenant code (see
:class:`executor.stopping.UserCodeShield`); a long native call delays it.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

from executor import placement
from executor.errors import RoundhouseError, StopExecution, Stopped, UserCodeError
from executor.rounds._guard import execute_script
from executor.rounds._namespace import RoundOutputs, cpu_state
from executor.stopping import DoneThread, UserCodeShield

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundOutcome:
    """How a round ended, whichever runner ran it."""

    stopped: bool
    error: dict[str, Any] | None
    trained: dict[str, torch.Tensor] | None
    report: dict[str, Any] | None
    training_time: float


def failure(exc: BaseException) -> dict[str, Any]:
    """The error of a round that raised ``exc``, with its stable code."""
    if placement.is_oom(exc):
        return placement.oom_error(exc).to_json()
    if isinstance(exc, RoundhouseError):
        return exc.to_json()
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return UserCodeError(f"{type(exc).__name__}: {exc}", {"traceback": tail[-8000:]}).to_json()


class ThreadRound:
    """Runs one round in a daemon thread named ``executor``; ``on_done`` gets the outcome."""

    def __init__(
        self,
        compiled: CodeType,
        namespace: Callable[[RoundOutputs], dict[str, Any]],
        *,
        training: bool,
        shield: UserCodeShield,
        emit_log: Callable[[str], None],
        on_done: Callable[[RoundOutcome], None],
    ) -> None:
        self._compiled = compiled
        self._namespace = namespace
        self._training = training
        self._shield = shield
        self._emit_log = emit_log
        self._on_done = on_done
        self.thread = DoneThread(self._main, "executor")

    def start(self) -> None:
        self.thread.start()

    def _main(self) -> None:
        started = time.monotonic()
        outputs = RoundOutputs()
        namespace: dict[str, Any] = {}
        stopped, error = False, None
        try:
            namespace = self._namespace(outputs)
            self._shield.enter()
            try:
                execute_script(self._compiled, namespace)
            finally:
                self._shield.leave()
        except (StopExecution, Stopped):
            stopped = True
        except BaseException as exc:
            error = failure(exc)
            logger.info("tenant code failed: %s", error["message"])
            self._emit_log(f"[ERROR] {error['message']}")
        elapsed = time.monotonic() - started
        trained = None
        try:
            if self._training and not stopped and error is None:
                trained = self._trained_state(outputs, namespace)
        except StopExecution:  # a stop that raced the end of tenant code
            stopped, trained = True, None
        finally:
            namespace.clear()
            gc.collect()
            placement.empty_device_cache()
        self._on_done(RoundOutcome(stopped, error, trained, outputs.report, elapsed))

    @staticmethod
    def _trained_state(outputs: RoundOutputs, namespace: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """What ``save_model`` got; else the module left in ``model``; else nothing (a zero delta)."""
        if outputs.saved_state is not None:
            return outputs.saved_state
        if hasattr(namespace.get("model"), "state_dict"):
            return cpu_state(namespace["model"])
        return None
