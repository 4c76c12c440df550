"""``python -m bench.hashes [--mb 2048] [--runs 3]``: the state hash's two schemes on this host.

``file_state_hash`` of one fp32 safetensors model (16 tensors, in the page cache) in the
``sha256:`` scheme (one core: sha256 cannot be split) and in the ``blake3:`` scheme (BLAKE3's
tree mode on every core), against ``openssl dgst -sha256`` of the same file; interleaved,
medians. Part of the GPU check (``scripts/gpu_check.sh``), where a 14 GB model's hash is the
floor of every load and apply. Appends a row to ``$ROUNDHOUSE_GPU_RESULTS`` and writes
``bench/results/hashes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import add_size_and_runs, save, scratch
from bench.load import make_model
from executor.delta import file_state_hash


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_size_and_runs(parser, mb=2048, runs=3)
    args = parser.parse_args()
    with scratch(args.dir) as base:
        model = base / "model.safetensors"
        make_model(model, args.mb)
        size = model.stat().st_size
        methods = {
            "openssl dgst -sha256": lambda: subprocess.run(
                ["openssl", "dgst", "-sha256", str(model)], check=True, capture_output=True
            ),
            "file_state_hash sha256": lambda: file_state_hash(str(model)),
            "file_state_hash blake3": lambda: file_state_hash(str(model), scheme="blake3"),
        }
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        subprocess.run(["cat", str(model)], stdout=subprocess.DEVNULL, check=True)
        for _ in range(args.runs):
            for name, fn in methods.items():
                started = time.monotonic()
                fn()
                seconds[name].append(time.monotonic() - started)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(
        f"state hash schemes: {size / 2**20:.0f} MiB model, {os.cpu_count()} cores, {args.runs} runs, medians"
    )
    print(f"{'what':<26}{'seconds':>9}{'GB/s':>8}")
    for name, value in medians.items():
        print(f"{name:<26}{value:>9.3f}{size / value / 1e9:>8.2f}")
    row = {
        "check": "state hash: blake3 vs sha256 (GB/s)",
        "result": "measured",
        "cores": os.cpu_count(),
        "sha256_gb_s": round(size / medians["file_state_hash sha256"] / 1e9, 2),
        "blake3_gb_s": round(size / medians["file_state_hash blake3"] / 1e9, 2),
        "openssl_gb_s": round(size / medians["openssl dgst -sha256"] / 1e9, 2),
    }
    rows = Path(os.environ.get("ROUNDHOUSE_GPU_RESULTS", "var/gpu/results.jsonl"))
    rows.parent.mkdir(parents=True, exist_ok=True)
    with rows.open("a") as out:
        out.write(json.dumps(row) + "\n")
    save("hashes", {"date": time.strftime("%Y-%m-%d"), "bytes": size, "seconds": seconds, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
