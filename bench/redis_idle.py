"""What idle workers leave in Redis: 16 real ``celery worker`` processes idling for 10 minutes,
with Celery's gossip and mingle on (plain ``celery worker``) and off (``roundhouse worker``).

``python -m bench.redis_idle [--workers 16] [--minutes 10]``

For each configuration: a fresh Redis (the embedded one, loopback), N workers started at
once (``ROUNDHOUSE_SANDBOX=off``, no metrics port, default heartbeats), then Redis's key
count, ``used_memory`` and the keys by kind once every worker is ready and again after the
idle minutes. Workers run unsigned here (loopback; the signed plane adds keys only per
message: nonces, which expire), so that mingle runs as in any Celery deployment (a signed
worker has no key to say hello with). What grows is the point: a key count that rises with
idle time grows Redis without bound.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import save, scratch
from orchestrator.local import EmbeddedRedis, LocalWorker

CONFIGS = {
    "gossip+mingle on (celery worker)": False,
    "gossip+mingle off (roundhouse worker)": True,
}
ENV = {
    "ROUNDHOUSE_SANDBOX": "off",
    "ROUNDHOUSE_METRICS_PORT": "0",
    "ROUNDHOUSE_TRUSTED_CERTS": "",
    "ROUNDHOUSE_SIGNING_KEY": "",
    "ROUNDHOUSE_SIGNING_CERT": "",
    "ROUNDHOUSE_KEYS_DIR": "",
}


class PlainCeleryWorker(LocalWorker):
    """``celery -A tasks worker`` as Celery ships it: gossip and mingle on."""

    def start(self, timeout_s: float = 600) -> LocalWorker:
        import subprocess

        argv = [
            sys.executable, "-m", "celery", "-A", "tasks", "worker", "-P", "prefork", "-c", "1", "-E",
            "-Q", f"roundhouse.{self.host_id}", "-n", f"{self.host_id}@%h", "--loglevel=INFO",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, cwd=Path(__file__).resolve().parents[1], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.wait_ready(timeout_s)
        return self


def kinds(client: Any) -> dict[str, int]:
    """Keys by kind: the name with host ids, uuids and numbers folded."""
    found: Counter[str] = Counter()
    for key in client.scan_iter(count=1000):
        name = key.decode(errors="replace")
        name = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<uuid>", name)
        name = re.sub(r"idle-\d+", "<host>", name)
        found[name] += 1
    return dict(found)


def snapshot(client: Any) -> dict[str, Any]:
    memory = client.info("memory")
    return {"keys": int(client.dbsize()), "used_memory": int(memory["used_memory"]), "kinds": kinds(client)}


def run(config: str, roundhouse: bool, workers: int, minutes: float, base: Path) -> dict[str, Any]:
    redis = EmbeddedRedis(base / "redis").start()
    kind = LocalWorker if roundhouse else PlainCeleryWorker
    started = [kind(f"idle-{i}", redis.url, base / f"w{i}", env=ENV) for i in range(workers)]
    if roundhouse:
        for worker in started:  # the flags roundhouse worker adds itself, nothing more
            worker.celery_args = ("--loglevel=INFO",)
    try:
        threads = [threading.Thread(target=w.start, kwargs={"timeout_s": 900}) for w in started]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for worker in started:
            worker.wait_ready(300)
        print(f"{config}: {workers} workers ready in {time.monotonic() - began:.0f} s", flush=True)
        client = redis.client()
        before = snapshot(client)
        time.sleep(minutes * 60)
        after = snapshot(client)
    finally:
        for worker in started:
            worker.stop()
        redis.stop()
    return {"config": config, "workers": workers, "minutes": minutes, "before": before, "after": after}


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(prog="python -m bench.redis_idle", description=__doc__.split("\n\n")[0])
    options.add_argument("--workers", type=int, default=16)
    options.add_argument("--minutes", type=float, default=10.0)
    args = options.parse_args(argv)
    records = []
    for config, roundhouse in CONFIGS.items():
        with scratch() as base:
            records.append(run(config, roundhouse, args.workers, args.minutes, base))
    print(f"\n{args.workers} idle workers, {args.minutes:g} minutes")
    header = ("configuration", "keys before", "keys after", "used_memory before", "after")
    print(f"{header[0]:40} {header[1]:>11} {header[2]:>10} {header[3]:>18} {header[4]:>10}")
    for r in records:
        b, a = r["before"], r["after"]
        print(
            f"{r['config']:40} {b['keys']:>11} {a['keys']:>10} "
            f"{b['used_memory'] / 1e6:>15.2f} MB {a['used_memory'] / 1e6:>7.2f} MB"
        )
    for r in records:
        grown = {k: (r["before"]["kinds"].get(k, 0), n) for k, n in r["after"]["kinds"].items()}
        print(f"  {r['config']}: " + ", ".join(f"{k} {b}->{n}" for k, (b, n) in sorted(grown.items())))
    path = save("redis_idle", {"workers": args.workers, "minutes": args.minutes, "runs": records})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
