"""``python -m bench.sharded``: star against sharded aggregation, side by side (issue 29; root).

The cluster of ``bench.goodput`` (N real workers, each in a network namespace of its own whose
link to the host side is shaped both ways by ``tc tbf`` at ``--rate``; Redis and the artifact
server on the host side), a model of ``--mb`` MB of fp32, a tenant that **simulates**
``--compute-s`` of compute (bench.goodput's: its weights nudged, the rest asleep), and the
reference orchestrator in this process, ``--rounds`` rounds in each mode on the same cluster:

- ``star``: every host PUTs its delta, the orchestrator GETs and folds them all, takes the
  outer step and publishes the sync, every host applies it;
- ``sharded`` (docs/SHARDED.md): every host PUTs its delta as N shards, host j reduces shard j
  of every host, every host applies the N sync shards.

Per steady round (all but the first), medians:

- **aggregation**: from the round's results (the last delta PUT done) to every host holding
  the new model: the round's phases after ``wait`` (star: fold, outer step, sync build,
  publish, apply; sharded: reduce, apply), against the time one host's link takes to move
  2 × M (M: one host's encoded delta), the issue's bound being 1.25 × that at 8 hosts;
- **per host, up and down**: the bytes each host PUT and GOT at the store in the round
  (the server's own account, by client address), against M + M/N up and 2M down;
- **the orchestrator's tensor bytes**: what it fetched from the store (its fold's GETs are
  local copies: counted at ``store.fetch``), and the sync and model it published.

This is 2 cores for N workers and the orchestrator: every host's CPU work (hashing, decoding,
the apply) shares them, which a fleet does not. Writes ``bench/results/sharded.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import save, scratch
from bench.goodput import SLEEP_TENANT, Cluster, cluster, model_of
from executor.sandbox import bwrap_works
from orchestrator.artifacts import ArtifactServer
from orchestrator.diloco import Orchestrator, Session
from orchestrator.records import RoundSummary
from tests.support import netns

AFTER_WAIT = ("fold", "reduce", "outer", "sync_build", "publish", "apply")
RATES = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def bits_per_s(rate: str) -> float:
    for suffix, scale in RATES.items():
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(f"a link rate like 1gbit or 200mbit, not {rate!r}")


def run_mode(
    made: Cluster, net: netns.Network, root: Path, args: argparse.Namespace, mode: str
) -> dict[str, Any]:
    with ArtifactServer(root, host=net.host_address) as store:
        fetched: list[int] = []
        real_fetch = store.fetch

        def fetch(name: str, dest: str | os.PathLike[str]) -> None:
            real_fetch(name, dest)
            fetched.append(os.path.getsize(dest))

        store.fetch = fetch  # type: ignore[method-assign]
        session = Session(
            made.hosts, [], SLEEP_TENANT, params={"compute_s": args.compute_s, "seed": args.mb},
            steps=1, tenant=f"sharded-bench-{mode}", sync_timeout_s=1800, round_deadline_s=1800,
            aggregation=mode,
        )  # fmt: skip
        orchestrator = Orchestrator(made.client, store, model_of(args.mb), session)
        marks: list[tuple[int, int, int]] = []  # per round: where the traffic log and fetches stood
        try:
            orchestrator.load()
            for round_num in range(args.rounds):
                marks.append((round_num, len(store.traffic), len(fetched)))
                orchestrator.run(round_num + 1)
            marks.append((args.rounds, len(store.traffic), len(fetched)))
            return measure(orchestrator.history, store, fetched, marks, made, args)
        finally:
            orchestrator.close()
            for host in made.hosts:
                made.client.reset(host).get(timeout=300)


def measure(
    history: list[RoundSummary],
    store: ArtifactServer,
    fetched: list[int],
    marks: list[tuple[int, int, int]],
    made: Cluster,
    args: argparse.Namespace,
) -> dict[str, Any]:
    steady = range(1, len(history)) if len(history) > 1 else range(len(history))
    hosts = made.hosts
    rounds = []
    for r in steady:
        start, end = marks[r], marks[r + 1]
        log = store.traffic[start[1] : end[1]]
        up = {h: sum(n for m, _p, a, n in log if m == "PUT" and a == made.addresses[h]) for h in hosts}
        down = {h: sum(n for m, _p, a, n in log if m == "GET" and a == made.addresses[h]) for h in hosts}
        summary = history[r]
        delta = statistics.mean(up.values())  # what a host PUT is its delta (+ its reduce's outputs)
        rounds.append(
            {
                "round_s": summary.seconds,
                "aggregation_s": sum(summary.phases.get(p, 0.0) for p in AFTER_WAIT),
                "phases": summary.phases,
                "up": up,
                "down": down,
                "orchestrator_fetched": sum(fetched[start[2] : end[2]]),
                "mean_up": delta,
            }
        )
    return {
        "rounds": rounds,
        "aggregation_s": statistics.median(r["aggregation_s"] for r in rounds),
        "round_s": statistics.median(r["round_s"] for r in rounds),
        "up_per_host": statistics.median(statistics.mean(r["up"].values()) for r in rounds),
        "down_per_host": statistics.median(statistics.mean(r["down"].values()) for r in rounds),
        "orchestrator_fetched": statistics.median(r["orchestrator_fetched"] for r in rounds),
    }


def table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | MB | hosts | link | round s | aggregation s | 2M over the link s | ratio | up/host MB "
        "| down/host MB | orchestrator fetched MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['mode']} | {r['mb']} | {r['hosts']} | {r['rate']} | {r['round_s']:.2f} | "
            f"{r['aggregation_s']:.2f} | {r['link_2m_s']:.2f} | {r['aggregation_s'] / r['link_2m_s']:.2f} | "
            f"{r['up_per_host'] / 1e6:.1f} | {r['down_per_host'] / 1e6:.1f} | "
            f"{r['orchestrator_fetched'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sharded", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64, help="model size in MB of fp32")
    p.add_argument("--hosts", default="2,4,8", help="worker counts, comma-separated")
    p.add_argument("--rate", default="1gbit", help="link rate (tc tbf)")
    p.add_argument("--compute-s", type=float, default=0.5, help="simulated compute per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode (the first is left out)")
    p.add_argument("--modes", default="star,sharded")
    p.add_argument("--sandbox", default="off" if not bwrap_works() else "auto")
    p.add_argument("--scratch", default=None, help="where the workers' dirs and the store live")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (reason := netns.unavailable()) is not None:
        print(f"bench.sharded needs network namespaces: {reason}", file=sys.stderr)
        return 2
    records: list[dict[str, Any]] = []
    machine = f"{os.cpu_count()} cores, no GPU (compute simulated: {args.compute_s} s a round)"
    with scratch(args.scratch) as base:
        for hosts in [int(x) for x in args.hosts.split(",")]:
            with cluster(base / f"h{hosts}", args.rate, hosts, args.sandbox) as (net, made):
                for mode in args.modes.split(","):
                    record: dict[str, Any] = {"mode": mode, "mb": args.mb, "hosts": hosts, "rate": args.rate}
                    record.update(run_mode(made, net, base / f"store-{hosts}-{mode}", args, mode))
                    record["link_2m_s"] = 0.0  # set below, from the star round's delta
                    records.append(record)
            # M, one host's encoded delta: what it PUT in a star round.
            star = next((r for r in records if r["hosts"] == hosts and r["mode"] == "star"), None)
            delta = star["up_per_host"] if star is not None else records[-1]["up_per_host"]
            for r in records:
                if r["hosts"] == hosts:
                    r["delta_bytes"] = delta
                    r["link_2m_s"] = 2 * delta * 8 / bits_per_s(args.rate)
            print(table([r for r in records if r["hosts"] == hosts]), flush=True)
    print(f"\n{machine}\n{table(records)}")
    save("sharded", {"machine": machine, "args": vars(args), "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
