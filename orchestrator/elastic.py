"""Elastic membership in action: joins at round boundaries, and the sync that follows a round.

:class:`Elastic` does for the :class:`~orchestrator.diloco.Orchestrator` what changes the
set of active hosts (the rules are :mod:`orchestrator.membership`'s):

- :meth:`Elastic.boundary`, before a round: a member whose heartbeat is gone is lost; joins
  that finished are settled (active when they left the global model on the host, re-sent
  when the global moved on meanwhile); live idle hosts that may (re)join are sent their
  ``load_model`` or ``apply_delta``; then it waits up to ``join_wait_s`` for them (longer
  when nobody is active), and lets slower ones go on while the round runs;
- :meth:`Elastic.sync_all`, after a round: joins that finished during it join the sync;
  every active host is sent the sync delta; a host whose sync did not leave the new hash is
  given a second chance by full download, and failing that must re-sync before it trains
  again (or is dropped after repeated failures);
- :meth:`Elastic.stop_inflight`, on resume: the dead orchestrator's round is stopped.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from orchestrator.checkpoint import StateDir
from orchestrator.collect import POLL_S, Deadline, Ending, Outcome, Waiter
from orchestrator.membership import HostState, Join, Membership, join_kind
from orchestrator.phases import seconds
from tasks.client import RoundClient


class SessionSettings(Protocol):
    """What of :class:`orchestrator.diloco.Session` the joins and syncs read."""

    shards: list[dict[str, Any]]
    code: str
    params: dict[str, Any]
    batch_size: int
    tenant: str
    round_deadline_s: float
    join_wait_s: float
    sync_timeout_s: float
    url_ttl_s: float


class Driver(Protocol):
    """What of the :class:`~orchestrator.diloco.Orchestrator` this module uses (a protocol,
    so that the orchestrator's module is not imported back)."""

    client: RoundClient
    membership: Membership
    waiter: Waiter
    state: StateDir | None
    global_hash: str

    @property
    def session(self) -> SessionSettings: ...

    def model_url(self) -> str: ...

    def rejoin(self, host: str, shards: list[dict[str, Any]]) -> Any: ...

    def shard_descriptors(self) -> list[dict[str, Any]]: ...

    def note(self, host: str | None, event: str, round_num: int, **data: Any) -> None: ...


class Elastic:
    def __init__(self, orchestrator: Driver) -> None:
        self.o = orchestrator
        self.apply_s: dict[str, float] = {}  # the last sync: each host's own apply time

    # ------------------------------------------------------------ boundaries

    def boundary(self, round_num: int, *, wait_s: float | None = None) -> None:
        o, m, session = self.o, self.o.membership, self.o.session
        beats = m.beats()
        for host in m.active():
            if host not in beats:
                m.set(host, HostState.LOST, round_num, "lost", reason="heartbeat expired between rounds")
        self.poll_joins(round_num, o.global_hash, beats)
        self.start_joins(round_num, beats)
        if not m.active() and not m.with_state(HostState.JOINING):
            # Nobody to train with: wait (up to a round's deadline) for a host to come back.
            until = time.monotonic() + session.round_deadline_s
            while not m.with_state(HostState.JOINING) and time.monotonic() < until:
                time.sleep(1.0)
                self.start_joins(round_num, m.beats())
        wait = session.join_wait_s if wait_s is None else wait_s
        if not m.active():
            wait = max(wait, session.sync_timeout_s)
        until = time.monotonic() + wait
        while m.with_state(HostState.JOINING) and time.monotonic() < until:
            time.sleep(POLL_S)
            self.poll_joins(round_num, o.global_hash)

    def start_joins(self, round_num: int, beats: dict[str, dict[str, Any]]) -> None:
        o, m = self.o, self.o.membership
        for host in m.candidates(beats):
            member = m.members.get(host) or m.add(host, round_num)
            kind = join_kind(member, beats[host], o.session.tenant)
            shards = o.shard_descriptors()
            if kind == "apply":
                task = o.rejoin(host, shards)
            else:
                task = o.client.load_model(
                    host, o.model_url(), shards, o.session.code, batch_size=o.session.batch_size,
                    params=o.session.params, initial_shard_index=member.shard_index, tenant=o.session.tenant,
                )  # fmt: skip
            m.set(host, HostState.JOINING, round_num, "joining", kind=kind, task_id=task.id)
            member.join = Join(kind, task, o.global_hash)
            member.urls_at = time.monotonic()

    def poll_joins(self, round_num: int, current_hash: str, beats: dict[str, Any] | None = None) -> None:
        """Settle the joins that ended; ``current_hash`` is the model hosts must hold to be active."""
        o, m = self.o, self.o.membership
        joining = m.with_state(HostState.JOINING)
        if not joining:
            return
        beats = beats if beats is not None else m.alive(joining)
        for host in joining:
            member = m.members[host]
            join = member.join
            assert join is not None
            if beats.get(host) is None:
                o.waiter.stop(host, join.task)
                m.set(host, HostState.LOST, round_num, "lost", reason="heartbeat expired while joining")
                continue
            if not join.task.ready():
                if time.monotonic() - join.started > o.session.sync_timeout_s:
                    o.waiter.stop(host, join.task)
                    m.failed(host, round_num, f"{join.kind} timed out after {o.session.sync_timeout_s:g} s")
                continue
            outcome = o.waiter.finished(host, join.task, time.monotonic() - join.started)
            self._settle(round_num, member.host, join, outcome, current_hash)

    def _settle(self, round_num: int, host: str, join: Join, outcome: Outcome, current_hash: str) -> None:
        m = self.o.membership
        member = m.members[host]
        if outcome.ending is not Ending.RESULT or outcome.result is None:
            m.failed(host, round_num, f"{join.kind} failed: {outcome.reason}")
            return
        held = outcome.result.get("model_hash")
        if held != current_hash:
            # The global model moved on while this host joined: bring it up to date next.
            member.held_session = True
            m.set(host, HostState.RESYNC, round_num, "join-stale", held=held)
            return
        first = not member.held_session
        member.held_session, member.failures = True, 0
        if join.kind == "apply" and outcome.result.get("noop"):
            event = "kept"  # it holds the global model already: not loaded again
        else:
            event = "joined" if first else "rejoined"
        via = "load" if join.kind == "load" else outcome.result.get("via")
        m.set(host, HostState.ACTIVE, round_num, event, via=via, seconds=round(outcome.seconds, 3))

    # ------------------------------------------------------------ the sync

    def sync_all(self, round_num: int, delta_url: str, base_hash: str) -> dict[str, str]:
        """Bring every active host from ``base_hash`` to the orchestrator's new global model."""
        o, m = self.o, self.o.membership
        self.apply_s = {}
        self.poll_joins(round_num, base_hash)  # joined during the round: they hold the base too
        hosts = m.active()
        refresh = self._shards_if_due(hosts)
        pending = {
            host: o.client.apply_delta(
                host, o.model_url(), delta_url=delta_url, base_hash=base_hash, result_hash=o.global_hash,
                dataset_shards=refresh,
            )
            for host in hosts
        }  # fmt: skip
        via: dict[str, str] = {}
        retry = self._settle_syncs(round_num, o.waiter.wait(pending, Deadline(o.session.sync_timeout_s)), via)
        if retry:
            # A second chance, by full download, for hosts whose sync did not hold.
            shards = o.shard_descriptors()
            pending = {
                host: o.client.apply_delta(
                    host, o.model_url(), result_hash=o.global_hash, dataset_shards=shards
                )
                for host in retry
            }
            outcomes = o.waiter.wait(pending, Deadline(o.session.sync_timeout_s))
            for host, why in self._settle_syncs(round_num, outcomes, via).items():
                m.failed(host, round_num, why)
            for host in retry:
                if host in via:
                    o.note(host, "resynced", round_num, reason=retry[host], via=via[host])
        return via

    def _settle_syncs(
        self, round_num: int, outcomes: dict[str, Outcome], via: dict[str, str]
    ) -> dict[str, str]:
        """Record the good syncs in ``via``; returns the hosts whose sync failed, and why."""
        o, m = self.o, self.o.membership
        failed: dict[str, str] = {}
        for host, outcome in outcomes.items():
            if outcome.ending is Ending.LOST:
                m.set(host, HostState.LOST, round_num, "lost", reason="heartbeat expired during the sync",
                      last_beat_ts=outcome.last_beat_ts)  # fmt: skip
                continue
            held = (outcome.result or {}).get("model_hash")
            if outcome.ending is Ending.RESULT and held == o.global_hash:
                via[host] = str((outcome.result or {}).get("via", "delta"))
                # The worker's own time (a resync's, when its first try did not hold).
                if (took := seconds((outcome.result or {}).get("seconds"))) is not None:
                    self.apply_s[host] = self.apply_s.get(host, 0.0) + took
            elif outcome.ending is Ending.RESULT:
                failed[host] = f"holds {held} after the sync, not {o.global_hash}"
            else:
                failed[host] = f"sync {outcome.ending.value}: {outcome.reason}"
        return failed

    def _shards_if_due(self, hosts: list[str]) -> list[dict[str, Any]] | None:
        """Fresh shard URLs for everyone once the oldest a host holds is half-way to expiry."""
        o = self.o
        if not any("name" in item for item in o.session.shards):
            return None  # URLs given by the caller: nothing to re-sign
        members = [o.membership.members[h] for h in hosts]
        if not any(time.monotonic() - mb.urls_at > o.session.url_ttl_s / 2 for mb in members):
            return None
        for mb in members:
            mb.urls_at = time.monotonic()
        return o.shard_descriptors()

    # ------------------------------------------------------------ resume

    def stop_inflight(self) -> None:
        """Stop the round a dead orchestrator left running, and wait (up to ``join_wait_s``)
        until its hosts are idle, so that they can rejoin at the next boundary."""
        o = self.o
        record = o.state.load_inflight() if o.state is not None else None
        if record is None:
            return
        round_num, tasks = record
        for host, task_id in tasks.items():
            try:
                o.client.stop(task_id, host)
            except Exception:  # Redis away: the task's worker rechecks the stop key later
                continue
            o.note(host, "stopped-after-restart", round_num, task_id=task_id)
        until = time.monotonic() + o.session.join_wait_s
        while time.monotonic() < until:
            beats = o.membership.alive(tasks)
            if all(b is None or b.get("task_id") not in tasks.values() for b in beats.values()):
                break
            time.sleep(POLL_S)
        assert o.state is not None
        o.state.clear_inflight()
