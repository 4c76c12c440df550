"""``python -m bench.gpu [--steps 40] [--runs 2]``: executor steps/s against a bare PyTorch loop.

On a CUDA machine: the timm ResNet-50 and the 6-layer GPT-2 of ``tests/support/gpu_models``
are trained by the same step loop twice, side by side in one run and alternating: as
tenant code through ``Executor.run_round`` (sandboxed when the machine allows, shards from
the cache, ``should_stop``/``emit_stats`` every step), and as plain PyTorch in this
process with the shards already in memory. Steps/s excludes step 0 in both. Target: the
executor at 0.98x the bare loop or better. Appends rows to ``$ROUNDHOUSE_GPU_RESULTS``
(``var/gpu/results.jsonl``) and writes ``bench/results/gpu.json``.

``python -m bench.gpu --table`` prints every row of that results file as one table (the
last thing ``scripts/gpu_check.sh`` prints).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import save, scratch
from executor import Executor
from settings import Settings
from tests.support.gpu_models import TENANT_CODE, bare_loop, make_cases, sandbox_mode
from tests.support.http_server import FaultServer

ROWS = Path(os.environ.get("ROUNDHOUSE_GPU_RESULTS", "var/gpu/results.jsonl"))


def table() -> int:
    if not ROWS.exists():
        print(f"no GPU results in {ROWS}")
        return 1
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"\nGPU check, {time.strftime('%Y-%m-%d')}, {card}, torch {torch.__version__}")
    print(f"{'check':<44}{'result':<10}figures")
    for row in rows:
        figures = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("check", "result"))
        print(f"{row['check']:<44}{row['result']:<10}{figures}")
    return 0


def executor_steps_per_s(  # type: ignore[no-untyped-def]
    executor: Executor, server: FaultServer, root: Path, case, steps: int
) -> tuple[float, dict]:
    shards = [
        {"url": server.url(name), "compression": "zstd", "size_bytes": (root / name).stat().st_size}
        for name in case.shard_files
    ]
    executor.load(server.url(case.model_file), shards, TENANT_CODE, params=case.params)
    result = executor.run_round(steps=steps)
    assert result.error is None and result.report is not None, result.error
    report = dict(result.report)
    return float(report.pop("steps_per_s")), report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--table", action="store_true", help="print the collected GPU results and exit")
    parser.add_argument(
        "--sandbox", default=None, help="auto|off (default: auto where bwrap or unshare works here, else off)"
    )
    args = parser.parse_args()
    mode = args.sandbox or sandbox_mode()
    if args.table:
        return table()
    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA device")
        return 1
    record: dict[str, dict[str, list[float]]] = {}
    details: dict[str, dict[str, list[dict]]] = {}
    with scratch() as base:
        root = base / "srv"
        root.mkdir()
        cases = make_cases(root)
        settings = Settings(
            work_dir=str(base / "work"),
            cache_dir=str(base / "cache"),
            host_id="bench-gpu",
            sandbox=mode,
            url_allow=["127.0.0.1"],  # the bench's artifact server is on loopback (DESIGN §11)
        )
        executor = Executor(lambda _s: None, lambda _l: None, settings=settings, sandboxed=mode != "off")
        try:
            with FaultServer(root) as server:
                for key, case in cases.items():
                    record[key] = {"executor": [], "bare": []}
                    details[key] = {"executor": [], "bare": []}
                    for _ in range(args.runs):  # alternating, so drift hits both alike
                        for side in ("executor", "bare"):
                            steps_per_s, detail = (
                                executor_steps_per_s(executor, server, root, case, args.steps)
                                if side == "executor"
                                else bare_loop(case, root, args.steps)
                            )
                            record[key][side].append(steps_per_s)
                            details[key][side].append(detail)
                            print(f"{cases[key].name:<24} {side:<9}{steps_per_s:8.2f} steps/s  {detail}")
        finally:
            executor.shutdown()
    ROWS.parent.mkdir(parents=True, exist_ok=True)
    summary = {}
    unsandboxed = " (no sandbox)" if mode == "off" else ""
    with ROWS.open("a") as out:
        for key, runs in record.items():
            ours, bare = statistics.median(runs["executor"]), statistics.median(runs["bare"])
            ratio = ours / bare
            summary[key] = {
                "executor_steps_s": ours,
                "bare_steps_s": bare,
                "ratio": ratio,
                "runs": runs,
                "details": details[key],
            }
            row = {
                "check": f"steps/s {cases[key].name}: executor{unsandboxed} vs bare",
                "result": "pass" if ratio >= 0.98 else "below",
                "executor": round(ours, 2),
                "bare": round(bare, 2),
                "ratio": round(ratio, 3),
                "sandbox": mode,
            }
            out.write(json.dumps(row) + "\n")
            print(
                f"{cases[key].name:<24} executor {ours:8.2f} steps/s  bare {bare:8.2f} steps/s  {ratio:.3f}x"
            )
    save("gpu", {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(0), **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
