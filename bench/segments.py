"""``python -m bench.segments [--mb 1024] [--runs 5] [--sizes 32,128] [--sha256] [--dir /dev/shm]``:
the segment size of a split download, side by side.

One nginx on loopback, ``transfer.fetch`` forced to split (``parallel_below_bytes_s=0``, its
8 connections), ``TransferConfig.segment_max_bytes`` set to each size in turn, the sizes
alternated run by run in one process; ``--sha256`` checks the file's hash as the load does
(the hash follows the gapless front). ``--dir /dev/shm`` takes the disk out. Prints the medians and writes
``bench/results/segments.json``. The figures behind its default (docs/BENCHMARKS.md,
"Quiet reruns").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

from bench.common import add_size_and_runs, save, scratch
from bench.download import clean, make_source, transfer_config
from bench.nginx import Nginx
from bench.tools import require
from executor.fileio import MIB
from executor.transfer import fetch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_size_and_runs(parser, mb=1024, runs=5)
    parser.add_argument("--sizes", default="32,128", help="segment sizes in MiB, comma-separated")
    parser.add_argument("--sha256", action="store_true", help="check the file's sha256 as it lands")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    tools = require("nginx")
    split = transfer_config(parallel_below_bytes_s=0)
    seconds: dict[str, list[float]] = {str(size): [] for size in sizes}
    with scratch(args.dir) as directory:
        served = directory / "www"
        served.mkdir()
        os.chmod(directory, 0o755)
        digest = make_source(served / "model.bin", args.mb)
        dest = directory / "out" / "model.bin"
        dest.parent.mkdir()
        with Nginx(tools["nginx"], served, directory / "nginx") as server:
            url = server.url("model.bin")
            for _ in range(args.runs):
                for size in sizes:
                    config = dataclasses.replace(split, segment_max_bytes=size * MIB)
                    clean(dest)
                    started = time.monotonic()
                    fetch(url, str(dest), config=config, sha256=digest if args.sha256 else None)
                    seconds[str(size)].append(time.monotonic() - started)
    for size, runs in seconds.items():
        each = " ".join(f"{s:.3f}" for s in runs)
        print(f"{size:>5} MiB segments: median {statistics.median(runs):.3f} s  ({each})")
    save(
        "segments",
        {"date": time.strftime("%Y-%m-%d"), "mb": args.mb, "sha256": args.sha256, "seconds": seconds},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
