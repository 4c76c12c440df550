"""Overlapped rounds: the next round trains while the last one's deltas are folded (docs/OVERLAP.md).

The sequential loop (:meth:`orchestrator.diloco.Orchestrator.round`) leaves every GPU idle
from a round's end until the sync of its outer step has been applied. Here round k+1 is
dispatched as soon as round k's results are in, and the outer step of round k, its sync
delta and its publication run while round k+1 trains. The sync reaches a host whose round
is running as a signed order under a key of its own (:mod:`tasks.overlap`), never a second
task: the worker applies it to its copy of the global model beside the round.

Host i trains round k+1 from ``θ_k + d_i,k`` (the global model it holds, published during
round k, plus its own progress in round k: one-step delay with the host's own progress as
the eager correction, arXiv 2502.12996); its delta is relative to that start, so the outer
step is the sequential one applied one round later. Every host's copy of the global model is
still brought from one hash to the next by a checked sync, so what every host holds of it is
provably identical; the working copy it trains from is a function of it and its own delta.

What each round names, and what each host must hold at its end:

- ``run_round(k, overlap={"base_hash": θ_k-1's hash, "sync_id": id, "sync_wait_s"})``: the
  round starts on θ_k-1 (a host that does not hold it refuses with ``not_in_sync``) and, at
  its end, waits for the order named ``id`` (round k-1's sync, θ_k-1 → θ_k): that wait is
  idle time, reported (``sync_wait``);
- a host whose round did not complete, or that did not end it holding θ_k, re-syncs at the
  next boundary (``apply_delta``: its own progress is dropped) as in sequential mode;
- after the last round its sync is applied as in sequential mode (``apply_delta``): every
  host ends on the final global model.

A stop, a lost host, a straggler, a join and a resumed orchestrator behave as in sequential
mode (docs/OPERATIONS.md): the checkpoint written once round k-1's outer step is taken
names round k as the one in flight, which a resumed orchestrator stops and runs again.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from orchestrator.aggregate import DeltaFolder
from orchestrator.artifacts import ArtifactStore
from orchestrator.checkpoint import StateDir
from orchestrator.collect import Ending, Outcome, round_failure, round_loss
from orchestrator.elastic import Elastic
from orchestrator.membership import HostState, Membership
from orchestrator.outer import OuterOptimizer
from orchestrator.phases import PhaseClock, worker_phases
from orchestrator.records import RoundSummary, Session
from tasks.client import RoundClient
from tasks.overlap import SyncOrder


class Driver(Protocol):
    """What of the :class:`~orchestrator.diloco.Orchestrator` the loop uses (a protocol, so
    that the orchestrator's module is not imported back)."""

    client: RoundClient
    store: ArtifactStore
    membership: Membership
    elastic: Elastic
    outer: OuterOptimizer
    state: StateDir | None
    global_state: dict[str, torch.Tensor]
    global_hash: str
    total_rounds: int
    history: list[RoundSummary]

    @property
    def session(self) -> Session: ...
    @property
    def next_round(self) -> int: ...
    def delta_name(self, round_num: int, host: str) -> str: ...
    def round_started(self, round_num: int, task_ids: dict[str, str]) -> None: ...
    def wait_folding(
        self, round_num: int, pending: Mapping[str, Any], clock: PhaseClock
    ) -> tuple[dict[str, Outcome], DeltaFolder]: ...
    def folded(
        self, folder: DeltaFolder, clock: PhaseClock
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]: ...
    def note_outcome(self, round_num: int, outcome: Outcome, why: str | None) -> None: ...
    def note(self, host: str | None, event: str, round_num: int, **data: Any) -> None: ...
    def publish_sync(
        self, round_num: int, new_state: dict[str, torch.Tensor] | None, clock: PhaseClock
    ) -> tuple[str, str] | None: ...
    def sync_now(
        self, round_num: int, new_state: dict[str, torch.Tensor] | None, clock: PhaseClock
    ) -> dict[str, str]: ...
    def finish_round(self, summary: RoundSummary) -> None: ...
    def model_url(self) -> str: ...
    def publish_delta(self, name: str, delta: Mapping[str, torch.Tensor]) -> tuple[str, str]: ...


logger = logging.getLogger(__name__)


@dataclass
class Collected:
    """A round whose results are in: its deltas still folding, its outer step still to take
    (both while the next round trains)."""

    round_num: int
    started: float
    clock: PhaseClock
    outcomes: dict[str, Outcome]
    folder: DeltaFolder
    mean: dict[str, torch.Tensor] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)

    @property
    def included(self) -> list[str]:
        return sorted(h for h in self.outcomes if h not in self.excluded)


class OverlappedLoop:
    """The rounds of an overlapped session, from the orchestrator's next one."""

    def __init__(self, orchestrator: Driver) -> None:
        self.o = orchestrator

    def run(self, rounds: int) -> list[RoundSummary]:
        o = self.o
        o.total_rounds = rounds
        collected: Collected | None = None
        try:
            for round_num in range(o.next_round, rounds):
                collected = self.round(round_num, rounds, collected)
            if collected is not None:  # the last round's sync: every host idle, as in sequential mode
                kept, new_state = self._outer(collected)
                via = o.sync_now(collected.round_num, new_state, collected.clock)
                self._summarize(collected, kept, via, time.monotonic())
                if o.state is not None:
                    o.state.clear_inflight()
        finally:
            if collected is not None:
                collected.folder.close()  # idempotent: a round given up halfway leaves no fetches
        return o.history

    def round(self, round_num: int, total_rounds: int, previous: Collected | None) -> Collected:
        """Dispatch ``round_num``, take ``previous``'s outer step and send its sync while it
        trains, and collect it."""
        o, session = self.o, self.o.session
        o.elastic.boundary(round_num)
        started, clock = time.monotonic(), PhaseClock()
        hosts = o.membership.active()
        sync_id = secrets.token_hex(16) if previous is not None else None
        overlap = {
            "base_hash": o.global_hash, "sync_id": sync_id, "sync_wait_s": session.sync_timeout_s,
            "gain": o.outer.eager_gain(),
        }  # fmt: skip
        with clock.phase("dispatch"):
            pending = {
                host: o.client.run_round(
                    host, steps=session.steps, round_num=round_num, total_rounds=total_rounds,
                    step_offset=round_num * session.steps, delta_dtype=session.delta_dtype,
                    delta_url=o.store.url_put(o.delta_name(round_num, host)), overlap=overlap,
                )
                for host in hosts
            }  # fmt: skip
        if o.state is not None:
            o.state.save_inflight(round_num, {host: task.id for host, task in pending.items()})
        o.round_started(round_num, {host: task.id for host, task in pending.items()})
        if previous is not None and sync_id is not None:
            self._step(previous, sync_id, hosts, started)
        outcomes, folder = o.wait_folding(round_num, pending, clock)
        for host, outcome in outcomes.items():
            if outcome.ending is Ending.LOST:  # now: the next boundary must not count on it
                o.note_outcome(round_num, outcome, None)
            self._check_held(round_num, host, outcome)
        return Collected(round_num, started, clock, outcomes, folder)

    def _settle(self, c: Collected) -> None:
        """Round ``c``'s deltas folded (while the next round trains): its mean, who is left out."""
        o = self.o
        c.mean, folded_errors = o.folded(c.folder, c.clock)
        c.excluded = {
            h: why for h, out in c.outcomes.items() if (why := round_failure(out) or folded_errors.get(h))
        }
        for host, outcome in c.outcomes.items():
            if outcome.ending is not Ending.LOST:  # noted as the round ended
                o.note_outcome(c.round_num, outcome, c.excluded.get(host))

    def _check_held(self, round_num: int, host: str, outcome: Outcome) -> None:
        """A host that did not end its round on the current global model re-syncs first."""
        o = self.o
        member = o.membership.members.get(host)
        if outcome.ending is Ending.LOST or member is None or member.state is not HostState.ACTIVE:
            return
        said = (outcome.result or {}).get("overlap")
        held = said.get("global_hash") if isinstance(said, dict) else None
        if held != o.global_hash:
            why = (said or {}).get("sync_error") if isinstance(said, dict) else None
            o.membership.set(
                host, HostState.RESYNC, round_num, "resync-needed",
                reason=str(why or round_failure(outcome) or "not on the global model")[:500],
                held=held if isinstance(held, str) else None,
            )  # fmt: skip

    def _outer(self, collected: Collected) -> tuple[bool, dict[str, torch.Tensor] | None]:
        o = self.o
        self._settle(collected)
        kept = len(collected.included) < o.session.min_hosts
        if kept:
            o.note(None, "model-kept", collected.round_num, completed=len(collected.included),
                   min_hosts=o.session.min_hosts)  # fmt: skip
        with collected.clock.phase("outer"):
            return kept, None if kept else o.outer.step(o.global_state, collected.mean)

    def _step(self, previous: Collected, sync_id: str, hosts: list[str], dispatched: float) -> None:
        """``previous``'s outer step, its sync published and ordered on every host now training."""
        o = self.o
        kept, new_state = self._outer(previous)
        base_hash = o.global_hash
        published = o.publish_sync(previous.round_num, new_state, previous.clock)
        with previous.clock.phase("publish"):  # the part of the next step common to every host
            correction = o.outer.eager_correction()
            eager = o.publish_delta(f"sync/eager-{previous.round_num}", correction) if correction else None
        order = SyncOrder(
            sync_id, previous.round_num, o.model_url(), published[0] if published else None,
            base_hash, o.global_hash, *(eager or (None, None)),
        )  # fmt: skip
        with previous.clock.phase("apply"):  # here: the orders sent (each host applies beside)
            for host in hosts:
                try:
                    o.client.send_sync(host, order)
                except Exception as exc:  # Redis away: that host's round ends unsynced, it re-syncs
                    logger.warning("sync order for %s not sent: %s", host, exc)
        self._summarize(previous, kept, {}, dispatched)

    def _summarize(self, c: Collected, kept: bool, via: dict[str, str], ended: float) -> None:
        """Round ``c``'s summary, its wall time from its dispatch to the next one's."""
        o = self.o
        losses = {h: loss for h in c.included if (loss := round_loss(c.outcomes[h])) is not None}
        host_phases = {h: worker_phases(out.result) for h, out in c.outcomes.items() if out.completed}
        for host, seconds in (o.elastic.apply_s if via else {}).items():
            host_phases.setdefault(host, {})["apply"] = seconds
        lost = sorted(h for h, out in c.outcomes.items() if out.ending is Ending.LOST)
        summary = RoundSummary(
            c.round_num, losses, c.included, c.excluded, via, o.global_hash, ended - c.started, kept, lost,
            o.membership.active(), c.clock.to_json(), host_phases, overlap=True,
        )  # fmt: skip
        o.finish_round(summary)


UPLOAD_POLL_S = 0.05
UPLOAD_UNREPORTED_S = 10.0
MAX_HASH_CHARS = 200  # a delta no heartbeat mentions for this long is not coming


def await_uploads(
    folder: DeltaFolder,
    alive: Callable[[Iterable[str]], Mapping[str, Mapping[str, Any] | None]],
    bound_s: float,
) -> None:
    """Hand ``folder`` each deferred delta once its host's heartbeat reports the upload done
    (``uploads`` in the beat, matched by round), with the hash the report gives where the result
    had none (the worker hashes such a delta beside the next round); refuse it when the upload
    failed, the host is lost, no beat mentions it for ``UPLOAD_UNREPORTED_S`` (its worker
    restarted: the upload died with it), or ``bound_s`` passed. A beat is the worker's word, as
    its result is: it decides only that host's delta, whose hash is checked once fetched."""
    unreported: dict[str, float] = {}
    until = time.monotonic() + bound_s
    while folder.deferred:
        beats, now = alive(list(folder.deferred)), time.monotonic()
        for host, (name, round_num, delta_hash) in list(folder.deferred.items()):
            beat = beats.get(host)
            reports = beat.get("uploads") if isinstance(beat, Mapping) else None
            report = next(
                (r for r in reports or [] if isinstance(r, Mapping) and r.get("round") == round_num), None
            )
            reported = report.get("hash") if report is not None else None
            if beat is None:
                why: str | None = "lost before its delta's upload was reported"
            elif report is None:
                since = unreported.setdefault(host, now)
                why = "its delta's upload is not reported" if now - since > UPLOAD_UNREPORTED_S else None
            elif report.get("state") == "done":
                del folder.deferred[host]
                if not _a_hash(reported) or (delta_hash is not None and reported != delta_hash):
                    folder.refuse(host, "its delta's upload reports no hash, or another than its result")
                else:
                    folder.submit(host, name, str(reported))
                continue
            elif report.get("state") == "failed":
                why = f"its delta's upload failed: {str(report.get('error'))[:500]}"
            else:
                why = f"its delta's upload did not end within {bound_s:g} s" if now > until else None
            if why is not None:
                del folder.deferred[host]
                folder.refuse(host, why)
        if folder.deferred:
            time.sleep(UPLOAD_POLL_S)


def _a_hash(value: object) -> bool:
    """A state hash as a worker reports one (``scheme:hex``), not anything a beat may hold."""
    if not isinstance(value, str) or len(value) > MAX_HASH_CHARS:
        return False
    scheme, _, digest = value.partition(":")
    return scheme.isalnum() and len(digest) >= 32 and all(c in "0123456789abcdef" for c in digest)
