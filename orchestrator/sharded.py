"""Sharded rounds: the hosts reduce the round among themselves (docs/SHARDED.md, issue 29).

In a session with ``aggregation="sharded"`` no tensor byte of a round passes through the
orchestrator: it signs URLs, decides who contributes and who reduces, and checks that every
host ends on one model. A round:

1. ``run_round`` on every active host with ``delta_url`` a list of P URLs: each host PUTs its
   delta as P shard objects over the fixed partition (P, the session's shard count, is fixed
   for the session, so the velocity's shards stay where they are as hosts come and go);
2. the round ends as in sequential mode (quorum + grace); S, the contributors, is the sorted
   list of hosts that completed with P well-formed shard hashes, frozen and noted;
3. ``reduce_shard`` for each shard ``j`` on S's host ``j mod |S|``; a reduce that fails
   naming a contributor (its shard did not match its hash or layout) drops that host from S
   and every reduce is sent again without it; a reduce that fails otherwise (its host lost,
   its task failed) is sent to the next host of S, up to |S| tries a shard. A round whose
   reduces cannot all complete (``sharded-failed``) falls back to the star path;
4. ``apply_delta`` on every active host with the P sync shards: each host checks every shard
   and reports the model's hash; the round's new global hash is the one the hosts agree on
   (a host that reports another is re-synced: it assembles the model from the state shards).
   A reducer's apply also PUTs the state and velocity its reduce kept (deferred off the reduce:
   nothing reads them before a later round); a shard no apply confirms is restored
   (:mod:`orchestrator.sharded_state`).

What the orchestrator keeps of the model is its hash and the names and hashes of its state
and velocity shards (``ShardedState``, :mod:`orchestrator.sharded_state`): a joining or
re-syncing host assembles the model from them and the session's first model (its layout).
The checkpoint holds that record, written once a round's reduces are done and again once its
hosts agree: a resumed session whose last round was reduced but not synced restores its state
and velocity shards and brings its hosts to that round's model (:meth:`ShardedLoop.settle`).
A round with fewer than two contributors, or whose reduces cannot all complete, is folded by the
orchestrator instead (:mod:`orchestrator.fallback`: the star path, once). Not built yet: int8/int4
sharded syncs (the hosts' deltas may be quantised), overlapped sharded rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from executor.reduce import OuterRule
from orchestrator.artifacts import ArtifactStore
from orchestrator.checkpoint import StateDir
from orchestrator.collect import Deadline, Ending, Outcome, Waiter, round_failure, round_loss
from orchestrator.elastic import Elastic
from orchestrator.fallback import assemble, fold, model_split, publish_split
from orchestrator.membership import HostState, Membership
from orchestrator.outer import OuterOptimizer
from orchestrator.phases import PhaseClock, worker_phases
from orchestrator.records import RoundSummary, Session
from orchestrator.sharded_state import Restore, ShardedState
from tasks.client import RoundClient

logger = logging.getLogger(__name__)


class Driver(Protocol):
    """What of the :class:`~orchestrator.diloco.Orchestrator` the loop uses."""

    client: RoundClient
    store: ArtifactStore
    session: Session
    outer: OuterOptimizer
    membership: Membership
    waiter: Waiter
    elastic: Elastic
    global_hash: str
    round_done: int
    total_rounds: int
    sharded: ShardedState
    history: list[RoundSummary]
    state: StateDir | None
    global_state: dict[str, torch.Tensor]
    layout: dict[str, torch.Tensor]
    scratch: str

    def sync_now(
        self, round_num: int, new_state: dict[str, torch.Tensor] | None, clock: PhaseClock
    ) -> dict[str, str]: ...

    @property
    def next_round(self) -> int: ...

    def model_url(self) -> str: ...

    def round_started(self, round_num: int, task_ids: dict[str, str]) -> None: ...

    def note_outcome(self, round_num: int, outcome: Outcome, why: str | None) -> None: ...

    def finish_round(self, summary: RoundSummary) -> None: ...

    def note(self, host: str | None, event: str, round_num: int, **data: Any) -> None: ...


class ShardedLoop:
    """The rounds of a sharded session, from the orchestrator's next one."""

    def __init__(self, orchestrator: Driver) -> None:
        self.o = orchestrator

    def run(self, rounds: int) -> list[RoundSummary]:
        o = self.o
        o.total_rounds = rounds
        for round_num in range(o.next_round, rounds):
            self.round(round_num, rounds)
        return o.history

    def round(self, round_num: int, total_rounds: int) -> RoundSummary:
        o, session, sharded = self.o, self.o.session, self.o.sharded
        started, clock = time.monotonic(), PhaseClock()
        o.elastic.boundary(round_num)
        hosts, shards = o.membership.active(), range(sharded.count)
        with clock.phase("dispatch"):
            pending = {
                host: o.client.run_round(
                    host, steps=session.steps, round_num=round_num, total_rounds=total_rounds,
                    step_offset=round_num * session.steps, delta_dtype=session.delta_dtype,
                    delta_url=[o.store.url_put(sharded.name(round_num, "delta", j, host)) for j in shards],
                )
                for host in hosts
            }  # fmt: skip
        if o.state is not None:  # a resumed orchestrator stops this round and runs it again
            o.state.save_inflight(round_num, {host: task.id for host, task in pending.items()})
        o.round_started(round_num, {host: task.id for host, task in pending.items()})
        with clock.phase("wait"):
            deadline = Deadline(session.round_deadline_s, session.quorum, session.grace_s)
            outcomes = o.waiter.wait(pending, deadline)
        excluded = {
            h: why for h, out in outcomes.items() if (why := round_failure(out) or self._bad_shards(out))
        }
        contributors = sorted(h for h in outcomes if h not in excluded)
        o.note(None, "contributors", round_num, hosts=contributors)
        reduced, via, star = None, {}, False
        if len(contributors) >= max(2, session.min_hosts):
            with clock.phase("reduce"):
                reduced = self.reduce(round_num, outcomes, contributors, excluded)
        if reduced is None and len([h for h in contributors if h not in excluded]) >= session.min_hosts:
            # Fewer than two hosts, or a round that cannot close: the star path, this once.
            via, star = (
                self.star(
                    round_num, outcomes, [h for h in contributors if h not in excluded], excluded, clock
                ),
                True,
            )
        included = [h for h in contributors if h not in excluded]
        losses = {h: loss for h in included if (loss := round_loss(outcomes[h])) is not None}
        if reduced is None and not star:
            o.note(None, "model-kept", round_num, completed=len(contributors), min_hosts=session.min_hosts)
        elif reduced is not None:
            sync, state, velocity, reducers = reduced
            sharded.pending = {
                "reducers": reducers, "sync": sync, "theta": sharded.state, "velocity": sharded.velocity,
                "run": sharded.run_id,
                "hashes": {h: [s["hash"] for s in outcomes[h].result["delta"]["shards"]] for h in included},  # type: ignore[index]
            }  # fmt: skip
            sharded.state, sharded.velocity = state, velocity
            sharded.round, sharded.global_hash = round_num, None
            sharded.summary = {"included": included, "excluded": excluded, "losses": losses}
            self.save()  # before any host is told: a resumed session brings them to this model
            with clock.phase("apply"):
                via = self.sync(round_num, sync)
        for host, outcome in outcomes.items():
            o.note_outcome(round_num, outcome, excluded.get(host))
        o.round_done = round_num
        kept, seconds = reduced is None and not star, time.monotonic() - started
        summary = RoundSummary(
            round_num, losses, included, excluded, via, o.global_hash, seconds, kept,
            sorted(h for h, out in outcomes.items() if out.ending is Ending.LOST), o.membership.active(),
            clock.to_json(), {h: worker_phases(out.result) for h, out in outcomes.items() if out.completed},
        )  # fmt: skip
        o.finish_round(summary)
        if o.state is not None:
            o.state.clear_inflight()
        return summary

    def star(
        self,
        round_num: int,
        outcomes: Mapping[str, Outcome],
        contributors: list[str],
        excluded: dict[str, str],
        clock: PhaseClock,
    ) -> dict[str, str]:
        """The round folded by the orchestrator from the hosts' shards (orchestrator.fallback),
        synced by the star path, and the model and velocity written back as shards."""
        o, sharded = self.o, self.o.sharded
        o.note(None, "star-fallback", round_num, contributors=contributors)
        split = model_split(o.layout, sharded.count)
        with clock.phase("fold"):
            if sharded.state:  # the global model and velocity are the store's shards
                o.global_state = assemble(o.store, o.scratch, o.layout, split, sharded.state)
                o.outer.velocity = assemble(
                    o.store, o.scratch, o.layout, split, sharded.velocity, floats_only=True
                )
            shards_of = {
                h: [
                    (sharded.name(round_num, "delta", j, h), outcomes[h].result["delta"]["shards"][j]["hash"])  # type: ignore[index]
                    for j in range(sharded.count)
                ]
                for h in contributors
            }
            mean, refused = fold(o.store, o.scratch, o.layout, split, shards_of)
        excluded.update(refused)
        if not mean:
            return {}
        with clock.phase("outer"):
            new_state = o.outer.step(o.global_state, mean)
        via = o.sync_now(round_num, new_state, clock)
        sharded.state = publish_split(
            o.store, o.scratch, o.global_state, split, lambda j: sharded.name(round_num, "fallback-state", j)
        )
        sharded.velocity = publish_split(
            o.store,
            o.scratch,
            o.outer.velocity,
            split,
            lambda j: sharded.name(round_num, "fallback-velocity", j),
        )
        sharded.round, sharded.global_hash, sharded.summary = round_num, o.global_hash, None
        self.save()
        return via

    def _bad_shards(self, outcome: Outcome) -> str | None:
        shards = ((outcome.result or {}).get("delta") or {}).get("shards")
        if not isinstance(shards, list) or len(shards) != self.o.sharded.count:
            return f"its delta is not {self.o.sharded.count} shards"
        if not all(isinstance(s, dict) and isinstance(s.get("hash"), str) for s in shards):
            return "a shard without a hash"
        return None

    # ------------------------------------------------------------ the reduce

    def reduce(
        self,
        round_num: int,
        outcomes: Mapping[str, Outcome],
        contributors: list[str],
        excluded: dict[str, str],
    ) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]], dict[str, str]] | None:
        """Every shard reduced (sync, state and velocity objects, name and hash each; who reduced
        each shard, its state and velocity still to be stored), or None when the round cannot
        close. A contributor whose shard a reducer refused leaves S (in ``excluded``) and the
        reduce starts again without it."""
        o = self.o
        while len(contributors) >= o.session.min_hosts:
            done, refused = self._reduce_all(round_num, outcomes, contributors)
            if refused is None:
                return done
            host, why = refused
            excluded[host] = why
            contributors = [h for h in contributors if h != host]
            o.note(host, "shard-refused", round_num, reason=why)
        return None

    def _reduce_all(
        self, round_num: int, outcomes: Mapping[str, Outcome], contributors: list[str]
    ) -> tuple[Any, tuple[str, str] | None]:
        o, sharded = self.o, self.o.sharded
        count = sharded.count
        tries = dict.fromkeys(range(count), 0)
        results: dict[int, dict[str, Any]] = {}
        reducers: dict[str, str] = {}
        while len(results) < count:
            wave: dict[str, int] = {}  # one reduce a host at a time (the Waiter keys by host)
            for j in sorted(set(range(count)) - set(results)):
                if tries[j] >= len(contributors):
                    o.note(None, "sharded-failed", round_num, shard=j)
                    return None, None
                reducer = contributors[(j + tries[j]) % len(contributors)]
                if reducer not in wave:
                    wave[reducer] = j
                    tries[j] += 1
            pending = {
                host: o.client.reduce_shard(host, **self._task(round_num, j, outcomes, contributors))
                for host, j in wave.items()
            }
            for host, outcome in o.waiter.wait(pending, Deadline(o.session.sync_timeout_s)).items():
                j = wave[host]
                if outcome.ending is Ending.RESULT and outcome.result is not None:
                    results[j], reducers[str(j)] = outcome.result, host
                    continue
                named = [h for h in contributors if f"host {h}'s shard" in (outcome.reason or "")]
                if named:
                    return None, (named[0], outcome.reason or "its shard was refused")
                o.note(host, "reduce-failed", round_num, shard=j, reason=outcome.reason)

        def objects(kind: str) -> list[dict[str, str]]:
            return [
                {"name": sharded.name(round_num, kind, j), "hash": results[j][kind]["hash"]}
                for j in range(count)
            ]

        return (objects("sync"), objects("state"), objects("velocity"), reducers), None

    def _task(
        self, round_num: int, shard: int, outcomes: Mapping[str, Outcome], contributors: list[str]
    ) -> dict[str, Any]:
        o, sharded = self.o, self.o.sharded
        contributions = [
            {
                "host": h, "url": o.store.url_get(sharded.name(round_num, "delta", shard, h)),
                "hash": outcomes[h].result["delta"]["shards"][shard]["hash"],  # type: ignore[index]
            }
            for h in contributors
        ]  # fmt: skip
        velocity = None
        if sharded.velocity:
            v = sharded.velocity[shard]
            velocity = {"url": o.store.url_get(v["name"]), "hash": v["hash"]}
        return {
            "shard": shard, "count": sharded.count, "base_hash": o.global_hash,
            "contributions": contributions, "velocity": velocity, "outer": o.outer.settings(),
            "sync_dtype": o.session.sync_delta_dtype,
            # the state and velocity: deferred to the reducer's apply (its ``store`` order)
            "sync_url": o.store.url_put(sharded.name(round_num, "sync", shard)),
        }  # fmt: skip

    # ------------------------------------------------------------ the sync

    def sync(self, round_num: int, sync: list[dict[str, str]]) -> dict[str, str]:
        """Every active host to the round's model; the global hash is the one they agree on."""
        o, base_hash = self.o, self.o.global_hash
        o.elastic.poll_joins(round_num, base_hash)
        pending = {
            host: o.client.apply_delta(
                host, o.model_url(), delta_url=o.sharded.sync_shards(o.store, sync, host), base_hash=base_hash
            )
            for host in o.membership.active()
        }
        outcomes = o.waiter.wait(pending, Deadline(o.session.sync_timeout_s))
        via = self._agree(round_num, outcomes)
        o.sharded.settle_store(round_num, outcomes, self._restore)
        self.save()
        for host, outcome in outcomes.items():
            if host in via:
                continue
            if outcome.ending is Ending.LOST:
                o.membership.set(
                    host, HostState.LOST, round_num, "lost", reason="heartbeat expired during the sync",
                    last_beat_ts=outcome.last_beat_ts,
                )  # fmt: skip
            else:
                why = outcome.reason if outcome.ending is not Ending.RESULT else "holds another model"
                o.membership.failed(host, round_num, f"sharded sync: {why}")
        return via

    def _agree(self, round_num: int, outcomes: Mapping[str, Outcome]) -> dict[str, str]:
        """The hash most hosts report holding becomes the global one (every host checked every
        shard: honest hosts agree); the hosts that hold it, and how they got there."""
        o = self.o
        held = {
            host: out.result.get("model_hash")
            for host, out in outcomes.items()
            if out.ending is Ending.RESULT and out.result is not None
        }
        votes: dict[str, int] = {}
        for value in held.values():
            if isinstance(value, str):
                votes[value] = votes.get(value, 0) + 1
        if votes:
            o.global_hash = max(sorted(votes), key=lambda value: votes[value])
            o.sharded.global_hash, o.sharded.summary = o.global_hash, None
            self.save()
        via = {
            h: str((outcomes[h].result or {}).get("via", "delta"))
            for h, v in held.items()
            if v == o.global_hash
        }
        o.note(
            None, "sharded-sync", round_num, global_hash=o.global_hash, agreed=len(via), hosts=len(outcomes)
        )
        return via

    def save(self) -> None:
        if self.o.state is not None:
            self.o.state.update(sharded=self.o.sharded.to_json())

    # ------------------------------------------------------------ resume

    def settle(self) -> None:
        """A resumed session whose last reduced round has no summary yet: its live members are
        brought to that round's model (assembled from its state shards, or kept where they hold
        it), the hash they agree on is the global one, and the round is recorded."""
        o, sharded = self.o, self.o.sharded
        if sharded.round <= o.round_done or not sharded.state:
            return
        if sharded.pending is not None:  # whether its reducers' stores were done is not known
            sharded.settle_store(sharded.round, {}, self._restore)
            self.save()
        alive = o.membership.alive(sorted(o.membership.members))
        pending = {
            host: o.client.apply_delta(
                host, o.model_url(), delta_url=sharded.sync_shards(o.store), result_hash=sharded.global_hash
            )
            for host, beat in alive.items()
            if beat is not None
        }
        via = self._agree(sharded.round, o.waiter.wait(pending, Deadline(o.session.sync_timeout_s)))
        said = sharded.summary or {}
        o.round_done = sharded.round
        o.note(None, "resumed-reduced", sharded.round, global_hash=o.global_hash, hosts=sorted(via))
        o.finish_round(
            RoundSummary(
                sharded.round, dict(said.get("losses", {})), list(said.get("included", [])),
                dict(said.get("excluded", {})), via, o.global_hash, 0.0, members=o.membership.active(),
            )
        )  # fmt: skip

    @property
    def _restore(self) -> Restore:
        o = self.o
        return Restore(
            o.store, o.scratch, o.layout, OuterRule(**o.outer.settings()),
            getattr(torch, o.session.sync_delta_dtype), o.note,
        )  # fmt: skip
