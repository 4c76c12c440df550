"""A quantised delta on the wire: its safetensors entries, its metadata, and reading it back.

The file is an ordinary delta file (one zstd frame of safetensors) whose ``__metadata__``
names the scheme (``QUANT_KEY`` and its siblings, versioned) and whose entries are, for
each key ``K`` of the delta, ``scales/K`` (float32 or float16, one a block) and
``codes/K`` (int8, or uint8 holding two int4 codes a byte), both flat; ``K``'s shape is
in the metadata. The two prefixes are distinct, so no model key can collide with another's
entries. :func:`entries` lays the data out key by key in sorted order, scales before codes,
so that the streaming apply reads the file in one pass holding one tensor's scales.

Every check a malformed file can fail is here: anything but exactly those entries, a
shape or dtype that disagrees with the metadata, an unknown version or key in the
``roundhouse.quant`` namespace, non-finite scales, codes out of range. Each is ``BadArtifact``,
as for any unreadable delta.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from executor.delta._quant import (
    SCALE_DTYPES,
    SCHEME_BITS,
    QuantScheme,
    QuantTensor,
    check_codes,
    check_scales,
    dequantize,
    scale_per_element,
    unpack_int4,
)
from executor.errors import BadArtifact, into, map_exceptions
from executor.tensorfile import Header, TensorSpec, dtype_name, tensor_bytes

QUANT_KEY = "roundhouse.quant"  # "int8" | "int4": the delta is quantised
VERSION_KEY = "roundhouse.quant.version"  # "1"
BLOCK_KEY = "roundhouse.quant.block_size"  # decimal
SCALE_KEY = "roundhouse.quant.scale_dtype"  # "float32" | "float16"
SHAPES_KEY = "roundhouse.quant.shapes"  # JSON: {key: [dims]}
VERSION = "1"
CODES, SCALES = "codes/", "scales/"
MAX_DIMS = 64


def metadata(scheme: QuantScheme, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    return {
        QUANT_KEY: scheme.name,
        VERSION_KEY: VERSION,
        BLOCK_KEY: str(scheme.block_size),
        SCALE_KEY: dtype_name(scheme.scale_dtype),
        SHAPES_KEY: json.dumps({k: list(shapes[k]) for k in sorted(shapes)}, separators=(",", ":")),
    }


def entries(
    scheme: QuantScheme, shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The safetensors entries of a quantised delta, in the order their data is written."""
    out: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for key in sorted(shapes):
        numel = math.prod(shapes[key])
        out.append((SCALES + key, scheme.scale_dtype, (scheme.blocks(numel),)))
        out.append((CODES + key, scheme.code_dtype(), (scheme.code_bytes(numel),)))
    return out


@dataclass(frozen=True)
class QuantEntry:
    shape: tuple[int, ...]
    codes: TensorSpec
    scales: TensorSpec

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class QuantLayout:
    """A quantised delta's header, checked: its scheme and, per key, where codes and scales lie."""

    scheme: QuantScheme
    keys: dict[str, QuantEntry]

    def in_stream_order(self) -> bool:
        """Whether the data lies as :func:`entries` lays it out (one sequential pass reads it)."""
        starts = [s.start for k in sorted(self.keys) for s in (self.keys[k].scales, self.keys[k].codes)]
        return starts == sorted(starts)

    def specs(self) -> dict[str, TensorSpec]:
        """What the delta stands for: one float32 entry per key, of the key's shape."""
        return {k: TensorSpec(k, torch.float32, e.shape, 0, 4 * e.numel) for k, e in self.keys.items()}


def parse_layout(header: Header) -> QuantLayout | None:
    """The quantised layout of a delta's header; None for a plain (float) delta."""
    meta = header.metadata
    if QUANT_KEY not in meta:
        if any(k.startswith(QUANT_KEY + ".") for k in meta):
            raise BadArtifact(f"delta has {QUANT_KEY}.* metadata but no {QUANT_KEY}")
        return None
    scheme, shapes = _parse_metadata(meta)
    names = {CODES + k for k in shapes} | {SCALES + k for k in shapes}
    if set(header.specs) != names:
        odd = sorted(set(header.specs) ^ names)[:3]
        raise BadArtifact(f"quantised delta's entries do not match its shapes (first: {odd})")
    keys = {}
    for key, shape in shapes.items():
        numel = math.prod(shape)
        codes, scales = header.specs[CODES + key], header.specs[SCALES + key]
        if codes.dtype != scheme.code_dtype() or codes.shape != (scheme.code_bytes(numel),):
            raise BadArtifact(f"quantised delta {key!r}: codes are not {scheme.name} of shape {list(shape)}")
        if scales.dtype != scheme.scale_dtype or scales.shape != (scheme.blocks(numel),):
            raise BadArtifact(f"quantised delta {key!r}: scales do not fit the blocks of {list(shape)}")
        keys[key] = QuantEntry(shape, codes, scales)
    return QuantLayout(scheme, keys)


def _parse_metadata(meta: Mapping[str, str]) -> tuple[QuantScheme, dict[str, tuple[int, ...]]]:
    known = {QUANT_KEY, VERSION_KEY, BLOCK_KEY, SCALE_KEY, SHAPES_KEY}
    unknown = sorted(k for k in meta if k.startswith(QUANT_KEY + ".") and k not in known)
    if unknown:
        raise BadArtifact(f"quantised delta has unknown metadata {unknown[:3]}")
    if meta.get(VERSION_KEY) != VERSION:
        version = meta.get(VERSION_KEY)
        raise BadArtifact(f"quantised delta version {version!r} is not supported (want {VERSION})")
    name, block, scale = meta[QUANT_KEY], meta.get(BLOCK_KEY, ""), meta.get(SCALE_KEY, "")
    if name not in SCHEME_BITS or scale not in SCALE_DTYPES or not _canonical_int(block):
        raise BadArtifact(f"quantised delta metadata is malformed: {name!r}, {block!r}, {scale!r}")
    with map_exceptions({ValueError: into(BadArtifact, "quantised delta scheme")}):
        scheme = QuantScheme.named(name, int(block), scale)
    with map_exceptions({(ValueError, RecursionError): into(BadArtifact, "quantised delta shapes")}):
        raw = json.loads(meta.get(SHAPES_KEY, ""))
    if not isinstance(raw, dict):
        raise BadArtifact("quantised delta shapes are not a JSON object")
    shapes = {}
    for key, dims in raw.items():
        if (
            not isinstance(dims, list)
            or len(dims) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)
        ):
            raise BadArtifact(f"quantised delta shape of {key!r} is not a list of sizes")
        shapes[str(key)] = tuple(dims)
    return scheme, shapes


def _canonical_int(text: str) -> bool:
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


def decode_all(layout: QuantLayout, raw: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 tensors of a quantised delta read whole (``raw``: its entries by name)."""
    out = {}
    for key in sorted(layout.keys):
        entry = layout.keys[key]
        qt = QuantTensor(entry.shape, raw[CODES + key], raw[SCALES + key])
        out[key] = dequantize(qt, layout.scheme, repr(key))
    return out


# ---------------------------------------------------------------- the streaming apply's slices

RawRead = Callable[[TensorSpec, int, int, memoryview], None]


class SliceDecoder:
    """Dequantised slices of a quantised delta, key by key, for the streaming apply.

    ``read(spec, offset, nbytes, out)`` reads raw entry bytes, forward only. Per key the
    scales are read whole (4 bytes a block, 1/16 of the key's float32 size at the default
    block of 64) and the codes slice by slice; an int4 slice that starts mid-byte reuses the
    byte its predecessor read.
    """

    def __init__(self, layout: QuantLayout, read: RawRead) -> None:
        self.layout = layout
        self._read = read
        self._key: str | None = None
        self._scales = torch.empty(0)
        self._codes_read = 0  # bytes of the current key's codes read so far
        self._last_byte = 0

    def read_slice(self, spec: TensorSpec, offset: int, nbytes: int, out: memoryview) -> None:
        """Fill ``out`` with float32 bytes ``[offset, offset + nbytes)`` of ``spec.name``'s tensor."""
        entry = self.layout.keys[spec.name]
        if self._key != spec.name:
            self._start_key(spec.name, entry)
        start, count = offset // 4, nbytes // 4
        if count == 0:
            return
        codes = self._codes(spec.name, entry, start, count)
        scales = scale_per_element(self._scales, start, count, self.layout.scheme.block_size)
        target = torch.frombuffer(out, dtype=torch.float32, count=count)
        torch.mul(codes.to(torch.float32), scales, out=target)

    def _start_key(self, key: str, entry: QuantEntry) -> None:
        raw = torch.empty(entry.scales.shape, dtype=entry.scales.dtype)
        if entry.scales.nbytes:
            self._read(entry.scales, 0, entry.scales.nbytes, tensor_bytes(raw))
        self._scales = check_scales(raw, repr(key))
        self._key, self._codes_read, self._last_byte = key, 0, 0

    def _codes(self, key: str, entry: QuantEntry, start: int, count: int) -> torch.Tensor:
        scheme = self.layout.scheme
        if scheme.bits == 8:
            codes = torch.empty(count, dtype=torch.int8)
            self._read(entry.codes, start, count, tensor_bytes(codes))
            self._codes_read = start + count
        else:
            first, end = start // 2, (start + count + 1) // 2
            packed = torch.empty(end - first, dtype=torch.uint8)
            fresh = max(first, self._codes_read)
            if fresh > first + 1:
                raise BadArtifact(f"quantised delta {key!r}: slices requested out of order")
            if fresh > first:  # the slice starts in the byte the previous slice ended in
                packed[0] = self._last_byte
            if end > fresh:
                self._read(entry.codes, fresh, end - fresh, tensor_bytes(packed[fresh - first :]))
            self._codes_read, self._last_byte = end, int(packed[-1])
            if end == entry.codes.shape[0] and entry.numel % 2 and self._last_byte >> 4:
                raise BadArtifact(f"quantised delta {key!r}: the padding nibble is not zero")
            codes = unpack_int4(packed, 2 * (end - first))[start - 2 * first :][:count]
        check_codes(codes, scheme, repr(key))
        return codes
