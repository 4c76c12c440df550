"""Decoding a delta within a cap known before the first byte is decoded (DESIGN §11).

A delta arrives as zstd, and zstd turns 32 KB into a gibibyte of zeros, so no decode
trusts the stream: :class:`CappedStream` refuses a frame whose recorded content size is
over the cap before decoding it, and stops a frame that records none at the cap. What
is decoded is never held beyond what the format needs: a delta in key order streams, a
safetensors delta out of key order and the seed's ``torch.save`` format are spooled to
an anonymous file beside the delta (gone with the process, whatever happens), bounded
by the same cap.

The cap of a sync delta is :func:`max_delta_bytes` of the model it applies to. A valid
sync delta holds at most one entry per floating key of the model, of the model's shape;
the apply adds in float32, so no entry needs more than 4 bytes an element (a float64
delta carries nothing the float32 add keeps, and a float32 delta of a bf16 model is
twice the model's data, which the bound allows). Around that data a safetensors header
names a subset of the model's keys with its shapes, so it is at most the model's header
plus, per key, a different dtype code, two wider offsets and JSON whitespace; the seed's
``torch.save`` zip adds a few hundred bytes a tensor (member headers, 64-byte alignment,
pickle opcodes). ``PER_KEY_BYTES`` and ``FIXED_BYTES`` cover both with room to spare.

The seed's format is a pickle, and a pickle's bytes do not bound the objects its unpickler
builds (one byte of ``EMPTY_SET`` is a 216-byte set). Its legacy bare-pickle form is refused
from its first bytes; the zip form's pickle is walked without building anything and held to
a budget of :func:`max_delta_tensors` tensors (:mod:`executor.torchzip`) before ``torch.load``.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterable, Mapping
from typing import IO

import torch
import zstandard

from executor import torchzip
from executor.delta._qlayout import SliceDecoder, parse_layout
from executor.delta._sync import is_floating
from executor.errors import BadArtifact, into, map_exceptions
from executor.tensorfile import (
    Header,
    StreamWriter,
    TensorSpec,
    header_length,
    parse_header,
    read_header,
    read_into,
)

# Per model key and once per delta: what an encoding may add around the entries' data.
PER_KEY_BYTES = 1024
FIXED_BYTES = 1 << 20
FLOAT32_BYTES = 4
# libzstd's own default limit, made explicit: the decoder's window (its memory) stays under it,
# and every window a zstd CLI level or ``--long`` picks fits.
MAX_WINDOW_BYTES = 1 << 27
# The largest zstd frame header: enough to read the recorded content size.
FRAME_HEADER_BYTES = 18
COPY_BYTES = 1 << 20

_NOT_ZSTD = {zstandard.ZstdError: into(BadArtifact, "delta is not valid zstd")}


def max_delta_bytes(model: str | Header | Mapping[str, torch.Tensor]) -> int:
    """The most a delta for ``model`` (a model file, its header, or a state) can decode to."""
    if isinstance(model, str):
        with open(model, "rb") as file:
            model = read_header(file)
    if isinstance(model, Header):
        return _bound(((s.dtype, s.numel) for s in model.specs.values()), model.data_offset)
    # Laid out as write_state (and so write_delta) lays a state out: in sorted key order.
    entries = [(name, model[name].dtype, tuple(model[name].shape)) for name in sorted(model)]
    header = len(StreamWriter(io.BytesIO(), entries).header_bytes)
    return _bound(((t.dtype, t.numel()) for t in model.values()), header)


def max_delta_tensors(model: Header | Mapping[str, torch.Tensor]) -> int:
    """The most tensors a delta for ``model`` holds: one per floating key (the pickle budget of
    the seed's torch format, :mod:`executor.torchzip`)."""
    values = model.specs.values() if isinstance(model, Header) else model.values()
    return sum(1 for value in values if is_floating(value.dtype))


def _bound(keys: Iterable[tuple[torch.dtype, int]], header_bytes: int) -> int:
    elements, count = 0, 0
    for dtype, numel in keys:
        count += 1
        if is_floating(dtype):
            elements += numel
    return FLOAT32_BYTES * elements + header_bytes + PER_KEY_BYTES * count + FIXED_BYTES


def zstd_bound(decoded: int) -> int:
    """The most a zstd file of ``decoded`` bytes can take (ZSTD_COMPRESSBOUND, rounded up):
    the download cap of a delta whose decoded size is capped."""
    return decoded + (decoded >> 8) + (1 << 17)


def over_cap(cap: int, detail: str) -> BadArtifact:
    return BadArtifact(f"delta is over its cap of {cap} decoded bytes ({detail})", {"cap": cap})


class CappedStream:
    """The decoded bytes of a zstd file, never more than ``cap`` of them.

    A read that would go past the cap is refused before anything is decoded for it;
    a stream that goes on past the cap when read to its end is refused at the cap.
    """

    def __init__(self, file: IO[bytes], cap: int) -> None:
        self.cap = cap
        self.position = 0
        with map_exceptions(_NOT_ZSTD):
            recorded = zstandard.frame_content_size(os.pread(file.fileno(), FRAME_HEADER_BYTES, 0))
        if recorded > cap:  # -1: not recorded, decoded with a bounded output instead
            raise over_cap(cap, f"its zstd frame records {recorded}")
        decompressor = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
        self._reader = decompressor.stream_reader(file, read_across_frames=True, closefd=False)

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes; a stream that ends first is truncated."""
        if self.position + len(view) > self.cap:
            raise over_cap(self.cap, f"it needs at least {self.position + len(view)}")
        got = 0
        with map_exceptions(_NOT_ZSTD):
            while got < len(view):
                n = self._reader.readinto(view[got:])
                if not n:
                    raise BadArtifact("delta stream ended early (truncated)")
                got += n
        self.position += got

    def read(self, count: int) -> bytes:
        buffer = bytearray(count)
        self.readinto(memoryview(buffer))
        return bytes(buffer)

    def skip_to(self, target: int) -> None:
        """Decode and drop the bytes up to ``target`` (forward only)."""
        if target == self.position:  # the common case: the next slice follows this one
            return
        if target < self.position:
            raise BadArtifact("delta slices requested out of order")
        if target > self.cap:
            raise over_cap(self.cap, f"it needs at least {target}")
        buffer = memoryview(bytearray(min(COPY_BYTES, target - self.position)))
        while self.position < target:
            self.readinto(buffer[: target - self.position])

    def copy_to(self, out: IO[bytes], count: int | None) -> None:
        """Write the next ``count`` bytes (None: the rest of the stream, within the cap) to ``out``."""
        end = self.cap if count is None else self.position + count
        if end > self.cap:
            raise over_cap(self.cap, f"it needs at least {end}")
        buffer = memoryview(bytearray(COPY_BYTES))
        with map_exceptions(_NOT_ZSTD):
            while self.position < end:
                n = self._reader.readinto(buffer[: min(COPY_BYTES, end - self.position)])
                if not n:
                    if count is None:
                        return
                    raise BadArtifact("delta stream ended early (truncated)")
                out.write(buffer[:n])
                self.position += n
            if count is None and self._reader.read(1):
                raise over_cap(self.cap, "it decodes to more")

    def close(self) -> None:
        self._reader.close()


# ---------------------------------------------------------------- what the stream holds


def is_torch_prefix(prefix: bytes) -> bool:
    """The seed's ``torch.save``: a zip (the default), or a bare pickle (the legacy format, told
    apart only to be refused with a clear message)."""
    return torchzip.is_zip(prefix) or torchzip.is_legacy_pickle(prefix)


def read_stream_header(stream: CappedStream, prefix: bytes) -> Header:
    """The safetensors header that follows ``prefix``; refused when it promises more than the cap."""
    length = header_length(prefix)
    if 8 + length > stream.cap:
        raise over_cap(stream.cap, f"its safetensors header needs {8 + length}")
    header = parse_header(stream.read(length), None)
    promised = header.data_offset + header.data_bytes
    if promised > stream.cap:
        raise over_cap(stream.cap, f"its safetensors header promises {promised}")
    return header


def spool(directory: str) -> IO[bytes]:
    """An anonymous file in ``directory``: nothing of it outlives the process."""
    with map_exceptions({}, where=directory):
        return tempfile.TemporaryFile(dir=directory)


def load_torch_delta(
    stream: CappedStream, prefix: bytes, spool_dir: str, max_tensors: int | None = None
) -> dict[str, torch.Tensor]:
    """The seed's ``torch.save`` dict, decoded once to a spool file (within the cap), its pickle
    checked within ``max_tensors`` tensors (:func:`executor.torchzip.check_torch_zip`; None: from
    its storage records), then loaded with ``weights_only``: the tensors are all it holds."""
    if not torchzip.is_zip(prefix):
        raise BadArtifact(f"delta {torchzip.LEGACY_REFUSED}")  # refused before the rest is decoded
    what = "delta is neither safetensors nor a weights-only torch dict"
    with spool(spool_dir) as file:
        file.write(prefix)
        with map_exceptions({}, where=spool_dir):
            stream.copy_to(file, None)
        torchzip.check_torch_zip(file, "delta", max_tensors)
        with map_exceptions({Exception: into(BadArtifact, what)}):
            loaded = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise BadArtifact("delta must be a dict of tensors")
    return loaded


# ---------------------------------------------------------------- the apply's delta source


class DeltaSource:
    """Tensors of a delta file, handed out slice by slice in sorted key order, within ``cap``.

    When the safetensors data lies in sorted key order (as :func:`write_delta` writes
    it) the zstd stream is consumed sequentially and never held whole; otherwise its
    data section is spooled once to an anonymous file and read from there, and the
    seed's torch format is loaded from such a file (its tensors held, nothing more).
    """

    def __init__(self, path: str, cap: int, max_tensors: int | None = None) -> None:
        self._max_tensors = max_tensors
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._stream: CappedStream | None = None
        self._spool: IO[bytes] | None = None
        self._tensors: dict[str, torch.Tensor] | None = None
        self._quant: SliceDecoder | None = None
        try:
            self._stream = CappedStream(self._file, cap)
            self.specs = self._open(self._stream, os.path.dirname(os.path.abspath(path)))
        except BaseException:
            self.close()
            raise

    def _open(self, stream: CappedStream, spool_dir: str) -> dict[str, TensorSpec]:
        prefix = stream.read(8)
        if is_torch_prefix(prefix):
            self._tensors = load_torch_delta(stream, prefix, spool_dir, self._max_tensors)
            return {n: TensorSpec(n, t.dtype, tuple(t.shape), 0, 0) for n, t in self._tensors.items()}
        header = read_stream_header(stream, prefix)
        ordered = sorted(header.specs.values(), key=lambda s: s.name)
        self._base = header.data_offset
        layout = parse_layout(header)
        if layout is not None:
            # Quantised: hand out each key's float32 slices, decoded from its codes and scales.
            self._quant = SliceDecoder(layout, self._read_raw)
            in_order = layout.in_stream_order()
        else:
            in_order = [s.start for s in ordered] == sorted(s.start for s in ordered)
        if not in_order:
            # Not in key order: a sequential pass is impossible, spool the data section once.
            self._spool = spool(spool_dir)
            with map_exceptions({}, where=spool_dir):
                stream.copy_to(self._spool, header.data_bytes)
                self._spool.flush()  # read back with pread, below the buffer
        return layout.specs() if layout is not None else header.specs

    @classmethod
    def for_model(cls, path: str, model: Header) -> DeltaSource:
        """The delta at ``path`` within the bounds of the model it applies to (bytes and tensors)."""
        return cls(path, max_delta_bytes(model), max_delta_tensors(model))

    def read_slice(self, spec: TensorSpec, offset: int, nbytes: int, out: memoryview) -> None:
        """Fill ``out`` with bytes [offset, offset+nbytes) of ``spec``'s data; calls must go forward.

        For a quantised delta ``spec`` is one of :attr:`specs` (float32) and ``out`` gets the
        dequantised values."""
        if self._quant is not None:
            self._quant.read_slice(spec, offset, nbytes, out)
            return
        self._read_raw(spec, offset, nbytes, out)

    def _read_raw(self, spec: TensorSpec, offset: int, nbytes: int, out: memoryview) -> None:
        if self._spool is not None:
            read_into(self._spool, spec.start + offset, out[:nbytes])
            return
        assert self._stream is not None
        self._stream.skip_to(self._base + spec.start + offset)
        self._stream.readinto(out[:nbytes])

    def tensor(self, name: str) -> torch.Tensor | None:
        """Whole tensors for the torch-format fallback (None when the stream is safetensors)."""
        return None if self._tensors is None else self._tensors.get(name)

    def close(self) -> None:
        for closable in (self._stream, self._spool):
            if closable is not None:
                closable.close()
        self._stream = self._spool = None
        self._file.close()

    def __enter__(self) -> DeltaSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
