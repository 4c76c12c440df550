"""``python -m bench.first_step [--mb 1024] [--runs 2]``: load-to-first-step through a real worker.

From ``load_model`` sent (``RoundClient``, a ``run_round`` queued right behind it) to the
tenant's first ``emit_stats``, which it sends once its first step ran on the device: the model
downloaded, hashed and installed, the first shard staged, the sandboxed runner started
(``import torch``, the CUDA context), the model read and moved to the device, one step done.
Against the floor a user could get by hand, run alternately: ``curl -o`` of the same file,
then a fresh interpreter that loads it to the device (``safetensors.torch.load_file``) and
runs the same step. On a GPU host (``scripts/gpu_check.sh``) the device is ``cuda``; it runs
on a CPU-only host too (device ``cpu``), which is how it is tested. The tenant's clock is the
host's (the sandbox shares it). Appends a row to ``$ROUNDHOUSE_GPU_RESULTS`` and writes
``bench/results/first_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import save, scratch
from bench.load import make_model, make_shard
from bench.nginx import Nginx
from bench.tools import require, which
from tests.support.http_server import FaultServer

HOST = "bench-first-step"
# One "step": every tensor on the device, touched once, the device synchronised.
STEP = """
import time, torch
state = {k: v.to(device) for k, v in state.items()}
total = sum(float(v.float().mul_(1.0).sum()) for v in state.values())
if device.startswith("cuda"):
    torch.cuda.synchronize()
"""
TENANT = f"""
state = load_model(model_path)
{STEP}
emit_stats({{"step": 0, "t": time.time(), "total": total}})
save_report({{"ok": True}})
"""
BARE = f"""
import sys, time
from safetensors.torch import load_file
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
state = load_file(sys.argv[1], device=device)
{STEP}
print(time.time())
"""


def worker_first_step(client: Any, model_url: str, shard: dict[str, Any], tenant: str) -> float:
    from tests.support.rounds import event_seq

    since = event_seq(client, HOST)
    first: list[float] = []
    ready = threading.Event()

    def listen() -> None:
        stream = client.events(HOST, since=since, idle_timeout_s=120)
        ready.set()
        for event in stream:
            if event.type == "stats" and "t" in event.data:
                first.append(float(event.data["t"]))
                return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    ready.wait(10)
    sent = time.time()
    loaded = client.load_model(HOST, model_url, [shard], TENANT, tenant=tenant)
    round_ = client.run_round(HOST, steps=1)
    loaded.get(timeout=300)
    result = round_.get(timeout=300)
    assert result["status"] == "completed", result
    listener.join(30)
    assert first, "the tenant's first emit_stats never arrived"
    return first[0] - sent


def by_hand(curl: str, url: str, dest: Path) -> float:
    started = time.time()
    subprocess.run([curl, "-sS", "-f", "-o", str(dest), url], check=True)
    out = subprocess.run([sys.executable, "-c", BARE, str(dest)], check=True, capture_output=True, text=True)
    done = float(out.stdout.strip().splitlines()[-1])
    dest.unlink()
    return done - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    # The GPU host reaches no package mirror: without nginx there, the tests' file server.
    tools = require("curl")
    nginx = which("nginx")
    from orchestrator.local import EmbeddedRedis, LocalWorker
    from settings import Settings
    from tasks.client import RoundClient

    with scratch() as base:
        www = base / "www"
        www.mkdir()
        os.chmod(base, 0o755)
        make_model(www / "model.safetensors", args.mb)
        shard = make_shard(www / "shard0.pt")
        redis_server = EmbeddedRedis(base / "redis").start()
        env = {"ROUNDHOUSE_METRICS_PORT": "0", "ROUNDHOUSE_URL_ALLOW": "127.0.0.1"}
        worker = LocalWorker(HOST, redis_server.url, base / "worker", env=env)
        seconds: dict[str, list[float]] = {
            "load_model -> first emit_stats": [],
            "curl + bare load + step": [],
        }
        try:
            worker.start()
            client = RoundClient(Settings(broker_url=redis_server.url, host_id="bench-first-step-client"))
            serving = Nginx(nginx, www, base / "nginx") if nginx else FaultServer(www)
            with serving as server:
                url = server.url("model.safetensors")
                desc = {
                    "url": server.url(shard["name"]),
                    "compression": "none",
                    "size_bytes": shard["size_bytes"],
                }
                for run in range(args.runs):
                    os.sync()
                    seconds["load_model -> first emit_stats"].append(
                        worker_first_step(client, url, desc, f"t{run}")
                    )
                    os.sync()
                    seconds["curl + bare load + step"].append(
                        by_hand(tools["curl"], url, base / "by-hand.safetensors")
                    )
        finally:
            worker.stop()
            redis_server.stop()
    return report(seconds, args)


def report(seconds: dict[str, list[float]], args: argparse.Namespace) -> int:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    ours, floor = medians["load_model -> first emit_stats"], medians["curl + bare load + step"]
    print(f"load to first step: {args.mb} MiB fp32 safetensors, device {device}, {args.runs} runs, medians")
    for name, value in medians.items():
        print(f"{name:<34}{value:>9.3f} s")
    print(f"ratio {ours / floor:.2f} x the by-hand floor")
    row = {
        "check": "load_model -> first step vs curl + bare load",
        "result": "measured",
        "worker_s": round(ours, 3),
        "by_hand_s": round(floor, 3),
        "ratio": round(ours / floor, 3),
        "mb": args.mb,
    }
    rows = Path(os.environ.get("ROUNDHOUSE_GPU_RESULTS", "var/gpu/results.jsonl"))
    rows.parent.mkdir(parents=True, exist_ok=True)
    with rows.open("a") as out:
        out.write(json.dumps(row) + "\n")
    save("first_step", {"date": time.strftime("%Y-%m-%d"), "device": device, "seconds": seconds, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
