"""The shared test vectors' tensor codec: a tensor as its dtype name, shape and raw
little-endian bytes in hex, so a vector pins the exact bits, independent of any float
formatting. The vector scripts (``scripts/make_*_vectors.py``) write with ``encode``; the
tests on both sides of the sync-delta contract read with ``decode``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from executor.tensorfile import dtype_from_name, dtype_name, tensor_bytes


def encode(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, object]]:
    return {
        name: {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "hex": bytes(tensor_bytes(t.contiguous())).hex(),
        }
        for name, t in sorted(state.items())
    }


def decode(encoded: dict[str, dict[str, object]]) -> dict[str, torch.Tensor]:
    """The tensors of ``encode``'s form, each its own writable copy."""
    state = {}
    for name, entry in encoded.items():
        raw = bytearray.fromhex(str(entry["hex"]))
        dtype = dtype_from_name(str(entry["dtype"]))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        state[name] = flat.reshape([int(d) for d in entry["shape"]])  # type: ignore[attr-defined]
    return state
