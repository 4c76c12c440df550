"""Overlapped rounds on the worker: the round's spec, its sync's gate, and its delta's upload.

In overlapped mode (docs/OVERLAP.md) round k+1 trains while round k's deltas are folded, so the
sync that brings the global model G from θ_k to θ_{k+1} arrives during a round (applied to G
beside it, on the task's inbox thread). A round of an overlapped session starts from W
(``executor.session._working``) when W was built on the G the round names; else from a snapshot
of G when its sync will change G during the round, else from G itself (a host whose own
progress was lost, by a stop, a crash or a re-sync, starts from the global model like a new
one). At its end it waits for its sync (``Overlap.gate``), writes its delta and the next W in
one pass, and hands the delta to an upload that hashes, frames and PUTs it beside the next
round (``DeferredUpload``), reported in the heartbeat.

Every other way the model changes (a load, ``apply_delta``, a sequential round, a reset)
drops W.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from executor import transfer
from executor.delta import compress_delta, file_state_hash
from executor.errors import ErrorInfo, HashMismatch, InvalidRequest, error_info
from executor.fileio import TEMP_SUFFIX, remove_quietly
from executor.session._working import PlainDelta, WorkingCopy
from executor.stopping import DoneThread
from executor.urls import Url

MAX_SYNC_WAIT_S = 24 * 3600.0
# A plain delta's file once its upload has ended, kept for the next round's delta to be written
# over (no page or block to allocate on the GPU's critical path); a temp name, so a start-up
# after a crash removes it.
SPARE_DELTA = ".spare-delta" + TEMP_SUFFIX
MAX_GAIN = 100.0
SYNC_ID_CHARS = 64


def spare_delta(delta_path: str) -> str:
    return os.path.join(os.path.dirname(delta_path), SPARE_DELTA)


class NotInSync(HashMismatch):
    """An overlapped round names a global model this host does not hold: it must re-sync
    (``hash_mismatch``, the contract's code for a model that is not the one named)."""


@dataclass(frozen=True)
class OverlapSpec:
    """``run_round``'s ``overlap``: the global model the round starts on (``base_hash``), the
    id of the sync it awaits (None: none is outstanding) and how long it waits for it at its end."""

    base_hash: str
    sync_id: str | None
    sync_wait_s: float
    # The outer step's gain on the mean delta: W = G + gain * d + the order's correction.
    gain: float = 1.0

    @classmethod
    def parse(cls, value: object) -> OverlapSpec | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidRequest(f"overlap must be an object, got {type(value).__name__}")
        base_hash, sync_id, wait = (
            value.get("base_hash"),
            value.get("sync_id"),
            value.get("sync_wait_s", 600.0),
        )
        if not isinstance(base_hash, str) or not base_hash or len(base_hash) > 256:
            raise InvalidRequest("overlap.base_hash must be a model hash")
        if sync_id is not None and (
            not isinstance(sync_id, str) or not sync_id.isalnum() or not 0 < len(sync_id) <= SYNC_ID_CHARS
        ):
            raise InvalidRequest(f"overlap.sync_id must be 1-{SYNC_ID_CHARS} letters or digits")
        if (
            not isinstance(wait, (int, float))
            or isinstance(wait, bool)
            or not math.isfinite(wait)
            or not 0 <= wait <= MAX_SYNC_WAIT_S
        ):
            raise InvalidRequest(f"overlap.sync_wait_s must be seconds in [0, {MAX_SYNC_WAIT_S:g}]")
        gain = value.get("gain", 1.0)
        if not isinstance(gain, (int, float)) or isinstance(gain, bool) or not 0 <= gain <= MAX_GAIN:
            raise InvalidRequest(f"overlap.gain must be a number in [0, {MAX_GAIN:g}]")
        return cls(base_hash, sync_id, float(wait), float(gain))


@dataclass(frozen=True)
class RoundEnd:
    """An overlapped round's end, for its result: the wait for its sync (idle, reported), whether
    W was rebuilt for the next round and how long a separate rebuild took (0: in the delta's pass)."""

    sync_wait_s: float
    rebased: bool
    rebase_s: float


@dataclass(frozen=True)
class KeptDelta:
    """An overlapped round's delta file, from its write to its hand-off to the upload
    (``compressed`` False: plain safetensors, framed by the upload)."""

    path: str
    url: Url | None
    delta_hash: str | None  # None: a plain delta, hashed by its upload
    round_num: int
    compressed: bool = True


class DeferredUpload:
    """An overlapped round's delta, hashed and framed (a plain one) and PUT while the next round
    trains (so the GPU waits on neither the hash, the compressor nor the link); its hash is
    reported with its end, in the heartbeat. Its own stop: the next round's stop does not
    cancel it; a reset, a load or a sequential round does. Its files are removed once the
    upload has ended, either way."""

    def __init__(
        self,
        kept: KeptDelta,
        url: Url,
        *,
        config: transfer.TransferConfig,
        on_done: Callable[[], None],
    ) -> None:
        self.round_num, self.delta_hash = kept.round_num, kept.delta_hash
        self.state = "running"
        self.error: ErrorInfo | None = None
        self.seconds = 0.0
        self.bytes = 0
        self._kept, self._url, self._config, self._on_done = kept, url, config, on_done
        self._abort = threading.Event()
        self._thread = DoneThread(self._run, "roundhouse-delta-upload")
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        path = self._kept.path
        try:
            if self.delta_hash is None:
                self.delta_hash = file_state_hash(self._kept.path)  # the worker's own file
            if not self._kept.compressed:
                path = self._kept.path + ".zst"
                self.bytes = compress_delta(self._kept.path, path, self._abort)
            else:
                self.bytes = os.path.getsize(path)
            transfer.upload(path, self._url, config=self._config, abort=self._abort)
            self.state = "done"
        except Exception as exc:  # reported in the heartbeat: the orchestrator leaves the delta out
            self.error, self.state = error_info(exc), "failed"
        finally:
            self.seconds = time.monotonic() - started
            if path != self._kept.path:  # the plain file, framed: the next round's pass reuses it
                remove_quietly(path)
                with contextlib.suppress(OSError):
                    os.replace(self._kept.path, spare_delta(self._kept.path))
            remove_quietly(self._kept.path)
            self._on_done()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._thread.wait(timeout_s)

    def cancel(self, timeout_s: float) -> None:
        self._abort.set()
        self._thread.wait(timeout_s)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"round": self.round_num, "hash": self.delta_hash, "state": self.state}
        out.update(seconds=round(self.seconds, 6), bytes=self.bytes)
        if self.error is not None:
            out["error"] = self.error.to_json()
        return out


class Overlap:
    """An overlapped session's side of the worker: W, the last round's delta until it is handed
    to its upload, and the uploads that run beside the next rounds (the last few, reported in
    the heartbeat: the orchestrator folds a delta once its upload is reported done)."""

    KEPT_REPORTS = 4

    def __init__(
        self, model_dir: str, transfer_config: transfer.TransferConfig, join_timeout_s: float
    ) -> None:
        self.working = WorkingCopy(model_dir)
        self.kept: KeptDelta | None = None
        self.uploads: deque[DeferredUpload] = deque(maxlen=self.KEPT_REPORTS)
        # The round's eager step: its gain (from the round's task) and the correction the sync
        # order brought (checked against the order's hash), used by the rebase at its end.
        self.gain = 1.0
        self.correction: dict[str, torch.Tensor] | None = None
        # Set by the task for its round: waits for the round's sync, True once it is applied.
        self.gate: Callable[[], bool] | None = None
        self.ended: RoundEnd | None = None
        self._transfer, self._join_timeout_s = transfer_config, join_timeout_s
        self._spare: str | None = None  # where an ended upload leaves its plain file

    def start_path(
        self, spec: OverlapSpec, global_path: str, global_hash: str, unchanged: bool
    ) -> str | None:
        """Where the round starts: W when it is built on the global model the round names; a
        snapshot of G as W when the round awaits a sync (applied to G in place while it trains);
        else None (G itself). ``NotInSync`` when this host does not hold the model named."""
        if global_hash != spec.base_hash or not unchanged:
            raise NotInSync(
                "this host does not hold the global model the overlapped round starts on",
                {"expected": spec.base_hash, "held": global_hash},
            )
        self.drop_kept()
        self.gain, self.correction, self.gate, self.ended = spec.gain, None, None, None
        if self.working.usable(global_hash):
            return self.working.path
        if spec.sync_id is not None:
            self.working.snapshot(global_path, global_hash)
            return self.working.path
        self.working.drop()
        return None

    def await_sync(self) -> tuple[bool, float]:
        """At a completed round's end: wait for its sync (the task's gate); applied?, seconds."""
        started = time.monotonic()
        gate, self.gate = self.gate, None
        synced = gate is None or gate()
        return synced, time.monotonic() - started

    def write_end(
        self,
        start_path: str,
        trained: Mapping[str, torch.Tensor],
        kept: KeptDelta,
        dtype: torch.dtype,
        base: tuple[str, str] | None,
        sync_wait_s: float,
    ) -> PlainDelta:
        """A completed round's float delta written plain and, on ``base`` (the synced G), the next
        W, in one pass (``WorkingCopy.write_round_end``); the delta kept for its upload."""
        correction, self.correction = self.correction, None
        self._spare = spare_delta(kept.path)
        written = self.working.write_round_end(
            start_path, trained, kept.path, dtype, base, gain=self.gain, correction=correction,
            spare=self._spare,
        )  # fmt: skip
        self.keep(kept)
        self.ended = RoundEnd(sync_wait_s, written.rebased, rebase_s=0.0)
        return written

    def keep(self, kept: KeptDelta) -> None:
        self.drop_kept()
        self.kept = kept

    def rebase(self, global_path: str, global_hash: str, synced: bool, sync_wait_s: float) -> None:
        """After a quantised delta's write: W = G + the kept delta, dequantised (``synced``: G is
        the model the next round names), else W dropped."""
        correction, self.correction = self.correction, None
        started = time.monotonic()
        if not synced or self.kept is None:
            self.working.drop()
        else:
            self.working.rebase(
                global_path, global_hash, self.kept.path, gain=self.gain, correction=correction
            )
        self.ended = RoundEnd(sync_wait_s, synced and self.kept is not None, time.monotonic() - started)

    def end_round(self) -> RoundEnd:
        """How the round's end went; a round that shipped nothing (stopped, failed) drops W."""
        ended, self.ended, self.gate = self.ended, None, None
        if ended is None:
            self.correction = None
            self.working.drop()
            return RoundEnd(0.0, False, 0.0)
        return ended

    def hand_off(self, on_done: Callable[[], None]) -> float:
        """The kept delta to its upload, once the previous upload has ended (a link slower than a
        round: that wait is idle time, returned in seconds)."""
        started = time.monotonic()
        for upload in self.uploads:
            upload.wait()
        waited = time.monotonic() - started
        kept, self.kept = self.kept, None
        if kept is not None and kept.url is not None:
            self.uploads.append(DeferredUpload(kept, kept.url, config=self._transfer, on_done=on_done))
        elif kept is not None:
            remove_quietly(kept.path)
        return waited

    def reports(self) -> list[dict[str, object]]:
        return [upload.to_json() for upload in list(self.uploads)]

    def drop_kept(self) -> None:
        if self.kept is not None:
            remove_quietly(self.kept.path)
            self.kept = None

    def end(self) -> None:
        """The model is no longer the overlapped session's: W, the kept delta and the uploads go."""
        self.drop_kept()
        self.working.drop()
        self.correction, self.gate, self.ended = None, None, None
        for upload in list(self.uploads):
            upload.cancel(self._join_timeout_s)
        self.uploads.clear()
        if self._spare is not None:
            remove_quietly(self._spare)
