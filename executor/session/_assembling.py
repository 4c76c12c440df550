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

The apply streams (:func:`_stream`: one pass over the model, one shard's sync slices held at a
time, as the star path's apply streams); the assembly, the rare path, holds the model in memory
(two fp32 copies).
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
from executor.delta import (
    DEFAULT_SCHEME,
    apply_rule,
    hash_entry_header,
    hash_prefix,
    new_hasher,
    result_dtype,
    scheme_of,
    state_hash,
    zstd_bound,
)
from executor.errors import BadArtifact, ErrorInfo, HashMismatch, InvalidRequest, Stopped, error_info
from executor.fileio import atomic_writer, remove_quietly
from executor.reduce import Partition, Slice, flat_slice, model_partition, read_delta_shard, read_slice
from executor.reduce import shard_bound as bound_of
from executor.results import ApplyVia
from executor.session._model import NO_BASE, InstalledModel, ModelFiles, Synced, model_fingerprint
from executor.session._requests import ShardedSync, SyncShard
from executor.tensorfile import StreamWriter, load_state, read_header, read_tensor, tensor_bytes, write_state
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
        return _stream(files, current, sync, scheme_of(base_hash, DEFAULT_SCHEME), abort, config)
    except Stopped:
        raise
    except Exception as exc:
        info = error_info(exc)
        logger.warning("sharded sync not applied (%s): %s", info.code, info.message)
        return info


def _stream(
    files: ModelFiles,
    current: InstalledModel,
    sync: ShardedSync,
    scheme: str,
    abort: threading.Event,
    config: transfer.TransferConfig,
) -> InstalledModel:
    """The sync shards applied in one pass over the model, key by key in sorted order: each
    shard's sync slices held while its slices are made (one shard at a time), each made slice
    written where it goes, fed to its shard's hash (checked once the shard's last slice is
    made) and to the new model's hash."""
    with open(current.path, "rb") as probe:
        header = read_header(probe)
    split = model_partition(header.specs, len(sync.shards), sync.align)
    paths = [_download(files, shard.url, split, j, abort, config) for j, shard in enumerate(sync.shards)]
    try:
        names, (pieces, last) = sorted(header.specs), _walk(split)
        full, shard_hashes = (
            new_hasher(scheme),
            [new_hasher(scheme_of(s.result_hash, DEFAULT_SCHEME)) for s in sync.shards],
        )
        held: tuple[int, dict[str, torch.Tensor]] | None = None
        entries = [(n, result_dtype(header.specs[n].dtype), header.specs[n].shape) for n in names]
        # Entered first, so it exits last: the model is replaced once the base file is closed.
        with atomic_writer(files.model_path, retire=True) as out, open(current.path, "rb") as base:
            writer = StreamWriter(out, entries)
            writer.write_header()
            for name in names:
                spec = header.specs[name]
                hash_entry_header(full, name, result_dtype(spec.dtype), spec.shape)
                if name not in pieces:  # not floating: passed through as it is
                    value = read_tensor(base, header, spec)
                    full.update(tensor_bytes(value))
                    writer.write(tensor_bytes(value))
                    continue
                for j, piece in pieces[name]:
                    if held is None or held[0] != j:
                        held = (j, read_delta_shard(paths[j], split, j, sync.shards[j].hash))
                    made = apply_rule(read_slice(base, header, spec, piece), held[1].get(name)).contiguous()
                    hash_entry_header(shard_hashes[j], name, torch.float32, (piece.numel,))
                    for hasher in (shard_hashes[j], full):
                        hasher.update(tensor_bytes(made))
                    writer.write(tensor_bytes(made))
                    if (
                        piece is last[j]
                        and _digest(shard_hashes[j], sync.shards[j]) != sync.shards[j].result_hash
                    ):
                        raise HashMismatch(f"sync shard {j} does not make the state its reducer reported")
            for j, shard in enumerate(sync.shards):  # a shard with no slice makes the empty state
                if j not in last and _digest(shard_hashes[j], shard) != shard.result_hash:
                    raise HashMismatch(f"sync shard {j} does not make the state its reducer reported")
    finally:
        for path in paths:
            remove_quietly(path)
    os.chmod(files.model_path, 0o644)  # the sandboxed runner reads it as another uid
    model_hash = hash_prefix(scheme) + full.hexdigest()
    return replace(current, model_hash=model_hash, fingerprint=model_fingerprint(files.model_path))


def _walk(split: Partition) -> tuple[dict[str, list[tuple[int, Slice]]], dict[int, Slice]]:
    """Each key's slices with their shards, in order (the pass's walk), and each non-empty
    shard's last slice (where its hash is complete)."""
    pieces: dict[str, list[tuple[int, Slice]]] = {}
    for j in range(len(split)):
        for piece in split.shard(j):
            pieces.setdefault(piece.key, []).append((j, piece))
    return pieces, {j: split.shard(j)[-1] for j in range(len(split)) if split.shard(j)}


def _digest(hasher: Any, shard: SyncShard) -> str:
    return hash_prefix(scheme_of(shard.result_hash, DEFAULT_SCHEME)) + hasher.copy().hexdigest()


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


def _download(
    files: ModelFiles,
    url: Url,
    split: Partition,
    index: int,
    abort: threading.Event,
    config: transfer.TransferConfig,
) -> str:
    path = os.path.join(files.incoming, f"sync-shard-{index}.zst")
    try:
        transfer.fetch(url, path, config=config, abort=abort, max_bytes=zstd_bound(bound_of(split, index)))
    except BaseException:
        remove_quietly(path)
        raise
    return path


def _fetch_checked(
    files: ModelFiles,
    url: Url,
    expected: str,
    split: Partition,
    index: int,
    abort: threading.Event,
    config: transfer.TransferConfig,
) -> dict[str, torch.Tensor]:
    path = _download(files, url, split, index, abort, config)
    try:
        return read_delta_shard(path, split, index, expected)
    finally:
        remove_quietly(path)
