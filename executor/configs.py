"""The engine's component configs, built once from the settings (DESIGN §10).

The settings (``settings.Settings``, 70-odd flat fields read from the environment) are read
here and by the facade, nowhere below it: each component owns a small frozen config of
its own (torchtitan's nested ``Config``), and :class:`EngineConfig` is all of them, built
once where an Executor is built and handed down. A test that wants a component alone builds
its config directly, or from ``Settings(...)`` through the functions here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from executor.fileio import MIB
from executor.rounds import BudgetLimits
from executor.sandbox import SandboxConfig
from executor.session import ModelLimits, QuantConfig, SessionConfig
from executor.shards import CacheLimits
from executor.transfer import TransferConfig, UrlPolicy
from settings import Settings


@dataclass(frozen=True)
class EngineConfig:
    """Every component's config, and where the engine keeps its files."""

    host_id: str
    work_dir: str
    cache_dir: str
    # The shared shard cache's limit; <= 0 keeps the seed's meaning: no shared cache and no
    # prefetch, shards live in the work dir.
    cache_max_bytes: int
    transfer: TransferConfig
    cache: CacheLimits
    budget: BudgetLimits
    sandbox: SandboxConfig
    session: SessionConfig

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(
            host_id=settings.host_id,
            work_dir=settings.work_dir,
            cache_dir=settings.cache_dir,
            cache_max_bytes=settings.shard_cache_max_mb * MIB,
            transfer=transfer_config(settings),
            cache=CacheLimits(settings.max_shard_mb * MIB, settings.cache_wait_timeout_s),
            budget=budget_limits(settings),
            sandbox=sandbox_config(settings),
            session=session_config(settings),
        )

    def overridden(
        self,
        *,
        host_id: str = "",
        shard_cache_max_mb: int | None = None,
        stage_first_shard: bool | None = None,
    ) -> EngineConfig:
        """With the seed's constructor arguments, which win over the settings where given."""
        config = replace(self, host_id=host_id or self.host_id)
        if shard_cache_max_mb is not None:
            config = replace(config, cache_max_bytes=shard_cache_max_mb * MIB)
        if stage_first_shard is not None:
            config = replace(config, session=replace(config.session, stage_first_shard=stage_first_shard))
        return config


def transfer_config(settings: Settings) -> TransferConfig:
    return TransferConfig(
        retries=settings.download_retries,
        backoff_s=settings.download_backoff_s,
        connect_timeout_s=settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        buffer_bytes=settings.download_buffer_bytes,
        parallel_min_bytes=settings.parallel_min_bytes,
        parallel_connections=settings.parallel_connections,
        parallel_below_bytes_s=settings.parallel_below_bytes_s,
        low_speed_bytes_s=settings.download_low_speed_bytes_s,
        low_speed_time_s=settings.download_low_speed_time_s,
        policy=UrlPolicy.build(settings.file_roots, settings.url_allow, settings.http_proxy),
        max_unknown_bytes=settings.max_unknown_download_mb * MIB,
    )


def budget_limits(settings: Settings) -> BudgetLimits:
    return BudgetLimits(
        stats_events=settings.round_stats_max_events,
        stats_bytes=settings.round_stats_max_mb * MIB,
        log_bytes=settings.round_log_max_mb * MIB,
    )


def sandbox_config(settings: Settings) -> SandboxConfig:
    """``ROUNDHOUSE_SANDBOX`` and its limits; ``off`` reads as ``auto`` here, because a caller
    that builds a sandboxed runner asked for a sandbox."""
    return SandboxConfig(
        mode=settings.sandbox if settings.sandbox != "off" else "auto",
        uid=settings.sandbox_ids[0],
        gid=settings.sandbox_ids[1],
        max_procs=settings.sandbox_max_procs,
        max_open_files=settings.sandbox_max_open_files,
        memory_bytes=settings.sandbox_memory_mb * MIB if settings.sandbox_memory_mb else None,
        tmp_bytes=settings.sandbox_tmp_mb * MIB,
        stop_grace_s=settings.sandbox_stop_grace_s,
        wall_time_s=settings.sandbox_wall_time_s,
        disk_bytes=settings.sandbox_disk_mb * MIB if settings.sandbox_disk_mb else None,
        confinement=settings.sandbox_confinement,
        spare=settings.sandbox_spare,
    )


def model_limits(settings: Settings) -> ModelLimits:
    return ModelLimits(
        max_model_bytes=settings.max_model_mb * MIB,
        bundle_max_bytes=settings.bundle_max_bytes,
        bundle_max_files=settings.bundle_max_files,
    )


def session_config(settings: Settings) -> SessionConfig:
    return SessionConfig(
        model=model_limits(settings),
        quant=QuantConfig(
            settings.quant_block_size, settings.quant_scale_dtype, settings.quant_error_feedback
        ),
        max_script_bytes=settings.max_script_bytes,
        stage_first_shard=settings.stage_first_shard,
        stop_join_timeout_s=settings.stop_join_timeout_s,
    )
