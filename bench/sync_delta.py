"""``python -m bench.sync_delta [--mb 1024] [--runs 3]``: the sync-delta apply against its limits.

Side by side, in one run, on one model file of ``--mb`` MB of fp32 with an fp16 delta:

- ``cp``: one copy of the model file (``cp --reflink=never``), the floor the target is set against;
- ``openssl dgst -sha256``: one OpenSSL sha256 pass over the file, the floor of an apply whose
  result is hashed with one sha256 stream (issue 15's target: apply <= 1.15 x this);
- ``sha256``: raw ``hashlib.sha256`` over the file (read in 16 MiB slices), the floor of any hash;
- ``blake3``: :func:`executor.delta.file_state_hash` in the ``blake3:`` scheme (every core);
- ``state_hash``: :func:`executor.delta.file_state_hash` of the same file;
- ``apply (known base)``: the executor's path (it knows the hash of the file it installed);
- ``apply (known base, blake3)``: the same with the session's hashes in the ``blake3:`` scheme;
- ``apply (full)``: base hash checked in the same pass;
- ``seed approach``: load base, hash, decompress delta to disk, reload, add, hash, save.

Each apply runs in a fresh subprocess so its peak RSS (VmHWM) is its own. Prints a table
of medians and ratios and writes ``bench/results/sync_delta.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import add_size_and_runs, save, scratch
from executor.delta import file_state_hash, make_sync_delta, state_hash, write_delta
from executor.tensorfile import write_state

SLICE = 16 * 1024 * 1024

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import torch
from executor.delta import apply_sync_delta
from bench.seed_apply import seed_apply
mode, model, delta, base_hash, result_hash = sys.argv[1:6]
started = time.monotonic()
if mode == "seed":
    seed_apply(model, delta, base_hash, result_hash)
elif mode != "idle":  # idle: the floor every apply process pays (python, torch, the modules)
    apply_sync_delta(model, delta, base_hash=base_hash, result_hash=result_hash,
                     known_base_hash=base_hash if mode.startswith("known") else None)
seconds = time.monotonic() - started
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({{"seconds": seconds, "peak_rss_bytes": int(hwm) * 1024}}))
"""


def make_model(directory: Path, megabytes: int) -> tuple[Path, Path, dict[str, tuple[str, str]]]:
    generator = torch.Generator().manual_seed(0)
    rows = 1024
    per_tensor = 64  # MB
    count = max(1, megabytes // per_tensor)
    base = {
        f"layer{i:03d}.weight": torch.randn(rows, per_tensor * 256, generator=generator) for i in range(count)
    }
    model = directory / "model.safetensors"
    with open(model, "wb") as file:
        write_state(file, base)
    new = {k: v + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in base.items()}
    sync = make_sync_delta(base, new)
    delta = directory / "delta.safetensors.zst"
    write_delta(sync.delta, str(delta))
    # The same delta's hashes in the other scheme (its bytes do not depend on the scheme).
    result_b3 = state_hash(sync.result, scheme="blake3")
    hashes = {
        "sha256": (sync.base_hash, sync.result_hash),
        "blake3": (state_hash(base, scheme="blake3"), result_b3),
    }
    return model, delta, hashes


MODES = (
    ("known", "apply (known base)"),
    ("known-blake3", "apply (known base, blake3)"),
    ("full", "apply (full)"),
    ("seed", "seed approach"),
    ("idle", "python+torch"),
)


def copy_file(source: Path, target: Path) -> None:
    subprocess.run(["cp", "--reflink=never", str(source), str(target)], check=True)


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def raw_sha256(path: Path) -> None:
    hasher = hashlib.sha256()
    buffer = bytearray(SLICE)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(view):
            hasher.update(view[:count])


def child_apply(mode: str, model: Path, original: Path, delta: Path, base: str, result: str) -> dict:
    shutil.copyfile(original, model)  # every apply starts from the base
    repo = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(repo=repo), mode, str(model), str(delta), base, result],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_size_and_runs(parser, mb=1024, runs=3)
    args = parser.parse_args()
    with scratch(args.dir) as directory:
        original, delta, hashes = make_model(directory, args.mb)
        model = directory / "work.safetensors"
        size = original.stat().st_size
        names = ("cp", "openssl dgst -sha256", "sha256", "state_hash", "state_hash (blake3)")
        rows: dict[str, list[float]] = {k: [] for k in names}
        peaks: dict[str, list[int]] = {}
        copy = directory / "copy.safetensors"
        openssl = ["openssl", "dgst", "-sha256", str(original)]
        for _ in range(args.runs):
            rows["cp"].append(timed(lambda: copy_file(original, copy)))
            copy.unlink()
            rows["openssl dgst -sha256"].append(
                timed(lambda: subprocess.run(openssl, check=True, capture_output=True))
            )
            rows["sha256"].append(timed(lambda: raw_sha256(original)))
            rows["state_hash"].append(timed(lambda: file_state_hash(str(original))))
            rows["state_hash (blake3)"].append(timed(lambda: file_state_hash(str(original), scheme="blake3")))
            for mode, label in MODES:
                base, result = hashes["blake3" if mode.endswith("blake3") else "sha256"]
                measured = child_apply(mode, model, original, delta, base, result)
                rows.setdefault(label, []).append(measured["seconds"])
                peaks.setdefault(label, []).append(measured["peak_rss_bytes"])
    return report(rows, peaks, size, args)


def report(
    rows: dict[str, list[float]], peaks: dict[str, list[int]], size: int, args: argparse.Namespace
) -> int:
    medians = {k: statistics.median(v) for k, v in rows.items()}
    cp = medians["cp"]
    print(f"sync delta bench: model {size / 1e6:.0f} MB fp32, fp16 delta, {args.runs} runs, medians")
    floor = statistics.median(peaks.pop("python+torch"))
    medians.pop("python+torch")
    print(f"{'what':<30}{'seconds':>10}{'x cp':>8}{'MB/s':>9}{'peak RSS / model':>18}")
    print(f"(peak RSS counts what the step adds above the {floor / 1e6:.0f} MB of python + torch)")
    for label, seconds in medians.items():
        peak = (statistics.median(peaks[label]) - floor) / size if label in peaks else None
        peak_text = f"{peak:.2f}" if peak is not None else "-"
        print(f"{label:<30}{seconds:>10.3f}{seconds / cp:>8.2f}{size / seconds / 1e6:>9.0f}{peak_text:>18}")
    print(f"state_hash at {medians['sha256'] / medians['state_hash'] * 100:.0f}% of raw sha256 speed")
    openssl = medians["openssl dgst -sha256"]
    for label in ("apply (known base)", "apply (known base, blake3)"):
        print(f"{label}: {medians[label] / openssl:.2f} x one openssl sha256 pass")
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "model_bytes": size,
        "runs": args.runs,
        "seconds": rows,
        "peak_rss_bytes": peaks,
        "peak_rss_floor_bytes": floor,
        "cpu_count": os.cpu_count(),
    }
    save("sync_delta", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
