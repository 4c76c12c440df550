"""A loaded session: what ``load_model`` established and every later round reuses.

Also the validation of ``load_model``'s arguments, so that a bad request is
refused before anything on disk or in memory changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

from executor.delta import DeltaFormat, ErrorFeedback, QuantScheme
from executor.errors import InvalidRequest, RoundhouseError
from executor.fileio import atomic_write_json, read_json
from executor.modelfile import InstalledModel, ModelFiles
from executor.rounds import RoundSpec, validate_script
from executor.shards import ShardDescriptor, ShardSession, check_tenant
from executor.workdir import SessionDir

if TYPE_CHECKING:
    from settings import Settings

logger = logging.getLogger(__name__)

DELTA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
QUANT_DTYPES = ("int8", "int4")


def parse_delta_dtype(name: object, settings: Settings | None = None) -> DeltaFormat:
    """``run_round``'s ``delta_dtype``: a float dtype, or a quantised scheme whose block size and
    scale dtype are the settings' (``quant_block_size``, ``quant_scale_dtype``; their defaults
    without settings)."""
    if isinstance(name, str) and name in QUANT_DTYPES:
        if settings is None:
            return QuantScheme.named(name)
        return QuantScheme.named(name, settings.quant_block_size, settings.quant_scale_dtype)
    if not isinstance(name, str) or name not in DELTA_DTYPES:
        names = [*sorted(DELTA_DTYPES), *QUANT_DTYPES]
        raise InvalidRequest(f"delta_dtype must be one of {names}, got {name!r}")
    return DELTA_DTYPES[name]


def check_params(params: object) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidRequest(f"params must be an object, got {type(params).__name__}")
    return dict(params)


def check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRequest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class LoadArgs:
    tenant: str
    descriptors: list[ShardDescriptor]
    batch_size: int
    params: dict[str, Any]
    initial_shard_index: int


def check_round_args(
    steps: object, round_num: object, total_rounds: object, mode: object, step_offset: object
) -> RoundSpec:
    """``run_round``'s arguments as a spec; a negative ``step_offset`` counts as 0 (the seed's)."""
    if mode not in ("training", "inference"):
        raise InvalidRequest(f"mode must be 'training' or 'inference', got {mode!r}")
    return RoundSpec(
        check_int("steps", steps, 0),
        check_int("round_num", round_num, 0),
        check_int("total_rounds", total_rounds, 0),
        max(0, check_int("step_offset", step_offset, -(2**62))),
        str(mode),
    )


def check_update_args(
    params: object, dataset_shards: object
) -> tuple[dict[str, Any] | None, list[ShardDescriptor] | None]:
    """``apply_delta``'s optional replacements: None leaves what the session has."""
    if dataset_shards is not None and (
        not isinstance(dataset_shards, Sequence) or isinstance(dataset_shards, (str, bytes))
    ):
        raise InvalidRequest("dataset_shards must be a list of URLs or descriptors")
    return (
        check_params(params) if params is not None else None,
        [ShardDescriptor.parse(d) for d in dataset_shards] if dataset_shards is not None else None,
    )


def check_load_args(
    model_url: object,
    dataset_shards: object,
    batch_size: object,
    params: object,
    initial_shard_index: object,
    tenant: object,
) -> LoadArgs:
    if not isinstance(model_url, str) or not model_url:
        raise InvalidRequest("model_url must be a non-empty string")
    if dataset_shards is None:
        dataset_shards = []
    if not isinstance(dataset_shards, Sequence) or isinstance(dataset_shards, (str, bytes)):
        raise InvalidRequest("dataset_shards must be a list of URLs or descriptors")
    return LoadArgs(
        tenant=check_tenant(tenant),  # type: ignore[arg-type]
        descriptors=[ShardDescriptor.parse(item) for item in dataset_shards],
        batch_size=check_int("batch_size", batch_size, 1),
        params=check_params(params),
        # The seed clamps a negative index to 0 and wraps a large one; keep that.
        initial_shard_index=max(0, check_int("initial_shard_index", initial_shard_index, -(2**62))),
    )


@dataclass
class Session:
    """The loaded session; ``model`` is replaced whole when a sync installs a new file."""

    tenant: str
    model_url: str
    model: InstalledModel
    code: str
    compiled: CodeType
    params: dict[str, Any]
    batch_size: int
    dataset: ShardSession

    @property
    def model_path(self) -> str:
        return self.model.path

    @property
    def bundle_root(self) -> str | None:
        return self.model.bundle_root

    @property
    def preprocessor_config(self) -> Mapping[str, Any]:
        return self.model.preprocessor_config

    @property
    def model_hash(self) -> str:
        return self.model.model_hash

    def update(
        self,
        model: InstalledModel,
        params: dict[str, Any] | None,
        descriptors: list[ShardDescriptor] | None,
    ) -> None:
        """After a sync: the model now in place, and the params and shards it replaced (if any)."""
        self.model = model
        if params is not None:
            self.params = params
        if descriptors is not None:
            self.dataset.replace_descriptors(descriptors)

    def manifest(self) -> dict[str, Any]:
        """What a replacement process needs to carry on with this session (kept in the work dir)."""
        return {
            "v": 1,
            "tenant": self.tenant,
            "model_url": self.model_url,
            "preprocessor_config": dict(self.preprocessor_config),
            "model_path": self.model_path,
            "bundle_root": self.bundle_root,
            "model_hash": self.model_hash,
            "fingerprint": list(self.model.fingerprint),
            "code": self.code,
            "params": self.params,
            "batch_size": self.batch_size,
            "shards": [d.__dict__ for d in self.dataset.descriptors],
        }


def write_manifest(session: Session, work_dir: str) -> None:
    """Keep what a replacement process needs beside the model (atomically)."""
    try:
        atomic_write_json(SessionDir(work_dir).manifest, session.manifest())
    except (TypeError, ValueError):
        # Library callers may pass params JSON cannot hold; the manifest is then skipped.
        logger.warning("session manifest not written: params are not JSON-serialisable")


def drop_manifest(work_dir: str) -> None:
    """The session is over: no process may resume it, and its error feedback goes with it
    (a new model must not get the residual of the old one's deltas)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SessionDir(work_dir).manifest)
    ErrorFeedback(work_dir).drop()


def session_from_manifest(
    work_dir: str,
    models: ModelFiles,
    *,
    max_script_bytes: int,
    dataset: Callable[[str, list[ShardDescriptor]], ShardSession],
) -> Session | None:
    """The session a manifest describes, or None when it (or its model file) is not usable."""
    try:
        manifest = read_json(SessionDir(work_dir).manifest)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("v") != 1:
        return None
    try:
        fingerprint = manifest.get("fingerprint")
        model = models.installed(
            str(manifest["model_hash"]),
            fingerprint if isinstance(fingerprint, list) else [],
            dict(manifest.get("preprocessor_config") or {}),
        )
        args = check_load_args(
            manifest["model_url"],
            manifest["shards"],
            manifest["batch_size"],
            manifest["params"],
            0,
            manifest["tenant"],
        )
        compiled = validate_script(manifest["code"], max_bytes=max_script_bytes)
    except (KeyError, TypeError, RoundhouseError) as exc:
        logger.warning("session manifest not usable: %s", exc)
        return None
    if model is None:
        return None
    return Session(
        tenant=args.tenant,
        model_url=str(manifest["model_url"]),
        model=model,
        code=str(manifest["code"]),
        compiled=compiled,
        params=args.params,
        batch_size=args.batch_size,
        dataset=dataset(args.tenant, args.descriptors),
    )
