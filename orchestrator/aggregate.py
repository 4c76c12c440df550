"""Streaming aggregation: a round's trained deltas folded into one running sum as they arrive.

The naive mean holds every delta of a round at once (8 hosts × a 1 GB model: 8 GB). Here
each delta is fetched (to disk) as soon as its worker reports it, decoded, checked against
the hash the worker reported and against the model's keys and shapes, added into an fp32
running sum, and dropped. :class:`DeltaFolder` fetches ``parallel`` deltas at a time but
lets at most ``in_memory`` of them be decoded at once, so the orchestrator's memory is the
sum (the model's floating keys in fp32) plus ``in_memory`` decoded deltas: O(model), not
O(hosts × model). ``python -m bench.aggregate`` measures both.

The mean is the same as :func:`orchestrator.diloco.mean_delta` (a key a delta lacks counts
as zero): bit for bit when the deltas are folded in the same order. Folding follows arrival,
so two runs may differ in the last bit of the average; every worker still ends bit-identical
to the orchestrator, which publishes the exact state it computed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from executor.delta import max_delta_bytes, max_delta_tensors, read_delta, state_hash, zstd_bound

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20
_allocator_set = False


def release_freed_buffers() -> None:
    """Make glibc give a freed delta's memory back to the system at once (process-wide, once).

    glibc serves allocations below its mmap threshold from per-thread arenas, and raises the
    threshold (up to 32 MiB) each time an mmapped block is freed; a delta's tensors then land
    in the fetch threads' arenas and stay resident after they are freed, so the peak grows
    with the threads instead of with ``in_memory`` (measured: 1.9x the bound on a 32 MB
    model). A fixed 1 MiB threshold maps every tensor of a delta and unmaps it when freed.
    """
    global _allocator_set
    if _allocator_set:
        return
    _allocator_set = True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except OSError:  # not glibc (musl, macOS): its allocator is left alone
        pass


class DeltaRejected(Exception):
    """A delta that does not fit the model (unknown or non-floating key, wrong shape)."""


class DeltaSource(Protocol):
    def fetch(self, name: str, dest: str | os.PathLike[str]) -> None: ...


class RunningMean:
    """The elementwise fp32 mean of deltas added one at a time, for the floating keys of ``model``."""

    def __init__(self, model: Mapping[str, torch.Tensor]) -> None:
        self._shapes = {k: tuple(v.shape) for k, v in model.items() if v.dtype.is_floating_point}
        self._sum: dict[str, torch.Tensor] = {}
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    def check(self, delta: Mapping[str, torch.Tensor]) -> None:
        """Refuse a delta that the outer step could not use (before anything is added)."""
        for key, value in delta.items():
            if key not in self._shapes:
                raise DeltaRejected(f"the delta has a key the model lacks or cannot train: {key!r}")
            if tuple(value.shape) != self._shapes[key]:
                raise DeltaRejected(f"{key!r} has shape {tuple(value.shape)}, the model {self._shapes[key]}")
            if not value.dtype.is_floating_point:
                raise DeltaRejected(f"{key!r} is {value.dtype}, not a floating dtype")

    def add(self, delta: Mapping[str, torch.Tensor]) -> None:
        self.check(delta)
        with self._lock:
            for key in sorted(delta):
                total = self._sum.get(key)
                if total is None:
                    self._sum[key] = delta[key].to(torch.float32, copy=True)
                else:
                    total.add_(delta[key])  # cast element by element: no fp32 copy of the delta
            self._count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        """The mean, computed in place (the running sum is spent)."""
        if not self._count:
            raise ValueError("no deltas to average")
        with self._lock:
            out = {key: self._sum[key].div_(self._count) for key in sorted(self._sum)}
            self._sum = {}
            return out


@dataclass(frozen=True)
class Folded:
    """What became of one host's delta: ``error`` is None when it is in the sum."""

    host: str
    error: str | None
    seconds: float


class DeltaFolder:
    """Fetches the workers' deltas in parallel and folds each into a :class:`RunningMean`.

    ``submit`` returns at once; ``on_done`` (if given) is called from a pool thread with each
    :class:`Folded`. ``parallel`` downloads run at a time, ``in_memory`` decoded deltas exist
    at a time (the rest wait on disk).
    """

    def __init__(
        self,
        source: DeltaSource,
        scratch: str,
        model: Mapping[str, torch.Tensor],
        *,
        parallel: int = 4,
        in_memory: int = 2,
        on_done: Callable[[Folded], None] | None = None,
    ) -> None:
        if parallel < 1 or in_memory < 1:
            raise ValueError("parallel and in_memory must be at least 1")
        release_freed_buffers()
        self.mean = RunningMean(model)
        self._source = source
        self._scratch = scratch
        os.makedirs(scratch, exist_ok=True)
        # A worker's delta is untrusted: it decodes to no more than the model allows.
        self._max_bytes = max_delta_bytes(model)
        self._max_tensors = max_delta_tensors(model)
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="delta-fold")
        self._slots = threading.BoundedSemaphore(in_memory)
        self._futures: dict[str, Future[Folded]] = {}
        self._on_done = on_done
        self._lock = threading.Lock()
        self._decoded = 0
        self.peak_decoded = 0  # the most deltas decoded at once (tests check the bound)
        # Overlapped rounds: deltas whose upload runs beside the next round, host -> (name, round,
        # the result's hash: None when the upload reports it), submitted once the upload is
        # reported done (orchestrator.overlap.await_uploads).
        self.deferred: dict[str, tuple[str, int, str | None]] = {}

    def submit(self, host: str, name: str, expected_hash: str) -> None:
        if host in self._futures:
            raise ValueError(f"{host}'s delta was submitted already")
        self._futures[host] = self._pool.submit(self._one, host, name, expected_hash)

    def refuse(self, host: str, reason: str) -> None:
        """``host``'s delta is out of the mean without a fetch (its upload failed, say)."""
        if host in self._futures:
            raise ValueError(f"{host}'s delta was submitted already")
        refused: Future[Folded] = Future()
        refused.set_result(Folded(host, reason, 0.0))
        self._futures[host] = refused

    def _one(self, host: str, name: str, expected_hash: str) -> Folded:
        started = time.monotonic()
        local = os.path.join(self._scratch, f"delta-{host}.zst")
        try:
            error = self._fold(name, local, expected_hash)
        except Exception as exc:  # whatever a worker uploaded, it must not stop the round
            error = f"delta unreadable: {type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local)
        folded = Folded(host, error, time.monotonic() - started)
        if self._on_done is not None:
            self._on_done(folded)
        return folded

    def _fold(self, name: str, local: str, expected_hash: str) -> str | None:
        self._source.fetch(name, local)
        with self._slots:
            with self._lock:
                self._decoded += 1
                self.peak_decoded = max(self.peak_decoded, self._decoded)
            try:
                # In a function of its own: the decoded delta is freed when it returns, before
                # the slot is given to the next one.
                return self._decode_and_add(local, expected_hash)
            finally:
                with self._lock:
                    self._decoded -= 1

    def _decode_and_add(self, local: str, expected_hash: str) -> str | None:
        # Refused before a byte is decoded: a file larger than any delta of this model compresses
        # to, and the seed's pickle format (a worker writes zstd(safetensors) only). What remains
        # decodes within the model's bound, so the hash (of the decoded tensors) is checked next.
        size = os.path.getsize(local)
        if size > zstd_bound(self._max_bytes):
            return f"delta file is {size} bytes, over the cap of {zstd_bound(self._max_bytes)} for this model"
        delta = read_delta(local, max_bytes=self._max_bytes, max_tensors=self._max_tensors, allow_torch=False)
        os.unlink(local)  # decoded: the file is not needed any more
        if state_hash(delta) != expected_hash:
            return "delta does not match its reported hash"
        try:
            self.mean.add(delta)
        except DeltaRejected as exc:
            return f"delta does not fit the model: {exc}"
        return None

    def pending(self) -> list[str]:
        return sorted(host for host, future in self._futures.items() if not future.done())

    def results(self, timeout_s: float | None = None) -> dict[str, Folded]:
        """Every submitted host's outcome, waiting for those still in flight."""
        out = {}
        for host, future in self._futures.items():
            out[host] = future.result(timeout=timeout_s)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
