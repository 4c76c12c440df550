"""``python -m bench.download [--mb 2048] [--runs 3]``: model-file download against the usual tools.

One file of ``--mb`` MiB, served by a local nginx (``sendfile``, page cache) on loopback,
fetched to disk side by side in one run, the methods interleaved run by run:

- ``cp``: ``cp --reflink=never`` of the served file, the limit of any download here;
- ``curl``: ``curl -sS -f -o``;
- ``aria2c -x8 -s8``: eight ranged connections (``--file-allocation=falloc``, its fastest
  allocation mode on ext4, so it is not charged for writing zeros first);
- ``requests loop``: ``requests.get(stream=True)`` + ``iter_content(1 MiB)`` + ``write``;
- ``roundhouse``: :func:`executor.transfer.fetch` with its default settings (files of 64 MiB
  and more split into 8 ranged GETs when the first connection is slow, transfer._stream.PROBE_BYTES),
  the same forced to split (``parallel_below_bytes_s=0``), with one connection, and with the
  sha256 checked (against ``curl`` + ``sha256sum``).

Then, for Roundhouse alone: resume after nginx drops every connection half-way (it is
stopped and restarted), resume after the fetching process is killed with SIGKILL, and the
latency of an abort, against a full-speed server and against one trickling (read blocked).

The destination is deleted and ``sync`` run before every timed fetch, so no method pays
for another's dirty pages. Prints a table and writes ``bench/results/download.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from bench.common import add_size_and_runs, save, scratch
from bench.nginx import Nginx
from bench.tools import require
from executor import configs
from executor.errors import Stopped
from executor.fileio import MIB
from executor.transfer import FetchResult, TransferConfig, fetch
from settings import Settings


def transfer_config(**settings: Any) -> TransferConfig:
    """Settings as given, with loopback (where nginx listens) opened in the URL policy."""
    return configs.transfer_config(Settings(url_allow=["127.0.0.1"], **settings))


DEFAULTS = transfer_config()

BLOCK = 64 * MIB

CRASH_CHILD = r"""
import sys, time
sys.path.insert(0, {repo!r})
from executor import configs
from executor.transfer import fetch
from settings import Settings
url, dest, half = sys.argv[1], sys.argv[2], int(sys.argv[3])
said = False
def progress(done, total):
    global said
    if done >= half and not said:
        said = True
        print("half", flush=True)
        time.sleep(60)  # the parent kills this process here
fetch(url, dest, config=configs.transfer_config(Settings(url_allow=["127.0.0.1"])), progress=progress)
"""


def make_source(path: Path, megabytes: int) -> str:
    """Write ``megabytes`` MiB of incompressible bytes; returns their sha256."""
    digest = hashlib.sha256()
    block = os.urandom(BLOCK)
    with open(path, "wb") as file:
        written = 0
        while written < megabytes * MIB:
            chunk = block[: min(BLOCK, megabytes * MIB - written)]
            # vary each block so no layer could deduplicate them
            chunk = written.to_bytes(8, "little") + chunk[8:]
            file.write(chunk)
            digest.update(chunk)
            written += len(chunk)
    return digest.hexdigest()


def requests_loop(url: str, dest: Path) -> None:
    with requests.get(url, stream=True, timeout=60) as response, open(dest, "wb") as file:
        response.raise_for_status()
        for chunk in response.iter_content(MIB):
            file.write(chunk)


def curl_and_check(curl: str, url: str, dest: Path, sha256: str) -> None:
    run([curl, "-sS", "-f", "-o", str(dest), url])
    out = subprocess.run(["sha256sum", str(dest)], check=True, capture_output=True, text=True).stdout
    if out.split()[0] != sha256:
        raise RuntimeError("curl fetched the wrong bytes")


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def methods(
    tools: dict[str, str], source: Path, url: str, sha256: str, dest: Path
) -> dict[str, Callable[[], object]]:
    one_stream = transfer_config(parallel_connections=1)
    split = transfer_config(parallel_below_bytes_s=0)
    return {
        "cp": lambda: run(["cp", "--reflink=never", str(source), str(dest)]),
        "curl": lambda: run([tools["curl"], "-sS", "-f", "-o", str(dest), url]),
        "aria2c -x8 -s8": lambda: run(
            [
                tools["aria2c"],
                "-q",
                "-x8",
                "-s8",
                "--file-allocation=falloc",
                "--allow-overwrite=true",
                "--auto-file-renaming=false",
                "-d",
                str(dest.parent),
                "-o",
                dest.name,
                url,
            ]
        ),
        "requests loop": lambda: requests_loop(url, dest),
        "roundhouse": lambda: fetch(url, str(dest), config=DEFAULTS),
        "roundhouse, 8 forced": lambda: fetch(url, str(dest), config=split),
        "roundhouse, 1 connection": lambda: fetch(url, str(dest), config=one_stream),
        "roundhouse + sha256": lambda: fetch(url, str(dest), config=DEFAULTS, sha256=sha256),
        "curl + sha256sum": lambda: curl_and_check(tools["curl"], url, dest, sha256),
    }


def clean(dest: Path) -> None:
    for path in dest.parent.glob(dest.name + "*"):
        path.unlink()
    os.sync()


def timed(fn: Callable[[], object]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def resume_after_drop(server: Nginx, url: str, dest: Path, size: int, at_s: float) -> dict[str, float]:
    """Stop nginx ``at_s`` into a fetch (every connection dropped mid-body), restart it at once."""
    clean(dest)
    config = transfer_config(download_backoff_s=0.1)
    result: list[FetchResult] = []
    server.reset_log()
    thread = threading.Thread(target=lambda: result.append(fetch(url, str(dest), config=config)))
    started = time.monotonic()
    thread.start()
    time.sleep(at_s)
    server.stop()
    server.start()
    thread.join()
    seconds = time.monotonic() - started
    if not result or dest.stat().st_size != size:
        raise RuntimeError("resume after a dropped connection did not complete")
    sent = server.bytes_sent()
    return {"seconds": seconds, "logged_bytes_after_restart": sent}


def resume_after_crash(url: str, dest: Path, size: int) -> dict[str, float]:
    """SIGKILL a fetching process half-way; a new process resumes from the sidecar."""
    clean(dest)
    repo = str(Path(__file__).resolve().parents[1])
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD.format(repo=repo), url, str(dest), str(size // 2)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    child.kill()
    child.wait()
    if line.strip() != "half":
        raise RuntimeError("crash child did not reach half-way")
    if dest.exists():
        # Progress is reported at intervals: a small file can be whole before the first report.
        raise RuntimeError("the download finished before it could be killed half-way: use a larger --mb")
    started = time.monotonic()
    result = fetch(url, str(dest), config=DEFAULTS)
    return {
        "seconds": time.monotonic() - started,
        "resumed_bytes": result.resumed_bytes,
        "bytes": result.bytes,
    }


def abort_latency(url: str, dest: Path, after_s: float) -> float:
    """Seconds from setting the abort Event to ``fetch`` raising ``Stopped``."""
    clean(dest)
    abort = threading.Event()
    outcome: list[BaseException | None] = []
    raised_at: list[float] = []

    def target() -> None:
        try:
            fetch(url, str(dest), config=DEFAULTS, abort=abort)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        raised_at.append(time.monotonic())

    thread = threading.Thread(target=target)
    thread.start()
    time.sleep(after_s)
    set_at = time.monotonic()
    abort.set()
    thread.join(timeout=30)
    if not outcome or not isinstance(outcome[0], Stopped):
        raise RuntimeError(f"abort did not stop the fetch: {outcome}")
    if dest.exists():
        raise RuntimeError("an aborted fetch left a file under the final name")
    return raised_at[0] - set_at


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_size_and_runs(parser, mb=2048, runs=3)
    args = parser.parse_args()
    tools = require("nginx", "curl", "aria2c")
    with scratch(args.dir) as directory:
        served = directory / "www"
        served.mkdir()
        os.chmod(directory, 0o755)
        source = served / "model.bin"
        sha256 = make_source(source, args.mb)
        size = source.stat().st_size
        dest = directory / "out" / "model.bin"
        dest.parent.mkdir()
        with Nginx(tools["nginx"], served, directory / "nginx") as server:
            url = server.url("model.bin")
            candidates = methods(tools, source, url, sha256, dest)
            seconds: dict[str, list[float]] = {name: [] for name in candidates}
            run(["cat", str(source)])  # into the page cache before anything is timed
            for _ in range(args.runs):
                for name, fn in candidates.items():
                    clean(dest)
                    seconds[name].append(timed(fn))
                    if dest.stat().st_size != size:
                        raise RuntimeError(f"{name} wrote {dest.stat().st_size} bytes, expected {size}")
            clean_s = statistics.median(seconds["roundhouse"])
            drop = [resume_after_drop(server, url, dest, size, clean_s / 2) for _ in range(args.runs)]
            crash = [resume_after_crash(url, dest, size) for _ in range(args.runs)]
            # Early enough to be mid-fetch however the machine's load swings between the runs.
            early_s = min(clean_s / 3, 0.25)
            fast_abort = [abort_latency(url, dest, early_s) for _ in range(max(5, args.runs))]
            slow_abort = [
                abort_latency(server.url("model.bin", slow=True), dest, 1.0) for _ in range(max(5, args.runs))
            ]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "bytes": size,
        "runs": args.runs,
        "cpu_count": os.cpu_count(),
        "seconds": seconds,
        "resume_after_drop": drop,
        "resume_after_crash": crash,
        "abort_latency_s": {"full_speed": fast_abort, "trickling": slow_abort},
    }
    report(record, clean_s)
    save("download", record)
    return 0


def report(record: dict, clean_s: float) -> None:  # type: ignore[type-arg]
    size = record["bytes"]
    medians = {name: statistics.median(values) for name, values in record["seconds"].items()}
    cp = medians["cp"]
    best_tool = min(medians["curl"], medians["aria2c -x8 -s8"])
    print(f"download bench: {size / MIB:.0f} MiB from nginx on loopback, {record['runs']} runs, medians")
    print(f"{'what':<28}{'seconds':>9}{'MB/s':>8}{'x cp':>7}{'x best tool':>13}")
    for name, value in medians.items():
        print(
            f"{name:<28}{value:>9.3f}{size / value / 1e6:>8.0f}{value / cp:>7.2f}{value / best_tool:>13.2f}"
        )
    drop = statistics.median(d["seconds"] for d in record["resume_after_drop"])
    print(
        f"resume after every connection dropped half-way: {drop:.3f} s ({drop / clean_s:.2f}x a clean fetch)"
    )
    crash = record["resume_after_crash"]
    resumed = statistics.median(c["resumed_bytes"] / c["bytes"] for c in crash)
    crash_s = statistics.median(c["seconds"] for c in crash)
    print(f"resume after SIGKILL half-way: {resumed * 100:.0f}% kept, the rest in {crash_s:.3f} s")
    for case, values in record["abort_latency_s"].items():
        p50, worst = statistics.median(values) * 1000, max(values) * 1000
        print(f"abort latency ({case}): p50 {p50:.1f} ms, max {worst:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
