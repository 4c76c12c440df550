"""A sharded round's sync on this host (docs/SHARDED.md): the N sync shards applied to the model.

``apply_delta`` of a sharded round names, instead of one delta, the round's N shards: each
shard's sync object and the hash its reducer reported for it, the hash of the state slices it
makes (``result_hash``) and that state's own object. On a host that holds the round's base
model, each sync shard is downloaded within its bound, its hash and layout checked (against the
partition this host computes), applied to its slices of the model by the sync's own rule, and
the slices it made checked against its ``result_hash``; once every shard holds, the new model
is written whole, atomically, and hashed (the star path's scheme): that hash is what the host
reports, and what the orchestrator requires every host to agree on. No full model exists on the
orchestrator in this mode, so the fallback (a host without the base, or a shard that does not
hold) assembles the model instead: the session's model file (``model_url``, for its layout and
its non-floating keys, which no sync changes) with every floating value from the round's state
shards, each checked against its hash.

This first version holds the model and its result in memory (two model-sized copies in fp32);
the streaming apply of the star path is its next step.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from executor import transfer
from executor.delta import DEFAULT_SCHEME, apply_rule, scheme_of, state_hash, zstd_bound
from executor.errors import BadArtifact, ErrorInfo, HashMismatch, InvalidRequest, Stopped, error_info
from executor.fileio import atomic_writer, remove_quietly
from executor.reduce import Partition, flat_slice, model_partition, read_delta_shard
from executor.reduce import shard_bound as bound_of
from executor.results import ApplyVia
from executor.session._model import NO_BASE, InstalledModel, ModelFiles, Synced, model_fingerprint
from executor.session._requests import ShardedSync
from executor.tensorfile import load_state, read_header, write_state
from executor.urls import Url

logger = logging.getLogger(__name__)


def sync_sharded(
    files: ModelFiles,
    current: InstalledModel | None,
    model_url: Url,
    base_hash: str | None,
    result_hash: str | None,
    sync: ShardedSync,
    abort: threading.Event,
    config: transfer.TransferConfig,
) -> Synced:
    """The shards applied to ``current`` when it is the round's base; else the model assembled
    from the state shards (``ApplyVia.FULL``, with the reason); nothing when ``current`` is
    ``result_hash`` already (a host that rejoins holding the global model)."""
    if current is not None and result_hash and current.model_hash == result_hash and current.file_unchanged():
        return Synced(ApplyVia.DELTA, current, None, noop=True)
    reason = ErrorInfo(NO_BASE, "no local base model")
    if current is not None and base_hash:
        applied = _delta_path(files, current, base_hash, sync, abort, config)
        if isinstance(applied, InstalledModel):
            return Synced(ApplyVia.DELTA, applied, None)
        reason = applied
    logger.warning("sharded sync: %s; assembling the model from the state shards", reason.message)
    scheme = scheme_of(current.model_hash, DEFAULT_SCHEME) if current is not None else DEFAULT_SCHEME
    return Synced(ApplyVia.FULL, _assemble(files, model_url, sync, scheme, abort, config), reason)


def _delta_path(
    files: ModelFiles,
    current: InstalledModel,
    base_hash: str,
    sync: ShardedSync,
    abort: threading.Event,
    config: transfer.TransferConfig,
) -> InstalledModel | ErrorInfo:
    if current.model_hash != base_hash or not current.file_unchanged():
        return HashMismatch(
            "local model is not the sync's base", {"expected": base_hash, "got": current.model_hash}
        ).info()
    try:
        base = load_state(current.path)
        split = model_partition(_specs(current.path), len(sync.shards), sync.align)
        result = {k: v for k, v in base.items() if not v.dtype.is_floating_point}
        floats = _float_buffers(base)
        for index, shard in enumerate(sync.shards):
            delta = _fetch_checked(files, shard.url, shard.hash, split, index, abort, config)
            made = {}
            for piece in split.shard(index):
                made[piece.key] = apply_rule(flat_slice(base[piece.key], piece), delta.get(piece.key))
                flat_slice(floats[piece.key], piece).copy_(made[piece.key])
            if state_hash(made) != shard.result_hash:
                raise HashMismatch(f"sync shard {index} does not make the state its reducer reported")
        result.update(floats)
        return _install(files, current, result, scheme_of(base_hash, DEFAULT_SCHEME))
    except Stopped:
        raise
    except Exception as exc:
        info = error_info(exc)
        logger.warning("sharded sync not applied (%s): %s", info.code, info.message)
        return info


def _assemble(
    files: ModelFiles,
    model_url: Url,
    sync: ShardedSync,
    scheme: str,
    abort: threading.Event,
    config: transfer.TransferConfig,
) -> InstalledModel:
    if any(shard.state_url is None for shard in sync.shards):
        raise InvalidRequest("this host does not hold the sync's base and the shards name no state")
    with files.staging() as staging:  # the model file is replaced only once it is whole
        layout, _ = files.fetch_hashed(model_url, "model-layout", staging, scheme=scheme, abort=abort)
        state = load_state(layout.model_path)
        split = model_partition(_specs(layout.model_path), len(sync.shards), sync.align)
        floats = _float_buffers(state)
        for index, shard in enumerate(sync.shards):
            assert shard.state_url is not None
            values = _fetch_checked(files, shard.state_url, shard.result_hash, split, index, abort, config)
            for piece in split.shard(index):
                if piece.key not in values:
                    raise BadArtifact(f"state shard {index} lacks {piece.key!r}")
                flat_slice(floats[piece.key], piece).copy_(values[piece.key])
        state.update(floats)
        with atomic_writer(layout.model_path) as out:
            write_state(out, state)
        return files.install(layout, state_hash(state, scheme=scheme))


def _float_buffers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Where each floating key of the new model is assembled (fp32: what the sync's rule makes)."""
    return {
        k: torch.empty(v.shape, dtype=torch.float32) for k, v in state.items() if v.dtype.is_floating_point
    }


def _specs(path: str) -> Mapping[str, Any]:
    with open(path, "rb") as file:
        return read_header(file).specs


def _fetch_checked(
    files: ModelFiles,
    url: Url,
    expected: str,
    split: Partition,
    index: int,
    abort: threading.Event,
    config: transfer.TransferConfig,
) -> dict[str, torch.Tensor]:
    path = os.path.join(files.incoming, f"sync-shard-{index}.zst")
    try:
        transfer.fetch(url, path, config=config, abort=abort, max_bytes=zstd_bound(bound_of(split, index)))
        values = read_delta_shard(path, split, index)
    finally:
        remove_quietly(path)
    if state_hash(values, scheme=scheme_of(expected, DEFAULT_SCHEME)) != expected:
        raise HashMismatch(f"shard {index} does not match its hash", {"shard": index})
    return values


def _install(
    files: ModelFiles, current: InstalledModel, state: Mapping[str, torch.Tensor], scheme: str
) -> InstalledModel:
    with atomic_writer(files.model_path, retire=True) as out:
        write_state(out, state)
    os.chmod(files.model_path, 0o644)  # the sandboxed runner reads it as another uid
    model_hash = state_hash(state, scheme=scheme)
    return replace(
        current, path=files.model_path, model_hash=model_hash, fingerprint=model_fingerprint(files.model_path)
    )
