"""The Executor: one per process, persisting across tasks (DESIGN §1).

``load`` downloads and validates the model and stages the first shard; ``run``
starts a round of tenant code (in a thread, or in the sandboxed runner);
``finish_round`` turns its outcome into a result and a trained delta;
``update_model`` applies the orchestrator's sync delta, falling back to a full
download; ``reset`` is the tenant boundary. The public methods and signatures
are the seed's, with keyword-only additions.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from executor import placement, transfer
from executor.delta import file_state_hash
from executor.errors import CleanupFailed, InvalidRequest
from executor.fileio import atomic_write_json, tree_bytes
from executor.modelfile import ModelFiles
from executor.results import (
    ApplyOutcome,
    ApplyVia,
    ExecutorState,
    LoadResult,
    RoundResult,
)
from executor.rounds import (
    RoundOutcome,
    RoundOutputs,
    RoundSpec,
    SessionView,
    ThreadRound,
    round_result,
    session_namespace,
    ship_delta,
    validate_script,
)
from executor.sandbox import Isolation
from executor.session import (
    Session,
    check_int,
    check_load_args,
    check_params,
    parse_delta_dtype,
    session_from_manifest,
)
from executor.shards import ShardCache, ShardDescriptor, ShardSession
from executor.stopping import DoneThread, StopSignal, UserCodeShield
from settings import Settings, get_settings

logger = logging.getLogger(__name__)

MANIFEST_NAME = "session.json"

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
        self._emit_stats = emit_stats
        self._emit_log = emit_log
        self._emit_state = emit_state or (lambda _data: None)
        self._host_id = host_id or self.settings.host_id
        self._sandboxed = sandboxed
        self._stage_first_shard = (
            self.settings.stage_first_shard if stage_first_shard is None else stage_first_shard
        )
        base = work_dir or self.settings.work_dir
        os.makedirs(base, exist_ok=True)
        if session_dir is not None:
            os.makedirs(session_dir, mode=0o700, exist_ok=True)
            self._tmpdir = session_dir
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="task-", dir=base)
        cache_mb = self.settings.shard_cache_max_mb if shard_cache_max_mb is None else shard_cache_max_mb
        # <= 0 keeps the seed's meaning: no shared cache and no prefetch; shards live in the work dir.
        self._cache_private = cache_mb <= 0
        self._transfer = transfer.TransferConfig.from_settings(self.settings)
        self._cache = ShardCache(
            os.path.join(self._tmpdir, "private-shards")
            if self._cache_private
            else (cache_dir or self.settings.cache_dir),
            max(cache_mb, 1) * 1024 * 1024 if not self._cache_private else 1 << 62,
            transfer_config=self._transfer,
            wait_timeout_s=self.settings.cache_wait_timeout_s,
        )
        self._stop_event = StopSignal()
        self._shield = UserCodeShield(self._stop_event)
        self._models = ModelFiles(
            self._tmpdir,
            transfer_config=self._transfer,
            abort=self._stop_event,
            bundle_max_bytes=self.settings.bundle_max_bytes,
            bundle_max_files=self.settings.bundle_max_files,
            progress=self._progress_reporter,
        )
        self._models.clean_leftovers()
        self._thread: DoneThread | None = None
        # The sandboxed runner's manager (DESIGN §8), or None for in-thread execution.
        self._isolation = (
            Isolation.for_settings(
                self.settings,
                self._tmpdir,
                self._models.model_dir,
                host_id=self._host_id,
                emit_log=self._emit_log,
                emit_stats=self._emit_stats,
            )
            if sandboxed
            else None
        )
        self._session: Session | None = None
        self._round = RoundSpec(100, 0, 1, 0, "training")
        self._stopped = False
        self.original_state: dict[str, torch.Tensor] | None = None
        self.modified_state: dict[str, torch.Tensor] | None = None
        self.training_time: float = 0.0
        self.report: dict[str, Any] | None = None
        self.execution_error: dict[str, Any] | None = None

    @property
    def sandbox_mode(self) -> str:
        """``bwrap`` | ``unshare`` when tenant code runs sandboxed, ``off`` when in-thread."""
        return self._isolation.mode if self._isolation is not None else "off"

    # ------------------------------------------------------------ properties

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
    ) -> LoadResult:
        """Download and validate the model, stage one shard, and start the next one's prefetch.

        Nothing is touched until the request validates; a failure after that leaves
        the executor idle (never with a half-written model file).
        """
        started = time.monotonic()
        if self.is_running():
            raise InvalidRequest("a round is running on this worker: stop it before loading")
        self._stop_event.clear()
        compiled = validate_script(code, max_bytes=self.settings.max_script_bytes)
        args = check_load_args(model_url, dataset_shards, batch_size, params, initial_shard_index, tenant)
        if not self._cache_private:
            self._cache.check_fits(args.descriptors)
        # Everything is fetched and checked beside the current session; it is replaced only
        # once the new one is complete, so a bad model or shard leaves the old one intact.
        with self._models.staging() as staging:
            artifact = self._models.fetch(model_url, "model", staging)
            model_hash = file_state_hash(artifact.model_path)
            dataset = ShardSession(
                self._cache,
                args.tenant,
                args.descriptors,
                abort=self._stop_event,
                progress=self._progress_reporter("shard"),
                retain=not self._cache_private,
            )
            if self._session is not None:
                self._session.dataset.close(timeout_s=self.settings.stop_join_timeout_s)  # free its pins
            staged = None
            try:
                if args.descriptors and self._stage_first_shard:
                    staged = dataset.stage(args.initial_shard_index % len(args.descriptors))
                self._close_session()
                # A crash from here on must not rehydrate the old session onto the new model.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._manifest_path)
                model = self._models.install(artifact, model_hash)
            except BaseException:
                dataset.close(timeout_s=self.settings.stop_join_timeout_s)
                raise
        self._session = Session(
            tenant=args.tenant,
            model_url=model_url,
            model_path=model.path,
            bundle_root=model.bundle_root,
            preprocessor_config=model.preprocessor_config,
            code=code,
            compiled=compiled,
            params=args.params,
            batch_size=args.batch_size,
            model_hash=model_hash,
            fingerprint=model.fingerprint,
            dataset=dataset,
        )
        self._write_manifest()
        if self._isolation is not None:
            self._isolation.start(self._session)  # warm: torch and CUDA load now, not in round 1
        self.original_state = self.modified_state = None
        self.training_time = 0.0
        logger.info("load complete: %d keys, hash %s", artifact.keys, model_hash)
        return LoadResult(
            model_hash,
            artifact.keys,
            artifact.bytes,
            staged,
            time.monotonic() - started,
            artifact.source_format,
        )

    def _progress_reporter(self, what: str) -> Callable[[int, int | None], None]:
        def report(done: int, total: int | None) -> None:
            self._emit_state({"phase": "download", "what": what, "done": done, "total": total})

        return report

    @property
    def _manifest_path(self) -> str:
        return os.path.join(self._tmpdir, MANIFEST_NAME)

    def rehydrate(self) -> bool:
        """Carry on with the session a previous process left in this work dir.

        A replacement worker child (after a crash, an OOM kill) finds the manifest and the
        model file where the old one left them. Returns False, leaving the executor idle,
        when there is nothing usable.
        """
        session = session_from_manifest(
            self._manifest_path,
            self._models.model_dir,
            max_script_bytes=self.settings.max_script_bytes,
            dataset=lambda tenant, descriptors: ShardSession(
                self._cache, tenant, descriptors, abort=self._stop_event,
                progress=self._progress_reporter("shard"), retain=not self._cache_private,
            ),
        )  # fmt: skip
        if session is None:
            return False
        self._session = session
        if self._isolation is not None:
            self._isolation.adopt(session)
        self._write_manifest()
        logger.info("rehydrated the session of tenant %s (model %s)", session.tenant, session.model_hash)
        return True

    def _write_manifest(self) -> None:
        if self._session is None:
            return
        try:
            atomic_write_json(self._manifest_path, self._session.manifest())
        except (TypeError, ValueError):
            # Library callers may pass params JSON cannot hold; the manifest is then skipped.
            logger.warning("session manifest not written: params are not JSON-serialisable")

    # ------------------------------------------------------------ execution phase

    def run(
        self,
        steps: int = 100,
        round_num: int = 0,
        total_rounds: int = 1,
        mode: str = "training",
        step_offset: int = 0,
    ) -> None:
        """Start tenant code in a background thread (or the sandboxed runner)."""
        if self.is_running():
            logger.warning("Executor already running")
            return
        if self._session is None:
            raise InvalidRequest("no model is loaded: send load_model first")
        if mode not in ("training", "inference"):
            raise InvalidRequest(f"mode must be 'training' or 'inference', got {mode!r}")
        for name, value in (("steps", steps), ("round_num", round_num), ("total_rounds", total_rounds)):
            check_int(name, value, 0)
        self._round = RoundSpec(steps, round_num, total_rounds, max(0, int(step_offset)), mode)
        self._stopped = False
        self.execution_error = None
        self.report = None
        self.modified_state = None
        self.training_time = 0.0
        self._stop_event.clear()
        session = self._require_session()
        isolation = self._isolation
        if isolation is not None:
            spec = self._round
            self._thread = DoneThread(
                lambda: self._round_done(isolation.run_round(spec, self._stop_event)), "executor"
            )
            self._thread.start()
            return
        runner = ThreadRound(
            session.compiled,
            self._namespace,
            training=mode == "training",
            shield=self._shield,
            emit_log=self._emit_log,
            on_done=self._round_done,
        )
        self._thread = runner.thread
        runner.start()

    def _round_done(self, outcome: RoundOutcome) -> None:
        self._stopped = outcome.stopped
        self.execution_error = outcome.error
        self.modified_state = outcome.trained
        self.report = outcome.report
        self.training_time = outcome.training_time

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
        dtype = parse_delta_dtype(delta_dtype)
        self.run(steps, round_num, total_rounds, mode, step_offset)
        self.wait()
        return self.finish_round(delta_url=delta_url, delta_dtype=str(dtype).removeprefix("torch."))

    def _namespace(self, outputs: RoundOutputs) -> dict[str, Any]:
        session = self._require_session()
        view = SessionView(
            model_path=session.model_path,
            bundle_root=session.bundle_root,
            preprocessor_config=session.preprocessor_config,
            params=session.params,
            batch_size=session.batch_size,
            num_shards=session.dataset.num_shards,
            host_id=self._host_id,
            offload_dir=os.path.join(self._tmpdir, "model-offload"),
        )
        return session_namespace(
            view,
            self._round,
            get_shard=self.get_shard,
            emit_stats=self._emit_stats,
            emit_log=self._emit_log,
            stop_signal=self._stop_event,
            outputs=outputs,
            shield=self._shield.callback,
        )

    # ------------------------------------------------------------ finishing a round

    def finish_round(self, *, delta_url: str | None = None, delta_dtype: str = "float16") -> RoundResult:
        """The result of the round that just ended, with its trained delta written (and uploaded)."""
        if self.is_running():
            raise InvalidRequest("the round is still running")
        session = self._require_session()
        dtype = parse_delta_dtype(delta_dtype)
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
        )
        result = round_result(
            stopped=self._stopped,
            error=self.execution_error,
            training_time=self.training_time,
            report=self.report,
            round_num=self._round.round_num,
            ship=ship if self._round.mode == "training" else None,
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
        new_params = check_params(params) if params is not None else None
        descriptors = (
            [ShardDescriptor.parse(d) for d in dataset_shards] if dataset_shards is not None else None
        )
        self.original_state = self.modified_state = None
        placement.empty_device_cache()
        session = self._session
        if (
            session is not None
            and result_hash
            and session.model_hash == result_hash
            and session.file_unchanged()
        ):
            self._update_session(new_params, descriptors)
            return ApplyOutcome(ApplyVia.DELTA, result_hash, time.monotonic() - started, noop=True)
        via, model_hash, reason = self._models.sync(session, model_url, delta_url, base_hash, result_hash)
        self._update_session(new_params, descriptors)
        return ApplyOutcome(via, model_hash, time.monotonic() - started, reason)

    def _update_session(
        self, params: dict[str, Any] | None, descriptors: list[ShardDescriptor] | None
    ) -> None:
        session = self._session
        if session is None:
            return
        if params is not None:
            session.params = params
        if descriptors is not None:
            session.dataset.replace_descriptors(descriptors)
        self._write_manifest()

    # ------------------------------------------------------------ model and data access

    def get_original_state(self) -> dict[str, torch.Tensor] | None:
        """The pre-round state from the model file (mmap-backed, loaded on demand)."""
        if self.original_state is None and self._session is not None:
            from safetensors.torch import load_file

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
        if self._isolation is not None:
            # The runner gets the stop too; its watchdog kills the sandbox after the grace period.
            self._isolation.request_stop()
        deadline = time.monotonic() + self.settings.stop_join_timeout_s
        thread = self._thread
        # Re-deliver periodically: tenant code may catch one StopExecution in a bare except.
        while thread is not None and thread.running and time.monotonic() < deadline:
            self._shield.interrupt()
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
        wiped = tree_bytes(self._tmpdir)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        os.makedirs(self._tmpdir, mode=0o700, exist_ok=True)
        if owner and not self._cache_private:
            wiped += self._cache.remove_tenant(owner)
        self.original_state = self.modified_state = None
        self.report = self.execution_error = None
        self._thread = None
        gc.collect()
        placement.empty_device_cache()
        return wiped

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if self._isolation is not None:
            self._isolation.close()
        if session is not None:
            session.dataset.close(timeout_s=self.settings.stop_join_timeout_s)

    def shutdown(self) -> None:
        """``stop`` + remove the work dir. Idempotent."""
        self.stop()
        lingering = self._lingering_threads()
        if lingering:
            raise CleanupFailed("cannot safely close while workload threads remain: " + ", ".join(lingering))
        self._close_session()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

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
        }
