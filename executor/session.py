"""A loaded session: what ``load_model`` established and every later round reuses.

Also the validation of ``load_model``'s arguments, so that a bad request is
refused before anything on disk or in memory changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

from executor.errors import InvalidRequest, RoundhouseError
from executor.shards import ShardDescriptor, ShardSession, check_tenant

logger = logging.getLogger(__name__)

DELTA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

Fingerprint = tuple[int, int, int]


def model_fingerprint(path: str) -> Fingerprint:
    """Identity of the model file as this process wrote it (inode, size, mtime)."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def parse_delta_dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DELTA_DTYPES:
        raise InvalidRequest(f"delta_dtype must be one of {sorted(DELTA_DTYPES)}, got {name!r}")
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
    tenant: str
    model_url: str
    model_path: str
    bundle_root: str | None
    preprocessor_config: dict[str, Any]
    code: str
    compiled: CodeType
    params: dict[str, Any]
    batch_size: int
    model_hash: str
    fingerprint: Fingerprint
    dataset: ShardSession

    def file_unchanged(self) -> bool:
        """Whether the model file is still the one whose hash we hold."""
        try:
            return model_fingerprint(self.model_path) == self.fingerprint
        except FileNotFoundError:
            return False

    def manifest(self) -> dict[str, Any]:
        """What a replacement process needs to carry on with this session (kept in the work dir)."""
        return {
            "v": 1,
            "tenant": self.tenant,
            "model_url": self.model_url,
            "preprocessor_config": self.preprocessor_config,
            "model_path": self.model_path,
            "bundle_root": self.bundle_root,
            "model_hash": self.model_hash,
            "fingerprint": list(self.fingerprint),
            "code": self.code,
            "params": self.params,
            "batch_size": self.batch_size,
            "shards": [d.__dict__ for d in self.dataset.descriptors],
        }


def session_from_manifest(
    manifest_path: str,
    model_dir: str,
    *,
    max_script_bytes: int,
    dataset: Callable[[str, list[ShardDescriptor]], ShardSession],
) -> Session | None:
    """The session a manifest describes, or None when it (or its model file) is not usable.

    The recorded model hash is trusted only while the file is the one the manifest
    describes (inode, size, mtime); otherwise it is recomputed from the file.
    """
    from executor.delta import file_state_hash
    from executor.fileio import read_json
    from executor.rounds import validate_script

    model_path = os.path.join(model_dir, "model.safetensors")
    try:
        manifest = read_json(manifest_path)
        fingerprint = model_fingerprint(model_path)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("v") != 1:
        return None
    try:
        model_hash = str(manifest["model_hash"])
        if list(fingerprint) != list(manifest.get("fingerprint", [])):
            model_hash = file_state_hash(model_path)  # replaced since: an apply that crashed late
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
    bundle_root = os.path.join(model_dir, "bundle")
    return Session(
        tenant=args.tenant,
        model_url=str(manifest["model_url"]),
        model_path=model_path,
        bundle_root=bundle_root if os.path.isdir(bundle_root) else None,
        preprocessor_config=dict(manifest.get("preprocessor_config") or {}),
        code=str(manifest["code"]),
        compiled=compiled,
        params=args.params,
        batch_size=args.batch_size,
        model_hash=model_hash,
        fingerprint=fingerprint,
        dataset=dataset(args.tenant, args.descriptors),
    )
