"""Applying a sync delta to a model file in one streaming pass (DESIGN §4).

Per slice of each tensor: read the base, hash it, cast and add (``apply_rule``),
hash the result, write it. Memory stays at a few slices whatever the model size
(no second copy of the model, no decompress-to-disk-then-reload); the delta decodes
within the cap its model sets (:mod:`executor.delta._decode`); the model file is
replaced atomically, and only when both hashes hold.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import torch

from executor.delta._decode import DeltaSource
from executor.delta._schemes import SHA256, hash_prefix, new_hasher, scheme_of
from executor.delta._sync import (
    apply_rule,
    check_delta_specs,
    hash_entry_header,
    is_floating,
    result_dtype,
)
from executor.errors import HashMismatch, Stopped
from executor.fileio import atomic_writer
from executor.tensorfile import StreamWriter, TensorSpec, read_header, read_into, tensor_bytes

# ---------------------------------------------------------------- streaming apply


@dataclass(frozen=True)
class ApplyResult:
    model_hash: str
    keys: int
    delta_keys: int
    bytes: int
    seconds: float


RING_SLOTS = 3
APPLY_SLICE_ELEMENTS = 256 * 1024


class _Slot:
    """Reusable read buffers for one slice in flight."""

    def __init__(self, elements: int) -> None:
        self.base = bytearray(elements * 8)
        self.delta = bytearray(elements * 8)
        self.busy: list[Future[None]] = []

    def wait(self) -> None:
        for future in self.busy:
            future.result()
        self.busy = []


def _view(buffer: bytearray, dtype: torch.dtype, count: int) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=dtype, count=count) if count else torch.empty(0, dtype=dtype)


class _Lane:
    """One thread that runs its tasks in submission order (hashes must see bytes in order).

    sha256 and ``write`` release the GIL, so the lanes run beside the reading and adding.
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._last: Future[None] | None = None

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        self._last = self._pool.submit(fn)
        return self._last

    def close(self, *, cancel: bool) -> None:
        """Run (or, after a failure upstream, drop) what is queued; re-raise a lane failure."""
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        if not cancel and self._last is not None:
            self._last.result()


class _Pipeline:
    """Reading and adding on the caller's thread; hashing and writing on lanes behind it."""

    def __init__(self, writer: StreamWriter, base_hasher: Any, result_hasher: Any, elements: int) -> None:
        self.writer = writer
        self.base_hasher = base_hasher
        self.result_hasher = result_hasher
        self.elements = elements
        self.slots = [_Slot(elements) for _ in range(RING_SLOTS)]
        self.turn = 0
        self.result_lane = _Lane("delta-result")
        self.base_lane = _Lane("delta-base") if base_hasher is not None else None

    def next_slot(self) -> _Slot:
        slot = self.slots[self.turn % RING_SLOTS]
        self.turn += 1
        slot.wait()
        return slot

    def header(self, spec: TensorSpec) -> None:
        hasher = self.result_hasher
        self.result_lane.submit(
            lambda: hash_entry_header(hasher, spec.name, result_dtype(spec.dtype), spec.shape)
        )
        if self.base_lane is not None:
            base_hasher = self.base_hasher
            self.base_lane.submit(lambda: hash_entry_header(base_hasher, spec.name, spec.dtype, spec.shape))

    def emit(self, slot: _Slot, base_bytes: memoryview, result: torch.Tensor | memoryview) -> None:
        data = result if isinstance(result, memoryview) else tensor_bytes(result)

        def finish() -> None:
            self.result_hasher.update(data)
            self.writer.write(data)

        slot.busy.append(self.result_lane.submit(finish))
        if self.base_lane is not None:
            slot.busy.append(self.base_lane.submit(lambda: self.base_hasher.update(base_bytes)))

    def close(self, *, cancel: bool) -> None:
        for lane in (self.result_lane, self.base_lane):
            if lane is not None:
                lane.close(cancel=cancel)


def apply_sync_delta(
    model_path: str,
    delta_path: str,
    *,
    base_hash: str,
    result_hash: str,
    abort: threading.Event | None = None,
    known_base_hash: str | None = None,
) -> ApplyResult:
    """Apply a sync delta to a safetensors model file in one streaming pass: per slice of each
    tensor, read the base, hash it, cast and add, hash the result, write it. ``model_path`` is
    replaced atomically only when both hashes hold, else left as it was (``HashMismatch``).
    ``known_base_hash`` (the file's hash as this process last wrote it) skips hashing the
    base: the result hash still proves every byte."""
    started = time.monotonic()
    if known_base_hash is not None and known_base_hash != base_hash:
        raise HashMismatch(
            "local model is not the delta's base", {"expected": base_hash, "local": known_base_hash}
        )
    with contextlib.ExitStack() as stack:
        # Entered first, so it exits last: the model is replaced once the base file is closed
        # (were it still open, closing it would free the replaced file's blocks on this path).
        out = stack.enter_context(atomic_writer(model_path, retire=True))
        base_file = stack.enter_context(open(model_path, "rb"))
        header = read_header(base_file)
        # The delta's cap is known before its first byte is decoded: the model bounds it.
        source = stack.enter_context(DeltaSource.for_model(delta_path, header))
        check_delta_specs(
            {n: (s.dtype, s.shape) for n, s in header.specs.items()},
            {n: (s.dtype, s.shape) for n, s in source.specs.items()},
        )
        names = sorted(header.specs)
        entries = [(n, result_dtype(header.specs[n].dtype), header.specs[n].shape) for n in names]
        # Each hash in the scheme its prefix names (the session's: sha256 or blake3).
        base_hasher = new_hasher(scheme_of(base_hash, SHA256)) if known_base_hash is None else None
        result_hasher = new_hasher(scheme_of(result_hash, SHA256))
        # The new file takes the old one's mode (a sandboxed runner reads it as another uid).
        os.fchmod(out.fileno(), os.fstat(base_file.fileno()).st_mode & 0o777)
        writer = StreamWriter(out, entries)
        _preallocate(out, writer.total_bytes)
        writer.write_header()
        # 256 Ki elements (1 MiB of fp32) per slice: the base, the sum and its hash stay in a
        # core's L2; 8 MiB slices made the apply 1.2-1.4x slower (bench/sync_delta.py).
        pipeline = _Pipeline(writer, base_hasher, result_hasher, APPLY_SLICE_ELEMENTS)
        try:
            for name in names:
                if abort is not None and abort.is_set():
                    raise Stopped("sync delta apply stopped")
                pipeline.header(header.specs[name])
                _apply_one(base_file, header.data_offset, header.specs[name], source, pipeline)
        except BaseException:
            pipeline.close(cancel=True)
            raise
        pipeline.close(cancel=False)
        _check_hashes(base_hasher, result_hasher, base_hash=base_hash, result_hash=result_hash)
    size = os.path.getsize(model_path)
    return ApplyResult(result_hash, len(names), len(source.specs), size, time.monotonic() - started)


def _check_hashes(base_hasher: Any, result_hasher: Any, *, base_hash: str, result_hash: str) -> None:
    """``HashMismatch`` unless the base (when it was hashed) and the result are the named ones:
    raised before the atomic writer commits, so the model file is left as it was."""
    got_base = _named(base_hasher, base_hash) if base_hasher is not None else base_hash
    if got_base != base_hash:
        raise HashMismatch("local model is not the delta's base", {"expected": base_hash, "local": got_base})
    got_result = _named(result_hasher, result_hash)
    if got_result != result_hash:
        raise HashMismatch(
            "result of the delta apply does not match result_hash",
            {"expected": result_hash, "got": got_result},
        )


def _named(hasher: Any, like: str) -> str:
    """A hasher's digest with the prefix of the scheme that ``like`` names."""
    return hash_prefix(scheme_of(like, SHA256)) + hasher.hexdigest()


def _preallocate(out: IO[bytes], nbytes: int) -> None:
    # Allocating the blocks up front makes the writes plain copies into the page cache.
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fallocate(out.fileno(), 0, nbytes)


def _add(base: torch.Tensor, delta: torch.Tensor | None, *, in_place: bool) -> torch.Tensor:
    """``apply_rule`` for one slice of a floating key, the sum written over the slot's base
    buffer when nothing else reads it (no base hash in flight) and it is float32 already: the
    same two operations without a copy of the base (0.86 x the apply's time with the copy,
    1 GiB, alternated runs; converting the delta inside a mixed-dtype ``add_`` was slower)."""
    if not in_place or base.dtype != torch.float32:
        return apply_rule(base, delta)
    if delta is not None:
        base.add_(delta.to(torch.float32))
    return base


def _apply_one(
    base_file: IO[bytes], data_offset: int, spec: TensorSpec, source: DeltaSource, pipeline: _Pipeline
) -> None:
    delta_spec = source.specs.get(spec.name)
    whole = source.tensor(spec.name)
    whole_flat = whole.reshape(-1) if whole is not None else None
    done = 0
    while done < spec.numel:
        count = min(pipeline.elements, spec.numel - done)
        slot = pipeline.next_slot()
        base_view = memoryview(slot.base)[: count * spec.dtype.itemsize]
        read_into(base_file, data_offset + spec.start + done * spec.dtype.itemsize, base_view)
        if not is_floating(spec.dtype):
            pipeline.emit(slot, base_view, base_view)
        else:
            delta: torch.Tensor | None = None
            if whole_flat is not None:
                delta = whole_flat[done : done + count]
            elif delta_spec is not None:
                size = delta_spec.dtype.itemsize
                source.read_slice(delta_spec, done * size, count * size, memoryview(slot.delta))
                delta = _view(slot.delta, delta_spec.dtype, count)
            base = _view(slot.base, spec.dtype, count)
            pipeline.emit(slot, base_view, _add(base, delta, in_place=pipeline.base_lane is None))
        done += count
