"""Waiting for the workers, with deadlines: how a round (or a sync) ends.

A round ends at ``round_deadline_s``, or once ``quorum`` of its hosts have completed plus
``grace_s``, whichever comes first; every task still running then is a **straggler**: it is
stopped (:meth:`tasks.client.RoundClient.stop`, which also keeps a task that has not
started from ever starting) and left out of the mean. Meanwhile the hosts' heartbeats are
read every ``poll_s`` (the results more often, ``RESULT_POLL_S``): a host whose heartbeat
has expired is **lost** at once (within the heartbeat TTL plus a poll of its last beat), its
task stopped the same way so that it never runs late, and the wait goes on without it. The
same waiter, without a quorum, bounds the loads and syncs.

A task the host's gate refused (unsigned, untrusted, expired, a replay: DESIGN §11) never
runs and has no result; the waiter finds the refusal in the host's events stream and ends
that host's wait at once with an ``error`` outcome naming the reason, instead of at the
deadline. A refusal's task id is only what the refused message claimed, so one is believed
only from the host the task was sent to and while that host's heartbeat does not show the
task running, and the task is stopped
as well: should a genuine copy be admitted later, it does not run for nobody.

Nothing here raises for a worker's failure: every host ends with an :class:`Outcome`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis
from celery.result import AsyncResult

from tasks.client import RoundClient

POLL_S = 0.25
# A result is one GET in the backend per pending task: read every 20 ms while few are pending
# (a round's end, a sync's, waited on for half a poll less on average: 2 a round, bench.goodput),
# no faster than 2 ms per pending task, so that a fleet's wait costs the backend what it did.
RESULT_POLL_S = 0.02
RESULT_POLL_PER_TASK_S = 0.002
REFUSAL_LOOKBACK_S = 300.0  # a wait's first read of the events reaches back this far: the task
# was sent before the wait began, and the worker's clock may be behind ours
REFUSALS_KEPT = 4096  # refused task ids remembered (a flood of forged refusals stays bounded)

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
        self._cursors: dict[str, str] = {}  # per host: the last events-stream entry read
        # (host, task id) -> why that host's gate refused it: a message claiming our id on
        # another host's queue says nothing of ours
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()

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
            beats = self.alive(list(waiting))
            for host, beat in beats.items():
                if beat is not None:
                    self._last_beats[host] = float(beat.get("ts") or time.time())
                elif host in waiting:
                    self.stop(host, waiting[host])
                    last = self._last_beats.get(host)
                    end(Outcome(host, Ending.LOST, reason="heartbeat expired", seconds=self.clock() - started,
                                last_beat_ts=last, detected_ts=time.time()))  # fmt: skip
            for host, task in list(waiting.items()):
                if (why := self.refusal(host, task, beats.get(host))) is not None:
                    self.stop(host, task)
                    end(Outcome(host, Ending.ERROR, reason=why, seconds=self.clock() - started))
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
                self._nap(waiting)
        return outcomes

    def _nap(self, waiting: Mapping[str, AsyncResult]) -> None:
        """Up to ``poll_s``, ended early once a pending task's result is in."""
        tick = min(self.poll_s, max(RESULT_POLL_S, RESULT_POLL_PER_TASK_S * len(waiting)))
        until = time.monotonic() + self.poll_s
        while True:
            time.sleep(min(tick, max(0.0, until - time.monotonic())))
            if time.monotonic() >= until or any(task.ready() for task in waiting.values()):
                return

    def finished(self, host: str, task: AsyncResult, seconds: float) -> Outcome:
        try:
            result = task.get(timeout=10, propagate=True)
        except Exception as exc:  # the task failed (its error class and args), or was revoked
            return Outcome(host, Ending.ERROR, reason=describe(exc), seconds=seconds)
        if not isinstance(result, dict):
            return Outcome(host, Ending.ERROR, reason=f"unexpected result {result!r:.200}", seconds=seconds)
        return Outcome(host, Ending.RESULT, result=result, seconds=seconds)

    def refusal(self, host: str, task: AsyncResult, beat: Mapping[str, Any] | None) -> str | None:
        """Why ``host``'s gate refused ``task``, if a refusal names it and the host does not
        run it; the host's events read since the last call (Redis away: nothing new)."""
        cursor = self._cursors.get(host) or f"{int((time.time() - REFUSAL_LOOKBACK_S) * 1000)}-0"
        try:
            found, self._cursors[host] = self.client.refusals(host, cursor)
        except redis.RedisError as exc:
            logger.debug("events of %s not read: %s", host, exc)
            found = []
        for event in found:
            if event.task_id:
                self._refused[host, event.task_id] = (
                    f"refused by {host}'s gate: {event.data.get('reason')}: {event.data.get('detail')}"
                )
                while len(self._refused) > REFUSALS_KEPT:
                    self._refused.popitem(last=False)
        if beat is not None and beat.get("task_id") == task.id:
            return None  # it runs: the refusal was of another message claiming its id
        return self._refused.get((host, task.id))

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


def round_loss(outcome: Outcome) -> float | None:
    """The final loss a round's tenant reported (``final_loss``, else ``loss``), when a number."""
    report = (outcome.result or {}).get("report") or {}
    loss = report.get("final_loss", report.get("loss")) if isinstance(report, dict) else None
    return float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
