"""The wire format of a delta, both directions, and the trained delta a round ships back.

A delta is a safetensors file compressed with zstd as one frame that records its
content size (:func:`write_delta`, :func:`read_delta`), keys in sorted order so that
the streaming apply reads it in one sequential pass. On input, a zstd-compressed
``torch.save`` dict of tensors (the seed's format) is accepted too and loaded with
``weights_only``. Reading decodes within a cap (:mod:`executor.delta._decode`), once,
straight into the tensors. :func:`write_result_delta` writes a round's ``trained - original``
in the same format, streaming the original from the model file.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import zstandard

from executor.delta._decode import CappedStream, is_torch_prefix, load_torch_delta, read_stream_header
from executor.delta._feedback import ResidualUpdate
from executor.delta._qlayout import decode_all, parse_layout
from executor.delta._quant import DeltaFormat, QuantizedDelta, QuantScheme
from executor.delta._qwire import trained_keys, write_quantized, write_quantized_result
from executor.delta._sync import HASH_PREFIX, hash_entry_header, is_floating
from executor.errors import BadArtifact, DownloadAborted
from executor.fileio import atomic_writer
from executor.tensorfile import StreamWriter, dtype_name, read_header, read_tensor, tensor_bytes

ZSTD_LEVEL = 3
COMPRESS_CHUNK_BYTES = 8 << 20
# read_delta's default cap: a 16-bit trained delta (the default dtype) of any model a worker accepts
# by default (ROUNDHOUSE_MAX_MODEL_MB, 64 GiB of at least 2 bytes an element), with room for its header.
DEFAULT_MAX_DELTA_BYTES = 65 << 30


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
    """Write ``delta`` as zstd(safetensors), atomically; keys in sorted order.

    A :class:`QuantizedDelta` is written quantised (its codes and scales, the scheme in
    the metadata); its hash is that of the float32 tensors it stands for.
    """
    if isinstance(delta, QuantizedDelta):
        digest, keys = write_quantized(delta, path, _compressor())
        return DeltaFile(os.path.getsize(path), digest, delta.scheme.name, keys)
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


def read_delta(
    path: str,
    *,
    max_bytes: int = DEFAULT_MAX_DELTA_BYTES,
    max_tensors: int | None = None,
    allow_torch: bool = True,
) -> dict[str, torch.Tensor]:
    """Load a delta file whole: zstd(safetensors), or the seed's zstd(torch.save dict).

    ``max_bytes`` caps what the file may decode to (``BadArtifact`` past it, nothing decoded
    for a frame or header that promises more). Pass :func:`max_delta_bytes` of the model the
    delta belongs to; the default is the largest model a worker loads by default. The seed's
    torch format is refused when ``allow_torch`` is false (what a worker writes is never in it),
    else its pickle is held to ``max_tensors`` tensors (:func:`max_delta_tensors` of the model;
    None: its own storage records) before it is loaded.
    The data is decoded once, straight into the tensors returned. A quantised delta is
    returned dequantised (float32), after every check of its layout and values.
    """
    with open(path, "rb") as file:
        stream = CappedStream(file, max_bytes)
        try:
            prefix = stream.read(8)
            if is_torch_prefix(prefix):
                if not allow_torch:
                    raise BadArtifact(
                        "delta is in the seed's torch format; only zstd(safetensors) is accepted"
                    )
                return load_torch_delta(stream, prefix, os.path.dirname(os.path.abspath(path)), max_tensors)
            header = read_stream_header(stream, prefix)
            layout = parse_layout(header)  # None: a float delta
            tensors: dict[str, torch.Tensor] = {}
            for spec in sorted(header.specs.values(), key=lambda s: (s.start, s.end)):
                stream.skip_to(header.data_offset + spec.start)
                tensor = tensors[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
                if spec.nbytes:
                    stream.readinto(tensor_bytes(tensor))
            if layout is not None:
                return decode_all(layout, tensors)
            return {name: tensors[name] for name in sorted(tensors)}
        finally:
            stream.close()


# ---------------------------------------------------------------- the trained delta


def write_result_delta(
    original_path: str,
    trained: Mapping[str, torch.Tensor],
    path: str,
    *,
    dtype: DeltaFormat = torch.float16,
    feedback: ResidualUpdate | None = None,
) -> DeltaFile:
    """``trained - original`` for every floating key of the model file, cast, as a delta file.

    Streams key by key (original read from the file, never held whole). A trained key
    the model lacks is ignored; a key the trained state lacks is left out (zero delta).
    A shape change is a ``ValueError`` (the caller reports it as the user's error).
    A :class:`QuantScheme` quantises each key as it is written, adding ``feedback``'s
    previous residual first and staging the next one (error feedback).
    """
    if isinstance(dtype, QuantScheme):
        digest, keys = write_quantized_result(original_path, trained, path, dtype, _compressor(), feedback)
        return DeltaFile(os.path.getsize(path), digest, dtype.name, keys)
    if not is_floating(dtype):
        raise ValueError(f"delta dtype must be floating, got {dtype}")
    with open(original_path, "rb") as file:
        header = read_header(file)
        names = trained_keys(header, trained)
        entries = [(n, dtype, header.specs[n].shape) for n in names]
        total = StreamWriter(io.BytesIO(), entries).total_bytes
        hasher = hashlib.sha256()
        with atomic_writer(path) as raw, _compressor().stream_writer(raw, size=total, closefd=False) as zf:
            writer = StreamWriter(zf, entries)
            writer.write_header()
            for name in names:
                diff = trained_diff(trained[name], read_tensor(file, header, header.specs[name]), dtype)
                hash_entry_header(hasher, name, dtype, diff.shape)
                data = tensor_bytes(diff)
                hasher.update(data)
                writer.write(data)
    digest = HASH_PREFIX + hasher.hexdigest()
    return DeltaFile(os.path.getsize(path), digest, dtype_name(dtype), len(names))


def trained_diff(trained: torch.Tensor, original: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One key of a round's delta: ``trained - original`` in fp32, cast to ``dtype``."""
    value = trained.detach().to("cpu", torch.float32)
    return (value - original.to(torch.float32)).to(dtype).contiguous()


def compress_delta(raw_path: str, path: str, abort: threading.Event | None = None) -> int:
    """Frame a plain safetensors delta (an overlapped round's, written by
    ``executor.session.WorkingCopy.write_round_end``) as the wire's zstd one, atomically; the
    bytes written. ``abort`` is checked between chunks (``DownloadAborted``: the caller's stop).
    The state hash is the content's, so it does not change."""
    size = os.path.getsize(raw_path)
    with (
        open(raw_path, "rb") as source,
        atomic_writer(path) as out,
        _compressor().stream_writer(out, size=size, closefd=False) as zf,
    ):
        while chunk := source.read(COMPRESS_CHUNK_BYTES):
            if abort is not None and abort.is_set():
                raise DownloadAborted("the delta's compression was stopped")
            zf.write(chunk)
    return os.path.getsize(path)
