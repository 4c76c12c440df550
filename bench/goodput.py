"""``python -m bench.goodput``: how much of a training run's wall time the workers compute (root).

What the field measures a DiLoCo system by (Covenant-72B 94.5 %, INTELLECT-1 83-96 %): GPU
busy = compute time / wall time, over the steady-state rounds of a real run:

- N real workers (``roundhouse worker``: prefork ``celery worker``, sandboxed where bubblewrap
  works), each in a network namespace of its own whose link to the host side (Redis, the
  orchestrator's artifact server) is shaped both ways by ``tc tbf`` at ``--rate``
  (tests/support/netns.py); this kernel has no ``netem``, so no round-trip time is added;
- the reference orchestrator (:class:`orchestrator.diloco.Orchestrator`) in this process,
  a model of M MB of fp32 tensors, ``--rounds`` rounds;
- a tenant that **simulates** T s of GPU compute per round (``--compute-s``): this machine
  has no GPU, so the script loads its start state, then spends T s "computing": it perturbs
  every weight with seeded noise (a delta of random low bits, which no compressor shrinks
  much; on a GPU host the weights change on the GPU during the compute) and sleeps the rest
  of T with the host's CPU free, then saves the state. Its load and save are the tenant's
  round trip, not compute: their own bar ("tenant load/save"). ``--tenant mlp`` trains the
  demo's MLP instead (real, tiny compute).

GPU busy per host = T × its completed steady rounds / the steady rounds' wall time (the first
round is left out: the runners' first start). The loop's phases per round, medians over the
steady rounds: the workers' own (compute, tenant load/save, delta write, upload: the slowest host's)
and the orchestrator's (dispatch, the fold left after the last result, outer step, sync build,
publish, apply: the whole sync, every host's apply in it); "other" is the rest of the round's
wall time (task hand-offs, results through the backend).

Modes (``--modes``, side by side on the same cluster): ``sequential`` (run → upload → fold →
outer step → sync → apply → next round) and ``overlapped`` (docs/OVERLAP.md: the next round is
dispatched once the last one's results are in; the outer step, sync build, publish and the sync's
apply run while it trains). An overlapped round's wall time is from its dispatch to the next
one's; its bars are the hosts' own idle time at the round's end (delta write, the wait for the
sync, the working copy's rebase; the delta's PUT runs beside the next round, so "upload" is only
a wait for the last one's) and "other" (hand-offs); the orchestrator's phases ran
beside the round, so they are not stacked (they are in the JSON). Its steady rounds leave out
the last one too: it ends with the sequential sync that brings every host to the final model.

Writes ``bench/results/goodput.json`` and ``bench/results/goodput.png`` (a stacked bar per
configuration). Namespaces, veths, Redis and the workers are removed afterwards.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, save, scratch
from executor.sandbox import bwrap_works
from orchestrator.artifacts import ArtifactServer
from orchestrator.demo import TRAIN, build_model, build_shards
from orchestrator.diloco import Orchestrator, RoundSummary, Session
from orchestrator.local import EmbeddedRedis, LocalWorker, signed_env
from settings import Settings
from tasks.client import RoundClient
from tasks.trust.keys import ensure_keys
from tests.support import netns
from tests.support.worker import TEST_ENV

TENSOR_ELEMENTS = 4 << 20  # 16 MiB of fp32 per tensor

# Simulated compute (see the module docstring): the start state loaded, T s of "compute" (every
# weight nudged, the rest of T asleep), the state saved.
SLEEP_TENANT = """
import time
state = load_model(model_path)
computing = time.monotonic()
noise = torch.Generator()
noise.seed()  # each host its own nudge: hosts with equal deltas would share shard objects by hash
for tensor in state.values():
    tensor.add_(torch.randn(tensor.shape, generator=noise), alpha=1e-3)
time.sleep(max(0.0, float(params["compute_s"]) - (time.monotonic() - computing)))
save_model(state)
save_report({"compute_s": float(params["compute_s"])})
"""

WORKER_SIDE = ("compute", "tenant load/save", "delta write", "upload", "sync wait", "rebase")
ORCHESTRATOR_SIDE = ("dispatch", "fold", "outer", "sync_build", "publish", "apply")


def model_of(megabytes: int) -> dict[str, torch.Tensor]:
    tensors = max(1, (megabytes << 20) // (TENSOR_ELEMENTS * 4))
    noise = torch.Generator().manual_seed(megabytes)
    return {f"layer{i}.weight": torch.randn(TENSOR_ELEMENTS, generator=noise) for i in range(tensors)}


class Cluster:
    """Redis on the bridge, and ``hosts`` workers, each in its namespace behind a shaped link."""

    def __init__(self, base: Path, net: netns.Network, hosts: int, sandbox: str) -> None:
        # Signed, as off loopback a worker must be: it trusts the development keys' certificate.
        keys = ensure_keys(str(base / "keys"))
        self.redis = EmbeddedRedis(base / "redis", bind=net.host_address).start()
        self.client = RoundClient(
            Settings(
                broker_url=self.redis.url, host_id="goodput",
                signing_key=str(keys.signing_key()), signing_cert=str(keys.signing_cert()),
            )
        )  # fmt: skip
        env = {
            **TEST_ENV, **signed_env(keys), "ROUNDHOUSE_URL_ALLOW": net.cidr, "ROUNDHOUSE_SANDBOX": sandbox,
        }  # fmt: skip
        self.workers: list[LocalWorker] = []
        self.addresses: dict[str, str] = {}  # host -> its namespace's address (bench.sharded)
        for index in range(hosts):
            ns = net.add()
            host = f"gp{index}"
            self.addresses[host] = ns.address
            self.workers.append(
                LocalWorker(
                    host, self.redis.url, base / host, cache_dir=base / host / "cache", env=env,
                    prefix=tuple(ns.argv()),
                )
            )  # fmt: skip
        with ThreadPoolExecutor(len(self.workers)) as pool:  # a worker that does not come up raises here
            list(pool.map(lambda worker: worker.start(timeout_s=300), self.workers))

    @property
    def hosts(self) -> list[str]:
        return [w.host_id for w in self.workers]

    def close(self) -> None:
        for worker in self.workers:
            worker.stop(timeout_s=10)
        self.redis.stop()


@contextmanager
def cluster(base: Path, rate: str, hosts: int, sandbox: str) -> Iterator[tuple[netns.Network, Cluster]]:
    with netns.Network(rate=rate) as net:
        made = Cluster(base, net, hosts, sandbox)
        try:
            yield net, made
        finally:
            made.close()


def run_session(
    made: Cluster, net: netns.Network, root: Path, args: argparse.Namespace, megabytes: int, mode: str
) -> list[RoundSummary]:
    """One training session of ``args.rounds`` rounds over every worker of ``made``."""
    with ArtifactServer(root, host=net.host_address) as store:
        model, code, shards, params = tenant(args, store, root, megabytes)
        session = Session(
            made.hosts, shards, code, params=params, steps=args.steps, tenant=f"goodput{megabytes}",
            delta_dtype=args.delta_dtype, sync_timeout_s=1800, round_deadline_s=1800,
            overlap=mode == "overlapped",
        )  # fmt: skip
        orchestrator = Orchestrator(made.client, store, model, session)
        try:
            orchestrator.load()
            return orchestrator.run(args.rounds)
        finally:
            orchestrator.close()
            for host in made.hosts:
                made.client.reset(host).get(timeout=120)


def tenant(
    args: argparse.Namespace, store: ArtifactServer, root: Path, megabytes: int
) -> tuple[dict[str, torch.Tensor], str, list[dict[str, Any]], dict[str, Any]]:
    """The model, the code, the shards and the params of ``--tenant``."""
    if args.tenant == "sleep":
        return model_of(megabytes), SLEEP_TENANT, [], {"compute_s": args.compute_s, "seed": megabytes}
    (root / "shards").mkdir(parents=True, exist_ok=True)
    shards = []
    for name, path in build_shards(root / "shards"):
        store.publish(name, path)
        shards.append({"name": name, "compression": "zstd", "size_bytes": path.stat().st_size})
    return build_model(), TRAIN, shards, {"lr": 0.05}


def measure(summaries: list[RoundSummary], hosts: list[str], compute_s: float) -> dict[str, Any]:
    """GPU busy and the loop's phases over the steady rounds (all but the first)."""
    steady = summaries[1:] or summaries
    if summaries and summaries[-1].overlap and len(steady) > 1:
        steady = steady[:-1]  # the last ends with the sequential sync of the final model
    wall = sum(s.seconds for s in steady)
    busy = {h: compute_s * sum(h in s.included for s in steady) / wall for h in hosts}
    per_round = [round_phases(s, compute_s) for s in steady]
    phases = {name: statistics.median(r[name] for r in per_round) for name in per_round[0]}
    return {
        "rounds": len(steady),
        "round_s": statistics.median(s.seconds for s in steady),
        "gpu_busy": {"total": sum(busy.values()) / len(busy), **busy},
        "phases": phases,
        "history": [s.to_json() for s in summaries],
    }


def round_phases(summary: RoundSummary, compute_s: float) -> dict[str, float]:
    """One round's wall time cut into the bars: the slowest host's side, the orchestrator's."""
    hosts = summary.host_phases.values()
    training = max((h.get("training", 0.0) for h in hosts), default=0.0)
    out = {
        "compute": min(compute_s, training),
        "tenant load/save": max(0.0, training - compute_s),
        "delta write": max((h.get("delta_write", 0.0) for h in hosts), default=0.0),
        # Overlapped: the PUT runs beside the next round; what is idle is waiting for the last one.
        "upload": max((h.get("upload", 0.0) + h.get("upload_wait", 0.0) for h in hosts), default=0.0),
        "sync wait": max((h.get("sync_wait", 0.0) for h in hosts), default=0.0),
        "rebase": max((h.get("rebase", 0.0) for h in hosts), default=0.0),
    }
    # Overlapped: the orchestrator's phases but the dispatch ran while the hosts trained.
    beside = summary.overlap
    out.update(
        {n: 0.0 if beside and n != "dispatch" else summary.phases.get(n, 0.0) for n in ORCHESTRATOR_SIDE}
    )
    out["other"] = max(0.0, summary.seconds - sum(out.values()))
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*WORKER_SIDE, *ORCHESTRATOR_SIDE, "other"]
    labels = [f"{r['mode'][:3]}\n{r['mb']} MB\n{r['hosts']} h\n{r['rate']}" for r in records]
    figure, axes = plt.subplots(figsize=(max(6, 1.1 * len(records)), 5))
    bottom = [0.0] * len(records)
    colors = plt.get_cmap("tab20")
    for index, name in enumerate(names):
        color = colors(index)
        heights = [r["phases"][name] for r in records]
        axes.bar(labels, heights, bottom=bottom, label=name, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, record in enumerate(records):
        axes.annotate(f"{record['gpu_busy']['total']:.2f}", (x, bottom[x]), ha="center", va="bottom")
    axes.set_ylabel("seconds per round (median, steady rounds); GPU busy on top")
    axes.set_title("bench.goodput: where a round's wall time goes (seq: sequential, ove: overlapped)")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(records: list[dict[str, Any]]) -> str:
    names = [*WORKER_SIDE, *ORCHESTRATOR_SIDE, "other"]
    head = ["mode", "MB", "hosts", "link", "round s", "GPU busy", *names]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [r["mode"], str(r["mb"]), str(r["hosts"]), r["rate"], f"{r['round_s']:.2f}"]
        cells.append(f"{r['gpu_busy']['total']:.2f}")
        cells += [f"{r['phases'][n]:.2f}" for n in names]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", default="64", help="model sizes in MB, comma-separated (64,256,1024)")
    p.add_argument("--hosts", default="1,2", help="worker counts, comma-separated (1,2,4)")
    p.add_argument("--rate", default="1gbit", help="link rates (tc tbf), comma-separated (1gbit,200mbit)")
    p.add_argument("--compute-s", type=float, default=2.0, help="simulated compute per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per session (the first is left out)")
    p.add_argument("--steps", type=int, default=1, help="inner steps (the mlp tenant's)")
    p.add_argument("--delta-dtype", default="float16")
    p.add_argument("--tenant", choices=("sleep", "mlp"), default="sleep")
    p.add_argument("--sandbox", default="auto" if bwrap_works() else "off")
    p.add_argument("--modes", default="sequential,overlapped", help="sequential, overlapped, or both")
    p.add_argument(
        "--scratch", default=None,
        help="where the workers' dirs, caches and the store live (default ./var, this VM's disk, "
        "whose writeback a model-sized write a round runs into; /dev/shm: the loop without the disk)",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (reason := netns.unavailable()) is not None:
        print(f"bench.goodput needs network namespaces: {reason}", file=sys.stderr)
        return 2
    sizes = [int(x) for x in args.mb.split(",")]
    records: list[dict[str, Any]] = []
    machine = (
        f"{os.cpu_count()} cores, no GPU (compute simulated: {args.compute_s} s asleep a round), "
        f"files on {args.scratch or 'the disk (./var)'}"
    )
    with scratch(args.scratch) as base:
        for rate, hosts in itertools.product(args.rate.split(","), [int(x) for x in args.hosts.split(",")]):
            with cluster(base / f"{rate}-{hosts}", rate, hosts, args.sandbox) as (net, made):
                for megabytes, mode in itertools.product(sizes, args.modes.split(",")):
                    started = time.monotonic()
                    store = base / f"store-{rate}-{hosts}-{megabytes}-{mode}"
                    summaries = run_session(made, net, store, args, megabytes, mode)
                    record = {"mode": mode, "mb": megabytes, "hosts": hosts, "rate": rate}
                    record.update(measure(summaries, made.hosts, args.compute_s))
                    record["session_s"] = time.monotonic() - started
                    records.append(record)
                    print(table([record]).splitlines()[-1], flush=True)
    out = {"machine": machine, "args": vars(args), "records": records}
    print(f"\n{machine}\n{table(records)}")
    save("goodput", out)
    plot(records, RESULTS / "goodput.png")
    print(f"wrote {RESULTS / 'goodput.json'} and {RESULTS / 'goodput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
