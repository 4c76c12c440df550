"""Streaming safetensors: read one tensor at a time, write without holding the state.

The ``safetensors`` package reads through ``mmap`` (every touched page then counts
in RSS) and writes only from a complete in-memory dict. The delta apply, the
bundle consolidation and the state hash need the opposite: bounded memory, one
tensor (or one slice of one) at a time, explicit file descriptors. The file
format is the standard one (8-byte little-endian header length, JSON header,
raw little-endian data), so files written here load with ``safetensors``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch

from executor.errors import BadArtifact, into, map_exceptions

# A bound on the JSON header: the largest real checkpoints have headers of a few MB.
MAX_HEADER_BYTES = 100 * 1024 * 1024

_CODE_TO_DTYPE: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_TO_CODE = {dtype: code for code, dtype in _CODE_TO_DTYPE.items()}


def dtype_code(dtype: torch.dtype) -> str:
    code = _DTYPE_TO_CODE.get(dtype)
    if code is None:
        raise BadArtifact(f"dtype {dtype} cannot be stored in safetensors")
    return code


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own name of a dtype (``float32``), as the state hash spells it."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file: where its bytes are, relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True)
class Header:
    specs: dict[str, TensorSpec]
    data_offset: int
    metadata: dict[str, str]

    @property
    def data_bytes(self) -> int:
        return max((spec.end for spec in self.specs.values()), default=0)


def _parse_spec(name: str, raw: Any) -> TensorSpec:
    if not isinstance(raw, dict):
        raise BadArtifact(f"safetensors entry {name!r} is not an object")
    code = raw.get("dtype")
    shape = raw.get("shape")
    offsets = raw.get("data_offsets")
    if code not in _CODE_TO_DTYPE:
        raise BadArtifact(f"safetensors entry {name!r} has unsupported dtype {code!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise BadArtifact(f"safetensors entry {name!r} has an invalid shape")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise BadArtifact(f"safetensors entry {name!r} has invalid data offsets")
    spec = TensorSpec(name, _CODE_TO_DTYPE[code], tuple(shape), offsets[0], offsets[1])
    if spec.numel * spec.dtype.itemsize != spec.nbytes:
        raise BadArtifact(f"safetensors entry {name!r}: shape and byte range disagree")
    return spec


def read_header(file: IO[bytes], max_header_bytes: int | None = None) -> Header:
    """Parse and validate a safetensors header; a truncated or malformed file is ``BadArtifact``.

    ``max_header_bytes`` refuses a longer header before it is read or parsed (a file the caller
    expects to hold a known set of keys: parsing costs memory and time in its length)."""
    size = os.fstat(file.fileno()).st_size
    prefix = os.pread(file.fileno(), 8, 0)
    header_len = header_length(prefix)
    if max_header_bytes is not None and header_len > max_header_bytes:
        raise BadArtifact(
            f"safetensors header is {header_len} bytes, over its bound of {max_header_bytes}",
            {"header_bytes": header_len, "cap": max_header_bytes},
        )
    if 8 + header_len > size:
        raise BadArtifact("safetensors header length exceeds the file (truncated or not safetensors)")
    return parse_header(os.pread(file.fileno(), header_len, 8), size)


def header_length(prefix: bytes) -> int:
    """The JSON header length from the first 8 bytes of a safetensors stream."""
    if len(prefix) != 8:
        raise BadArtifact("safetensors data is shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if not 2 <= header_len <= MAX_HEADER_BYTES:
        raise BadArtifact(f"safetensors header length {header_len} is out of bounds (not safetensors?)")
    return int(header_len)


def parse_header(raw: bytes, file_size: int | None) -> Header:
    """Validate a JSON header; ``file_size`` None skips the truncation check (streams check as they read)."""
    # A hostile header may nest deeply enough to exhaust the parser's recursion.
    with map_exceptions(
        {(ValueError, RecursionError): into(BadArtifact, "safetensors header is not valid JSON")}
    ):
        parsed = json.loads(raw)
    if not isinstance(parsed, dict):
        raise BadArtifact("safetensors header is not a JSON object")
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise BadArtifact("safetensors __metadata__ is not an object")
    specs = {name: _parse_spec(name, value) for name, value in parsed.items()}
    header = Header(specs, 8 + len(raw), {str(k): str(v) for k, v in metadata.items()})
    _check_layout(header, file_size)
    return header


def _check_layout(header: Header, file_size: int | None) -> None:
    ranges = sorted((spec.start, spec.end, spec.name) for spec in header.specs.values())
    cursor = 0
    for start, end, name in ranges:
        if start < cursor:
            raise BadArtifact(f"safetensors entry {name!r} overlaps another tensor")
        cursor = end
    if file_size is not None and header.data_offset + cursor > file_size:
        raise BadArtifact(
            f"safetensors data is truncated: needs {header.data_offset + cursor} bytes, file has {file_size}"
        )


def read_into(file: IO[bytes], offset: int, view: memoryview) -> None:
    """Fill ``view`` from ``offset``; short reads (a file truncated under us) are errors."""
    fd = file.fileno()
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise BadArtifact("unexpected end of file while reading tensor data")
        done += n


def read_tensor(file: IO[bytes], header: Header, spec: TensorSpec) -> torch.Tensor:
    """A fresh tensor holding one entry (its own storage: no mmap, no shared pages)."""
    out = torch.empty(spec.shape, dtype=spec.dtype)
    if spec.nbytes:
        read_into(file, header.data_offset + spec.start, tensor_bytes(out))
    return out


def iter_tensors(path: str, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    with open(path, "rb") as file:
        header = read_header(file)
        for name in names if names is not None else sorted(header.specs):
            yield name, read_tensor(file, header, header.specs[name])


def load_state(path: str) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(path))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


class StreamWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs``.

    The header is computed up front from (name, dtype, shape), so the data
    can then be appended in slices without holding any complete tensor.
    """

    def __init__(
        self,
        file: IO[bytes],
        entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._file = file
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self.order: list[str] = []
        self.sizes: dict[str, int] = {}
        cursor = 0
        for name, dtype, shape in entries:
            numel = 1
            for dim in shape:
                numel *= int(dim)
            nbytes = numel * dtype.itemsize
            header[name] = {
                "dtype": dtype_code(dtype),
                "shape": [int(d) for d in shape],
                "data_offsets": [cursor, cursor + nbytes],
            }
            self.order.append(name)
            self.sizes[name] = nbytes
            cursor += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        # Pad to 8 bytes so that readers can map the data section aligned.
        encoded += b" " * (-len(encoded) % 8)
        self.header_bytes = struct.pack("<Q", len(encoded)) + encoded
        self.total_bytes = len(self.header_bytes) + cursor
        self._written_header = False

    def write_header(self) -> None:
        self._file.write(self.header_bytes)
        self._written_header = True

    def write(self, data: memoryview | bytes) -> None:
        if not self._written_header:
            self.write_header()
        self._file.write(data)


def write_state(
    file: IO[bytes], state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write a whole state (in sorted key order) to an open file; returns bytes written."""
    names = sorted(state)
    tensors = {name: state[name].detach().to("cpu").contiguous() for name in names}
    writer = StreamWriter(
        file, [(name, tensors[name].dtype, tuple(tensors[name].shape)) for name in names], metadata
    )
    writer.write_header()
    for name in names:
        writer.write(tensor_bytes(tensors[name]))
    return writer.total_bytes
