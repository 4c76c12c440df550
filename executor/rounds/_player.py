"""The round in flight: tenant code played on the runner in a thread of its own.

A round runs beside the task's thread so that a stop (the task revoked, a reset) can reach
it: :meth:`RoundPlayer.stop_until` signals, interrupts tenant code and joins, again and again
until a deadline, because tenant code may catch one ``StopExecution`` in a bare ``except``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from executor.rounds._budget import RoundBudget
from executor.rounds._namespace import RoundSpec
from executor.rounds._outcome import RoundOutcome, RoundRunner, failure
from executor.stopping import DoneThread, StopSignal

logger = logging.getLogger(__name__)

INTERRUPT_EVERY_S = 0.25


class RoundPlayer:
    """One round at a time: its thread, its outcome (report budgeted) and its trained state."""

    def __init__(self, runner: RoundRunner, budget: RoundBudget, stop: StopSignal) -> None:
        self._runner = runner
        self._budget = budget
        self._stop = stop
        self.thread: DoneThread | None = None
        self.outcome: RoundOutcome | None = None
        # The seed's ``modified_state``: the trained state until the round's delta is shipped.
        self.trained: Mapping[str, torch.Tensor] | None = None

    @property
    def running(self) -> bool:
        return bool(self.thread and self.thread.running)

    def start(self, spec: RoundSpec) -> None:
        self.outcome = None
        self.trained = None
        self._stop.clear()
        self.thread = DoneThread(lambda: self._play(spec), "executor")
        self.thread.start()

    def _play(self, spec: RoundSpec) -> None:
        started = time.monotonic()
        self._budget.start_round()
        try:
            outcome = self._runner.run_round(spec, self._stop)
        except BaseException as exc:  # the runner itself failed (it could not start, say)
            logger.exception("round runner failed")
            outcome = RoundOutcome.failed(failure(exc), time.monotonic() - started)
        self._runner.replenish()  # a round that replaced a killed runner took the spare
        self.trained = outcome.trained
        # The outcome kept for the result does not hold the trained state: it goes with the delta.
        self.outcome = replace(outcome, trained=None, report=self._budget.report(outcome.report))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until tenant code finishes (or ``timeout_s`` passes); True when it has."""
        return self.thread is None or self.thread.wait(timeout_s)

    def stop_until(self, deadline: float) -> None:
        """Signal, interrupt tenant code, end the runner's round, and join, until ``deadline``."""
        self._stop.set()
        self._runner.interrupt()
        thread = self.thread
        while thread is not None and thread.running and time.monotonic() < deadline:
            self._runner.interrupt()
            thread.wait(INTERRUPT_EVERY_S)

    def forget(self) -> None:
        """The tenant boundary: no outcome and no trained state survive it."""
        self.thread = None
        self.outcome = None
        self.trained = None
