"""``roundhouse demo``: DiLoCo training of a tiny model over real Celery workers, end to end.

It is a preset of ``roundhouse train`` (:mod:`orchestrator.train`): the demo writes its
model, script and shards to a temp dir and runs the very same command on them. Without
``ROUNDHOUSE_BROKER_URL`` it starts everything itself: the embedded Redis, an artifact
server, and two CPU workers as real ``celery worker`` processes (sandboxed when bubblewrap
is there). With ``ROUNDHOUSE_BROKER_URL`` set it uses that broker and the idle
workers already running there (the Procfile's, a compose stack's). It builds a tiny model
and a synthetic, learnable dataset, trains several rounds with live progress bars per
worker (from the event stream), prints the loss per round, checks that every worker ends
bit-identical to the orchestrator, writes a PNG plot of the loss, and shuts down cleanly.
"""

from __future__ import annotations

import argparse
import io
import json
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

from orchestrator.local import EmbeddedRedis, LocalWorker, signed_env
from orchestrator.train import parser as train_parser
from orchestrator.train import report, train
from settings import Settings, get_settings
from tasks.trust.keys import DevKeys

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


def demo_keys(settings: Settings, console: Console) -> tuple[DevKeys, bool]:
    """The development keys the demo signs with (``ROUNDHOUSE_KEYS_DIR``, else var/keys, made
    when missing), and whether its Redis can speak TLS here."""
    from tasks.embedded_redis import TLS_HINT, tls_binary
    from tasks.trust.keys import ensure_keys

    keys = ensure_keys(settings.keys_dir or os.path.join("var", "keys"))
    tls = tls_binary() is not None
    if not tls:
        console.print(
            f"[yellow]no redis-server with TLS: the demo's Redis is plain, on loopback ({TLS_HINT})[/]"
        )
    return keys, tls


def signing_settings(settings: Settings, keys: DevKeys, tls: bool) -> Settings:
    """The orchestrator's side of the demo's own signed control plane: it signs with ``keys``,
    which its workers trust (whatever other keys the environment names)."""
    update = {
        "signing_key": str(keys.signing_key()),
        "signing_cert": str(keys.signing_cert()),
        "tls_ca_file": str(keys.ca_cert) if tls else None,
    }
    return settings.model_copy(update=update)


@contextmanager
def local_cluster(
    base: Path,
    workers: int,
    console: Console,
    settings: Settings,
    allow: list[str],
    *,
    signed: tuple[DevKeys, bool],
) -> Iterator[str]:
    """The embedded Redis (over TLS when it can) and ``workers`` CPU workers allowed to fetch
    from ``allow``, trusting ``keys``; yields the broker URL. Redis listens on loopback only."""
    keys, tls = signed
    redis = EmbeddedRedis(base / "redis", tls=keys if tls else None).start()
    env = {
        "ROUNDHOUSE_METRICS_PORT": "0",
        "ROUNDHOUSE_HEARTBEAT_INTERVAL_S": "1",
        "ROUNDHOUSE_URL_ALLOW": ",".join(allow),
        **signed_env(keys),
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


def parser() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(prog="roundhouse demo", description=__doc__)
    options.add_argument("--rounds", type=int, default=6)
    options.add_argument("--steps", type=int, default=25)
    options.add_argument("--workers", type=int, default=2)
    options.add_argument("--out", default=os.path.join("var", "demo"))
    options.add_argument("--bind", default=get_settings().demo_bind)
    options.add_argument("--overlap", action="store_true", help="overlapped rounds (docs/OVERLAP.md)")
    return options


def train_args(args: argparse.Namespace, base: Path) -> list[str]:
    """The ``roundhouse train`` command line the demo is a preset of: its tiny model, script and
    shards written to ``base``."""
    from safetensors.torch import save_file

    (base / "shards").mkdir()
    build_shards(base / "shards")
    save_file(build_model(), base / "model.safetensors")
    (base / "train.py").write_text(TRAIN, encoding="utf-8")
    return [
        "--model", str(base / "model.safetensors"), "--script", str(base / "train.py"),
        "--shards", str(base / "shards"), "--params", json.dumps({"lr": 0.2}), "--tenant", "demo",
        "--hosts", str(args.workers), "--rounds", str(args.rounds), "--steps", str(args.steps),
        "--outer-lr", "0.8", "--outer-momentum", "0.5", "--out", args.out, "--bind", args.bind,
        *(["--overlap"] if args.overlap else []),
    ]  # fmt: skip


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
            keys, tls = demo_keys(settings, console)
            cluster = local_cluster(base, args.workers, console, settings, allow, signed=(keys, tls))
            broker = stack.enter_context(cluster)
            settings = signing_settings(settings, keys, tls)
            console.print(f"Redis: {'TLS' if tls else 'plain'}, loopback only")
            console.print(f"control plane: signed with the keys in {keys.root}")
        options = train_parser().parse_args(train_args(args, base))
        client_settings = settings.model_copy(update={"host_id": "demo-orchestrator"})
        orchestrator, held = train(options, client_settings, console, broker=broker)
    # "Clearly below": at least a fifth lower, whatever the number of rounds.
    png = Path(args.out) / "loss.png"
    return report(orchestrator, held, png, console, time.monotonic() - started, require_fall=0.8)
