"""Overlapped rounds on the worker: the global copy G, and the working copy W rounds start from.

In overlapped mode (docs/OVERLAP.md) round k+1 trains while round k's deltas are folded, so the
sync that brings the global model from θ_k to θ_{k+1} arrives during a round. The worker keeps
two files in its model dir:

- **G**, the installed model (``model.safetensors``): only ever changed by a sync checked
  against its ``result_hash`` (or a load), so what every host holds of the global model is
  provably the same;
- **W**, ``working.safetensors``: where the next round starts, ``G + d`` with ``d`` the delta
  this host shipped for its last round (the values it reported, dequantised: a deterministic
  function of G and its own delta). A round of an overlapped session starts from W when W was
  built on the G the round names, else from G (a host whose own progress was lost, by a stop,
  a crash or a re-sync, starts from the global model like a new one).

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
from executor.delta import apply_rule, compress_delta, max_delta_bytes, read_delta, result_dtype
from executor.errors import ErrorInfo, HashMismatch, InvalidRequest, error_info
from executor.fileio import atomic_writer, remove_quietly
from executor.stopping import DoneThread
from executor.tensorfile import StreamWriter, iter_tensors, load_state, read_header, tensor_bytes
from executor.urls import Url

WORKING_NAME = "working.safetensors"
MAX_SYNC_WAIT_S = 24 * 3600.0
MAX_GAIN = 100.0
SYNC_ID_CHARS = 64


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


class WorkingCopy:
    """W, the file an overlapped session's rounds start from, and the G hash it was built on."""

    def __init__(self, model_dir: str) -> None:
        self.path = os.path.join(model_dir, WORKING_NAME)
        self.base_hash: str | None = None

    def usable(self, global_hash: str) -> bool:
        return self.base_hash == global_hash and os.path.exists(self.path)

    def rebase(
        self,
        global_path: str,
        global_hash: str,
        delta_path: str,
        *,
        gain: float = 1.0,
        correction: Mapping[str, torch.Tensor] | None = None,
        compressed: bool = True,
    ) -> None:
        """W = G + gain * the shipped delta + ``correction``, key by key (G streamed, the delta
        held: it is the small one). ``compressed`` False: the delta is this worker's own plain
        safetensors file (no zstd frame to decode on the round's critical path)."""
        self.drop()
        if compressed:
            delta = read_delta(delta_path, max_bytes=max_delta_bytes(global_path), allow_torch=False)
        else:
            delta = load_state(delta_path)
        if gain != 1.0 or correction:
            delta = {key: _eager(value, gain, (correction or {}).get(key)) for key, value in delta.items()}
        with open(global_path, "rb") as source:
            header = read_header(source)
        names = sorted(header.specs)
        entries = [(name, result_dtype(header.specs[name].dtype), header.specs[name].shape) for name in names]
        with atomic_writer(self.path) as out:
            writer = StreamWriter(out, entries)
            writer.write_header()
            for name, base in iter_tensors(global_path, names):
                writer.write(tensor_bytes(apply_rule(base, delta.get(name)).contiguous()))
        os.chmod(self.path, 0o644)  # the sandboxed runner reads it as another uid
        self.base_hash = global_hash

    def drop(self) -> None:
        self.base_hash = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _eager(delta: torch.Tensor, gain: float, correction: torch.Tensor | None) -> torch.Tensor:
    out = delta.to(torch.float32) * gain
    if correction is not None and correction.shape == out.shape:
        out.add_(correction.to(torch.float32))
    return out


@dataclass(frozen=True)
class KeptDelta:
    """An overlapped round's delta file, from its write to its hand-off to the upload
    (``compressed`` False: plain safetensors, framed by the upload)."""

    path: str
    url: Url | None
    delta_hash: str
    round_num: int
    compressed: bool = True


class DeferredUpload:
    """An overlapped round's delta, framed (a plain one) and PUT while the next round trains
    (so the GPU waits on neither the compressor nor the link). Its own stop: the next round's
    stop does not cancel it; a reset, a load or a sequential round does. Its files are
    removed once the upload has ended, either way."""

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
            remove_quietly(self._kept.path)
            remove_quietly(path)
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
        self._transfer, self._join_timeout_s = transfer_config, join_timeout_s

    def start_path(self, spec: OverlapSpec, global_hash: str, unchanged: bool) -> str | None:
        """Where the round starts: W when it is built on the global model the round names (None:
        the global model itself). ``NotInSync`` when this host does not hold that model."""
        if global_hash != spec.base_hash or not unchanged:
            raise NotInSync(
                "this host does not hold the global model the overlapped round starts on",
                {"expected": spec.base_hash, "held": global_hash},
            )
        self.drop_kept()
        self.gain, self.correction = spec.gain, None
        return self.working.path if self.working.usable(global_hash) else None

    def keep(self, kept: KeptDelta) -> None:
        self.drop_kept()
        self.kept = kept

    def rebase(self, global_path: str, global_hash: str, completed: bool) -> bool:
        """W = G + the kept delta (``completed``: the round shipped it and G is the model the next
        round names), else W dropped. True when rebuilt."""
        correction, self.correction = self.correction, None
        if not completed or self.kept is None:
            self.working.drop()
            return False
        self.working.rebase(
            global_path, global_hash, self.kept.path, gain=self.gain, correction=correction,
            compressed=self.kept.compressed,
        )  # fmt: skip
        return True

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
        self.correction = None
        for upload in list(self.uploads):
            upload.cancel(self._join_timeout_s)
        self.uploads.clear()
