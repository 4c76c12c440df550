"""Who trains: membership from the workers' heartbeats, elastic at round boundaries.

A worker's heartbeat key (``roundhouse:hosts:<host_id>``, DESIGN §5) lives for the
heartbeat TTL after its last beat. A member whose key is gone is **lost** — whatever
happened (the process tree killed, the link down, the machine off) — and nothing more is
waited for from it. A lost host whose heartbeat comes back **rejoins** at the next round
boundary; so does a host whose sync failed. A live, idle host that is not a member **joins**
when the session has room (``max_hosts``; only ``allowed`` hosts when names were given).
A host that fails to join ``max_failures`` times in a row is **dropped** for the session.

How a host (re)joins depends on what its heartbeat says it holds (:func:`join_kind`):

- ``apply``: a former member that still holds this session: ``apply_delta`` with the current
  hash, fresh shard URLs and no delta — a no-op when it holds the global model already (a
  restarted orchestrator finds its workers so: they are not loaded again), else a full
  download;
- ``load``: any other host (and one whose last join failed): ``load_model`` with the current
  global model.

Joins run while the rounds go on; :class:`Membership` keeps each join's task and the hash
it is to produce, and the orchestrator decides at each boundary and sync who is active.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from celery.result import AsyncResult

from tasks.client import RoundClient

MAX_FAILURES = 3


class HostState(StrEnum):
    ACTIVE = "active"  # holds the global model, takes part in rounds
    JOINING = "joining"  # a load_model / re-sync is in flight
    LOST = "lost"  # its heartbeat expired; may come back
    RESYNC = "resync"  # its sync failed, or its state is unknown (a restart): re-sync before use
    DROPPED = "dropped"  # failed to join too often: not used again in this session


@dataclass
class Join:
    """A join in flight: the task, what kind, and the hash it is to leave on the host."""

    kind: str  # "load" | "full" | "refresh"
    task: AsyncResult
    target_hash: str
    started: float = field(default_factory=time.monotonic)


@dataclass
class Member:
    host: str
    state: HostState
    shard_index: int
    since_round: int = 0
    failures: int = 0
    held_session: bool = False  # a join of this session succeeded once: it has our code and shards
    join: Join | None = None
    urls_at: float = field(default_factory=time.monotonic)  # when its shard URLs were signed

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "state": self.state.value,
            "shard_index": self.shard_index,
            "since_round": self.since_round,
            "failures": self.failures,
            "held_session": self.held_session,
        }


def join_kind(member: Member, beat: Mapping[str, Any], tenant: str) -> str:
    """How a live host that is not active gets the global model: ``apply`` (an ``apply_delta``
    without a delta: a no-op when it holds the model already, else a full download) for a
    former member that still holds this session, ``load`` for anyone else."""
    holds_session = beat.get("state") == "loaded" and beat.get("tenant") == tenant
    if member.held_session and holds_session and member.failures == 0:
        return "apply"
    return "load"  # a stranger, a former member that lost its session (a reset), or one that failed


class Membership:
    """The session's hosts and their states; ``note`` tells the story of each."""

    def __init__(
        self,
        client: RoundClient,
        tenant: str,
        *,
        max_hosts: int,
        allowed: Iterable[str] | None = None,
        note: Callable[..., None] | None = None,
    ) -> None:
        self.client = client
        self.tenant = tenant
        self.max_hosts = max_hosts
        self.allowed = set(allowed) if allowed is not None else None
        self.members: dict[str, Member] = {}
        self._note = note or (lambda *args, **kwargs: None)

    # ------------------------------------------------------------ heartbeats

    def beats(self) -> dict[str, dict[str, Any]]:
        """Every live worker's heartbeat, by host."""
        return {str(beat.get("host_id")): beat for beat in self.client.hosts(brief=True)}

    def alive(self, hosts: Iterable[str]) -> dict[str, dict[str, Any] | None]:
        """The heartbeat of each of ``hosts`` (None: expired, or not a beat of that host), in one
        round trip."""
        return self.client.beats(list(hosts))

    # ------------------------------------------------------------ states

    def with_state(self, *states: HostState) -> list[str]:
        return sorted(host for host, m in self.members.items() if m.state in states)

    def active(self) -> list[str]:
        return self.with_state(HostState.ACTIVE)

    def set(self, host: str, state: HostState, round_num: int, event: str, **data: Any) -> None:
        member = self.members[host]
        member.state = state
        member.since_round = round_num
        if state is not HostState.JOINING:
            member.join = None
        self._note(host, event, round_num, **data)

    def add(self, host: str, round_num: int) -> Member:
        index = len(self.members)
        member = self.members[host] = Member(host, HostState.RESYNC, index, round_num)
        return member

    def failed(self, host: str, round_num: int, reason: str) -> None:
        """A join or sync that did not work: re-sync later, or drop after too many."""
        member = self.members[host]
        member.failures += 1
        if member.failures >= MAX_FAILURES:
            self.set(host, HostState.DROPPED, round_num, "dropped", reason=reason, failures=member.failures)
        else:
            self.set(host, HostState.RESYNC, round_num, "resync-needed", reason=reason)

    # ------------------------------------------------------------ who may join

    def candidates(self, beats: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Live, idle hosts that may (re)join now: former members first, then new ones,
        up to ``max_hosts`` active or joining."""
        room = self.max_hosts - len(self.with_state(HostState.ACTIVE, HostState.JOINING))
        former, strangers = [], []
        for host, beat in sorted(beats.items()):
            if beat.get("state") == "running":
                continue  # busy: ours from a round that was stopped, or someone else's
            member = self.members.get(host)
            if member is not None:
                if member.state in (HostState.LOST, HostState.RESYNC):
                    former.append(host)
            elif self.allowed is not None:
                if host in self.allowed:
                    strangers.append(host)
            elif beat.get("state") == "idle" or beat.get("tenant") == self.tenant:
                strangers.append(host)  # a host loaded by another tenant is someone else's
        return (former + strangers)[: max(0, room)]

    # ------------------------------------------------------------ checkpoints

    def to_json(self) -> dict[str, Any]:
        return {host: member.to_json() for host, member in sorted(self.members.items())}

    def restore(self, saved: Mapping[str, Mapping[str, Any]]) -> None:
        """Members from a checkpoint. Whatever they were, what they hold now is unknown:
        the active and joining ones must prove it (a ``refresh``) before the next round."""
        for host, data in saved.items():
            state = HostState(data["state"])
            if state in (HostState.ACTIVE, HostState.JOINING):
                state = HostState.RESYNC
            self.members[host] = Member(
                host, state, int(data["shard_index"]), int(data["since_round"]), int(data.get("failures", 0)),
                bool(data.get("held_session", False)),
            )  # fmt: skip
