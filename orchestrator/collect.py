"""Waiting for the workers, with deadlines: how a round (or a sync) ends.

A round ends at ``round_deadline_s``, or once ``quorum`` of its hosts have completed plus
``grace_s``, whichever comes first; every task still running then is a **straggler**: it is
stopped (:meth:`tasks.client.RoundClient.stop`, which also keeps a task that has not
started from ever starting) and left out of the mean. Meanwhile the hosts' heartbeats are
read every ``poll_s``: a host whose heartbeat has expired is **lost** at once (within the
heartbeat TTL plus a poll of its last beat), its task stopped the same way so that it never
runs late, and the wait goes on without it. The same waiter, without a quorum, bounds the
loads and syncs.

Nothing here raises for a worker's failure: every host ends with an :class:`Outcome`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from celery.result import AsyncResult

from tasks.client import RoundClient

POLL_S = 0.25

logger = logging.getLogger(__name__)


class Ending(StrEnum):
    RESULT = "result"  # the task returned (its own status may still say failed or stopped)
    ERROR = "error"  # the task raised (load_model, apply_delta) or its result was lost
    LOST = "lost"  # the host's heartbeat expired
    STRAGGLER = "straggler"  # still running at the deadline (or after quorum + grace): stopped


@dataclass(frozen=True)
class Outcome:
    host: str
    ending: Ending
    result: dict[str, Any] | None = None
    reason: str | None = None
    seconds: float = 0.0
    last_beat_ts: float | None = None  # for a lost host: its last heartbeat's time (wall clock)
    detected_ts: float | None = None  # and when its loss was noticed

    @property
    def completed(self) -> bool:
        """A round that completed with a delta (or any other task that returned)."""
        if self.ending is not Ending.RESULT or self.result is None:
            return False
        return "status" not in self.result or (
            self.result["status"] == "completed" and bool(self.result.get("delta"))
        )


@dataclass(frozen=True)
class Deadline:
    """When a wait ends: ``deadline_s`` after it started, or ``grace_s`` after ``quorum``
    (a fraction of the hosts waited for) have completed."""

    deadline_s: float
    quorum: float = 1.0
    grace_s: float = 0.0

    def quorum_count(self, hosts: int) -> int:
        return max(1, math.ceil(self.quorum * hosts - 1e-9)) if hosts else 0


class Waiter:
    """Waits for tasks on several hosts, watching their heartbeats."""

    def __init__(
        self,
        client: RoundClient,
        alive: Callable[[Iterable[str]], Mapping[str, Mapping[str, Any] | None]],
        *,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.alive = alive
        self.poll_s = poll_s
        self.clock = clock
        self._last_beats: dict[str, float] = {}

    def wait(
        self,
        pending: Mapping[str, AsyncResult],
        deadline: Deadline,
        *,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> dict[str, Outcome]:
        """Each host's outcome; ``on_outcome`` is called as each one is known (for streaming)."""
        started = self.clock()
        waiting = dict(pending)
        outcomes: dict[str, Outcome] = {}
        need = deadline.quorum_count(len(pending))
        quorum_at: float | None = None

        def end(outcome: Outcome) -> None:
            outcomes[outcome.host] = outcome
            waiting.pop(outcome.host, None)
            if on_outcome is not None:
                on_outcome(outcome)

        while waiting:
            for host, task in list(waiting.items()):
                if task.ready():
                    end(self.finished(host, task, self.clock() - started))
            for host, beat in self.alive(list(waiting)).items():
                if beat is not None:
                    self._last_beats[host] = float(beat.get("ts") or time.time())
                elif host in waiting:
                    self.stop(host, waiting[host])
                    last = self._last_beats.get(host)
                    end(Outcome(host, Ending.LOST, reason="heartbeat expired", seconds=self.clock() - started,
                                last_beat_ts=last, detected_ts=time.time()))  # fmt: skip
            now = self.clock()
            if quorum_at is None and sum(o.completed for o in outcomes.values()) >= need:
                quorum_at = now
            over = now - started >= deadline.deadline_s
            if waiting and (over or (quorum_at is not None and now - quorum_at >= deadline.grace_s)):
                why = "deadline" if over else f"quorum ({need}) plus {deadline.grace_s:g} s grace"
                for host, task in list(waiting.items()):
                    self.stop(host, task)
                    end(
                        Outcome(
                            host,
                            Ending.STRAGGLER,
                            reason=f"still running at the {why}",
                            seconds=now - started,
                        )
                    )
            if waiting:
                time.sleep(self.poll_s)
        return outcomes

    def finished(self, host: str, task: AsyncResult, seconds: float) -> Outcome:
        try:
            result = task.get(timeout=10, propagate=True)
        except Exception as exc:  # the task failed (its error class and args), or was revoked
            return Outcome(host, Ending.ERROR, reason=describe(exc), seconds=seconds)
        if not isinstance(result, dict):
            return Outcome(host, Ending.ERROR, reason=f"unexpected result {result!r:.200}", seconds=seconds)
        return Outcome(host, Ending.RESULT, result=result, seconds=seconds)

    def stop(self, host: str, task: AsyncResult) -> None:
        try:
            self.client.stop(task.id, host)
        except Exception as exc:  # never the end of the round; Redis away: the worker rechecks later
            logger.warning("could not stop %s on %s: %s", task.id, host, exc)


def describe(exc: BaseException) -> str:
    """A worker's error as one line: its class, and its stable code when it has one."""
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) >= 2 and isinstance(args[1], dict) and "code" in args[1]:
        return f"{type(exc).__name__} ({args[1]['code']}): {args[0]}"
    return f"{type(exc).__name__}: {exc}"


def round_failure(outcome: Outcome) -> str | None:
    """Why a round's outcome adds nothing to the mean (None: it completed with a delta)."""
    if outcome.completed:
        return None
    if outcome.ending is not Ending.RESULT or outcome.result is None:
        return f"{outcome.ending.value}: {outcome.reason}"
    error = outcome.result.get("error") or {}
    return f"{outcome.result.get('status')}: {error.get('code', '')} {error.get('message', '')}".strip()
