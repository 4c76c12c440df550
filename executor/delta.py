"""The bit-exact sync delta (DESIGN §4) and the trained delta a round ships back.

One implementation serves both sides: the orchestrator builds a sync delta with
:func:`make_sync_delta` and publishes ``.result`` as the full-download fallback;
a worker applies it with :func:`apply_sync_delta` (streaming, one pass) and gets
the very same bytes, because both use :func:`apply_rule` — one IEEE fp32 add per
element, no scale, no fused ops.

Wire format of a delta in both directions: a safetensors file compressed with
zstd as one frame that records its content size (:func:`write_delta`,
:func:`read_delta`). On input, a zstd-compressed ``torch.save`` dict of tensors
(the seed's format) is accepted too and loaded with ``weights_only``.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch
import zstandard

from executor.errors import BadArtifact, HashMismatch, Stopped
from executor.fileio import atomic_writer
from executor.tensorfile import (
    StreamWriter,
    TensorSpec,
    dtype_name,
    header_length,
    parse_header,
    read_header,
    read_into,
    read_tensor,
    tensor_bytes,
)

if sys.byteorder != "little":  # pragma: no cover - the hash is defined on little-endian bytes
    raise ImportError("Roundhouse's state hash needs a little-endian host")

HASH_PREFIX = "sha256:"
# Slices bound the memory of the streaming passes whatever the size of one tensor.
SLICE_BYTES = 16 * 1024 * 1024
ZSTD_LEVEL = 3
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024


# ---------------------------------------------------------------- hashing


def hash_entry_header(hasher: Any, name: str, dtype: torch.dtype, shape: Iterable[int]) -> None:
    dims = [int(d) for d in shape]
    key = name.encode("utf-8")
    kind = dtype_name(dtype).encode("ascii")
    hasher.update(
        struct.pack(
            f"<I{len(key)}sI{len(kind)}sI{len(dims)}Q", len(key), key, len(kind), kind, len(dims), *dims
        )
    )


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """``"sha256:" + hex`` over the keys in sorted order (DESIGN §4 spells out the bytes)."""
    hasher = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        hash_entry_header(hasher, name, tensor.dtype, tensor.shape)
        hasher.update(tensor_bytes(tensor))
    return HASH_PREFIX + hasher.hexdigest()


def file_state_hash(path: str) -> str:
    """``state_hash`` of a safetensors file, read in slices (the file's bytes are the tensors' bytes)."""
    hasher = hashlib.sha256()
    buffer = bytearray(SLICE_BYTES)
    view = memoryview(buffer)
    with open(path, "rb") as file:
        header = read_header(file)
        for name in sorted(header.specs):
            spec = header.specs[name]
            hash_entry_header(hasher, name, spec.dtype, spec.shape)
            offset = header.data_offset + spec.start
            remaining = spec.nbytes
            while remaining:
                step = min(remaining, SLICE_BYTES)
                read_into(file, offset, view[:step])
                hasher.update(view[:step])
                offset += step
                remaining -= step
    return HASH_PREFIX + hasher.hexdigest()


# ---------------------------------------------------------------- the apply rule


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def apply_rule(base: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """``float32(base) + float32(delta)`` for a floating key; a non-floating key passes through."""
    if not is_floating(base.dtype):
        return base
    out = base.to(torch.float32, copy=True)
    if delta is not None:
        out.add_(delta.to(torch.float32))
    return out


def result_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if is_floating(dtype) else dtype


@dataclass(frozen=True)
class SyncDelta:
    """What the orchestrator publishes: the delta, and the exact state every worker will hold."""

    delta: dict[str, torch.Tensor]
    base_hash: str
    result_hash: str
    result: dict[str, torch.Tensor]


def make_sync_delta(
    base_state: Mapping[str, torch.Tensor],
    new_state: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float16,
) -> SyncDelta:
    """The sync delta from ``base_state`` towards ``new_state``, cast to ``dtype``.

    ``result`` is not ``new_state``: it is ``base + cast(delta)`` in fp32, which is what
    a worker will compute, so it is what the full-download fallback must serve.
    Non-floating keys keep the base value (the delta cannot carry them).
    """
    if not is_floating(dtype):
        raise ValueError(f"delta dtype must be floating, got {dtype}")
    extra = set(new_state) - set(base_state)
    if extra:
        raise ValueError(f"new state has keys the base lacks: {sorted(extra)[:5]}")
    delta: dict[str, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for name in sorted(base_state):
        base = base_state[name].detach().cpu()
        if is_floating(base.dtype) and name in new_state:
            new = new_state[name].detach().cpu()
            if tuple(new.shape) != tuple(base.shape):
                raise ValueError(f"shape of {name!r} changed: {tuple(base.shape)} -> {tuple(new.shape)}")
            delta[name] = (new.to(torch.float32) - base.to(torch.float32)).to(dtype).contiguous()
        result[name] = apply_rule(base, delta.get(name))
    return SyncDelta(delta, state_hash(base_state), state_hash(result), result)


def apply_sync_delta_state(
    base_state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """In-memory apply (the reference the streaming apply is tested against)."""
    check_delta_specs(
        {n: (t.dtype, tuple(t.shape)) for n, t in base_state.items()},
        {n: (t.dtype, tuple(t.shape)) for n, t in delta.items()},
    )
    return {name: apply_rule(base_state[name], delta.get(name)) for name in sorted(base_state)}


def check_delta_specs(
    base: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    delta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> None:
    """A delta entry for an unknown or non-floating key, or of the wrong shape, is a mismatch."""
    for name, (dtype, shape) in delta.items():
        if name not in base:
            raise HashMismatch(f"delta has a key the model lacks: {name!r}", {"key": name})
        base_dtype, base_shape = base[name]
        if not is_floating(base_dtype):
            raise HashMismatch(f"delta has an entry for non-floating key {name!r}", {"key": name})
        if not is_floating(dtype):
            raise HashMismatch(f"delta entry {name!r} is not floating ({dtype})", {"key": name})
        if tuple(shape) != tuple(base_shape):
            raise HashMismatch(
                f"delta entry {name!r} has shape {tuple(shape)}, model has {tuple(base_shape)}",
                {"key": name},
            )


# ---------------------------------------------------------------- wire format


@dataclass(frozen=True)
class DeltaFile:
    """Describes a written delta: file size, state hash of the tensors, dtype, key count."""

    bytes: int
    hash: str
    dtype: str
    keys: int

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "hash": self.hash, "dtype": self.dtype, "keys": self.keys}


def _compressor() -> zstandard.ZstdCompressor:
    # threads=-1: one frame still, compressed on every core the worker has.
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, threads=-1)


def write_delta(delta: Mapping[str, torch.Tensor], path: str) -> DeltaFile:
    """Write ``delta`` as zstd(safetensors), atomically; keys in sorted order."""
    names = sorted(delta)
    tensors = {name: delta[name].detach().cpu().contiguous() for name in names}
    dtypes = {dtype_name(t.dtype) for t in tensors.values()}
    hasher = hashlib.sha256()
    with atomic_writer(path) as raw:
        writer_spec = [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names]
        size = StreamWriter(io.BytesIO(), writer_spec).total_bytes
        with _compressor().stream_writer(raw, size=size, closefd=False) as zf:
            writer = StreamWriter(zf, writer_spec)
            writer.write_header()
            for name in names:
                tensor = tensors[name]
                hash_entry_header(hasher, name, tensor.dtype, tensor.shape)
                data = tensor_bytes(tensor)
                hasher.update(data)
                writer.write(data)
    return DeltaFile(
        os.path.getsize(path), HASH_PREFIX + hasher.hexdigest(), ",".join(sorted(dtypes)), len(names)
    )


def _decompressed(path: str) -> bytes:
    with open(path, "rb") as file:
        try:
            return zstandard.ZstdDecompressor().stream_reader(file, read_across_frames=True).read()
        except zstandard.ZstdError as exc:
            raise BadArtifact(f"delta is not valid zstd: {exc}") from None


def read_delta(path: str) -> dict[str, torch.Tensor]:
    """Load a delta file whole: zstd(safetensors), or the seed's zstd(torch.save dict)."""
    data = _decompressed(path)
    if _looks_like_safetensors(data[:8], len(data)):
        from safetensors.torch import load as load_safetensors

        try:
            return dict(load_safetensors(data))
        except Exception as exc:
            raise BadArtifact(f"delta safetensors is corrupt: {exc}") from None
    return _load_torch_delta(data)


def _looks_like_safetensors(prefix: bytes, total: int | None) -> bool:
    if len(prefix) < 8:
        return False
    (length,) = struct.unpack("<Q", prefix[:8])
    return 2 <= length <= _SAFETENSORS_MAX_HEADER and (total is None or 8 + length <= total)


def _load_torch_delta(data: bytes) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise BadArtifact(f"delta is neither safetensors nor a weights-only torch dict: {exc}") from None
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise BadArtifact("delta must be a dict of tensors")
    return loaded


# ---------------------------------------------------------------- streaming delta source


class DeltaSource:
    """Tensors of a delta file, handed out slice by slice in sorted key order.

    When the safetensors data lies in sorted key order (as :func:`write_delta`
    writes it) the zstd stream is consumed sequentially and never held whole;
    otherwise, or for the seed's torch format, it is decompressed into memory once.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        try:
            self._reader: zstandard.ZstdDecompressionReader | None = (
                zstandard.ZstdDecompressor().stream_reader(self._file, read_across_frames=True)
            )
            self._position = 0
            self._memory: memoryview | None = None
            self._tensors: dict[str, torch.Tensor] | None = None
            self.specs = self._open()
        except zstandard.ZstdError as exc:
            self.close()
            raise BadArtifact(f"delta is not valid zstd: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _read_exact(self, count: int) -> bytes:
        assert self._reader is not None
        chunks = []
        remaining = count
        while remaining:
            chunk = self._reader.read(remaining)
            if not chunk:
                raise BadArtifact("delta stream ended early (truncated)")
            chunks.append(chunk)
            remaining -= len(chunk)
        self._position += count
        return b"".join(chunks)

    def _open(self) -> dict[str, TensorSpec]:
        prefix = self._read_exact(8)
        if not _looks_like_safetensors(prefix, None):
            self._tensors = _load_torch_delta(prefix + self._rest())
            return {n: TensorSpec(n, t.dtype, tuple(t.shape), 0, 0) for n, t in self._tensors.items()}
        header = parse_header(self._read_exact(header_length(prefix)), None)
        ordered = sorted(header.specs.values(), key=lambda s: s.name)
        self._base = header.data_offset
        if [s.start for s in ordered] != sorted(s.start for s in ordered):
            # Not in key order: a sequential pass is impossible, hold the data section once.
            self._memory = memoryview(self._rest())
        return header.specs

    def _rest(self) -> bytes:
        assert self._reader is not None
        return self._reader.read()

    def read_slice(self, spec: TensorSpec, offset: int, nbytes: int, out: memoryview) -> None:
        """Fill ``out`` with bytes [offset, offset+nbytes) of ``spec``'s data; calls must go forward."""
        if self._memory is not None:
            start = spec.start + offset
            if start + nbytes > len(self._memory):
                raise BadArtifact("delta data is truncated")
            out[:nbytes] = self._memory[start : start + nbytes]
            return
        target = self._base + spec.start + offset
        if target < self._position:
            raise BadArtifact("delta slices requested out of order")
        if target > self._position:
            self._skip(target - self._position)
        got = 0
        assert self._reader is not None
        while got < nbytes:
            n = self._reader.readinto(out[got:nbytes])
            if not n:
                raise BadArtifact("delta stream ended early (truncated)")
            got += n
        self._position += nbytes

    def _skip(self, count: int) -> None:
        while count:
            step = min(count, SLICE_BYTES)
            self._read_exact(step)
            count -= step

    def tensor(self, name: str) -> torch.Tensor | None:
        """Whole tensors for the torch-format fallback (None when the stream is safetensors)."""
        return None if self._tensors is None else self._tensors.get(name)

    def close(self) -> None:
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.close()
            self._reader = None
        self._file.close()

    def __enter__(self) -> DeltaSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- streaming apply


@dataclass(frozen=True)
class ApplyResult:
    model_hash: str
    keys: int
    delta_keys: int
    bytes: int
    seconds: float


class _Slicer:
    """Reused byte buffers, viewed as tensors of any dtype, for the slice-by-slice passes."""

    def __init__(self, elements: int) -> None:
        self.elements = elements
        self.base = bytearray(elements * 8)
        self.delta = bytearray(elements * 8)

    @staticmethod
    def view(buffer: bytearray, dtype: torch.dtype, count: int) -> torch.Tensor:
        return torch.frombuffer(buffer, dtype=dtype, count=count) if count else torch.empty(0, dtype=dtype)


def apply_sync_delta(
    model_path: str,
    delta_path: str,
    *,
    base_hash: str,
    result_hash: str,
    abort: threading.Event | None = None,
    known_base_hash: str | None = None,
) -> ApplyResult:
    """Apply a sync delta to a safetensors model file in one streaming pass.

    Per slice of each tensor: read base, hash it, cast and add, hash the result,
    write it. ``model_path`` is replaced atomically only when the base hash and
    the result hash both hold; otherwise it is untouched and ``HashMismatch``
    is raised. ``known_base_hash`` (the hash of the file as this process last
    wrote it) skips re-hashing the base: the result hash still proves every byte.
    """
    started = time.monotonic()
    if known_base_hash is not None and known_base_hash != base_hash:
        raise HashMismatch(
            "local model is not the delta's base", {"expected": base_hash, "local": known_base_hash}
        )
    with open(model_path, "rb") as base_file, DeltaSource(delta_path) as source:
        header = read_header(base_file)
        check_delta_specs(
            {n: (s.dtype, s.shape) for n, s in header.specs.items()},
            {n: (s.dtype, s.shape) for n, s in source.specs.items()},
        )
        names = sorted(header.specs)
        entries = [(n, result_dtype(header.specs[n].dtype), header.specs[n].shape) for n in names]
        base_hasher = hashlib.sha256() if known_base_hash is None else None
        result_hasher = hashlib.sha256()
        slicer = _Slicer(SLICE_BYTES // 8)
        with atomic_writer(model_path) as out:
            writer = StreamWriter(out, entries)
            writer.write_header()
            for name in names:
                if abort is not None and abort.is_set():
                    raise Stopped("sync delta apply stopped")
                spec = header.specs[name]
                hash_entry_header(result_hasher, name, result_dtype(spec.dtype), spec.shape)
                if base_hasher is not None:
                    hash_entry_header(base_hasher, name, spec.dtype, spec.shape)
                _apply_one(
                    base_file, header.data_offset, spec, source, slicer, writer, base_hasher, result_hasher
                )
            got_base = HASH_PREFIX + base_hasher.hexdigest() if base_hasher is not None else base_hash
            got_result = HASH_PREFIX + result_hasher.hexdigest()
            if got_base != base_hash:
                raise HashMismatch(
                    "local model is not the delta's base", {"expected": base_hash, "local": got_base}
                )
            if got_result != result_hash:
                raise HashMismatch(
                    "result of the delta apply does not match result_hash",
                    {"expected": result_hash, "got": got_result},
                )
        size = os.path.getsize(model_path)
    return ApplyResult(result_hash, len(names), len(source.specs), size, time.monotonic() - started)


def _apply_one(
    base_file: IO[bytes],
    data_offset: int,
    spec: TensorSpec,
    source: DeltaSource,
    slicer: _Slicer,
    writer: StreamWriter,
    base_hasher: Any,
    result_hasher: Any,
) -> None:
    delta_spec = source.specs.get(spec.name)
    whole = source.tensor(spec.name)
    whole_flat = whole.reshape(-1) if whole is not None else None
    total = spec.numel
    done = 0
    while done < total:
        count = min(slicer.elements, total - done)
        base_bytes = count * spec.dtype.itemsize
        base_view = memoryview(slicer.base)[:base_bytes]
        read_into(base_file, data_offset + spec.start + done * spec.dtype.itemsize, base_view)
        if base_hasher is not None:
            base_hasher.update(base_view)
        if not is_floating(spec.dtype):
            result_hasher.update(base_view)
            writer.write(base_view)
        else:
            base = _Slicer.view(slicer.base, spec.dtype, count)
            delta: torch.Tensor | None = None
            if whole_flat is not None:
                delta = whole_flat[done : done + count]
            elif delta_spec is not None:
                size = delta_spec.dtype.itemsize
                source.read_slice(delta_spec, done * size, count * size, memoryview(slicer.delta))
                delta = _Slicer.view(slicer.delta, delta_spec.dtype, count)
            result = tensor_bytes(apply_rule(base, delta))
            result_hasher.update(result)
            writer.write(result)
        done += count


# ---------------------------------------------------------------- the trained delta


def write_result_delta(
    original_path: str,
    trained: Mapping[str, torch.Tensor],
    path: str,
    *,
    dtype: torch.dtype = torch.float16,
) -> DeltaFile:
    """``trained - original`` for every floating key of the model file, cast, as a delta file.

    Streams key by key (original read from the file, never held whole). A trained key
    the model lacks is ignored; a key the trained state lacks is left out (zero delta).
    A shape change is a ``ValueError`` (the caller reports it as the user's error).
    """
    if not is_floating(dtype):
        raise ValueError(f"delta dtype must be floating, got {dtype}")
    with open(original_path, "rb") as file:
        header = read_header(file)
        names = sorted(n for n, s in header.specs.items() if is_floating(s.dtype) and n in trained)
        for name in names:
            if tuple(trained[name].shape) != header.specs[name].shape:
                raise ValueError(
                    f"trained {name!r} has shape {tuple(trained[name].shape)}, "
                    f"the model file has {header.specs[name].shape}"
                )
        entries = [(n, dtype, header.specs[n].shape) for n in names]
        total = StreamWriter(io.BytesIO(), entries).total_bytes
        hasher = hashlib.sha256()
        with atomic_writer(path) as raw, _compressor().stream_writer(raw, size=total, closefd=False) as zf:
            writer = StreamWriter(zf, entries)
            writer.write_header()
            for name in names:
                original = read_tensor(file, header, header.specs[name])
                value = trained[name].detach().to("cpu", torch.float32)
                diff = (value - original.to(torch.float32)).to(dtype).contiguous()
                hash_entry_header(hasher, name, dtype, diff.shape)
                data = tensor_bytes(diff)
                hasher.update(data)
                writer.write(data)
    return DeltaFile(os.path.getsize(path), HASH_PREFIX + hasher.hexdigest(), dtype_name(dtype), len(names))
