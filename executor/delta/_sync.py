"""The bit-exact sync delta (DESIGN §4): the state hash both sides agree on and the apply rule.

One implementation serves both sides: the orchestrator builds a sync delta with
:func:`make_sync_delta` and publishes ``.result`` as the full-download fallback;
a worker applies it with :func:`executor.delta.apply_sync_delta` (one streaming pass) and
gets the very same bytes, because both use :func:`apply_rule` — one IEEE fp32 add per
element, no scale, no fused ops. Both sides prove it with :func:`state_hash` (or
:func:`file_state_hash` of the model file, which hashes the same bytes).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from executor.delta._quant import (
    DeltaFormat,
    QuantizedDelta,
    QuantScheme,
    QuantTensor,
    delta_format,
    dequantize,
    quantize,
)
from executor.delta._schemes import DEFAULT_SCHEME, hash_entry_header, hash_prefix, new_hasher
from executor.errors import HashMismatch
from executor.tensorfile import read_header, read_into, tensor_bytes

if sys.byteorder != "little":  # pragma: no cover - the hash is defined on little-endian bytes
    raise ImportError("Roundhouse's state hash needs a little-endian host")

HASH_PREFIX = "sha256:"
# Slices bound the memory of the streaming passes whatever the size of one tensor.
SLICE_BYTES = 16 * 1024 * 1024


# ---------------------------------------------------------------- hashing


def state_hash(state: Mapping[str, torch.Tensor], *, scheme: str = DEFAULT_SCHEME) -> str:
    """``"sha256:" + hex`` over the keys in sorted order (DESIGN §4 spells out the bytes);
    ``scheme="blake3"``: the same bytes through BLAKE3, ``"blake3:" + hex``."""
    hasher = new_hasher(scheme)
    for name in sorted(state):
        tensor = state[name].detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        hash_entry_header(hasher, name, tensor.dtype, tensor.shape)
        hasher.update(tensor_bytes(tensor))
    return hash_prefix(scheme) + hasher.hexdigest()


def file_state_hash(path: str, *, scheme: str = DEFAULT_SCHEME) -> str:
    """``state_hash`` of a safetensors file, read in slices (the file's bytes are the tensors' bytes)."""
    hasher = new_hasher(scheme)
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
    return hash_prefix(scheme) + hasher.hexdigest()


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

    delta: Mapping[str, torch.Tensor]  # a QuantizedDelta for "int8" / "int4"
    base_hash: str
    result_hash: str
    result: dict[str, torch.Tensor]


def make_sync_delta(
    base_state: Mapping[str, torch.Tensor],
    new_state: Mapping[str, torch.Tensor],
    dtype: DeltaFormat | str = torch.float16,
    *,
    scheme: str = DEFAULT_SCHEME,
    base_hash: str | None = None,
) -> SyncDelta:
    """The sync delta from ``base_state`` towards ``new_state``, cast to ``dtype``; its two
    hashes in ``scheme`` (the session's, ``sha256`` unless the orchestrator chose ``blake3``).
    ``base_hash``: the base's hash in ``scheme`` when the caller holds it already (the
    orchestrator does: the last sync's result hash), so that only the result is hashed.

    ``result`` is not ``new_state``: it is ``base + cast(delta)`` in fp32, which is what
    a worker will compute, so it is what the full-download fallback must serve.
    Non-floating keys keep the base value (the delta cannot carry them).
    ``dtype`` ``"int8"`` / ``"int4"`` (or a :class:`QuantScheme`): ``.delta`` is a
    :class:`QuantizedDelta` and ``result = float32(base) + dequant(delta)``.
    """
    fmt = delta_format(dtype)
    extra = set(new_state) - set(base_state)
    if extra:
        raise ValueError(f"new state has keys the base lacks: {sorted(extra)[:5]}")
    delta: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantTensor] = {}
    result: dict[str, torch.Tensor] = {}
    for name in sorted(base_state):
        base = base_state[name].detach().cpu()
        added: torch.Tensor | None = None
        if is_floating(base.dtype) and name in new_state:
            new = new_state[name].detach().cpu()
            if tuple(new.shape) != tuple(base.shape):
                raise ValueError(f"shape of {name!r} changed: {tuple(base.shape)} -> {tuple(new.shape)}")
            diff = new.to(torch.float32) - base.to(torch.float32)
            if isinstance(fmt, QuantScheme):
                quantized[name] = quantize(diff, fmt)
                added = dequantize(quantized[name], fmt, repr(name))
            else:
                added = delta[name] = diff.to(fmt).contiguous()
        result[name] = apply_rule(base, added)
    wire = QuantizedDelta(fmt, quantized) if isinstance(fmt, QuantScheme) else delta
    base_hash = base_hash or state_hash(base_state, scheme=scheme)
    return SyncDelta(wire, base_hash, state_hash(result, scheme=scheme), result)


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
