"""The Executor: one per process, persisting across tasks (DESIGN §1).

``load`` downloads and validates the model and stages the first shard; ``run``
starts a round of tenant code (in a thread, or in the sandboxed runner);
``finish_round`` turns its outcome into a result and a trained delta;
``update_model`` applies the orchestrator's sync delta, falling back to a full
download; ``reset`` is the tenant boundary. The public methods and signatures
are the seed's, with keyword-only additions.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from safetensors.torch import load_file

from executor import placement, transfer
from executor.delta import DEFAULT_SCHEME, check_scheme
from executor.errors import CleanupFailed, ErrorInfo, InvalidRequest
from executor.fileio import MIB, empty_dir, own_dir, remove_tree
from executor.loading import LoadPipeline
from executor.modelfile import ModelFiles
from executor.results import ApplyOutcome, ExecutorState, LoadResult, RoundResult
from executor.rounds import (
    InThreadRunner,
    RoundBudget,
    RoundOutcome,
    RoundRunner,
    RoundSpec,
    failure,
    round_result,
    ship_delta,
    validate_script,
)
from executor.sandbox import SandboxedRunner
from executor.session import (
    Session,
    check_load_args,
    check_round_args,
    check_update_args,
    parse_delta_dtype,
    session_from_manifest,
    write_manifest,
)
from executor.shards import ShardCache, ShardDescriptor, ShardSession
from executor.stopping import DoneThread, StopSignal
from executor.workdir import SessionDir
from settings import Settings, get_settings

logger = logging.getLogger(__name__)

StatsCallback = Callable[[dict[str, Any]], None]
LogCallback = Callable[[str], None]
StateCallback = Callable[[dict[str, Any]], None]


class Executor:
    def __init__(
        self,
        emit_stats: StatsCallback,
        emit_log: LogCallback,
        host_id: str = "",
        shard_cache_max_mb: int | None = None,
        stage_first_shard: bool | None = None,
        work_dir: str | None = None,
        sandboxed: bool = False,
        *,
        settings: Settings | None = None,
        cache_dir: str | None = None,
        session_dir: str | None = None,
        emit_state: StateCallback | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        # Tenant code's events and logs go through the round's budget, counted here in the worker.
        self._budget = RoundBudget.for_settings(self.settings, emit_stats, emit_log)
        self._emit_state = emit_state or (lambda _data: None)
        self._host_id = host_id or self.settings.host_id
        self._stage_first_shard = (
            self.settings.stage_first_shard if stage_first_shard is None else stage_first_shard
        )
        self._tmpdir = own_dir(work_dir or self.settings.work_dir, session_dir, prefix="task-")
        self._transfer = transfer.TransferConfig.from_settings(self.settings)
        cache_mb = self.settings.shard_cache_max_mb if shard_cache_max_mb is None else shard_cache_max_mb
        # <= 0 keeps the seed's meaning: no shared cache and no prefetch; shards live in the work dir.
        self._cache_private = cache_mb <= 0
        self._cache = ShardCache.for_settings(
            self.settings,
            SessionDir(self._tmpdir).private_shards
            if self._cache_private
            else (cache_dir or self.settings.cache_dir),
            cache_mb * MIB if not self._cache_private else 1 << 62,
            transfer_config=self._transfer,
        )
        self._stop_event = StopSignal()
        self._models = ModelFiles.for_settings(
            self._tmpdir, self.settings, abort=self._stop_event, progress=self._progress_reporter
        )
        self._models.clean_leftovers()
        self._runner = self._round_runner(sandboxed)
        self._runner.replenish()  # a spare runner while the worker waits for its first load
        self._thread: DoneThread | None = None
        self._session: Session | None = None
        self._round = RoundSpec(100, 0, 1, 0, "training")
        self._outcome: RoundOutcome | None = None
        self.original_state: dict[str, torch.Tensor] | None = None
        self.modified_state: dict[str, torch.Tensor] | None = None

    def _round_runner(self, sandboxed: bool) -> RoundRunner:
        """The sandboxed runner (DESIGN §8), or a thread of this process when trusted."""
        if sandboxed:
            return SandboxedRunner.for_settings(
                self.settings,
                self._tmpdir,
                self._models.model_dir,
                host_id=self._host_id,
                emit_log=self._budget.log,
                emit_stats=self._budget.stats,
            )
        return InThreadRunner(
            self._stop_event,
            host_id=self._host_id,
            offload_dir=SessionDir(self._tmpdir).model_offload,
            emit_stats=self._budget.stats,
            emit_log=self._budget.log,
        )

    # ------------------------------------------------------------ properties

    @property
    def sandbox_mode(self) -> str:
        """``bwrap`` | ``unshare`` when tenant code runs sandboxed, ``off`` when in-thread."""
        return self._runner.mode

    @property
    def work_dir(self) -> str:
        return self._tmpdir

    @property
    def abort_event(self) -> threading.Event:
        """The session's stop signal; transfers abort between chunks when it is set."""
        return self._stop_event

    @property
    def cache(self) -> ShardCache:
        return self._cache

    @property
    def session(self) -> Session | None:
        return self._session

    @property
    def state(self) -> ExecutorState:
        if self.is_running():
            return ExecutorState.RUNNING
        return ExecutorState.LOADED if self._session is not None else ExecutorState.IDLE

    def is_running(self) -> bool:
        return bool(self._thread and self._thread.running)

    # The seed's attributes for the last round, read from its one outcome.

    @property
    def execution_error(self) -> dict[str, Any] | None:
        error = self._outcome.error if self._outcome is not None else None
        return error.to_json() if error is not None else None

    @property
    def report(self) -> dict[str, Any] | None:
        return self._outcome.report if self._outcome is not None else None

    @property
    def training_time(self) -> float:
        return self._outcome.training_time if self._outcome is not None else 0.0

    # ------------------------------------------------------------ load phase

    def load(
        self,
        model_url: str,
        dataset_shards: Sequence[Mapping[str, Any] | str],
        code: str,
        batch_size: int = 32,
        params: dict[str, Any] | None = None,
        initial_shard_index: int = 0,
        *,
        tenant: str = "default",
        hash_scheme: str = DEFAULT_SCHEME,
    ) -> LoadResult:
        """Download and validate the model, stage one shard, and start the next one's prefetch.

        The model download, the first shard and the sandboxed runner's start run at once
        (``executor.loading``); the model hash (``hash_scheme``: ``sha256`` or ``blake3``)
        follows the bytes as they land. Nothing is touched until the request validates; a
        failure after that leaves the current session as it was (never a half-written file).
        """
        started = time.monotonic()
        if self.is_running():
            raise InvalidRequest("a round is running on this worker: stop it before loading")
        self._stop_event.clear()
        compiled = validate_script(code, max_bytes=self.settings.max_script_bytes)
        args = check_load_args(model_url, dataset_shards, batch_size, params, initial_shard_index, tenant)
        scheme = check_scheme(hash_scheme)
        if not self._cache_private:
            self._cache.check_fits(args.descriptors)
        pipeline = LoadPipeline(
            self._models,
            self._runner,
            self._stop_event,
            stage_first_shard=self._stage_first_shard,
            join_timeout_s=self.settings.stop_join_timeout_s,
        )
        dataset = self._dataset(args.tenant, args.descriptors)
        try:
            staged = pipeline.run(
                model_url, args, code, scheme=scheme, dataset=dataset, previous=self._session
            )
        except BaseException:
            self._runner.replenish()  # a load that took the spare and failed: the next one's
            raise
        model, artifact = staged.model, staged.artifact
        # The previous session's dataset was closed by the pipeline, its runner replaced.
        self._session = session = Session(
            tenant=args.tenant,
            model_url=model_url,
            model=model,
            code=code,
            compiled=compiled,
            params=args.params,
            batch_size=args.batch_size,
            dataset=staged.dataset,
        )
        write_manifest(session, self._tmpdir)
        self._runner.open(session, warm=True)  # warm: torch and CUDA load now, not in round 1
        self._runner.replenish()  # the load took the spare: the next session's starts now
        self.original_state = self.modified_state = None
        self._outcome = None
        logger.info("load complete: %d keys, hash %s", artifact.keys, model.model_hash)
        return LoadResult(
            model.model_hash,
            artifact.keys,
            artifact.bytes,
            staged.staged_shard,
            time.monotonic() - started,
            artifact.source_format,
        )

    def _dataset(self, tenant: str, descriptors: list[ShardDescriptor]) -> ShardSession:
        return ShardSession(
            self._cache,
            tenant,
            descriptors,
            abort=self._stop_event,
            progress=self._progress_reporter("shard"),
            retain=not self._cache_private,
        )

    def _progress_reporter(self, what: str) -> Callable[[int, int | None], None]:
        def report(done: int, total: int | None) -> None:
            self._emit_state({"phase": "download", "what": what, "done": done, "total": total})

        return report

    def rehydrate(self) -> bool:
        """Carry on with the session a previous process left in this work dir.

        A replacement worker child (after a crash, an OOM kill) finds the manifest and the
        model file where the old one left them. Returns False, leaving the executor idle,
        when there is nothing usable.
        """
        session = session_from_manifest(
            self._tmpdir,
            self._models,
            max_script_bytes=self.settings.max_script_bytes,
            dataset=self._dataset,
        )
        if session is None:
            return False
        self._session = session
        self._runner.open(session, warm=False)
        write_manifest(session, self._tmpdir)
        logger.info("rehydrated the session of tenant %s (model %s)", session.tenant, session.model_hash)
        return True

    # ------------------------------------------------------------ execution phase

    def run(
        self,
        steps: int = 100,
        round_num: int = 0,
        total_rounds: int = 1,
        mode: str = "training",
        step_offset: int = 0,
    ) -> None:
        """Start tenant code in a background thread (in-thread or in the sandboxed runner)."""
        if self.is_running():
            logger.warning("Executor already running")
            return
        self._require_session()
        self._round = check_round_args(steps, round_num, total_rounds, mode, step_offset)
        self._outcome = None
        self.modified_state = None
        self._stop_event.clear()
        self._thread = DoneThread(partial(self._play, self._round), "executor")
        self._thread.start()

    def _play(self, spec: RoundSpec) -> None:
        started = time.monotonic()
        self._budget.start_round()
        try:
            outcome = self._runner.run_round(spec, self._stop_event)
        except BaseException as exc:  # the runner itself failed (it could not start, say)
            logger.exception("round runner failed")
            outcome = RoundOutcome.failed(failure(exc), time.monotonic() - started)
        self._runner.replenish()  # a round that replaced a killed runner took the spare
        self.modified_state = outcome.trained
        self._outcome = replace(outcome, report=self._budget.report(outcome.report))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until tenant code finishes (or ``timeout_s`` passes); True when it has."""
        return self._thread is None or self._thread.wait(timeout_s)

    def run_round(
        self,
        steps: int = 100,
        round_num: int = 0,
        total_rounds: int = 1,
        mode: str = "training",
        step_offset: int = 0,
        *,
        delta_url: str | None = None,
        delta_dtype: str = "float16",
    ) -> RoundResult:
        """``run`` + ``wait`` + ``finish_round``: one round, blocking, as the task runs it."""
        parse_delta_dtype(delta_dtype)  # refused before the round runs
        self.run(steps, round_num, total_rounds, mode, step_offset)
        self.wait()
        return self.finish_round(delta_url=delta_url, delta_dtype=delta_dtype)

    def finish_round(self, *, delta_url: str | None = None, delta_dtype: str = "float16") -> RoundResult:
        """The result of the round that just ended, with its trained delta written (and uploaded)."""
        if self.is_running():
            raise InvalidRequest("the round is still running")
        session = self._require_session()
        dtype = parse_delta_dtype(delta_dtype, self.settings)
        trained, self.modified_state = self.modified_state, None
        ship = partial(
            ship_delta,
            session.model_path,
            trained,
            work_dir=self._tmpdir,
            round_num=self._round.round_num,
            dtype=dtype,
            delta_url=delta_url,
            transfer_config=self._transfer,
            abort=self._stop_event,
            error_feedback=self.settings.quant_error_feedback,
        )
        outcome = self._outcome or RoundOutcome.failed(ErrorInfo(InvalidRequest.code, "no round has run"))
        result = round_result(
            outcome,
            round_num=self._round.round_num,
            ship=ship if self._round.training else None,
            dropped=self._budget.dropped(),
        )
        # The stop was aimed at the round that just ended; the next sync must not inherit it.
        self._stop_event.clear()
        return result

    # ------------------------------------------------------------ sync phase

    def update_model(
        self,
        model_url: str,
        params: dict[str, Any] | None = None,
        dataset_shards: Sequence[Mapping[str, Any] | str] | None = None,
        delta_url: str | None = None,
        base_hash: str | None = None,
        result_hash: str | None = None,
    ) -> ApplyOutcome:
        """Apply the orchestrator's sync delta in place, else download the full model.

        A sync never fails *because of* the delta path: any divergence or error there
        falls back to ``model_url``. Only an explicit stop aborts instead.
        """
        started = time.monotonic()
        if self.is_running():
            raise InvalidRequest("a round is running on this worker: stop it before apply_delta")
        new_params, descriptors = check_update_args(params, dataset_shards)
        self.original_state = self.modified_state = None
        placement.empty_device_cache()
        session = self._session
        synced = self._models.sync(
            session.model if session else None, model_url, delta_url, base_hash, result_hash
        )
        if session is not None:
            session.update(synced.model, new_params, descriptors)
            write_manifest(session, self._tmpdir)
        return ApplyOutcome(
            synced.via, synced.model.model_hash, time.monotonic() - started, synced.reason, synced.noop
        )

    def get_original_state(self) -> dict[str, torch.Tensor] | None:
        """The pre-round state from the model file (mmap-backed, loaded on demand)."""
        if self.original_state is None and self._session is not None:
            self.original_state = load_file(self._session.model_path)
        return self.original_state

    def get_shard(self, i: int) -> Any:
        """One decoded shard; only one is held in memory at a time."""
        return self._require_session().dataset.get(i)

    def get_shard_path(self, i: int) -> str:
        """A shard's file on disk (pinned), for the sandboxed runner."""
        return self._require_session().dataset.path(i)

    def _require_session(self) -> Session:
        if self._session is None:
            raise InvalidRequest("no model is loaded: send load_model first")
        return self._session

    # ------------------------------------------------------------ stop, reset, shutdown

    def stop(self) -> None:
        """Stop the round cooperatively: signal, interrupt tenant code, end the runner, join."""
        self._stop_event.set()
        self._runner.interrupt()
        deadline = time.monotonic() + self.settings.stop_join_timeout_s
        thread = self._thread
        # Re-deliver periodically: tenant code may catch one StopExecution in a bare except.
        while thread is not None and thread.running and time.monotonic() < deadline:
            self._runner.interrupt()
            thread.wait(0.25)
        session = self._session
        if session is not None:
            session.dataset.wait_prefetch(max(0.0, deadline - time.monotonic()))

    def _lingering_threads(self) -> list[str]:
        threads = [self._thread]
        if self._session is not None:
            threads.append(self._session.dataset.prefetch_thread)
        return [t.name for t in threads if t is not None and t.running]

    def reset(self, *, tenant: str | None = None) -> int:
        """The tenant boundary: stop, then wipe the work dir, the tenant's cache entries and
        GPU memory. Returns the bytes wiped; raises ``CleanupFailed`` when it cannot prove
        that the round ended (restart the worker then)."""
        self.stop()
        lingering = self._lingering_threads()
        if lingering:
            raise CleanupFailed("cannot prove task cleanup; restart required for: " + ", ".join(lingering))
        self._stop_event.clear()
        owner = tenant or (self._session.tenant if self._session else None)
        self._close_session()
        wiped = empty_dir(self._tmpdir)
        if owner and not self._cache_private:
            wiped += self._cache.remove_tenant(owner)
        self.original_state = self.modified_state = None
        self._outcome = None
        self._thread = None
        gc.collect()
        placement.empty_device_cache()
        self._runner.replenish()  # the spare went with the work dir; the next tenant's is new
        return wiped

    def _close_session(self) -> None:
        session, self._session = self._session, None
        self._runner.close(spare=True)  # the spare's directories are in the work dir too
        if session is not None:
            session.dataset.close(timeout_s=self.settings.stop_join_timeout_s)

    def shutdown(self) -> None:
        """``stop`` + remove the work dir. Idempotent."""
        self.stop()
        lingering = self._lingering_threads()
        if lingering:
            raise CleanupFailed("cannot safely close while workload threads remain: " + ", ".join(lingering))
        self._close_session()
        remove_tree(self._tmpdir, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        session = self._session
        return {
            "host_id": self._host_id,
            "pid": os.getpid(),
            "state": self.state.value,
            "model_hash": session.model_hash if session else None,
            "tenant": session.tenant if session else None,
            "num_shards": session.dataset.num_shards if session else 0,
            "cache": self._cache.stats().to_json(),
            "sandbox": self._runner.describe(),
        }
