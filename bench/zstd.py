"""``python -m bench.zstd [--mb 512] [--runs 5]``: shard decode against ``zstd -d -T1``.

A token shard like a tenant would ship (``torch.save`` of int32 token ids drawn from a
Zipf-like distribution over a 32k vocabulary, packed with ``zstd -3``) is decoded, side by
side in one run, by:

- ``zstd -d -T1 -f packed -o out`` (the CLI, one thread: the reference);
- the shard cache's decode step (``ShardCache._decompress``: probe, reservation, streamed
  decode through one reused 1 MiB buffer, size check, atomic rename);
- ``ShardCache.acquire`` of the same shard from a local path (copy into the cache, decode,
  ledger, pin): what a round pays on a miss when the bytes are already on the host.

Medians of ``--runs``; the target is decode speed at 70 % or more of the CLI's.
Writes ``bench/results/zstd.json``.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zstandard

from bench.common import add_size_and_runs, save, scratch
from bench.tools import require
from executor.configs import transfer_config
from executor.shards import ShardCache, ShardDescriptor
from settings import Settings


def make_shard(path: Path, megabytes: int, seed: int = 11) -> tuple[int, int]:
    """A packed token shard of about ``megabytes`` decoded; returns (packed, decoded) sizes."""
    count = megabytes * (1 << 20) // 4
    generator = torch.Generator().manual_seed(seed)
    # Zipf-like ids: frequent tokens dominate, as in text, so zstd packs about 1.6-2x.
    ranks = torch.rand(count, generator=generator).pow(3.0)
    tokens = (ranks * 32_000).to(torch.int32)
    buffer = io.BytesIO()
    torch.save({"input_ids": tokens.view(-1, 2048)}, buffer)
    raw = buffer.getvalue()
    packed = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    path.write_bytes(packed)
    return len(packed), len(raw)


def timed(action: Callable[[], Callable[[], None]]) -> float:
    """Seconds of ``action``; the clean-up it returns (deleting its output) runs untimed, and
    the next method waits a moment: freeing 500 MB of page cache and blocks is the kernel's
    work, and it lands on whichever method runs next."""
    started = time.perf_counter()
    clean_up = action()
    seconds = time.perf_counter() - started
    clean_up()
    time.sleep(0.3)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_size_and_runs(parser, mb=512, runs=5, mb_help="decoded shard size in MiB")
    args = parser.parse_args()
    tools = require("zstd")
    with scratch(args.dir) as base:
        packed = base / "shard.pt.zst"
        packed_size, decoded_size = make_shard(packed, args.mb)
        out = base / "cli.out"
        # The shard is a local file: file:// under a root the bench names (DESIGN §11).
        config = transfer_config(Settings(file_roots=[str(base)]))
        cache = ShardCache(str(base / "cache"), 4 * (decoded_size + packed_size), transfer_config=config)
        descriptor = ShardDescriptor.parse(
            {"url": packed.as_uri(), "compression": "zstd", "size_bytes": packed_size}
        )

        def cli() -> Callable[[], None]:
            subprocess.run([tools["zstd"], "-q", "-d", "-T1", "-f", str(packed), "-o", str(out)], check=True)
            return out.unlink

        def decode() -> Callable[[], None]:
            # The cache's decode step alone, on the packed file already on disk, with its
            # reservation taken as _download takes it: probe, reserve, decode, check, rename.
            target = base / "decoded.entry"
            reservation = cache.ledger.reserve("bench", "decode", packed_size)
            try:
                cache._decompress(str(packed), str(target), reservation, packed_size, 0, None)
            finally:
                cache.ledger.release(reservation)
            return target.unlink

        def acquire() -> Callable[[], None]:
            pin = cache.acquire("bench", descriptor)
            pin.release()
            return lambda: cache.invalidate("bench", descriptor)

        def copy() -> Callable[[], None]:
            shutil.copyfile(packed, base / "copy.zst")
            return (base / "copy.zst").unlink

        methods: dict[str, Callable[[], Callable[[], None]]] = {
            "zstd -d -T1 (CLI)": cli,
            "roundhouse decode step": decode,
            "roundhouse acquire (copy+decode)": acquire,
            "copy of the packed file": copy,
        }
        for method in methods.values():  # warm the page cache and the code paths
            timed(method)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.runs):
            for name, method in methods.items():  # interleaved, so drift hits each alike
                times[name].append(timed(method))
    medians = {name: statistics.median(values) for name, values in times.items()}
    cli_s = medians["zstd -d -T1 (CLI)"]
    ratio = cli_s / medians["roundhouse decode step"]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python -m bench.zstd --mb {args.mb} --runs {args.runs}",
        "packed_bytes": packed_size,
        "decoded_bytes": decoded_size,
        "seconds": times,
        "median_s": medians,
        "decode_speed_vs_cli": ratio,
    }
    save("zstd", record)
    print(f"shard: {decoded_size / 1e6:.0f} MB decoded from {packed_size / 1e6:.0f} MB zstd-3")
    print(f"{'what':<36}{'seconds':>9}{'MB/s out':>10}{'x CLI':>7}")
    for name, value in medians.items():
        print(f"{name:<36}{value:>9.3f}{decoded_size / value / 1e6:>10.0f}{value / cli_s:>7.2f}")
    print(f"decode speed: {ratio * 100:.0f} % of zstd -d -T1 (target >= 70 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
