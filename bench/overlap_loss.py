"""``python -m bench.overlap_loss [--rounds 8] [--steps 20] [--workers 2]``: does overlap converge?

Overlapped rounds (docs/OVERLAP.md) train round k+1 from the global model one round old plus the
host's own progress; this bench checks what that costs in loss. The same DiLoCo session, once
sequential and once overlapped, through the real stack: ``--workers`` local ``roundhouse worker``
processes (prefork Celery, sandboxed where bubblewrap works) on an embedded Redis, the reference
orchestrator, a real :class:`orchestrator.artifacts.ArtifactServer` on loopback. Two models of
``bench.quant_models``: the demo's MLP and a tiny GPT-2 built from a config. The loss is the
bench's own evaluation of the global model after each round (the same data for both modes).

Prints the table (final loss per mode, their ratio against the 2 % target, wall time) and
writes ``bench/results/overlap_loss.json`` and ``bench/results/overlap_loss.png`` (the curves).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, save, scratch
from bench.quant_models import MODELS, BenchModel
from executor.sandbox import bwrap_works
from orchestrator.artifacts import ArtifactServer
from orchestrator.diloco import Orchestrator, Session
from orchestrator.local import EmbeddedRedis, LocalWorker, signed_env
from settings import Settings
from tasks.client import RoundClient
from tasks.trust.keys import ensure_keys
from tests.support.worker import TEST_ENV

TARGET = 0.02  # overlapped's final loss within 2 % of sequential's (issue 28)


def session_losses(
    key: str,
    model: BenchModel,
    client: RoundClient,
    hosts: list[str],
    root: Path,
    args: argparse.Namespace,
    overlap: bool,
) -> dict[str, Any]:
    """One session of ``args.rounds`` rounds: the global model's loss after each, and the wall time."""
    with ArtifactServer(root) as store:
        shards = []
        for name, path in model.shards:
            store.publish(name, path)
            shards.append({"name": name, "compression": "zstd", "size_bytes": path.stat().st_size})
        session = Session(
            hosts, shards, model.code, params=model.params, steps=args.steps, batch_size=model.batch_size,
            tenant=f"loss-{key}-{int(overlap)}", overlap=overlap,
        )  # fmt: skip
        losses: list[float] = []
        orchestrator = Orchestrator(
            client, store, model.state, session,
            on_summary=lambda _summary: losses.append(model.evaluate(orchestrator.global_state)),
        )  # fmt: skip
        started = time.monotonic()
        try:
            orchestrator.load()
            history = orchestrator.run(args.rounds)
        finally:
            orchestrator.close()
            for host in hosts:
                client.reset(host).get(timeout=120)
        return {
            "losses": losses,
            "initial": model.evaluate(model.state),
            "seconds": time.monotonic() - started,
            "included": [len(s.included) for s in history],
        }


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(records), figsize=(5 * len(records), 4))
    for axis, record in zip([axes] if len(records) == 1 else axes, records, strict=True):
        for mode in ("sequential", "overlapped"):
            losses = record[mode]["losses"]
            axis.plot(range(len(losses)), losses, marker="o", label=mode)
        axis.set_title(f"{record['model']}: global model's loss per round")
        axis.set_xlabel("round")
        axis.set_ylabel("loss")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overlap_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--models", default="mlp,gpt2")
    p.add_argument("--sandbox", default="bwrap" if bwrap_works() else "off")
    args = p.parse_args(argv)
    records = []
    with scratch() as base:
        keys = ensure_keys(str(base / "keys"))
        redis = EmbeddedRedis(base / "redis").start()
        env = {
            **TEST_ENV,
            **signed_env(keys),
            "ROUNDHOUSE_URL_ALLOW": "127.0.0.1",
            "ROUNDHOUSE_SANDBOX": args.sandbox,
        }
        workers = [
            LocalWorker(f"ol{i}", redis.url, base / f"ol{i}", cache_dir=base / "cache", env=env)
            for i in range(args.workers)
        ]
        try:
            for worker in workers:
                worker.start(timeout_s=300)
            client = RoundClient(
                Settings(
                    broker_url=redis.url, host_id="overlap-loss",
                    signing_key=str(keys.signing_key()), signing_cert=str(keys.signing_cert()),
                )
            )  # fmt: skip
            hosts = [w.host_id for w in workers]
            for name in args.models.split(","):
                (base / f"data-{name}").mkdir()
                model = MODELS[name](base / f"data-{name}")
                record: dict[str, Any] = {"model": name}
                for mode in ("sequential", "overlapped"):
                    root = base / f"store-{name}-{mode}"
                    record[mode] = session_losses(
                        name, model, client, hosts, root, args, mode == "overlapped"
                    )
                seq, ovl = record["sequential"]["losses"][-1], record["overlapped"]["losses"][-1]
                record["ratio"] = ovl / seq
                records.append(record)
                print(
                    f"{name}: sequential {seq:.4f}, overlapped {ovl:.4f}, ratio {ovl / seq:.3f}", flush=True
                )
        finally:
            for worker in workers:
                worker.stop(timeout_s=10)
            redis.stop()
    lines = [
        "| model | initial loss | sequential final | overlapped final | overlapped / sequential | "
        "within 2 % | sequential s | overlapped s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        seq, ovl = r["sequential"], r["overlapped"]
        lines.append(
            f"| {r['model']} | {seq['initial']:.4f} | {seq['losses'][-1]:.4f} | {ovl['losses'][-1]:.4f} | "
            f"{r['ratio']:.3f} | {'yes' if r['ratio'] <= 1 + TARGET else 'no'} | "
            f"{seq['seconds']:.1f} | {ovl['seconds']:.1f} |"
        )
    machine = (
        f"{os.cpu_count()} cores, CPU only; {args.workers} workers, {args.rounds} rounds x {args.steps} steps"
    )
    print(f"\n{machine}\n" + "\n".join(lines))
    save("overlap_loss", {"machine": machine, "args": vars(args), "records": records})
    plot(records, RESULTS / "overlap_loss.png")
    print(f"wrote {RESULTS / 'overlap_loss.json'} and {RESULTS / 'overlap_loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
