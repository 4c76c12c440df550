"""``python -m bench.aggregate [--mb 256] [--hosts 8] [--in-memory 2] [--runs 1]``: the orchestrator's
memory while it averages a round's trained deltas.

One model of ``--mb`` MB of fp32 and ``--hosts`` fp16 trained deltas (what a round's workers
upload, zstd safetensors), kept in an :class:`orchestrator.artifacts.ArtifactServer`'s
directory. Each way of averaging them runs in a fresh subprocess, so that its peak RSS
(VmHWM) is its own:

- ``naive``: fetch and decode every delta, then :func:`orchestrator.diloco.mean_delta` over
  all of them (what the orchestrator did before: O(hosts × model));
- ``streaming``: :class:`orchestrator.aggregate.DeltaFolder`, ``--parallel`` fetches at a
  time, at most ``--in-memory`` decoded deltas, each folded into the running fp32 sum as it
  arrives (O(model));
- ``python+torch``: the floor every process pays (the interpreter, torch, the modules).

Both means are written out and compared (they may differ in the last bit: the streaming
sum adds in arrival order). Prints a table and writes ``bench/results/aggregate.json``.
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

import torch

from bench.common import add_size_and_runs, save, scratch
from executor.delta import write_delta
from executor.tensorfile import load_state

TENSOR_MB = 16

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
import torch
from executor.delta import read_delta
from executor.tensorfile import write_state
from orchestrator.aggregate import DeltaFolder
from orchestrator.artifacts import ArtifactServer
from orchestrator.diloco import mean_delta
mode, root, hosts, in_memory, parallel, out = sys.argv[1:7]
hosts, in_memory, parallel = int(hosts), int(in_memory), int(parallel)
store = ArtifactServer(root)  # not started: the orchestrator's side, fetch is a local copy
scratch = os.path.join(root, "scratch-" + mode)
os.makedirs(scratch, exist_ok=True)
model = {{k: torch.empty(s) for k, s in json.load(open(os.path.join(root, "shapes.json"))).items()}}
started = time.monotonic()
if mode == "naive":
    deltas = []
    for i in range(hosts):
        local = os.path.join(scratch, f"h{{i}}.zst")
        store.fetch(f"deltas/h{{i}}.safetensors.zst", local)
        deltas.append(read_delta(local))
        os.unlink(local)
    mean = mean_delta(deltas)
elif mode == "streaming":
    hashes = json.load(open(os.path.join(root, "hashes.json")))
    folder = DeltaFolder(store, scratch, model, parallel=parallel, in_memory=in_memory)
    for i in range(hosts):
        folder.submit(f"h{{i}}", f"deltas/h{{i}}.safetensors.zst", hashes[f"h{{i}}"])
    errors = [r.error for r in folder.results().values() if r.error]
    assert not errors, errors
    folder.close()
    mean = folder.mean.mean()
seconds = time.monotonic() - started
if mode != "idle":
    with open(out, "wb") as file:
        write_state(file, mean)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({{"seconds": seconds, "peak_rss_bytes": int(hwm) * 1024}}))
"""

MODES = (
    ("naive", "naive (all deltas held)"),
    ("streaming", "streaming (DeltaFolder)"),
    ("idle", "python+torch"),
)


def make_round(root: Path, megabytes: int, hosts: int) -> int:
    """The model's shapes and ``hosts`` fp16 deltas in the store's directory; the model's size."""
    from executor.delta import state_hash

    count = max(1, megabytes // TENSOR_MB)
    shapes = {f"layer{i:03d}.weight": [1024, TENSOR_MB * 256] for i in range(count)}
    (root / "shapes.json").write_text(json.dumps(shapes))
    (root / "deltas").mkdir(parents=True, exist_ok=True)
    hashes = {}
    generator = torch.Generator().manual_seed(0)
    for host in range(hosts):
        delta = {k: (torch.randn(s, generator=generator) * 1e-3).half() for k, s in shapes.items()}
        write_delta(delta, str(root / "deltas" / f"h{host}.safetensors.zst"))
        hashes[f"h{host}"] = state_hash(delta)
        del delta
    (root / "hashes.json").write_text(json.dumps(hashes))
    return count * TENSOR_MB * 1024 * 1024


def child(mode: str, root: Path, args: argparse.Namespace) -> dict:
    repo = str(Path(__file__).resolve().parents[1])
    argv = [
        mode,
        str(root),
        str(args.hosts),
        str(args.in_memory),
        str(args.parallel),
        str(root / f"{mode}.out"),
    ]
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(repo=repo), *argv], check=True, capture_output=True, text=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_size_and_runs(parser, mb=256, runs=1, mb_help="model size in MB of fp32")
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--in-memory", type=int, default=2, help="decoded deltas at once (streaming)")
    parser.add_argument("--parallel", type=int, default=4, help="fetches at once (streaming)")
    args = parser.parse_args()
    with scratch(args.dir) as root:
        size = make_round(root, args.mb, args.hosts)
        seconds: dict[str, list[float]] = {}
        peaks: dict[str, list[int]] = {}
        for _ in range(args.runs):
            for mode, label in MODES:
                measured = child(mode, root, args)
                seconds.setdefault(label, []).append(measured["seconds"])
                peaks.setdefault(label, []).append(measured["peak_rss_bytes"])
        naive, streamed = load_state(str(root / "naive.out")), load_state(str(root / "streaming.out"))
        diff = max(float((naive[k] - streamed[k]).abs().max()) for k in naive)
    return report(seconds, peaks, size, diff, args)


def report(
    seconds: dict[str, list[float]],
    peaks: dict[str, list[int]],
    size: int,
    diff: float,
    args: argparse.Namespace,
) -> int:
    floor = statistics.median(peaks["python+torch"])
    delta_bytes = size // 2
    print(
        f"aggregate bench: {args.hosts} hosts, model {size / 1e6:.0f} MB fp32, fp16 deltas of "
        f"{delta_bytes / 1e6:.0f} MB, streaming with {args.in_memory} in memory and {args.parallel} fetches; "
        f"{args.runs} run(s), medians"
    )
    print(f"{'what':<26}{'seconds':>9}{'peak RSS MB':>13}{'above floor MB':>16}{'/ model':>9}")
    for label in seconds:
        peak = statistics.median(peaks[label])
        above = peak - floor
        ratio = f"{above / size:.2f}" if label != "python+torch" else "-"
        took = statistics.median(seconds[label])
        print(f"{label:<26}{took:>9.2f}{peak / 1e6:>13.0f}{above / 1e6:>16.0f}{ratio:>9}")
    print(f"largest difference between the two means: {diff:.3g} (addition order)")
    save(
        "aggregate",
        {
            "date": time.strftime("%Y-%m-%d"),
            "hosts": args.hosts,
            "model_bytes": size,
            "in_memory": args.in_memory,
            "parallel": args.parallel,
            "runs": args.runs,
            "seconds": seconds,
            "peak_rss_bytes": peaks,
            "max_abs_difference": diff,
            "cpu_count": os.cpu_count(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
