"""The wire format of a delta, both directions, and the trained delta a round ships back.

A delta is a safetensors file compressed with zstd as one frame that records its
content size (:func:`write_delta`, :func:`read_delta`), keys in sorted order so that
the streaming apply reads it in one sequential pass. On input, a zstd-compressed
``torch.save`` dict of tensors (the seed's format) is accepted too and loaded with
``weights_only``. :func:`write_result_delta` writes a round's ``trained - original``
in the same format, streaming the original from the model file.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import zstandard

from executor.delta._sync import HASH_PREFIX, hash_entry_header, is_floating
from executor.errors import BadArtifact, into, map_exceptions
from executor.fileio import atomic_writer
from executor.tensorfile import StreamWriter, dtype_name, read_header, read_tensor, tensor_bytes

ZSTD_LEVEL = 3
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024


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
    not_zstd = map_exceptions({zstandard.ZstdError: into(BadArtifact, "delta is not valid zstd")})
    with open(path, "rb") as file, not_zstd:
        return zstandard.ZstdDecompressor().stream_reader(file, read_across_frames=True).read()


def read_delta(path: str) -> dict[str, torch.Tensor]:
    """Load a delta file whole: zstd(safetensors), or the seed's zstd(torch.save dict)."""
    data = _decompressed(path)
    if looks_like_safetensors(data[:8], len(data)):
        from safetensors.torch import load as load_safetensors

        with map_exceptions({Exception: into(BadArtifact, "delta safetensors is corrupt")}):
            return dict(load_safetensors(data))
    return load_torch_delta(data)


def looks_like_safetensors(prefix: bytes, total: int | None) -> bool:
    if len(prefix) < 8:
        return False
    (length,) = struct.unpack("<Q", prefix[:8])
    return 2 <= length <= _SAFETENSORS_MAX_HEADER and (total is None or 8 + length <= total)


def load_torch_delta(data: bytes) -> dict[str, torch.Tensor]:
    what = "delta is neither safetensors nor a weights-only torch dict"
    with map_exceptions({Exception: into(BadArtifact, what)}):
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise BadArtifact("delta must be a dict of tensors")
    return loaded


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
