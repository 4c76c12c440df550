"""``python -m bench.shards [--shards 8] [--rounds 3]``: how long a round waits for shards.

A training round whose compute per shard is longer than that shard's fetch: ``--shards``
zstd token shards (``--mb`` MB decoded each) served by a local nginx limited to
``--rate`` per connection, a shard cache that holds only three of them (so every round
downloads every shard again: the worst case), and tenant code that takes one shard per
step and then computes for ``--compute-s`` seconds. The tenant code times each
``get_shard`` call itself, inside the sandbox; the fraction of round time spent in those
calls is the figure. The first shard of a round is reported apart: nothing can prefetch
it in a round that starts on a cold cache.

The compute is a CPU matmul loop on one thread (``torch.set_num_threads(1)``), standing in
for a GPU kernel: it keeps the second core free for the prefetch, as a GPU would keep the
CPUs free. For the serial alternative (fetch, then compute), the bench also times one
shard's fetch and decode alone. Writes ``bench/results/shards.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from safetensors.torch import save_file

from bench.common import save, scratch
from bench.nginx import Nginx
from bench.tools import require
from bench.zstd import make_shard
from executor import Executor
from executor.configs import transfer_config
from executor.shards import ShardCache, ShardDescriptor
from settings import Settings
from tests.support.engine import mlp_state

CODE = """
import time
torch.set_num_threads(1)
compute_s = params["compute_s"]
weights = torch.randn(256, 256) * 0.05
waits = []
started = time.perf_counter()
for step in range(steps):
    should_stop()
    asked = time.perf_counter()
    shard = get_shard(step % num_shards)
    first_row = int(shard["input_ids"][0, 0])  # touch the data, as a loader would
    waits.append(time.perf_counter() - asked)
    until = time.perf_counter() + compute_s
    while time.perf_counter() < until:
        weights = torch.tanh(weights @ weights) * 0.05
save_report({"waits": waits, "round_s": time.perf_counter() - started})
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--mb", type=int, default=32, help="decoded size of each shard")
    parser.add_argument("--rate", default="40m", help="nginx limit_rate per connection")
    parser.add_argument("--compute-s", type=float, default=1.0, help="compute per shard")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-thread", action="store_true", help="run the code without the sandbox")
    args = parser.parse_args()
    tools = require("nginx")
    with scratch() as base:
        root = base / "srv"
        root.mkdir()
        save_file(mlp_state(), str(root / "model.safetensors"))
        sizes = []
        for index in range(args.shards):
            packed, _ = make_shard(root / f"s{index}.pt.zst", args.mb, seed=index)
            sizes.append(packed)
        with Nginx(tools["nginx"], root, base / "nginx", slow_rate=args.rate) as server:
            shards = [
                {"url": server.url(f"s{i}.pt.zst", slow=True), "compression": "zstd", "size_bytes": size}
                for i, size in enumerate(sizes)
            ]
            fetch_s = serial_fetch_s(base, shards[0])
            settings = Settings(
                work_dir=str(base / "work"),
                cache_dir=str(base / "cache"),
                host_id="bench",
                url_allow=["127.0.0.1"],  # the bench's nginx is on loopback (DESIGN §11)
                # Room for three shards, each counted packed + decoded while it is decoded:
                # every round fetches every shard again.
                shard_cache_max_mb=3 * (max(sizes) // (1 << 20) + args.mb + 1),
                stage_first_shard=False,  # the first shard is fetched inside the round
            )
            executor = Executor(
                lambda _s: None, lambda _l: None, settings=settings, sandboxed=not args.in_thread
            )
            rounds = []
            try:
                executor.load(
                    server.url("model.safetensors"), shards, CODE, params={"compute_s": args.compute_s}
                )
                for round_num in range(args.rounds):
                    result = executor.run_round(steps=args.shards, round_num=round_num)
                    assert result.error is None and result.report is not None, result.error
                    rounds.append(result.report)
            finally:
                executor.shutdown()
            fetched = server.bytes_sent()
    rows = []
    for number, report in enumerate(rounds):
        waits, round_s = report["waits"], report["round_s"]
        rows.append(
            {
                "round": number,
                "round_s": round_s,
                "first_wait_s": waits[0],
                "later_waits_s": sum(waits[1:]),
                "later_wait_max_s": max(waits[1:]),
                "later_fraction": sum(waits[1:]) / round_s,
            }
        )
    fraction = statistics.median(row["later_fraction"] for row in rows)
    serial = fetch_s * (args.shards - 1) / (fetch_s * args.shards + args.compute_s * args.shards)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m bench.shards", *sys.argv[1:]]),
        "shard_packed_bytes": sizes,
        "fetch_and_decode_one_shard_s": fetch_s,
        "bytes_served_per_round": fetched / args.rounds,
        "rounds": rows,
        "median_waiting_fraction_after_first": fraction,
        "serial_waiting_fraction_after_first": serial,
    }
    save("shards", record)
    print(
        f"{args.shards} shards of {args.mb} MB ({statistics.mean(sizes) / 1e6:.1f} MB zstd) "
        f"at {args.rate}/s, "
        f"{args.compute_s:.2f} s compute each; one shard's fetch+decode alone: {fetch_s:.3f} s"
    )
    print(
        f"{'round':>5}{'round s':>9}{'1st wait s':>12}{'later waits s':>15}{'max later s':>13}{'later %':>9}"
    )
    for row in rows:
        print(
            f"{row['round']:>5}{row['round_s']:>9.2f}{row['first_wait_s']:>12.3f}{row['later_waits_s']:>15.4f}"
            f"{row['later_wait_max_s']:>13.4f}{row['later_fraction'] * 100:>9.2f}"
        )
    print(
        f"served {fetched / args.rounds / 1e6:.0f} MB per round (every shard, every round); "
        f"waiting after the first shard: {fraction * 100:.2f} % of round time (target < 1 %); "
        f"a serial fetch-then-compute loop would wait {serial * 100:.0f} %"
    )
    return 0


def serial_fetch_s(base: Path, shard: dict[str, object]) -> float:
    """One shard's fetch and decode into a fresh cache, timed alone (the serial loop's wait)."""
    cache = ShardCache(
        str(base / "serial-cache"),
        1 << 34,
        transfer_config=transfer_config(Settings(url_allow=["127.0.0.1"])),
    )
    descriptor = ShardDescriptor.parse(shard)
    started = time.perf_counter()
    cache.acquire("bench", descriptor).release()
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
