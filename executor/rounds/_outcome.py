"""Turning the end of a round into its result: status, error, and the trained delta shipped.

A round's delta is ``trained - original`` (DESIGN §3), written next to the work
dir and PUT to the orchestrator's URL when one is given; without a URL it stays
in ``<work>/deltas/`` and its path is returned.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

import torch

from executor import transfer
from executor.delta import write_result_delta
from executor.errors import NO_SPACE_ERRNOS, ErrorInfo, RoundhouseError, Stopped, UserCodeError, storage_full
from executor.results import DeltaInfo, RoundResult, RoundStatus


def ship_delta(
    model_path: str,
    trained: Mapping[str, torch.Tensor] | None,
    *,
    work_dir: str,
    round_num: int,
    dtype: torch.dtype,
    delta_url: str | None,
    transfer_config: transfer.TransferConfig,
    abort: threading.Event,
) -> DeltaInfo:
    """Write the trained delta (a zero delta when nothing was saved) and upload it."""
    deltas = os.path.join(work_dir, "deltas")
    os.makedirs(deltas, exist_ok=True)
    path = os.path.join(deltas, f"round-{round_num}.safetensors.zst")
    try:
        written = write_result_delta(model_path, trained or {}, path, dtype=dtype)
    except OSError as exc:
        if exc.errno in NO_SPACE_ERRNOS:
            raise storage_full(exc, "the work dir (trained delta)") from None
        raise
    if not delta_url:
        return DeltaInfo(written.bytes, written.hash, written.dtype, written.keys, path=path)
    try:
        transfer.upload(path, delta_url, config=transfer_config, abort=abort)
    finally:
        os.unlink(path)
    return DeltaInfo(
        written.bytes, written.hash, written.dtype, written.keys, url=transfer.redact_url(delta_url)
    )


def round_result(
    *,
    stopped: bool,
    error: Mapping[str, object] | None,
    training_time: float,
    report: dict[str, object] | None,
    round_num: int,
    ship: Callable[[], DeltaInfo] | None,
) -> RoundResult:
    """The result of a finished round; ``ship`` (training rounds) runs only when it completed."""
    info = ErrorInfo(**error) if error else None  # type: ignore[arg-type]
    status = RoundStatus.STOPPED if stopped else (RoundStatus.FAILED if info else RoundStatus.COMPLETED)
    delta: DeltaInfo | None = None
    if status is RoundStatus.COMPLETED and ship is not None:
        try:
            delta = ship()
        except Stopped:
            status = RoundStatus.STOPPED
        except RoundhouseError as exc:
            status, info = RoundStatus.FAILED, exc.info()
        except ValueError as exc:  # the trained state does not fit the model (a shape changed)
            status, info = RoundStatus.FAILED, UserCodeError(str(exc)).info()
    return RoundResult(status, training_time, report, info, delta, round_num)
