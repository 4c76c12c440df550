"""``python -m bench.wan [--mb 2048] [--runs 2]``: downloads over a WAN-like link (root only).

The artifact server is an nginx in a network namespace of its own, reached through a veth
pair whose server side is shaped by ``tc tbf`` (``--rate``, 800 Mbit/s), with nginx capping
every response at ``--per-connection`` (``limit_rate 12m``: 12 MiB/s, as object stores cap a
stream). This kernel has no ``netem``, so no round-trip time is added: the link's rate and
the per-connection cap are what is modelled. Side by side, interleaved run by run:

- ``aria2c -x16 -s16``: sixteen ranged connections, the reference;
- ``transfer.fetch`` with its defaults (one connection, split into 8 when its first 0.25 s
  ran slow) and with 16 connections;
- ``Executor.load`` of the model (in-thread runner): the download, its state hash following
  the in-order segments, the session installed;
- the same ``aria2c`` and ``transfer.fetch`` through a TCP proxy in the namespace that resets
  ``--reset-percent`` (1) of the responses mid-body (RST after a random 1-16 MiB);
- shards: a round of tenant code that takes ``--shards`` 64 MiB shards, one per step, with
  ``--compute-s`` of (idle, GPU-like) compute per shard, the next shard prefetched; the waits
  after the first shard against the round's time. Three such rounds, each with a cache of its
  own: before the downloads, right after them (their writes still being flushed, as a GPU
  host's shards follow its model's download), and after an ``os.sync()``; each samples
  ``/proc/meminfo``'s Dirty and Writeback every 50 ms, so a wait can be set beside the
  write backlog it ran into.

Namespaces, veths and qdiscs are removed afterwards. Writes ``bench/results/wan.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.common import save, scratch
from bench.load import make_model
from bench.nginx import Nginx, free_port
from bench.tools import require
from executor import Executor
from executor.configs import transfer_config
from executor.fileio import MIB
from executor.tensorfile import write_state
from executor.transfer import TransferConfig, fetch
from settings import Settings

SHARD_MB = 64


def ip(*argv: str, check: bool = True) -> None:
    subprocess.run(["ip", *argv], check=check, capture_output=True, text=True, timeout=30)


@contextmanager
def shaped_link(rate: str) -> Iterator[tuple[str, str]]:
    """A namespace behind a veth pair, its egress (server -> client) shaped to ``rate``.
    Yields (namespace, its address); everything is removed afterwards."""
    tag = secrets.token_hex(3)
    name, host_if, ns_if = f"rh-wan-{tag}", f"rhw{tag}a", f"rhw{tag}b"
    net = f"10.{200 + random.randrange(50)}.{random.randrange(250)}"
    ip("netns", "add", name)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", name)
        ip("addr", "add", f"{net}.1/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        inside = ("netns", "exec", name, "ip")
        ip(*inside, "addr", "add", f"{net}.2/24", "dev", ns_if)
        ip(*inside, "link", "set", ns_if, "up")
        ip(*inside, "link", "set", "lo", "up")
        # tbf: the token bucket of one link; a burst of ~1 ms at this rate, a 50 ms queue.
        shape = (
            "qdisc",
            "add",
            "dev",
            ns_if,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "256kb",
            "latency",
            "50ms",
        )
        subprocess.run(["ip", "netns", "exec", name, "tc", *shape], check=True, capture_output=True)
        yield name, f"{net}.2"
    finally:
        ip("link", "del", host_if, check=False)
        ip("netns", "del", name, check=False)


# ------------------------------------------------------------------ the resetting proxy


def proxy_main(listen: str, port: int, target: int, percent: float, seed: int) -> None:
    """Forward ``listen:port`` to ``listen:target`` (nginx); ``percent`` of the responses (each new
    request on a connection draws) are cut by an RST after 1-16 MiB of their body."""
    rng = random.Random(seed)
    lock = threading.Lock()
    server = socket.create_server((listen, port), backlog=128)
    print("ready", flush=True)

    def pipe(client: socket.socket, upstream: socket.socket) -> None:
        # [cut after this many bytes of the response or None, bytes sent since its request]
        state: list[int | None] = [None, 0]

        def up() -> None:
            buffer = bytearray(65536)
            with contextlib.suppress(OSError):
                while (count := client.recv_into(buffer)) > 0:
                    with lock:  # a new request: does its response get cut?
                        cut = rng.random() * 100 < percent
                        state[:] = [rng.randrange(1 * MIB, 16 * MIB) if cut else None, 0]
                    upstream.sendall(memoryview(buffer)[:count])
                upstream.shutdown(socket.SHUT_WR)

        threading.Thread(target=up, daemon=True).start()
        buffer = bytearray(256 * 1024)
        try:
            while (count := upstream.recv_into(buffer)) > 0:
                client.sendall(memoryview(buffer)[:count])
                with lock:
                    state[1] = (state[1] or 0) + count
                    limit, sent = state
                if limit is not None and sent is not None and sent > limit:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    # Wake the other thread's recv first: a socket closed while another thread
                    # still reads it is released (and the RST sent) only when that read returns.
                    client.shutdown(socket.SHUT_RD)
                    print("reset", flush=True)
                    break
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    while True:
        client, _ = server.accept()
        upstream = socket.create_connection((listen, target))
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()


class Proxy:
    def __init__(self, namespace: str, address: str, target: int, percent: float) -> None:
        self.port = free_port()
        argv = ["ip", "netns", "exec", namespace, sys.executable, "-m", "bench.wan", "--proxy"]
        argv += [address, str(self.port), str(target), str(percent)]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the resetting proxy did not start")
        self.resets = 0
        threading.Thread(target=self._count, daemon=True).start()

    def _count(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.resets += line.strip() == "reset"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


# ------------------------------------------------------------------ the measured methods


def config(address: str, **settings: Any) -> TransferConfig:
    # The server's address is a private one of this host: the URL policy must be told.
    return transfer_config(Settings(url_allow=[address], download_backoff_s=0.5, **settings))


def aria2c(binary: str, url: str, dest: Path) -> None:
    argv = [binary, "-q", "-x16", "-s16", "-k1M", "--file-allocation=falloc", "--allow-overwrite=true"]
    argv += ["--auto-file-renaming=false", "--max-tries=5", "--retry-wait=1", "-d", str(dest.parent)]
    subprocess.run([*argv, "-o", dest.name, url], check=True, stdout=subprocess.DEVNULL)


def meminfo_mib(*names: str) -> dict[str, float]:
    values = {}
    with open("/proc/meminfo") as file:
        for line in file:
            key, _, rest = line.partition(":")
            if key in names:
                values[key] = int(rest.split()[0]) / 1024  # kB
    return values


@contextmanager
def backlog_sampler(period_s: float = 0.05) -> Iterator[dict[str, float]]:
    """Dirty and Writeback (MiB) at the start and at their peak while the block runs."""
    found: dict[str, float] = {}
    start = meminfo_mib("Dirty", "Writeback")
    found.update({"dirty_start_mib": start["Dirty"], "writeback_start_mib": start["Writeback"]})
    peaks = dict(start)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(period_s):
            for key, value in meminfo_mib("Dirty", "Writeback").items():
                peaks[key] = max(peaks[key], value)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        done.set()
        thread.join()
        found.update({"dirty_peak_mib": peaks["Dirty"], "writeback_peak_mib": peaks["Writeback"]})


def shard_round(
    base: Path, address: str, model_url: str, urls: list[str], compute_s: float, label: str
) -> dict[str, float]:
    """One round over the shards (a cache of its own): waits for each ``get_shard`` against the
    round's time, and the write backlog meanwhile."""
    code = f"""
import time
waits = []
started = time.monotonic()
for step in range(steps):
    t = time.monotonic()
    get_shard(step % num_shards)
    waits.append(time.monotonic() - t)
    time.sleep({compute_s})  # a GPU kernel: the CPU is free meanwhile
save_report({{"waits": waits, "round_s": time.monotonic() - started}})
"""
    settings = Settings(
        work_dir=str(base / f"shard-work-{label}"),
        cache_dir=str(base / f"shard-cache-{label}"),
        url_allow=[address],
        shard_cache_max_mb=SHARD_MB * 4 + 16,
        stage_first_shard=False,
    )
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    try:
        descriptors = [{"url": url, "compression": "none"} for url in urls]
        ex.load(model_url, descriptors, code)
        with backlog_sampler() as backlog:
            result = ex.run_round(steps=len(urls), mode="inference")
        report = result.report or {}
        if "waits" not in report:
            raise RuntimeError(f"the shard round failed: {result.to_json()}")
        waits = report["waits"]
        return {
            "first_wait_s": waits[0],
            "later_waits_s": sum(waits[1:]),
            "round_s": report["round_s"],
            "waits_s": waits,
            **backlog,
        }
    finally:
        ex.shutdown()


def timed(fn: Callable[[], object]) -> float:
    os.sync()
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rate", default="800mbit")
    parser.add_argument("--per-connection", default="12m")
    parser.add_argument("--reset-percent", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--compute-s", type=float, default=1.0)
    parser.add_argument("--proxy", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proxy:
        listen, port, target, percent = args.proxy
        proxy_main(listen, int(port), int(target), float(percent), seed=15)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("bench.wan builds a network namespace: run it as root")
    tools = require("nginx", "aria2c")
    with scratch() as base, shaped_link(args.rate) as (namespace, address):
        www = base / "www"
        www.mkdir()
        os.chmod(base, 0o755)
        make_model(www / "model.safetensors", args.mb)
        with open(www / "tiny.safetensors", "wb") as file:
            write_state(file, {"w": torch.zeros(4)})
        for i in range(args.shards):
            ids = torch.randint(0, 32000, (SHARD_MB * MIB // 4,), dtype=torch.int32)
            torch.save({"ids": ids}, www / f"shard{i}.pt")
        size = (www / "model.safetensors").stat().st_size
        nginx = Nginx(
            tools["nginx"],
            www,
            base / "nginx",
            address=address,
            rate=args.per_connection,
            prefix=("ip", "netns", "exec", namespace),
        )
        with nginx:
            proxy = Proxy(namespace, address, nginx.port, args.reset_percent)
            try:
                record = measure(args, tools, base, address, nginx, proxy, size)
            finally:
                proxy.stop()
    save("wan", record)
    report(record, args)
    return 0


def measure(
    args: argparse.Namespace,
    tools: dict[str, str],
    base: Path,
    address: str,
    nginx: Nginx,
    proxy: Proxy,
    size: int,
) -> dict[str, Any]:
    url = nginx.url("model.safetensors")
    cut_url = f"http://{address}:{proxy.port}/model.safetensors"
    dest = base / "out" / "model.safetensors"
    dest.parent.mkdir()
    defaults, sixteen = config(address), config(address, parallel_connections=16)
    load_settings = Settings(work_dir=str(base / "work"), cache_dir=str(base / "cache"), url_allow=[address])
    executor = Executor(lambda _s: None, lambda _l: None, settings=load_settings)
    methods: dict[str, Callable[[], object]] = {
        "aria2c -x16 -s16": lambda: aria2c(tools["aria2c"], url, dest),
        "transfer.fetch (defaults: 8)": lambda: fetch(url, str(dest), config=defaults),
        "transfer.fetch, 16 connections": lambda: fetch(url, str(dest), config=sixteen),
        "Executor.load (hash followed)": lambda: executor.load(url, [], "pass"),
        f"aria2c -x16 -s16, {args.reset_percent:g}% reset": lambda: aria2c(tools["aria2c"], cut_url, dest),
        f"transfer.fetch, {args.reset_percent:g}% reset": lambda: fetch(cut_url, str(dest), config=defaults),
    }
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    shard_urls = [nginx.url(f"shard{i}.pt") for i in range(args.shards)]

    def shards(label: str) -> dict[str, float]:
        return shard_round(base, address, nginx.url("tiny.safetensors"), shard_urls, args.compute_s, label)

    try:
        os.sync()
        rounds = {"before the downloads": shards("before")}
        for _ in range(args.runs):
            for name, fn in methods.items():
                for path in dest.parent.glob("*"):
                    path.unlink()
                seconds[name].append(timed(fn))
        rounds["right after the downloads"] = shards("after")  # their last writes still being flushed
        os.sync()
        rounds["after os.sync()"] = shards("synced")
    finally:
        executor.shutdown()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m bench.wan", *sys.argv[1:]]),
        "bytes": size,
        "link": {"rate": args.rate, "per_connection": args.per_connection, "rtt": "none (no netem here)"},
        "runs": args.runs,
        "seconds": seconds,
        "resets": proxy.resets,
        "shards": {"count": args.shards, "mb": SHARD_MB, "compute_s": args.compute_s, "rounds": rounds},
    }


def report(record: dict[str, Any], args: argparse.Namespace) -> None:
    size = record["bytes"]
    link_bytes_s = _rate_bytes(args.rate)
    medians = {name: statistics.median(v) for name, v in record["seconds"].items()}
    aria = medians["aria2c -x16 -s16"]
    print(f"wan bench: {size / MIB:.0f} MiB over tbf {args.rate}, nginx limit_rate {args.per_connection}")
    print(f"per response, {record['runs']} runs interleaved, medians; {record['resets']} responses reset")
    print(f"{'what':<34}{'seconds':>9}{'MB/s':>8}{'x link':>8}{'x aria2c':>10}")
    for name, value in medians.items():
        rate = size / value
        print(f"{name:<34}{value:>9.2f}{rate / 1e6:>8.1f}{rate / link_bytes_s:>8.2f}{value / aria:>10.2f}")
    shards = record["shards"]
    print(f"shards: {shards['count']} x {shards['mb']} MiB, {shards['compute_s']} s compute each")
    columns = f"{'first s':>9}{'later s':>9}{'later %':>9}{'Dirty MiB start/peak':>22}{'Writeback':>12}"
    print(f"{'round':<28}{columns}")
    for name, one in shards["rounds"].items():
        later = one["later_waits_s"] / one["round_s"] * 100
        dirty = f"{one['dirty_start_mib']:.0f}/{one['dirty_peak_mib']:.0f}"
        writeback = f"{one['writeback_start_mib']:.0f}/{one['writeback_peak_mib']:.0f}"
        print(
            f"{name:<28}{one['first_wait_s']:>9.3f}{one['later_waits_s']:>9.3f}{later:>9.2f}"
            f"{dirty:>22}{writeback:>12}"
        )


def _rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    return float(rate)


if __name__ == "__main__":
    sys.exit(main())
