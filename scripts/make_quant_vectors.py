"""Write tests/vectors/sync_delta_quant_v1.json: shared vectors of the quantised sync delta.

The sibling of ``make_delta_vectors.py`` for ``make_sync_delta(..., dtype="int8"|"int4")``
(docs/ARCHITECTURE.md, "Quantised deltas"). Each vector pins, as raw little-endian bytes in
hex: the base and new states; the codes and scales of every key; the float32 values they
stand for (``delta``: what a worker adds); the result; the hashes; and ``wire``, the exact
safetensors bytes of the delta file before zstd (its header names the scheme). Run once;
the file is committed and both sides (the orchestrator's build, the worker's apply and
``read_delta``) are tested against it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.delta import QuantizedDelta, QuantScheme, make_sync_delta, state_hash, write_delta
from executor.tensorfile import tensor_bytes
from tests.support.vectors import encode

OUT = Path(__file__).resolve().parents[1] / "tests" / "vectors" / "sync_delta_quant_v1.json"
# (scheme, block size, scale dtype): block sizes that do and do not divide the tensors.
CASES = (("int8", 4, "float32"), ("int8", 3, "float16"), ("int4", 4, "float32"), ("int4", 5, "float16"))


def states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(20261201)
    base = {
        "encoder.weight": torch.randn(4, 3, generator=generator),
        "encoder.bias": torch.tensor([0.0, -0.0, 1e-40, -3.5]),  # signed zero, a subnormal
        "head.weight": torch.randn(2, 4, generator=generator).to(torch.bfloat16),
        "head.scale": torch.tensor(1.25, dtype=torch.float64),  # 0-dim, float64 rounds to fp32
        "norm.num_batches_tracked": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "half.w": torch.randn(5, generator=generator).to(torch.float16),  # odd: an int4 pad nibble
        "zeros.w": torch.zeros(6),  # unchanged: blocks of zeros, scale 0
        "tiny.w": torch.zeros(4),  # differences whose float16 scales underflow to 0
        "subnormal.w": torch.zeros(4),  # float32 scales that are subnormal
        "big.w": torch.zeros(7),  # a difference whose float16 scale would overflow
        "ünïcode.key": torch.ones(2),
    }
    new = {
        name: (t.to(torch.float32) + 0.01 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        if t.dtype.is_floating_point
        else t + 1
        for name, t in base.items()
    }
    new["encoder.bias"] = torch.tensor([70000.0, -0.0, 1e-40, -3.5])
    new["zeros.w"] = base["zeros.w"].clone()
    new["tiny.w"] = torch.tensor([1e-9, -2e-9, 5e-10, 0.0])
    new["subnormal.w"] = torch.tensor([1e-41, -3e-42, 0.0, 5e-42])
    new["big.w"] = torch.tensor([1e7, 1.0, -2.0, 0.5, -1e7, 3.0, 0.25])
    return base, new


def wire_bytes(delta: QuantizedDelta) -> bytes:
    """The safetensors bytes ``write_delta`` compresses (decompressed from a real write)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.zst"
        write_delta(delta, str(path))
        return zstandard.ZstdDecompressor().decompress(path.read_bytes())


def vector(name: str, block: int, scale: str) -> dict[str, object]:
    base, new = states()
    scheme = QuantScheme.named(name, block, scale)
    sync = make_sync_delta(base, new, scheme)
    assert isinstance(sync.delta, QuantizedDelta)
    dequantized = dict(sync.delta)
    return {
        "delta_dtype": name,
        "block_size": block,
        "scale_dtype": scale,
        "base": encode(base),
        "new": encode(new),
        "codes": {k: bytes(tensor_bytes(q.codes)).hex() for k, q in sync.delta.tensors.items()},
        "scales": {k: bytes(tensor_bytes(q.scales)).hex() for k, q in sync.delta.tensors.items()},
        "delta": encode(dequantized),
        "base_hash": sync.base_hash,
        "result_hash": sync.result_hash,
        "delta_hash": state_hash(dequantized),
        "result": encode(sync.result),
        "wire": wire_bytes(sync.delta).hex(),
    }


def main() -> None:
    vectors = [vector(*case) for case in CASES]
    OUT.write_text(json.dumps({"version": 1, "vectors": vectors}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
