"""A reference DiLoCo-style orchestrator on top of :class:`tasks.client.RoundClient`.

One training session over a changing set of workers:

1. ``load_model`` on the starting hosts (the global model, the shards, the code);
2. per round, at its boundary, membership is brought up to date from the heartbeats
   (:mod:`orchestrator.membership`): lost hosts that are back and new idle hosts join;
3. ``run_round`` on every active host with a URL to PUT its trained delta to; the round
   ends at its deadline, or at quorum plus a grace (:mod:`orchestrator.collect`): lost hosts
   and stragglers are stopped and left out;
4. each completed delta is fetched and folded into a running mean as it arrives
   (:mod:`orchestrator.aggregate`), and an outer step (SGD, Nesterov) gives the next global
   model — unless fewer than ``min_hosts`` completed: then the model stays as it was;
5. the fp16 sync delta from the old to the new global model is built with
   :func:`executor.delta.make_sync_delta`; the exact state every worker will hold
   (``.result``) is published as the full-download fallback and checkpointed
   (:mod:`orchestrator.checkpoint`);
6. ``apply_delta`` on every active host (the worker itself falls back to the full download
   when its base does not match); a host whose sync fails is re-synced by a full download,
   and failing that is left to rejoin later, or dropped — the run never stops for one host.

The outer step is :mod:`orchestrator.outer`'s. With ``Session(overlap=True)`` the rounds
overlap (:mod:`orchestrator.overlap`, docs/OVERLAP.md): round k+1 trains while round k's
deltas are folded and its sync travels to the hosts as a signed order, not a task.

Artifacts live in an :class:`~orchestrator.artifacts.ArtifactStore` and workers reach them
by URL only: :class:`orchestrator.artifacts.ArtifactServer` or :class:`orchestrator.s3.S3Store`.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from executor.delta import SyncFeedback, max_delta_bytes, state_hash, write_delta, zstd_bound
from executor.fileio import atomic_writer, remove_tree
from executor.tensorfile import write_state
from orchestrator.aggregate import DeltaFolder
from orchestrator.artifacts import ArtifactServer, ArtifactStore
from orchestrator.checkpoint import Checkpoint, StateDir
from orchestrator.collect import Deadline, Ending, Outcome, Waiter, round_failure, round_loss
from orchestrator.elastic import Elastic
from orchestrator.membership import HostState, Membership
from orchestrator.outer import OuterOptimizer, mean_delta
from orchestrator.overlap import OverlappedLoop, await_uploads
from orchestrator.phases import PhaseClock, worker_phases
from orchestrator.records import RoundSummary, Session
from orchestrator.sharded import ShardedLoop
from orchestrator.sharded_state import ShardedState, checked_sharding
from tasks.client import RoundClient

__all__ = [
    "ArtifactStore",
    "Orchestrator",
    "OuterOptimizer",
    "RoundSummary",
    "Session",
    "mean_delta",
    "pick_hosts",
]

logger = logging.getLogger(__name__)


class Orchestrator:
    def __init__(
        self,
        client: RoundClient,
        store: ArtifactStore,
        model: Mapping[str, torch.Tensor],
        session: Session,
        *,
        outer: OuterOptimizer | None = None,
        on_round_start: Callable[[int, dict[str, str]], None] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        on_summary: Callable[[RoundSummary], None] | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        fetch_parallel: int = 4,
        deltas_in_memory: int = 2,
        round_done: int = -1,
    ) -> None:
        self.client = client
        self.store = store
        self.session = session
        self.outer = outer or OuterOptimizer()
        self.sync_feedback = SyncFeedback(session.sync_delta_dtype)
        self.global_state = {k: v.detach().cpu().contiguous() for k, v in model.items()}
        self.layout = self.global_state  # the session's first model: a sharded session's layout
        self.global_hash = state_hash(self.global_state)
        if isinstance(store, ArtifactServer):  # its PUTs: no larger than this model's largest delta
            store.max_put_bytes = min(store.max_put_bytes, zstd_bound(max_delta_bytes(self.global_state)))
        self.round_done = round_done  # the last round whose outer step is in global_state
        self.total_rounds = 0
        self.history: list[RoundSummary] = []
        self.story: list[dict[str, Any]] = []
        self.fetch_parallel, self.deltas_in_memory = fetch_parallel, deltas_in_memory
        self._on_round_start = on_round_start
        self._on_event = on_event
        self._on_summary = on_summary
        self.state = StateDir(state_dir) if state_dir is not None else None
        # Fetched deltas, the sync delta: beside the checkpoint (a dead process's leftovers
        # are cleared at the next start), else in a temp dir.
        scratch_root = None
        if self.state is not None:
            scratch_root = os.path.join(self.state.path, "scratch")
            remove_tree(scratch_root, ignore_errors=True)
            os.makedirs(scratch_root)
        self._scratch = self.scratch = tempfile.mkdtemp(prefix="orchestrator-", dir=scratch_root)
        self._run_id = secrets.token_hex(4)  # this process's uploads never collide with a dead one's
        self.membership = Membership(
            client, session.tenant, max_hosts=session.max_hosts or len(session.hosts),
            allowed=session.allowed_hosts, note=self.note,
        )  # fmt: skip
        self.waiter = Waiter(client, self.membership.alive)
        self.elastic = Elastic(self)
        self.sharded = ShardedState(checked_sharding(session), self._run_id)
        self._model_name = self._publish_global(self._model_file(self.global_state))

    # ------------------------------------------------------------ start, resume

    @classmethod
    def resume(
        cls, client: RoundClient, store: ArtifactStore, state_dir: str | os.PathLike[str], **options: Any
    ) -> Orchestrator:
        """The session checkpointed in ``state_dir``, ready for its next round: the previous
        process's round in flight is stopped, and its hosts rejoin at the next boundary
        (those that hold the checkpointed model without being loaded again)."""
        saved = StateDir(state_dir).load()
        outer = OuterOptimizer(**saved.outer, velocity=saved.velocity)
        self = cls(
            client, store, saved.model, Session.from_json(saved.session), outer=outer,
            state_dir=state_dir, round_done=saved.round_done, **options,
        )  # fmt: skip
        self.total_rounds = saved.total_rounds
        self.history = [RoundSummary.from_json(h) for h in saved.history]
        self.membership.restore(saved.members)
        self.sync_feedback.residual = dict(saved.sync_residual)
        if saved.sharded is not None:  # the model is the store's shards; this one is the layout
            self.sharded = ShardedState.from_json(saved.sharded, self._run_id)
            self.global_hash = self.sharded.global_hash or self.global_hash
        self.note(None, "resumed", saved.round_done + 1, global_hash=self.global_hash)
        self.elastic.stop_inflight()
        if saved.sharded is not None:
            ShardedLoop(self).settle()
        return self

    @property
    def next_round(self) -> int:
        return self.round_done + 1

    def load(self) -> None:
        """``load_model`` on the starting hosts; those that fail are left to join later."""
        for host in self.session.hosts:
            if host not in self.membership.members:
                self.membership.add(host, self.next_round)
        self.elastic.boundary(self.next_round, wait_s=self.session.sync_timeout_s)
        self._checkpoint()

    def run(self, rounds: int) -> list[RoundSummary]:
        """Every round from the next one to ``rounds`` (the history has them all)."""
        if self.session.overlap:
            return OverlappedLoop(self).run(rounds)
        if self.session.aggregation == "sharded":
            return ShardedLoop(self).run(rounds)
        self.total_rounds = rounds
        for round_num in range(self.next_round, rounds):
            self.round(round_num, rounds)
        return self.history

    # ------------------------------------------------------------ one round

    def round(self, round_num: int, total_rounds: int) -> RoundSummary:
        started = time.monotonic()
        session, clock = self.session, PhaseClock()
        self.total_rounds = max(self.total_rounds, total_rounds)
        self.elastic.boundary(round_num)
        hosts = self.membership.active()
        with clock.phase("dispatch"):
            pending = {
                host: self.client.run_round(
                    host, steps=session.steps, round_num=round_num, total_rounds=total_rounds,
                    step_offset=round_num * session.steps, delta_dtype=session.delta_dtype,
                    delta_url=self.store.url_put(self.delta_name(round_num, host)),
                )
                for host in hosts
            }  # fmt: skip
        if self.state is not None:
            self.state.save_inflight(round_num, {host: task.id for host, task in pending.items()})
        self.round_started(round_num, {host: result.id for host, result in pending.items()})
        outcomes, mean, folded_errors = self.collect(round_num, pending, clock)
        excluded = {h: why for h, o in outcomes.items() if (why := round_failure(o) or folded_errors.get(h))}
        included = sorted(h for h in outcomes if h not in excluded)
        losses = {h: loss for h in included if (loss := round_loss(outcomes[h])) is not None}
        for host, outcome in outcomes.items():
            self.note_outcome(round_num, outcome, excluded.get(host))
        kept = len(included) < session.min_hosts
        if kept:
            self.note(None, "model-kept", round_num, completed=len(included), min_hosts=session.min_hosts)
        with clock.phase("outer"):
            new_state = None if kept else self.outer.step(self.global_state, mean)
        via = self.sync_now(round_num, new_state, clock)
        host_phases = {h: worker_phases(o.result) for h, o in outcomes.items() if o.completed}
        for host, seconds in self.elastic.apply_s.items():
            host_phases.setdefault(host, {})["apply"] = seconds
        summary = RoundSummary(
            round_num, losses, included, excluded, via, self.global_hash, time.monotonic() - started, kept,
            sorted(h for h, o in outcomes.items() if o.ending is Ending.LOST), self.membership.active(),
            clock.to_json(), host_phases,
        )  # fmt: skip
        self.finish_round(summary)
        if self.state is not None:
            self.state.clear_inflight()
        return summary

    def round_started(self, round_num: int, task_ids: dict[str, str]) -> None:
        if self._on_round_start is not None:
            self._on_round_start(round_num, task_ids)

    def finish_round(self, summary: RoundSummary) -> None:
        """A round's summary into the history, and the checkpoint's state after it (its model is
        in already, or unchanged)."""
        self.history.append(summary)
        if self.state is not None:
            self.state.update(
                round_done=summary.round_num,
                members=self.membership.to_json(),
                history=[s.to_json() for s in self.history],
            )
        logger.info(
            "round %d: mean loss %s, excluded %s", summary.round_num, summary.mean_loss, summary.excluded
        )
        if self._on_summary is not None:
            self._on_summary(summary)

    def delta_name(self, round_num: int, host: str) -> str:
        return f"deltas/round-{round_num}/{self._run_id}/{host}.safetensors.zst"

    def collect(
        self, round_num: int, pending: Mapping[str, Any], clock: PhaseClock
    ) -> tuple[dict[str, Outcome], dict[str, torch.Tensor], dict[str, str]]:
        """Wait for the round (deadlines, heartbeats), folding each delta as it is reported;
        returns the outcomes, the mean of the good deltas, and why the others were refused."""
        outcomes, folder = self.wait_folding(round_num, pending, clock)
        return outcomes, *self.folded(folder, clock)

    def wait_folding(
        self, round_num: int, pending: Mapping[str, Any], clock: PhaseClock
    ) -> tuple[dict[str, Outcome], DeltaFolder]:
        """The round's outcomes, each completed delta handed to the folder as it is reported
        (:meth:`folded` waits for the folding to end and closes the folder)."""
        folder = DeltaFolder(
            self.store, os.path.join(self._scratch, f"round-{round_num}"), self.global_state,
            parallel=self.fetch_parallel, in_memory=self.deltas_in_memory,
        )  # fmt: skip

        def fold(outcome: Outcome) -> None:
            if outcome.completed and outcome.result is not None:
                delta, name = outcome.result["delta"], self.delta_name(round_num, outcome.host)
                if isinstance(delta, dict) and delta.get("upload") == "deferred":
                    # Hashed and PUT beside the next round: the hash comes with the upload's report.
                    reported = delta.get("hash")
                    folder.deferred[outcome.host] = (
                        name,
                        round_num,
                        reported if isinstance(reported, str) else None,
                    )
                else:
                    folder.submit(outcome.host, name, delta["hash"])

        session = self.session
        try:
            deadline = Deadline(session.round_deadline_s, session.quorum, session.grace_s)
            with clock.phase("wait"):
                return self.waiter.wait(pending, deadline, on_outcome=fold), folder
        except BaseException:
            folder.close()
            raise

    def folded(
        self, folder: DeltaFolder, clock: PhaseClock
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The mean of the good deltas, and why the others were refused."""
        try:
            with clock.phase("fold"):  # what folding adds after the last result is in
                await_uploads(folder, self.membership.alive, self.session.round_deadline_s)
                errors = {host: f.error for host, f in folder.results().items() if f.error}
                return (folder.mean.mean() if folder.mean.count else {}), errors
        finally:
            folder.close()

    def note_outcome(self, round_num: int, outcome: Outcome, why: str | None) -> None:
        host = outcome.host
        if outcome.ending is Ending.LOST:
            self.membership.set(
                host, HostState.LOST, round_num, "lost", reason=outcome.reason,
                last_beat_ts=outcome.last_beat_ts, detected_ts=outcome.detected_ts,
            )  # fmt: skip
        elif outcome.ending is Ending.STRAGGLER:
            self.note(host, "straggler-stopped", round_num, reason=outcome.reason)
        elif why is not None:
            self.note(host, "left-out", round_num, reason=why)

    # ------------------------------------------------------------ the sync

    def sync_now(
        self, round_num: int, new_state: dict[str, torch.Tensor] | None, clock: PhaseClock
    ) -> dict[str, str]:
        """Publish the new global model and bring every active host to it."""
        published = self.publish_sync(round_num, new_state, clock)
        if published is None:  # nothing to average: the model, and what every host holds, stay
            return {}
        with clock.phase("apply"):
            return self.elastic.sync_all(round_num, *published)

    def publish_sync(
        self, round_num: int, new_state: dict[str, torch.Tensor] | None, clock: PhaseClock
    ) -> tuple[str, str] | None:
        """Round ``round_num``'s new global model, made current, checkpointed and published with
        the sync delta to it; the delta's URL and base hash (None: the model did not change)."""
        self.round_done = round_num
        if new_state is None:
            return None
        delta_name = f"sync/round-{round_num}-{self._run_id}.safetensors.zst"
        delta_file = os.path.join(self._scratch, "sync.zst")
        with clock.phase("sync_build"):
            # The base is the model every host holds, whose hash the last sync computed.
            sync = self.sync_feedback.build(self.global_state, new_state, base_hash=self.global_hash)
            write_delta(sync.delta, delta_file)
        with clock.phase("publish"):
            self.store.publish(delta_name, delta_file)
            self.global_state, self.global_hash = sync.result, sync.result_hash
            # Checkpointed before any host is told: a crash from here on resumes with this model.
            self._model_name = self._publish_global(self._checkpoint() or self._model_file(sync.result))
        return self.store.url_get(delta_name), sync.base_hash

    def publish_delta(self, name: str, delta: Mapping[str, torch.Tensor]) -> tuple[str, str]:
        """``delta`` as a delta file in the store under ``name`` (this process's run id added):
        its URL and hash."""
        path = os.path.join(self._scratch, "published.zst")
        written = write_delta(delta, path)
        stored = f"{name}-{self._run_id}.safetensors.zst"
        self.store.publish(stored, path)
        return self.store.url_get(stored), written.hash

    def _model_file(self, state: Mapping[str, torch.Tensor]) -> str:
        path = os.path.join(self._scratch, "global.safetensors")
        with atomic_writer(path) as file:
            write_state(file, state)
        return path

    def _publish_global(self, path: str) -> str:
        name = f"model/global-{self.round_done + 1}.safetensors"
        self.store.publish(name, path)
        return name

    def rejoin(self, host: str, shards: list[dict[str, Any]]) -> Any:
        """``apply_delta`` that brings a host that holds this session to the global model: the
        full model, or in a sharded session once a round has reduced, the model assembled from
        its state shards and the session's first model (its layout)."""
        if self.sharded.state:
            return self.client.apply_delta(
                host, self.model_url(), delta_url=self.sharded.sync_shards(self.store),
                result_hash=self.global_hash, params=self.session.params, dataset_shards=shards,
            )  # fmt: skip
        return self.client.apply_delta(
            host,
            self.model_url(),
            result_hash=self.global_hash,
            params=self.session.params,
            dataset_shards=shards,
        )

    def model_url(self) -> str:
        return self.store.url_get(self._model_name, self.session.url_ttl_s)

    def shard_descriptors(self) -> list[dict[str, Any]]:
        """The session's shards with URLs signed now (a stored shard's id is its name, so a
        worker's cache keeps it across URL changes)."""
        out = []
        for item in self.session.shards:
            if "name" in item:
                fresh = {k: v for k, v in item.items() if k != "name"}
                fresh["url"] = self.store.url_get(item["name"], self.session.url_ttl_s)
                fresh.setdefault("id", item["name"])
                out.append(fresh)
            else:
                out.append(dict(item))
        return out

    # ------------------------------------------------------------ checkpoints, the story

    def _checkpoint(self) -> str | None:
        """Save the state dir (if any); returns the checkpointed model file."""
        if self.state is None:
            return None
        saved = self.state.save(
            Checkpoint(
                self.round_done, self.total_rounds, self.global_state, self.outer.velocity,
                self.outer.settings(), self.session.to_json(), self.membership.to_json(),
                [s.to_json() for s in self.history], sync_residual=self.sync_feedback.residual,
            )
        )  # fmt: skip
        return str(saved)

    def note(self, host: str | None, event: str, round_num: int, **data: Any) -> None:
        record = {"ts": time.time(), "round": round_num, "host": host, "event": event, **data}
        self.story.append(record)
        logger.info("round %s: %s %s %s", round_num, host or "-", event, data or "")
        if self.state is not None:
            self.state.append_event(record)
        if self._on_event is not None:
            self._on_event(record)

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Each active host's ``status`` (what it holds, from the worker itself)."""
        return {host: self.client.status(host).get(timeout=60) for host in self.membership.active()}

    def close(self) -> None:
        remove_tree(self._scratch, ignore_errors=True)


def pick_hosts(client: RoundClient, count: int, *, wait_s: float = 60.0) -> list[str]:
    """``count`` idle live workers from the heartbeat registry (waiting for them to appear)."""
    deadline = time.monotonic() + wait_s
    while True:
        idle = [beat["host_id"] for beat in client.hosts(idle_only=True, brief=True)]
        if len(idle) >= count or time.monotonic() > deadline:
            if len(idle) < count:
                raise RuntimeError(f"wanted {count} idle workers, found {len(idle)}: {idle}")
            return sorted(idle)[:count]
        time.sleep(0.5)
