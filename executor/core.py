"""The Executor: one per process, persisting across tasks (DESIGN §1); the seed's facade.

``load`` (the model and the first shard), ``run`` / ``finish_round`` (a round of tenant code,
its result and trained delta), ``update_model`` (the sync delta, else a full download) and
``reset`` (the tenant boundary) keep the seed's signatures, with keyword-only additions. Each
call is parsed here once into a typed request and handed to the session's keeper
(:mod:`executor.session`) or the round's player; the parts are built once
(:mod:`executor.assembly`) from one :class:`~executor.configs.EngineConfig`.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from safetensors.torch import load_file

from executor import placement, transfer
from executor.assembly import LogCallback, StateCallback, StatsCallback, assemble
from executor.configs import EngineConfig
from executor.delta import DEFAULT_SCHEME
from executor.errors import CleanupFailed, InvalidRequest
from executor.fileio import own_dir, remove_tree
from executor.results import ApplyOutcome, ExecutorState, LoadResult, RoundResult
from executor.rounds import RoundSpec
from executor.sandbox import ResultState
from executor.session import LoadRequest, ReduceRequest, RoundRequest, Session, SessionKeeper, SyncRequest
from executor.shards import ShardCache
from settings import Settings, get_settings

logger = logging.getLogger(__name__)


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
        config: EngineConfig | None = None,
    ) -> None:
        # The settings it was built from, for callers; no part below reads them.
        self.settings = settings or get_settings()
        self.config = config = (config or EngineConfig.from_settings(self.settings)).overridden(
            host_id=host_id, shard_cache_max_mb=shard_cache_max_mb, stage_first_shard=stage_first_shard
        )
        self._parts = parts = assemble(
            config,
            own_dir(work_dir or config.work_dir, session_dir, prefix="task-"),
            cache_dir=cache_dir,
            sandboxed=sandboxed,
            emit_stats=emit_stats,
            emit_log=emit_log,
            emit_state=emit_state or (lambda _data: None),
        )
        self._keeper, self._player, self._runner = parts.keeper, parts.player, parts.runner
        self._round = RoundRequest(RoundSpec(100, 0, 1, 0, "training"))
        self.original_state: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------ properties

    @property
    def sandbox_mode(self) -> str:
        """``bwrap`` | ``unshare`` when tenant code runs sandboxed, ``off`` when in-thread."""
        return self._runner.mode

    @property
    def work_dir(self) -> str:
        return self._parts.work_dir

    @property
    def abort_event(self) -> threading.Event:
        """The session's stop signal; transfers abort between chunks when it is set."""
        return self._parts.stop

    @property
    def cache(self) -> ShardCache:
        return self._parts.cache

    @property
    def session(self) -> Session | None:
        return self._keeper.current

    @property
    def state(self) -> ExecutorState:
        if self.is_running():
            return ExecutorState.RUNNING
        return ExecutorState.LOADED if self._keeper.current is not None else ExecutorState.IDLE

    def is_running(self) -> bool:
        return self._player.running

    # The seed's attributes for the last round, read from its one outcome.

    @property
    def modified_state(self) -> dict[str, torch.Tensor] | None:
        trained = self._player.trained
        if trained is not None and not isinstance(trained, dict):  # the seed's callers get a dict
            trained = self._player.trained = dict(trained)
        return trained

    @modified_state.setter
    def modified_state(self, state: dict[str, torch.Tensor] | None) -> None:
        self._player.trained = state

    @property
    def execution_error(self) -> dict[str, Any] | None:
        outcome = self._player.outcome
        return outcome.error.to_json() if outcome is not None and outcome.error is not None else None

    @property
    def report(self) -> dict[str, Any] | None:
        return self._player.outcome.report if self._player.outcome is not None else None

    @property
    def training_time(self) -> float:
        return self._player.outcome.training_time if self._player.outcome is not None else 0.0

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
        """Download and validate the model (hashed in ``hash_scheme``: ``sha256`` or ``blake3``),
        stage one shard, and start the next one's prefetch. Nothing is touched until the request
        validates; a failure after that leaves the current session as it was."""
        if self.is_running():
            raise InvalidRequest("a round is running on this worker: stop it before loading")
        self._parts.stop.clear()
        request = LoadRequest.parse(
            model_url, dataset_shards, code, batch_size, params, initial_shard_index,
            tenant=tenant, hash_scheme=hash_scheme, max_script_bytes=self.config.session.max_script_bytes,
        )  # fmt: skip
        result = self._keeper.load(request)
        self.original_state = None
        self._player.forget()
        return result

    def rehydrate(self) -> bool:
        """Carry on with the session a previous process (a crashed, OOM-killed worker child)
        left in this work dir; False, leaving the executor idle, when there is nothing usable."""
        session = self._keeper.rehydrate()
        if session is not None:
            logger.info("rehydrated the session of tenant %s (model %s)", session.tenant, session.model_hash)
        return session is not None

    # ------------------------------------------------------------ execution phase

    def round_request(
        self,
        steps: int = 100,
        round_num: int = 0,
        total_rounds: int = 1,
        mode: str = "training",
        step_offset: int = 0,
        *,
        delta_url: str | None = None,
        delta_dtype: str = "float16",
        overlap: object = None,
    ) -> RoundRequest:
        """``run_round``'s arguments as one request, checked (the delta URL against the URL
        policy too) before the round trains; ``overlap``: see :meth:`overlapped`."""
        return RoundRequest.parse(
            steps, round_num, total_rounds, mode, step_offset, delta_url=delta_url, delta_dtype=delta_dtype,
            quant=self.config.session.quant, policy=partial(transfer.check_url, config=self.config.transfer),
            overlap=overlap,
        )  # fmt: skip

    def run(
        self,
        steps: int = 100,
        round_num: int = 0,
        total_rounds: int = 1,
        mode: str = "training",
        step_offset: int = 0,
    ) -> None:
        """Start tenant code in a background thread (in-thread or in the sandboxed runner)."""
        self.start(self.round_request(steps, round_num, total_rounds, mode, step_offset))

    def start(self, request: RoundRequest) -> None:
        """``run`` with a parsed request: its delta goes where the request says."""
        if self.is_running():
            logger.warning("Executor already running")
            return
        self._keeper.begin_round(request)  # which file it starts from (overlap: W or G)
        self._round = request
        self._player.start(request.spec)

    @property
    def overlapped(self) -> SessionKeeper:
        """An overlapped session's parts (docs/OVERLAP.md): ``sync_beside`` (the sync applied
        to the global copy while a round trains) and ``rebase`` (the working copy, after it)."""
        return self._keeper

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until tenant code finishes (or ``timeout_s`` passes); True when it has."""
        return self._player.wait(timeout_s)

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
        request = self.round_request(
            steps, round_num, total_rounds, mode, step_offset, delta_url=delta_url, delta_dtype=delta_dtype
        )
        self.start(request)
        self.wait()
        return self.finish_round()

    def finish_round(self, *, delta_url: str | None = None, delta_dtype: str | None = None) -> RoundResult:
        """The result of the round that just ended, with its trained delta written (and uploaded).

        The delta goes where the round's request said, unless ``delta_url`` or ``delta_dtype``
        is given (the seed's ``run`` names neither: then to ``delta_url`` as ``delta_dtype``,
        float16 by default)."""
        if self.is_running():
            raise InvalidRequest("the round is still running")
        self._keeper.require()
        request = self._round
        if delta_url is not None or delta_dtype is not None:
            delta_format = self.config.session.quant.delta_format(delta_dtype or "float16")
            request = request.shipping_to(delta_url, delta_format)
        trained, self._player.trained = self._player.trained, None
        try:
            result = self._keeper.finish(request, self._player.outcome, trained, self._parts.budget.dropped())
        finally:
            if isinstance(trained, ResultState):
                trained.close()  # the runner's result file, held open until its delta was written
        # The stop was aimed at the round that just ended; the next sync must not inherit it.
        self._parts.stop.clear()
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
        if self.is_running():
            raise InvalidRequest("a round is running on this worker: stop it before apply_delta")
        request = SyncRequest.parse(model_url, params, dataset_shards, delta_url, base_hash, result_hash)
        self.original_state = self._player.trained = None
        return self._keeper.sync(request)

    def reduce_shard(self, **arguments: Any) -> dict[str, Any]:
        """One shard of a sharded round reduced on this host, between rounds (docs/SHARDED.md)."""
        return self._keeper.reduce(ReduceRequest.parse(arguments), self._parts.stop, self.is_running())

    def get_original_state(self) -> dict[str, torch.Tensor] | None:
        """The pre-round state from the model file (mmap-backed, loaded on demand)."""
        session = self._keeper.current
        if self.original_state is None and session is not None:
            self.original_state = load_file(session.start_path)
        return self.original_state

    def get_shard(self, i: int) -> Any:
        """One decoded shard; only one is held in memory at a time."""
        return self._keeper.require().dataset.get(i)

    def get_shard_path(self, i: int) -> str:
        """A shard's file on disk (pinned), for the sandboxed runner."""
        return self._keeper.require().dataset.path(i)

    # ------------------------------------------------------------ stop, reset, shutdown

    def stop(self) -> None:
        """Stop the round cooperatively: signal, interrupt tenant code, end the runner, join."""
        deadline = time.monotonic() + self.config.session.stop_join_timeout_s
        self._player.stop_until(deadline)
        self._keeper.wait_prefetch(deadline)

    def _stop_and_prove(self, why: str) -> None:
        """``stop``, then ``CleanupFailed`` unless every thread of the session has ended."""
        self.stop()
        lingering = [t.name for t in (self._player.thread, *self._keeper.threads()) if t and t.running]
        if lingering:
            raise CleanupFailed(f"{why}: " + ", ".join(lingering))

    def reset(self, *, tenant: str | None = None) -> int:
        """The tenant boundary: stop, then wipe the work dir, the tenant's cache entries and
        GPU memory. Returns the bytes wiped; raises ``CleanupFailed`` when it cannot prove
        that the round ended (restart the worker then)."""
        self._stop_and_prove("cannot prove task cleanup; restart required for")
        self._parts.stop.clear()
        wiped = self._keeper.wipe(tenant)
        self.original_state = None
        self._player.forget()
        gc.collect()
        placement.empty_device_cache()
        self._runner.replenish()  # the spare went with the work dir; the next tenant's is new
        return wiped

    def shutdown(self) -> None:
        """``stop`` + remove the work dir. Idempotent."""
        self._stop_and_prove("cannot safely close while workload threads remain")
        self._keeper.close()
        remove_tree(self.work_dir, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        return {
            "host_id": self.config.host_id,
            "pid": os.getpid(),
            "state": self.state.value,
            **self._keeper.describe(),  # the session's model hash, tenant and shard count
            "cache": self._parts.cache.stats().to_json(),
            "sandbox": self._runner.describe(),
        }
