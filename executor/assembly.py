"""The engine's parts for one work dir, built once from one :class:`EngineConfig`.

The Executor (the seed's facade) holds these and nothing else: the stop signal every part
listens to, the round's budget, the shard cache, the round runner (sandboxed or in a
thread), the session's keeper and the round's player. They are wired here, each from its
own config, so that the facade reads as the seed's API and no part reads the settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor.configs import EngineConfig
from executor.rounds import InThreadRunner, RoundBudget, RoundPlayer, RoundRunner
from executor.sandbox import SandboxedRunner
from executor.session import ModelFiles, SessionKeeper
from executor.shards import ShardCache
from executor.stopping import StopSignal
from executor.workdir import SessionDir

StatsCallback = Callable[[dict[str, Any]], None]
LogCallback = Callable[[str], None]
StateCallback = Callable[[dict[str, Any]], None]

# A private cache (the seed's "no shared cache") is bounded by the work dir's disk, not by a limit.
UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class Parts:
    work_dir: str
    stop: StopSignal
    budget: RoundBudget
    cache: ShardCache
    private_cache: bool
    runner: RoundRunner
    keeper: SessionKeeper
    player: RoundPlayer


def assemble(
    config: EngineConfig,
    work_dir: str,
    *,
    cache_dir: str | None,
    sandboxed: bool,
    emit_stats: StatsCallback,
    emit_log: LogCallback,
    emit_state: StateCallback,
) -> Parts:
    """The parts, with a spare runner started while the worker waits for its first load."""
    stop = StopSignal()
    # Tenant code's events and logs go through the round's budget, counted here in the worker.
    budget = RoundBudget(config.budget, emit_stats, emit_log)
    private = config.cache_max_bytes <= 0  # the seed's: no shared cache, no prefetch
    cache = ShardCache(
        SessionDir(work_dir).private_shards if private else (cache_dir or config.cache_dir),
        UNBOUNDED if private else config.cache_max_bytes,
        transfer_config=config.transfer,
        max_shard_bytes=config.cache.max_shard_bytes,
        wait_timeout_s=config.cache.wait_timeout_s,
    )

    def progress(what: str) -> Callable[[int, int | None], None]:
        def report(done: int, total: int | None) -> None:
            emit_state({"phase": "download", "what": what, "done": done, "total": total})

        return report

    models = ModelFiles(
        work_dir, config.session.model, transfer_config=config.transfer, abort=stop, progress=progress
    )
    models.clean_leftovers()  # before anything else writes here: what a dead process left
    runner: RoundRunner
    if sandboxed:
        runner = _sandboxed(config, work_dir, models.model_dir, budget)
    else:  # trusted code, in a thread of this process
        runner = InThreadRunner(
            stop,
            host_id=config.host_id,
            offload_dir=SessionDir(work_dir).model_offload,
            emit_stats=budget.stats,
            emit_log=budget.log,
        )
    keeper = SessionKeeper(
        models,
        config.session,
        transfer_config=config.transfer,
        cache=cache,
        private_cache=private,
        runner=runner,
        stop=stop,
        progress=progress,
    )
    runner.replenish()
    return Parts(work_dir, stop, budget, cache, private, runner, keeper, RoundPlayer(runner, budget, stop))


def _sandboxed(config: EngineConfig, work_dir: str, model_dir: str, budget: RoundBudget) -> RoundRunner:
    """The sandboxed runner (DESIGN §8), probed now: a host that cannot isolate tenant code
    refuses to start a worker rather than fail its first round."""
    return SandboxedRunner.start(
        config.sandbox,
        work_dir,
        model_dir,
        host_id=config.host_id,
        max_script_bytes=config.session.max_script_bytes,
        emit_log=budget.log,
        emit_stats=budget.stats,
    )
