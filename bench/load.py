"""``python -m bench.load [--mb 1024] [--runs 3] [--no-worker]``: time to ready of ``load_model``
against ``curl -o`` of the same model file.

A safetensors model of ``--mb`` MiB (fp32, 16 tensors in sorted key order, as every writer of
the project lays them out) and one 32 MiB dataset shard, served by a local nginx on
loopback. Side by side in one run, the methods interleaved run by run, each after ``sync``:

- ``curl -o``: the model file alone, the reference;
- ``transfer.fetch``: the model file alone, the download floor of the executor;
- ``fetch, then file_state_hash``: the load's serial path before issue 15 (download, then
  read the file back to hash it);
- ``Executor.load`` (in-thread runner, sha256 and blake3): the model, its state hash, the
  first shard staged, the session installed;
- ``load_model ready`` (``--no-worker`` skips it): a real ``roundhouse worker`` (prefork
  child, bwrap sandbox) driven by ``RoundClient``, from the task sent to its result stored
  in Redis (polled every 5 ms): the model, the shard and the sandboxed runner's start
  (``import torch``), through Celery. A fresh tenant each run, so the shard is fetched
  each time. Two workers side by side: one as shipped, which adopts its spare runner
  (``ROUNDHOUSE_SANDBOX_SPARE``, started at boot and again after each load: the bench
  waits until the next spare is up before it times anything else, so that its start falls
  on no other method's time), and one with ``ROUNDHOUSE_SANDBOX_SPARE=false``, which starts
  its runner beside the download.

Targets (issue 15): ``Executor.load`` <= 0.9 x curl, ``load_model ready`` <= 1.0 x curl.
Writes ``bench/results/load.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import add_size_and_runs, save, scratch
from bench.nginx import Nginx
from bench.tools import require
from executor import Executor
from executor.configs import transfer_config
from executor.delta import file_state_hash
from executor.fileio import MIB
from executor.tensorfile import write_state
from executor.transfer import fetch
from settings import Settings

TENSORS = 16
SHARD_MB = 32
HOST = "bench-load"
CODE = "save_report({'ok': True})"


def make_model(path: Path, megabytes: int) -> None:
    """``megabytes`` MiB of fp32 in ``TENSORS`` tensors (random: nothing compresses or dedups)."""
    per = megabytes * MIB // 4 // TENSORS
    generator = torch.Generator().manual_seed(0)
    state = {f"layer{i:02d}.weight": torch.randn(per, generator=generator) for i in range(TENSORS)}
    with open(path, "wb") as file:
        write_state(file, state)


def make_shard(path: Path) -> dict[str, Any]:
    torch.save({"ids": torch.randint(0, 32000, (SHARD_MB * MIB // 4,), dtype=torch.int32)}, path)
    return {"name": path.name, "compression": "none", "size_bytes": path.stat().st_size}


def settings_for(base: Path, **overrides: Any) -> Settings:
    return Settings(
        work_dir=str(base / "work"),
        cache_dir=str(base / "cache"),
        url_allow=["127.0.0.1"],  # nginx listens on loopback, which the URL policy denies unless allowed
        host_id="bench-load",
        **overrides,
    )


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` took, or the seconds it measured itself (a float it returns)."""
    os.sync()
    started = time.monotonic()
    own = fn()
    took = time.monotonic() - started
    return own if isinstance(own, float) else took


class Methods:
    """The candidates, each one call that leaves nothing behind but its own state."""

    def __init__(self, base: Path, curl: str, model_url: str, shard: dict[str, Any]) -> None:
        self.base = base
        self.curl = curl
        self.model_url = model_url
        self.shard = shard
        self.dest = base / "out" / "model.safetensors"
        self.dest.parent.mkdir(exist_ok=True)
        self.config = transfer_config(settings_for(base))
        self.executor = Executor(lambda _s: None, lambda _l: None, settings=settings_for(base))
        self.runs = 0

    def clean(self) -> None:
        for path in self.dest.parent.glob("*"):
            path.unlink()

    def curl_o(self) -> None:
        subprocess.run([self.curl, "-sS", "-f", "-o", str(self.dest), self.model_url], check=True)

    def fetch_only(self) -> None:
        fetch(self.model_url, str(self.dest), config=self.config)

    def fetch_then_hash(self) -> None:
        fetch(self.model_url, str(self.dest), config=self.config)
        file_state_hash(str(self.dest))

    def load(self, scheme: str) -> Callable[[], None]:
        def run() -> None:
            self.runs += 1
            # A fresh tenant: its shard is not in the cache yet, so it is downloaded too.
            self.executor.load(self.model_url, [self.shard], CODE, tenant=f"t{self.runs}", hash_scheme=scheme)

        return run


SPARE_READY = "spare sandboxed runner ready"


def worker_load(client: Any, host: str, model_url: str, shard: dict[str, Any], tenant: str) -> float:
    from tests.support.rounds import stored_result

    started = time.monotonic()
    pending = client.load_model(host, model_url, [shard], CODE, tenant=tenant)
    result = stored_result(pending, timeout_s=120, poll_s=0.005)
    seconds = time.monotonic() - started
    assert result.get("model_hash"), result
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_size_and_runs(parser, mb=1024, runs=3)
    parser.add_argument("--no-worker", action="store_true", help="skip load_model through a real worker")
    args = parser.parse_args()
    tools = require("nginx", "curl")
    with scratch(args.dir) as base:
        www = base / "www"
        www.mkdir()
        os.chmod(base, 0o755)
        make_model(www / "model.safetensors", args.mb)
        shard = make_shard(www / "shard0.pt")
        size = (www / "model.safetensors").stat().st_size
        with Nginx(tools["nginx"], www, base / "nginx") as server:
            shard_desc = {**shard, "url": server.url(shard["name"])}
            shard_desc.pop("name")
            methods = Methods(base, tools["curl"], server.url("model.safetensors"), shard_desc)
            candidates: dict[str, Callable[[], object]] = {
                "curl -o": methods.curl_o,
                "transfer.fetch": methods.fetch_only,
                "fetch, then file_state_hash": methods.fetch_then_hash,
                "Executor.load (sha256)": methods.load("sha256"),
                "Executor.load (blake3)": methods.load("blake3"),
            }
            workers: dict[str, Any] = {}
            client = redis_server = None
            profile: list[str] = []
            if not args.no_worker:
                workers, client, redis_server = start_workers(base)
                model_url = server.url("model.safetensors")
                for host, worker in workers.items():
                    label = "spare" if host == HOST else "no spare"
                    candidates[f"load_model ready (worker, {label})"] = via_worker(
                        client, host, worker, model_url, shard_desc
                    )
            seconds: dict[str, list[float]] = {name: [] for name in candidates}
            subprocess.run(["cat", str(www / "model.safetensors")], stdout=subprocess.DEVNULL, check=True)
            try:
                for _ in range(args.runs):
                    for name, fn in candidates.items():
                        methods.clean()
                        seconds[name].append(timed(fn))
            finally:
                methods.executor.shutdown()
                for host, worker in workers.items():
                    profile += [f"{host}: {line}" for line in worker_profile(worker.log())]
                    worker.stop()
                if redis_server is not None:
                    redis_server.stop()
    return report(seconds, size, args, profile)


def worker_profile(log: str) -> list[str]:
    """Where each worker load's time went, from the worker's own log: the load pipeline's
    line (executor.session._loading) and Celery's "succeeded in" (the task on the child, from its
    start to its result) of each ``load_model``."""
    lines = []
    for line in log.splitlines():
        if "load_model: model fetched" in line:
            lines.append(line.split("load_model: ", 1)[1])
        elif "roundhouse.load_model[" in line and " succeeded in " in line:
            lines.append("task " + line.split(" succeeded in ", 1)[1].split(":", 1)[0])
    return lines


def via_worker(
    client: Any, host: str, worker: Any, model_url: str, shard: dict[str, Any]
) -> Callable[[], float]:
    runs = [0]

    def run() -> float:
        runs[0] += 1
        seconds = worker_load(client, host, model_url, shard, f"{host}-{runs[0]}")
        if host == HOST:  # the spare the load replaced starts now: not on the next method's time
            deadline = time.monotonic() + 120
            while worker.log().count(SPARE_READY) < runs[0] + 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        return seconds

    return run


def start_workers(base: Path) -> tuple[dict[str, Any], Any, Any]:
    """The worker as shipped (its spare runner on) and one without a spare, on one Redis."""
    from orchestrator.local import EmbeddedRedis, LocalWorker
    from tasks.client import RoundClient

    redis_server = EmbeddedRedis(base / "redis").start()
    env = {"ROUNDHOUSE_METRICS_PORT": "0", "ROUNDHOUSE_URL_ALLOW": "127.0.0.1"}
    workers = {
        HOST: LocalWorker(
            HOST, redis_server.url, base / "worker", env={**env, "ROUNDHOUSE_SANDBOX_SPARE": "true"}
        ),
        f"{HOST}-nospare": LocalWorker(
            f"{HOST}-nospare",
            redis_server.url,
            base / "worker-nospare",
            env={**env, "ROUNDHOUSE_SANDBOX_SPARE": "false"},
        ),
    }
    for worker in workers.values():
        worker.start()
    deadline = time.monotonic() + 120
    while SPARE_READY not in workers[HOST].log() and time.monotonic() < deadline:
        time.sleep(0.1)  # the spare of the worker's boot, before anything is timed
    client = RoundClient(Settings(broker_url=redis_server.url, host_id="bench-load-client"))
    return workers, client, redis_server


def report(seconds: dict[str, list[float]], size: int, args: argparse.Namespace, profile: list[str]) -> int:
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    curl = medians["curl -o"]
    print(f"load bench: {size / MIB:.0f} MiB safetensors ({TENSORS} tensors) + a {SHARD_MB} MiB shard,")
    print(f"nginx on loopback, {args.runs} runs interleaved, medians")
    print(f"{'what':<40}{'seconds':>9}{'MB/s':>8}{'x curl':>8}")
    for name, value in medians.items():
        print(f"{name:<40}{value:>9.3f}{size / value / 1e6:>8.0f}{value / curl:>8.2f}")
    if profile:
        print("the worker's own account of each load (the load pipeline's line, then Celery's task time):")
        for line in profile:
            print(f"  {line}")
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m bench.load", *sys.argv[1:]]),
        "model_bytes": size,
        "runs": args.runs,
        "cpu_count": os.cpu_count(),
        "seconds": seconds,
        "worker_profile": profile,
    }
    save("load", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
