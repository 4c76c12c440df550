"""The keeper of a work dir's one session: it loads it, restores it after a crash, syncs its
model, ships its rounds' deltas and closes it.

The facade (:class:`executor.core.Executor`) parses each request once and hands it here;
the keeper owns the model files, the manifest and the session's dataset, and tells the
round runner when a session opens and closes. Nothing here reads the settings: what it
needs comes in its :class:`SessionConfig`, built once where the Executor is built.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from executor import placement, transfer
from executor.delta import max_delta_bytes, read_delta, state_hash, zstd_bound
from executor.errors import ErrorInfo, HashMismatch, InvalidRequest, RoundhouseError, map_exceptions
from executor.fileio import empty_dir, remove_quietly
from executor.results import ApplyOutcome, DeltaInfo, LoadResult, RoundResult
from executor.rounds import RoundOutcome, RoundRunner, round_result
from executor.session._assembling import sync_sharded
from executor.session._loading import LoadPipeline
from executor.session._manifest import read_manifest, write_manifest
from executor.session._model import ModelFiles, ModelLimits
from executor.session._overlap import Overlap, RoundEnd
from executor.session._reducing import DeferredStore, ReduceRequest, reduce_on_host
from executor.session._requests import LoadRequest, QuantConfig, RoundRequest, SyncRequest
from executor.session._shipping import ship_delta, ship_overlapped
from executor.session._state import Session
from executor.shards import ShardCache, ShardDescriptor, ShardSession
from executor.stopping import DoneThread, StopSignal
from executor.transfer import Progress
from executor.urls import Url

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionConfig:
    """What a session's life needs to know (the settings of the same names)."""

    model: ModelLimits
    quant: QuantConfig
    max_script_bytes: int
    stage_first_shard: bool
    stop_join_timeout_s: float


class SessionKeeper:
    """One work dir's session (``current``), from its load to its close."""

    def __init__(
        self,
        models: ModelFiles,
        config: SessionConfig,
        *,
        transfer_config: transfer.TransferConfig,
        cache: ShardCache,
        private_cache: bool,
        runner: RoundRunner,
        stop: StopSignal,
        progress: Callable[[str], Progress],
    ) -> None:
        self.work_dir = models.work_dir
        self.models = models
        self.config = config
        self._transfer = transfer_config
        self._cache = cache
        # Private: shards live in the work dir and are dropped with the session (the seed's).
        self._private_cache = private_cache
        self._runner = runner
        self._stop = stop
        self._progress = progress
        self.current: Session | None = None
        self.overlap = Overlap(models.model_dir, transfer_config, config.stop_join_timeout_s)

    def require(self) -> Session:
        if self.current is None:
            raise InvalidRequest("no model is loaded: send load_model first")
        return self.current

    # ------------------------------------------------------------ load and restore

    def load(self, request: LoadRequest) -> LoadResult:
        """Download and validate the model, stage one shard, start the next one's prefetch.

        The model download, the first shard and the sandboxed runner's start run at once
        (``_loading``). A failure leaves the current session as it was (never a half-written
        file); only its warm runner, taken at the start, is started again at its next round.
        """
        started = time.monotonic()
        if not self._private_cache:
            self._cache.check_fits(request.descriptors)
        self.end_overlap()  # a new model: no earlier round's progress rides on it
        pipeline = LoadPipeline(
            self.models,
            self._runner,
            self._stop,
            stage_first_shard=self.config.stage_first_shard,
            join_timeout_s=self.config.stop_join_timeout_s,
        )
        dataset = self.dataset(request.tenant, request.descriptors)
        try:
            staged = pipeline.run(request, dataset=dataset, previous=self.current)
        except BaseException:
            self._runner.replenish()  # a load that took the spare and failed: the next one's
            raise
        # The previous session's dataset was closed by the pipeline, its runner replaced.
        self.current = session = Session.of(request, staged.model, staged.dataset)
        write_manifest(session, self.work_dir)
        self._runner.open(session, warm=True)  # warm: torch and CUDA load now, not in round 1
        self._runner.replenish()  # the load took the spare: the next session's starts now
        artifact = staged.artifact
        logger.info("load complete: %d keys, hash %s", artifact.keys, session.model_hash)
        return LoadResult(
            session.model_hash,
            artifact.keys,
            artifact.bytes,
            staged.staged_shard,
            time.monotonic() - started,
            artifact.source_format,
        )

    def dataset(self, tenant: str, descriptors: list[ShardDescriptor]) -> ShardSession:
        return ShardSession(
            self._cache,
            tenant,
            descriptors,
            abort=self._stop,
            progress=self._progress("shard"),
            retain=not self._private_cache,
        )

    def rehydrate(self) -> Session | None:
        """The session a previous process left in this work dir (its manifest and model file),
        opened cold; None, leaving nothing changed, when there is nothing usable."""
        self.overlap.working.drop()  # a dead process's working copy: its base is not known to be current
        manifest = read_manifest(self.work_dir)
        if manifest is None:
            return None
        try:
            request = manifest.request(max_script_bytes=self.config.max_script_bytes)
            model = self.models.installed(
                manifest.model_hash, manifest.fingerprint, manifest.preprocessor_config
            )
        except RoundhouseError as exc:
            logger.warning("session manifest not usable: %s", exc)
            return None
        if model is None:
            return None
        self.current = session = Session.of(request, model, self.dataset(request.tenant, request.descriptors))
        self._runner.open(session, warm=False)
        write_manifest(session, self.work_dir)
        return session

    # ------------------------------------------------------------ rounds and syncs

    def finish(
        self,
        request: RoundRequest,
        outcome: RoundOutcome | None,
        trained: Mapping[str, torch.Tensor] | None,
        dropped: Mapping[str, int],
    ) -> RoundResult:
        """The result of the round that just ended; a completed training round's delta shipped."""
        outcome = outcome or RoundOutcome.failed(ErrorInfo(InvalidRequest.code, "no round has run"))
        return round_result(
            outcome,
            round_num=request.spec.round_num,
            ship=partial(self.ship, trained, request) if request.spec.training else None,
            dropped=dropped,
        )

    def ship(self, trained: Mapping[str, torch.Tensor] | None, request: RoundRequest) -> DeltaInfo:
        """The round's delta written (and uploaded when the request names a URL)."""
        session, feedback = self.require(), self.config.quant.error_feedback
        if request.overlap is not None:
            return ship_overlapped(
                self.overlap, session, trained, request, work_dir=self.work_dir,
                transfer_config=self._transfer, abort=self._stop, error_feedback=feedback,
            )  # fmt: skip
        return ship_delta(
            session.start_path, trained, request, work_dir=self.work_dir,
            transfer_config=self._transfer, abort=self._stop, error_feedback=feedback,
        )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """The session's part of the worker's status."""
        session = self.current
        return {
            "model_hash": session.model_hash if session else None,
            "tenant": session.tenant if session else None,
            "num_shards": session.dataset.num_shards if session else 0,
        }

    def reduce(self, request: ReduceRequest, abort: threading.Event, running: bool) -> dict[str, Any]:
        """One shard of a sharded round reduced against the session's model (``_reducing``),
        between rounds (``running``: a round is, and the reduce is refused)."""
        if running:
            raise InvalidRequest("a round is running on this worker: reduce_shard runs between rounds")
        session = self.require()
        return reduce_on_host(
            request, session.model_path, session.model_hash, work_dir=self.work_dir,
            transfer_config=self._transfer, abort=abort,
        )  # fmt: skip

    def sync(self, request: SyncRequest) -> ApplyOutcome:
        """Apply the orchestrator's sync delta in place, else download the full model: a sync
        never fails *because of* the delta path. Only an explicit stop aborts instead."""
        started = time.monotonic()
        placement.empty_device_cache()
        self.end_overlap()  # the model is the global one now: no round's own progress rides on it
        session, stored = self.current, None
        if request.sharded is not None:  # a sharded round's N shards (docs/SHARDED.md)
            orders = [(j, s.result_hash, s.store) for j, s in enumerate(request.sharded.shards) if s.store]
            with DeferredStore(orders, self.work_dir, self._transfer, self._stop) as store:
                synced = sync_sharded(
                    self.models, session.model if session else None, request.model_url, request.base_hash,
                    request.result_hash, request.sharded, self._stop, self._transfer,
                )  # fmt: skip
            stored = store.outcome if orders else None
        else:
            synced = self.models.sync(
                session.model if session else None,
                request.model_url,
                request.delta_url,
                request.base_hash,
                request.result_hash,
            )
        if session is not None:
            session.update(synced.model, request.params, request.descriptors)
            write_manifest(session, self.work_dir)
        return ApplyOutcome(
            synced.via,
            synced.model.model_hash,
            time.monotonic() - started,
            synced.reason,
            synced.noop,
            stored,
        )

    # ------------------------------------------------------------ overlapped rounds

    def begin_round(self, request: RoundRequest) -> None:
        """Before a round starts: which file it starts from. An overlapped round starts from W
        when W is built on the global model it names; a sequential round ends overlap."""
        session = self.require()
        if request.overlap is None:
            self.end_overlap()
            return
        unchanged = session.model.file_unchanged()
        with map_exceptions({}, where="the work dir (working copy)"):
            session.working = self.overlap.start_path(
                request.overlap, session.model_path, session.model_hash, unchanged
            )

    def sync_beside(self, request: SyncRequest) -> ApplyOutcome:
        """An overlapped round's sync, applied to G while the round trains from W (on the
        inbox's thread; W, the round's file, is not touched)."""
        started = time.monotonic()
        session = self.require()
        synced = self.models.sync(
            session.model, request.model_url, request.delta_url, request.base_hash, request.result_hash
        )
        session.model = synced.model
        write_manifest(session, self.work_dir)
        return ApplyOutcome(
            synced.via, synced.model.model_hash, time.monotonic() - started, synced.reason, synced.noop
        )

    def fetch_correction(self, url: Url, expected_hash: str) -> None:
        """The common part of the next outer step that an overlapped sync order names (for the
        rebase at the round's end), within the model's bound and checked against its hash."""
        session = self.require()
        path = os.path.join(self.models.incoming, "eager-correction.zst")
        bound = max_delta_bytes(session.model_path)
        try:
            transfer.fetch(url, path, config=self._transfer, abort=self._stop, max_bytes=zstd_bound(bound))
            correction = read_delta(path, max_bytes=bound, allow_torch=False)
        finally:
            remove_quietly(path)
        if state_hash(correction) != expected_hash:
            raise HashMismatch("the eager step's correction does not match the hash its order names")
        self.overlap.correction = correction

    def end_overlapped_round(self) -> RoundEnd:
        """After an overlapped round: how its end went (its delta's pass waited for its sync and
        rebuilt W); a round that shipped nothing drops W."""
        if self.current is None:
            self.end_overlap()
            return RoundEnd(0.0, False, 0.0)
        self.current.working = None
        return self.overlap.end_round()

    def end_overlap(self) -> None:
        self.overlap.end()
        if self.current is not None:
            self.current.working = None

    # ------------------------------------------------------------ the end

    def wait_prefetch(self, deadline: float) -> None:
        if self.current is not None:
            self.current.dataset.wait_prefetch(max(0.0, deadline - time.monotonic()))

    def threads(self) -> list[DoneThread]:
        """The session's own threads (its dataset's prefetch), ended or not."""
        thread = self.current.dataset.prefetch_thread if self.current is not None else None
        return [thread] if thread is not None else []

    def wipe(self, tenant: str | None) -> int:
        """The tenant boundary: the session closed, the work dir emptied, and the cache entries
        of ``tenant`` (the session's, when None) removed. Returns the bytes wiped."""
        owner = tenant or (self.current.tenant if self.current else None)
        self.close()
        wiped = empty_dir(self.work_dir)
        if owner and not self._private_cache:
            wiped += self._cache.remove_tenant(owner)
        return wiped

    def close(self) -> None:
        """The session ends: its runner (the spare too: its directories are in the work dir)
        and its dataset (prefetch joined, pins released)."""
        self.end_overlap()
        session, self.current = self.current, None
        self._runner.close(spare=True)
        if session is not None:
            session.dataset.close(timeout_s=self.config.stop_join_timeout_s)
