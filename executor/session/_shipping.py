"""Shipping a round's delta: ``trained - original`` written in the work dir and PUT to the
orchestrator's URL (DESIGN §3); without a URL it stays in ``<work>/deltas/`` and its path is
returned.

A quantised delta with error feedback carries the residual of the session's earlier rounds
(``executor.delta.ErrorFeedback``, in the work dir); the next residual replaces it only once
this delta is delivered, so a failed upload leaves it as it was.

An overlapped round's (:func:`ship_overlapped`) is written after its sync came, in one pass
with the working copy the next round starts from, and uploaded beside the next round.

A sharded round's N shard files are kept once delivered (:func:`keep_file`, named by hash in
the work dir's ``reduce/``): the shard this host then reduces reads its own contribution there
instead of GETting it back; ``_reducing`` keeps its state and velocity the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from executor import transfer
from executor.delta import (
    ErrorFeedback,
    QuantScheme,
    file_state_hash,
    format_name,
    trained_keys,
    write_result_delta,
)
from executor.errors import InvalidRequest, map_exceptions
from executor.fileio import remove_quietly
from executor.reduce import model_partition, write_delta_shards
from executor.results import DeltaInfo
from executor.session._overlap import KeptDelta, Overlap
from executor.session._requests import EXACT_HASH, RoundRequest
from executor.session._state import Session
from executor.tensorfile import dtype_name, read_header
from executor.workdir import SessionDir


def ship_delta(
    model_path: str,
    trained: Mapping[str, torch.Tensor] | None,
    request: RoundRequest,
    *,
    work_dir: str,
    transfer_config: transfer.TransferConfig,
    abort: threading.Event,
    error_feedback: bool = True,
    defer: bool = False,
) -> DeltaInfo:
    """Write the trained delta (a zero delta when nothing was saved) and upload it; ``defer``
    (an overlapped round's quantised delta): written only, its ``path`` returned, for the
    rebase and the upload that runs beside the next round (:func:`ship_overlapped`)."""
    if request.delta_shards is not None:
        return ship_shards(model_path, trained, request, work_dir, transfer_config, abort)
    dirs = SessionDir(work_dir)
    os.makedirs(dirs.deltas, exist_ok=True)
    path = dirs.round_delta(request.spec.round_num)
    dtype, delta_url = request.delta_format, request.delta_url
    feedback = ErrorFeedback(work_dir) if isinstance(dtype, QuantScheme) and error_feedback else None
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        residual = stack.enter_context(feedback.next_round()) if feedback is not None else None
        with map_exceptions({}, where="the work dir (trained delta)"):
            written = write_result_delta(model_path, trained or {}, path, dtype=dtype, feedback=residual)
            if (defer or not delta_url) and residual is not None:
                # Kept in the work dir, or handed to an upload beside the next round, whose own
                # delta is cut before that upload ends: counted as delivered once written.
                residual.commit()
        info = DeltaInfo(
            written.bytes, written.hash, written.dtype, written.keys, write_s=time.monotonic() - started
        )
        if not delta_url:
            return replace(info, path=path)
        if defer:
            return replace(info, url=str(delta_url), path=path, deferred=True)  # str: redacted
        uploading = time.monotonic()
        try:
            transfer.upload(path, delta_url, config=transfer_config, abort=abort)
        finally:
            os.unlink(path)
        info = replace(info, url=str(delta_url), upload_s=time.monotonic() - uploading)  # str: redacted
        if residual is not None:
            with map_exceptions({}, where="the work dir (error feedback)"):
                residual.commit()
    return info


def ship_shards(
    model_path: str,
    trained: Mapping[str, torch.Tensor] | None,
    request: RoundRequest,
    work_dir: str,
    transfer_config: transfer.TransferConfig,
    abort: threading.Event,
) -> DeltaInfo:
    """A sharded round's delta (docs/SHARDED.md): ``trained - original`` written as the
    partition's shard files in one pass over the model, each hashed as written, then PUT to its
    URL in shard order; the result reports each shard's hash and size. A quantised one carries
    the session's residual (error feedback), committed once every shard is delivered."""
    urls = request.delta_shards or ()
    dirs = SessionDir(work_dir)
    os.makedirs(dirs.deltas, exist_ok=True)
    paths = [dirs.round_delta(request.spec.round_num) + f".shard-{n}" for n in range(len(urls))]
    quantised = isinstance(request.delta_format, QuantScheme)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        residual = stack.enter_context(ErrorFeedback(work_dir).next_round()) if quantised else None
        try:
            with map_exceptions({}, where="the work dir (trained delta)"):
                with open(model_path, "rb") as model:
                    header = read_header(model)
                split, keys = (
                    model_partition(header.specs, len(urls)),
                    len(trained_keys(header, trained or {})),
                )
                written = write_delta_shards(
                    model_path, trained or {}, split, request.delta_format, paths, feedback=residual
                )
            wrote = time.monotonic()
            for path, url in zip(paths, urls, strict=True):
                transfer.upload(path, url, config=transfer_config, abort=abort)
            os.makedirs(dirs.reduce, exist_ok=True)
            for n, (path, w) in enumerate(zip(paths, written, strict=True)):
                keep_file(path, dirs, "delta", n, w.hash)  # its reduce reads its own shard here
        finally:
            for path in paths:
                remove_quietly(path)
        if residual is not None:
            with map_exceptions({}, where="the work dir (error feedback)"):
                residual.commit()
    return DeltaInfo(
        sum(w.bytes for w in written), None, format_name(request.delta_format), keys,
        write_s=wrote - started, upload_s=time.monotonic() - wrote, url=str(urls[0]) if urls else None,
        shards=tuple({"hash": w.hash, "bytes": w.bytes} for w in written),
    )  # fmt: skip


def ship_overlapped(
    overlap: Overlap,
    session: Session,
    trained: Mapping[str, torch.Tensor] | None,
    request: RoundRequest,
    *,
    work_dir: str,
    transfer_config: transfer.TransferConfig,
    abort: threading.Event,
    error_feedback: bool = True,
) -> DeltaInfo:
    """An overlapped round's delta (docs/OVERLAP.md). Its sync is awaited first: the next W is
    built on it. A float delta is then written plain in one pass with the next W, and kept for
    the upload beside the next round, which hashes, frames and PUTs it (its hash reported in
    the heartbeat: the result's is None). A quantised delta is written and hashed as in
    sequential mode (its residual is committed now), then W is rebuilt from the values it
    carries. Without a URL, a plain delta is hashed here, for the result."""
    synced, waited = overlap.await_sync()
    url, round_num = request.delta_url, request.spec.round_num
    if isinstance(request.delta_format, QuantScheme):
        info = ship_delta(
            session.start_path, trained, request, work_dir=work_dir, transfer_config=transfer_config,
            abort=abort, error_feedback=error_feedback, defer=True,
        )  # fmt: skip
        if info.path is not None:
            overlap.keep(KeptDelta(info.path, url, info.hash, round_num))
        with map_exceptions({}, where="the work dir (working copy)"):
            overlap.rebase(session.model_path, session.model_hash, synced, waited)
        return replace(info, path=None)  # the work dir's own copy, for the upload: not reported
    dirs = SessionDir(work_dir)
    os.makedirs(dirs.deltas, exist_ok=True)
    kept = KeptDelta(dirs.round_delta(round_num, compressed=False), url, None, round_num, compressed=False)
    base = (session.model_path, session.model_hash) if synced else None
    started = time.monotonic()
    with map_exceptions({}, where="the work dir (trained delta)"):
        written = overlap.write_end(
            session.start_path, trained or {}, kept, request.delta_format, base, waited
        )
        delta_hash = None if url is not None else file_state_hash(kept.path)
    return DeltaInfo(
        written.bytes, delta_hash, dtype_name(request.delta_format), written.keys,
        write_s=time.monotonic() - started, url=str(url) if url is not None else None,
        deferred=url is not None,
    )  # fmt: skip


def kept_path(dirs: SessionDir, kind: str, shard: int, value_hash: str) -> str:
    """Where this host keeps the ``kind`` it last made for ``shard``, named by its hash: its own
    delta shards (from its round's shipping: its contribution to the shard it reduces is read,
    not GOT back), the state until the apply's store order PUTs it, the velocity after that too
    (the partition is fixed for the session, so while S is stable the shard's next reduce is
    here and reads it instead of GETting it back: one object less on the critical path)."""
    if not EXACT_HASH.match(value_hash):  # a name in this dir: never a path from a message
        raise InvalidRequest(f"not a hash: {value_hash[:80]!r}")
    return dirs.kept(kind, shard, value_hash.partition(":")[2])


def keep_file(path: str, dirs: SessionDir, kind: str, shard: int, value_hash: str) -> str:
    """``path`` moved to where ``kind`` of ``shard`` is kept (the shard's earlier one removed)."""
    for old in os.listdir(dirs.reduce):
        if old.startswith(f"kept-{kind}-{shard}-"):
            remove_quietly(os.path.join(dirs.reduce, old))
    kept = kept_path(dirs, kind, shard, value_hash)
    os.replace(path, kept)
    return kept
