"""``roundhouse demo``: DiLoCo training of a tiny model over real Celery workers, end to end.

Without ``ROUNDHOUSE_BROKER_URL`` it starts everything itself: the embedded Redis, an
artifact server, and two CPU workers as real ``celery worker`` processes (sandboxed when
bubblewrap is there). With ``ROUNDHOUSE_BROKER_URL`` set it uses that broker and the idle
workers already running there (the Procfile's, a compose stack's). It builds a tiny model
and a synthetic, learnable dataset, trains several rounds with live progress bars per
worker (from the event stream), prints the loss per round, checks that every worker ends
bit-identical to the orchestrator, writes a PNG plot of the loss, and shuts down cleanly.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import torch
import zstandard
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from orchestrator.artifacts import ArtifactServer
from orchestrator.diloco import ArtifactStore, Orchestrator, OuterOptimizer, RoundSummary, Session, pick_hosts
from orchestrator.local import EmbeddedRedis, LocalWorker
from orchestrator.s3 import S3Store
from settings import Settings, get_settings
from tasks.client import RoundClient
from tasks.names import seq_key

FEATURES = 16
SHARDS = 4
ROWS_PER_SHARD = 512

TRAIN = """
import zlib
import torch.nn.functional as F
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model.load_state_dict(load_model(model_path))
model = place_model(model)
opt = torch.optim.SGD(model.parameters(), lr=params["lr"])
first = zlib.crc32(host_id.encode())  # each worker walks the shards from its own place
losses = []
for step in range(steps):
    should_stop()
    shard = get_shard((first + step_offset + step) % num_shards)
    x, y = shard["x"].to(device), shard["y"].to(device)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    emit_stats({"step": step, "steps": steps, "loss": losses[-1]})
save_model(model)
save_report({"final_loss": sum(losses[-5:]) / len(losses[-5:]), "first_loss": losses[0]})
"""


def build_model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def build_shards(directory: Path) -> list[tuple[str, Path]]:
    """A learnable regression task, y = tanh(x·w), cut into zstd-compressed microshards."""
    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(FEATURES, 1, generator=g) / 4
    shards = []
    for index in range(SHARDS):
        x = torch.randn(ROWS_PER_SHARD, FEATURES, generator=g)
        buffer = io.BytesIO()
        torch.save({"x": x, "y": torch.tanh(x @ true_w)}, buffer)
        path = directory / f"shard-{index}.pt.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
        shards.append((f"data/shard-{index}.pt.zst", path))
    return shards


def artifact_hosts(args: argparse.Namespace, settings: Settings) -> list[str]:
    """What the embedded workers must reach: the artifact store, on this machine or the S3
    endpoint, which the URL policy refuses by default when it is on loopback or one of this
    host's own addresses (DESIGN §11). Added to whatever the operator allows already."""
    if settings.s3_endpoint:
        store = urlsplit(settings.s3_endpoint).hostname or ""
    elif args.bind in ("0.0.0.0", "::", ""):
        store = settings.demo_public_host or socket.gethostname()  # as ArtifactServer names itself
    else:
        store = settings.demo_public_host or args.bind
    hosts = [*settings.url_allow, "127.0.0.1", "::1", "localhost", store]
    return list(dict.fromkeys(host for host in hosts if host))


@contextmanager
def local_cluster(
    base: Path, workers: int, console: Console, settings: Settings, allow: list[str]
) -> Iterator[str]:
    """The embedded Redis and ``workers`` CPU workers allowed to fetch from ``allow``; yields
    the broker URL."""
    redis = EmbeddedRedis(base / "redis").start()
    env = {
        "ROUNDHOUSE_METRICS_PORT": "0",
        "ROUNDHOUSE_HEARTBEAT_INTERVAL_S": "1",
        "ROUNDHOUSE_URL_ALLOW": ",".join(allow),
    }
    if "sandbox" not in settings.model_fields_set:  # the operator chose no sandbox mode
        from executor.sandbox import bwrap_works

        if not bwrap_works():
            console.print(
                "[yellow]bubblewrap is not installed: the demo's workers run its own code unsandboxed[/]"
            )
            env["ROUNDHOUSE_SANDBOX"] = "off"
    started = [
        LocalWorker(f"demo-{i}", redis.url, base / f"worker-{i}", cache_dir=base / "cache", env=env)
        for i in range(workers)
    ]
    try:
        threads = [threading.Thread(target=w.start) for w in started]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for worker in started:
            worker.wait_ready(30)
        yield redis.url
    finally:
        for worker in started:
            worker.stop()
        redis.stop()


class LiveProgress:
    """One bar per worker, moved by the workers' ``stats`` events."""

    def __init__(self, client: RoundClient, hosts: list[str], steps: int, console: Console) -> None:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[loss]}"),
        )
        self.progress = Progress(*columns, console=console, transient=True)
        self._bars = {host: self.progress.add_task(host, total=steps, loss="") for host in hosts}
        self._client = client
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._follow, args=(host,), daemon=True) for host in hosts]

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.progress.stop()

    def new_round(self, round_num: int) -> None:
        for host, bar in self._bars.items():
            self.progress.reset(bar, description=f"{host} round {round_num}", loss="")

    def _follow(self, host: str) -> None:
        since = int(self._client.redis.get(seq_key(host)) or 0)
        for event in self._client.events(host, since=since, idle_timeout_s=None):
            if self._stop.is_set():
                return
            if event.type == "stats" and "step" in event.data:
                loss = event.data.get("loss")
                self.progress.update(
                    self._bars[host],
                    completed=int(event.data["step"]) + 1,
                    loss=f"loss {loss:.4f}" if loss else "",
                )


def plot(history: list[RoundSummary], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    rounds = [s.round_num for s in history]
    hosts = sorted({host for s in history for host in s.losses})
    for host in hosts:
        axes.plot(
            rounds, [s.losses.get(host, float("nan")) for s in history], marker=".", alpha=0.5, label=host
        )
    means = [s.mean_loss if s.mean_loss is not None else float("nan") for s in history]
    axes.plot(rounds, means, marker="o", linewidth=2.5, color="black", label="mean")
    axes.set_xlabel("round")
    axes.set_ylabel("training loss (MSE, last steps)")
    axes.set_yscale("log")
    axes.set_title("Roundhouse demo: DiLoCo over Celery workers")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def train(
    args: argparse.Namespace, settings: Settings, broker: str, base: Path, console: Console
) -> list[RoundSummary]:
    client = RoundClient(settings.model_copy(update={"broker_url": broker, "host_id": "demo-orchestrator"}))
    hosts = pick_hosts(client, args.workers)
    console.print(f"workers: {', '.join(hosts)}")
    store = make_store(args, settings, base)
    try:
        shards = []
        for name, path in build_shards(base):
            shards.append(
                {"url": store.publish(name, path), "compression": "zstd", "size_bytes": path.stat().st_size}
            )
        session = Session(hosts, shards, TRAIN, params={"lr": 0.2}, steps=args.steps, tenant="demo")
        with LiveProgress(client, hosts, args.steps, console) as live:
            orchestrator = Orchestrator(
                client, store, build_model(), session,
                outer=OuterOptimizer(lr=0.8, momentum=0.5), on_round_start=lambda n, _ids: live.new_round(n),
            )  # fmt: skip
            orchestrator.load()
            for round_num in range(args.rounds):
                summary = orchestrator.round(round_num, args.rounds)
                orchestrator.history.append(summary)
                via = ", ".join(sorted(set(summary.via.values())))
                loss = f"{summary.mean_loss:.4f}" if summary.mean_loss is not None else "-"
                live.progress.console.print(
                    f"round {round_num}: mean loss {loss}  synced via {via}  model {summary.model_hash[7:19]}"
                )
            statuses = orchestrator.statuses()
        orchestrator.close()
        if {s["model_hash"] for s in statuses.values()} != {orchestrator.global_hash}:
            raise RuntimeError(f"workers disagree with the orchestrator: {statuses}")
        return orchestrator.history
    finally:
        if isinstance(store, ArtifactServer):
            store.stop()


def make_store(args: argparse.Namespace, settings: Settings, base: Path) -> ArtifactStore:
    """MinIO/S3 when ROUNDHOUSE_S3_ENDPOINT is set (the compose stack), else a local server."""
    if settings.s3_endpoint:
        s3 = S3Store.from_settings(settings)
        s3.ensure_bucket()
        return s3
    return ArtifactServer(base / "artifacts", host=args.bind, public_host=settings.demo_public_host).start()


def parser() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(prog="roundhouse demo", description=__doc__)
    options.add_argument("--rounds", type=int, default=6)
    options.add_argument("--steps", type=int, default=25)
    options.add_argument("--workers", type=int, default=2)
    options.add_argument("--out", default=os.path.join("var", "demo"))
    options.add_argument("--bind", default=get_settings().demo_bind)
    return options


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    settings = get_settings()
    console = Console()
    started = time.monotonic()
    with ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="roundhouse-demo-")))
        if "broker_url" in settings.model_fields_set:  # given, not the default
            broker = settings.broker_url
            console.print("using the broker and the workers at ROUNDHOUSE_BROKER_URL")
        else:
            console.print(f"starting the embedded Redis and {args.workers} workers …")
            allow = artifact_hosts(args, settings)
            broker = stack.enter_context(local_cluster(base, args.workers, console, settings, allow))
        history = train(args, settings, broker, base, console)
    return report(history, Path(args.out) / "loss.png", console, time.monotonic() - started)


def report(history: list[RoundSummary], png: Path, console: Console, seconds: float) -> int:
    table = Table(title="loss per round")
    for column in ("round", "mean loss", "workers", "left out", "sync"):
        table.add_column(column)
    for s in history:
        table.add_row(
            str(s.round_num), f"{s.mean_loss:.4f}" if s.mean_loss is not None else "-", str(len(s.included)),
            ", ".join(s.excluded) or "-", ", ".join(f"{h}:{v}" for h, v in sorted(s.via.items())),
        )  # fmt: skip
    console.print(table)
    plot(history, png)
    first, last = history[0].mean_loss, history[-1].mean_loss
    console.print(f"plot: {png}   ({seconds:.0f} s)")
    # "Clearly below": at least a fifth lower, whatever the number of rounds.
    if first is None or last is None or not last < first * 0.8:
        console.print(f"[red]the loss did not fall enough: {first} -> {last}[/red]")
        return 1
    console.print(f"loss fell from {first:.4f} to {last:.4f}; every worker holds the orchestrator's model")
    return 0
