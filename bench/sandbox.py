"""``python -m bench.sandbox [--rounds 20]``: what the sandbox costs per round, and to start.

Side by side in one run, on the same tiny model and shard: a trivial round (``pass``)
and a small training round (one shard, a few steps), each run ``--rounds`` times in-thread
and in the sandboxed runner (bwrap, warm). The per-round overhead is the difference of the
medians; the start-up cost is ``load_model`` sandboxed minus in-thread (the runner starts
there, once per session). Writes ``bench/results/sandbox.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import save_file

from bench.common import save
from executor import Executor
from settings import Settings
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer

CASES = {"trivial": "pass", "train": TRAIN_CODE}


def measure(sandboxed: bool, base: Path, url: str, shards: list, rounds: int) -> dict[str, list[float]]:  # type: ignore[type-arg]
    settings = Settings(
        work_dir=str(base / ("sbx" if sandboxed else "thread")),
        cache_dir=str(base / "cache"),
        host_id="bench",
        url_allow=["127.0.0.1"],  # the bench's artifact server is on loopback (DESIGN §11)
    )
    times: dict[str, list[float]] = {"load": []}
    executor = Executor(lambda _s: None, lambda _l: None, settings=settings, sandboxed=sandboxed)
    try:
        for case, code in CASES.items():
            started = time.monotonic()
            executor.load(url, shards, code)
            times["load"].append(time.monotonic() - started)
            times[case] = []
            for round_num in range(rounds):
                started = time.monotonic()
                result = executor.run_round(steps=3, round_num=round_num)
                times[case].append(time.monotonic() - started)
                assert result.error is None, result.error
    finally:
        executor.shutdown()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        root = base / "srv"
        root.mkdir()
        save_file(mlp_state(), str(root / "model.safetensors"))
        raw = make_shards(root)
        with FaultServer(root) as server:
            shards = shard_descriptors(server, raw)
            url = server.url("model.safetensors")
            thread = measure(False, base, url, shards, args.rounds)
            sandbox = measure(True, base, url, shards, args.rounds)
    print(f"sandbox bench: {args.rounds} rounds per case, medians (seconds)")
    print(f"{'case':<12}{'in-thread':>12}{'sandboxed':>12}{'overhead':>12}")
    record: dict[str, dict[str, float]] = {}
    for case in ("trivial", "train"):
        a, b = statistics.median(thread[case]), statistics.median(sandbox[case])
        record[case] = {"in_thread_s": a, "sandboxed_s": b, "overhead_s": b - a}
        print(f"{case:<12}{a:>12.4f}{b:>12.4f}{b - a:>12.4f}")
    start = statistics.median(sandbox["load"]) - statistics.median(thread["load"])
    record["startup"] = {"load_in_thread_s": statistics.median(thread["load"]), "runner_start_s": start}
    print(f"runner start-up (load_model sandboxed minus in-thread): {start:.3f}")
    save("sandbox", {"date": time.strftime("%Y-%m-%d"), **record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
