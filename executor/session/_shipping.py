"""Shipping a round's delta: ``trained - original`` written in the work dir and PUT to the
orchestrator's URL (DESIGN §3); without a URL it stays in ``<work>/deltas/`` and its path is
returned.

A quantised delta with error feedback carries the residual of the session's earlier rounds
(``executor.delta.ErrorFeedback``, in the work dir); the next residual replaces it only once
this delta is delivered, so a failed upload leaves it as it was.
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
from executor.delta import ErrorFeedback, QuantScheme, write_result_delta
from executor.errors import map_exceptions
from executor.results import DeltaInfo
from executor.session._requests import RoundRequest
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
    (an overlapped round): written only, its ``path`` returned, for the rebase and the upload
    that runs beside the next round (``executor.session._overlap.DeferredUpload``), a float
    delta as plain safetensors (the upload frames it: ``compressed`` False, ``bytes`` the plain
    file's)."""
    dirs = SessionDir(work_dir)
    os.makedirs(dirs.deltas, exist_ok=True)
    dtype, delta_url = request.delta_format, request.delta_url
    # Deferred, a float delta is written plain: its zstd pass runs beside the next round too.
    plain = defer and not isinstance(dtype, QuantScheme)
    path = dirs.round_delta(request.spec.round_num, compressed=not plain)
    feedback = ErrorFeedback(work_dir) if isinstance(dtype, QuantScheme) and error_feedback else None
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        residual = stack.enter_context(feedback.next_round()) if feedback is not None else None
        with map_exceptions({}, where="the work dir (trained delta)"):
            written = write_result_delta(
                model_path, trained or {}, path, dtype=dtype, feedback=residual, compress=not plain
            )
            if (defer or not delta_url) and residual is not None:
                # Kept in the work dir, or handed to an upload beside the next round, whose own
                # delta is cut before that upload ends: counted as delivered once written.
                residual.commit()
        info = DeltaInfo(
            written.bytes, written.hash, written.dtype, written.keys, write_s=time.monotonic() - started,
            compressed=written.compressed,
        )  # fmt: skip
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
