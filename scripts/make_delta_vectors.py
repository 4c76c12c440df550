"""Write tests/vectors/sync_delta_v1.json: the shared test vectors of the bit-exact sync delta.

Run once; the file is committed and both sides (worker apply, orchestrator build) are
tested against it. Tensors are stored as raw little-endian bytes in hex, so the vectors
pin the exact bits, independent of any float formatting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.delta import make_sync_delta, state_hash
from executor.tensorfile import dtype_name
from tests.support.vectors import encode


def main() -> None:
    generator = torch.Generator().manual_seed(20261129)
    base = {
        "encoder.weight": torch.randn(4, 3, generator=generator),
        "encoder.bias": torch.tensor([0.0, -0.0, 1e-40, -3.5]),  # signed zero, a subnormal
        "head.weight": torch.randn(2, 4, generator=generator).to(torch.bfloat16),
        "head.scale": torch.tensor(1.25, dtype=torch.float64),  # 0-dim, float64 rounds to fp32
        "norm.num_batches_tracked": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "half.w": torch.randn(5, generator=generator).to(torch.float16),
        "ünïcode.key": torch.ones(2),
    }
    new = {
        name: (t.to(torch.float32) + 0.01 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        if t.dtype.is_floating_point
        else t + 1
        for name, t in base.items()
    }
    new["encoder.bias"] = torch.tensor([70000.0, -0.0, 1e-40, -3.5])  # 70000 overflows fp16 to inf
    vectors = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        sync = make_sync_delta(base, new, dtype)
        vectors.append(
            {
                "delta_dtype": dtype_name(dtype),
                "base": encode(base),
                "new": encode(new),
                "delta": encode(sync.delta),
                "base_hash": sync.base_hash,
                "result_hash": sync.result_hash,
                "delta_hash": state_hash(sync.delta),
                "result": encode(sync.result),
            }
        )
    out = Path(__file__).resolve().parents[1] / "tests" / "vectors" / "sync_delta_v1.json"
    out.write_text(json.dumps({"version": 1, "vectors": vectors}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
