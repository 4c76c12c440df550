"""Writing quantised deltas: the orchestrator's (a :class:`QuantizedDelta`) and a round's
trained delta, quantised key by key in the writer's streaming path, with error feedback.

Both write the layout of :mod:`executor.delta._qlayout` into one zstd frame whose content
size is known before the first byte (the header fixes every entry's size). The hash a
written delta reports is ``state_hash`` of the float32 tensors it stands for — what
``read_delta`` of the file returns — so the orchestrator checks a quantised delta exactly as
it checks a float one. The trained delta holds no more of the model at once than the
float path does: one key's original, its float32 difference, its codes and scales, and,
with error feedback, that key's previous and next residual.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

import torch
import zstandard

from executor.delta._feedback import ResidualUpdate
from executor.delta._qlayout import entries, metadata
from executor.delta._quant import QuantizedDelta, QuantScheme, QuantTensor, dequantize, quantize
from executor.delta._sync import HASH_PREFIX, hash_entry_header, is_floating
from executor.fileio import atomic_writer
from executor.tensorfile import StreamWriter, read_header, read_tensor, tensor_bytes


class _QuantStream:
    """One quantised delta being written: its header up front, then key by key."""

    def __init__(self, writer: StreamWriter) -> None:
        self._writer = writer
        self._hasher: Any = hashlib.sha256()
        self.keys = 0

    def put(self, name: str, qt: QuantTensor, dequantized: torch.Tensor) -> None:
        hash_entry_header(self._hasher, name, torch.float32, qt.shape)
        self._hasher.update(tensor_bytes(dequantized.contiguous()))
        self._writer.write(tensor_bytes(qt.scales.contiguous()))
        self._writer.write(tensor_bytes(qt.codes.contiguous()))
        self.keys += 1

    @property
    def digest(self) -> str:
        return HASH_PREFIX + str(self._hasher.hexdigest())


@contextmanager
def _quant_stream(
    raw: IO[bytes],
    scheme: QuantScheme,
    shapes: Mapping[str, tuple[int, ...]],
    compressor: zstandard.ZstdCompressor,
) -> Iterator[_QuantStream]:
    layout, meta = entries(scheme, shapes), metadata(scheme, shapes)
    size = StreamWriter(io.BytesIO(), layout, meta).total_bytes
    zf = compressor.stream_writer(raw, size=size, closefd=False)
    writer = StreamWriter(zf, layout, meta)
    writer.write_header()
    # Closed only on success: closing a frame cut short fails on its recorded size, and would
    # hide why it was cut short (the atomic writer discards the file either way).
    yield _QuantStream(writer)
    zf.close()


def write_quantized(
    delta: QuantizedDelta, path: str, compressor: zstandard.ZstdCompressor
) -> tuple[str, int]:
    """Write a quantised delta atomically; returns its hash and key count."""
    shapes = {name: qt.shape for name, qt in delta.tensors.items()}
    with atomic_writer(path) as raw, _quant_stream(raw, delta.scheme, shapes, compressor) as stream:
        for name, qt in delta.tensors.items():
            stream.put(name, qt, dequantize(qt, delta.scheme, repr(name)))
    return stream.digest, stream.keys


def trained_keys(header: Any, trained: Mapping[str, torch.Tensor]) -> list[str]:
    """The model's floating keys that ``trained`` holds, sorted; a shape change is a ``ValueError``."""
    names = sorted(n for n, s in header.specs.items() if is_floating(s.dtype) and n in trained)
    for name in names:
        if tuple(trained[name].shape) != header.specs[name].shape:
            raise ValueError(
                f"trained {name!r} has shape {tuple(trained[name].shape)}, "
                f"the model file has {header.specs[name].shape}"
            )
    return names


def write_quantized_result(
    original_path: str,
    trained: Mapping[str, torch.Tensor],
    path: str,
    scheme: QuantScheme,
    compressor: zstandard.ZstdCompressor,
    feedback: ResidualUpdate | None = None,
) -> tuple[str, int]:
    """``trained - original`` (+ the previous residual), quantised, as a delta file.

    The keys are those of :func:`executor.delta.write_result_delta`; with ``feedback`` the
    next residual is staged as each key is written (the caller commits it once the delta
    is delivered). A shape change, or a non-finite value, is a ``ValueError``.
    """
    with open(original_path, "rb") as file:
        header = read_header(file)
        shapes = trained_shapes(header, trained)
        with atomic_writer(path) as raw, _quant_stream(raw, scheme, shapes, compressor) as stream:
            for name, value, dequantized in residual_keys(file, header, shapes, trained, feedback):
                stream.put(name, quantize_key(name, value, scheme, dequantized), dequantized)
    return stream.digest, stream.keys


def trained_shapes(header: Any, trained: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The keys a round's delta writes (:func:`trained_keys`), in order, with their shapes."""
    return {name: header.specs[name].shape for name in trained_keys(header, trained)}


def residual_keys(
    file: IO[bytes],
    header: Any,
    shapes: Mapping[str, tuple[int, ...]],
    trained: Mapping[str, torch.Tensor],
    feedback: ResidualUpdate | None,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The per-key step of a quantised delta with error feedback, whole or in shards: for each
    key of ``shapes`` (from the open model ``file``), ``trained - original`` in fp32 plus the
    previous residual, and a buffer the caller fills with the dequantised values of what it
    quantised; once it asks for the next key, this key's next residual (the rest) is staged."""
    if feedback is not None:
        feedback.begin(sorted(shapes.items()))
    for name, shape in shapes.items():
        original = read_tensor(file, header, header.specs[name]).to(torch.float32)
        # contiguous: a transposed trained tensor must flatten in the model's row-major order
        value = (trained[name].detach().to("cpu", torch.float32) - original).contiguous()
        del original
        previous = feedback.previous(name, shape) if feedback is not None else None
        if previous is not None:
            value.add_(previous)
        dequantized = torch.empty(value.shape, dtype=torch.float32)
        yield name, value, dequantized
        if feedback is not None:
            feedback.put(name, value.sub_(dequantized))


def quantize_key(
    name: str, value: torch.Tensor, scheme: QuantScheme, dequantized: torch.Tensor
) -> QuantTensor:
    """``value`` (a key, or a slice of one) quantised, its dequantised values in
    ``dequantized``; a non-finite value is a ``ValueError`` naming the key."""
    try:
        return quantize(value, scheme, dequantized=dequantized)
    except ValueError:
        raise ValueError(f"trained {name!r} has inf or nan: it cannot be quantised") from None
