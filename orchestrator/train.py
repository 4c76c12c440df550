"""``roundhouse train``: DiLoCo training of your own model over Roundhouse workers.

You give the model file (safetensors, or a ``.pt``/``.pth``/``.bin`` state dict), the
training script (the worker's tenant code: DESIGN §9's namespace), the shards (a directory,
or a file listing one path, URL or JSON descriptor a line), the hosts (a count of idle
workers to wait for, or their names), the rounds, the steps per round and the outer
optimiser. It drives the workers at ``ROUNDHOUSE_BROKER_URL`` and serves the model, shards
and deltas itself (or uses the S3 store of ``ROUNDHOUSE_S3_ENDPOINT``).

With ``--state-dir`` every round is checkpointed there; when the directory holds a
checkpoint, the command resumes it at its next round (the model, script and shards come
from the checkpoint then) and workers that still hold the model are not loaded again.
Hosts may die, drop off the network, straggle, come back or be added while it runs
(docs/OPERATIONS.md, "The orchestrator"). It shows live progress, one line per membership
event and per round, the loss table, a plot (``--out``/loss.png), and checks at the end
that every active worker holds the orchestrator's model bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from orchestrator.artifacts import ArtifactServer, ArtifactStore
from orchestrator.diloco import Orchestrator, OuterOptimizer, RoundSummary, Session
from orchestrator.progress import LiveProgress, event_line, loss_table, plot, round_line
from orchestrator.s3 import S3Store
from settings import Settings, get_settings
from tasks.client import RoundClient

# What a shard's name ends with says how it is compressed (DESIGN §3: "none" | "zstd").
ZSTD_SUFFIXES = (".zst", ".zstd")


def parser(prog: str = "roundhouse train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="DiLoCo training of your own model over Roundhouse workers."
    )
    what = p.add_argument_group("what to train (ignored when --state-dir resumes)")
    what.add_argument("--model", help="model file: .safetensors, or a .pt/.pth/.bin state dict")
    what.add_argument("--script", help="the training script the workers run each round")
    what.add_argument(
        "--shards", help="a directory of shard files, or a file listing one path/URL/JSON a line"
    )
    what.add_argument("--params", default="{}", help="JSON object (or @file) passed to the script as params")
    what.add_argument("--batch-size", type=int, default=32)
    what.add_argument("--tenant", default="default")
    what.add_argument("--delta-dtype", default="float16", help="dtype of the workers' trained deltas")
    how = p.add_argument_group("how")
    how.add_argument("--hosts", default="2", help="a count of idle workers to wait for, or names a,b,c")
    how.add_argument("--max-hosts", type=int, default=None, help="most hosts at once (default: --hosts)")
    how.add_argument("--wait-hosts-s", type=float, default=120.0, help="how long to wait for the hosts")
    how.add_argument("--rounds", type=int, default=10)
    how.add_argument("--steps", type=int, default=50, help="inner steps per round")
    how.add_argument("--outer-lr", type=float, default=0.7)
    how.add_argument("--outer-momentum", type=float, default=0.9)
    how.add_argument("--no-nesterov", action="store_true", help="plain momentum instead of Nesterov")
    how.add_argument(
        "--overlap", action="store_true", help="the next round trains while the last syncs (docs/OVERLAP.md)"
    )
    how.add_argument(
        "--aggregation", choices=("star", "sharded"), default="star",
        help="star: this process folds every delta; sharded: the hosts reduce the round among themselves, "
        "no tensor byte through this process (docs/SHARDED.md)",
    )  # fmt: skip
    ends = p.add_argument_group("when a round ends (docs/OPERATIONS.md)")
    ends.add_argument("--round-deadline-s", type=float, default=600.0)
    ends.add_argument(
        "--quorum", type=float, default=1.0, help="fraction of hosts whose finishing starts the grace"
    )
    ends.add_argument("--grace-s", type=float, default=30.0)
    ends.add_argument("--min-hosts", type=int, default=1, help="fewer completing keeps the model as it was")
    ends.add_argument("--join-wait-s", type=float, default=30.0, help="how long a boundary waits for joins")
    ends.add_argument("--sync-timeout-s", type=float, default=600.0, help="bound on a load or a sync")
    out = p.add_argument_group("state and output")
    out.add_argument(
        "--state-dir", default=None, help="checkpoint every round here; resume when it holds one"
    )
    out.add_argument("--out", default=os.path.join("var", "train"), help="where loss.png goes")
    out.add_argument("--bind", default=get_settings().demo_bind, help="address the artifact server binds")
    out.add_argument("--port", type=int, default=0, help="its port (0: any free one)")
    out.add_argument(
        "--public-host", default=get_settings().demo_public_host, help="the name workers reach it by"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bars (plain lines only)")
    return p


def load_model_file(path: str) -> dict[str, torch.Tensor]:
    """A flat state dict from a safetensors file or a tensor-only torch file (no code runs)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return dict(load_file(path))
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    return {str(k): v.detach().contiguous() for k, v in loaded.items()}


def shard_sources(spec: str) -> list[dict[str, Any]]:
    """Shard descriptors; a local file's carries ``path`` (it is published, then dropped)."""
    root = Path(spec)
    if root.is_dir():
        base = root
        entries: list[Any] = sorted(
            p.name for p in root.iterdir() if p.is_file() and not p.name.startswith(".")
        )
    else:
        base = root.parent  # paths in a list are relative to the list
        lines = [line.strip() for line in root.read_text(encoding="utf-8").splitlines()]
        entries = [json.loads(x) if x.startswith("{") else x for x in lines if x and not x.startswith("#")]
    out = []
    for index, entry in enumerate(entries):
        if isinstance(entry, dict) or "://" in entry:
            out.append(entry if isinstance(entry, dict) else {"url": entry})
            continue
        path = (base / entry).resolve()
        name = f"data/{path.name}"
        if any(item.get("name") == name for item in out):  # same file name from two directories
            name = f"data/{index:05d}-{path.name}"
        out.append({
            "name": name, "path": str(path),
            "compression": "zstd" if path.name.endswith(ZSTD_SUFFIXES) else "none",
            "size_bytes": path.stat().st_size,
        })  # fmt: skip
    if not out:
        raise ValueError(f"no shards in {spec}")
    return out


def publish_shards(store: ArtifactStore, sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Local shards into the store (kept when an earlier run's copy is there); the session's list."""
    shards = []
    for item in sources:
        if "path" in item:
            path = item["path"]
            has_copy = getattr(store, "has_copy", None)
            if not (has_copy is not None and has_copy(item["name"], path)):
                store.publish(item["name"], path)
            item = {k: v for k, v in item.items() if k != "path"}
        shards.append(item)
    return shards


def make_store(args: argparse.Namespace, settings: Settings, root: Path) -> ArtifactStore:
    if settings.s3_endpoint:
        s3 = S3Store.from_settings(settings)
        s3.ensure_bucket()
        return s3
    return ArtifactServer(root, host=args.bind, port=args.port, public_host=args.public_host).start()


def usable_host(beat: dict[str, Any], names: list[str] | None, tenant: str) -> bool:
    """A named host, or else an idle one or one of this tenant: a host loaded by another tenant
    is someone else's."""
    if names is not None:
        return beat.get("host_id") in names
    return beat.get("state") == "idle" or beat.get("tenant") == tenant


def wait_for_hosts(
    client: RoundClient, spec: str, tenant: str, wait_s: float
) -> tuple[list[str], int, list[str] | None]:
    """The starting hosts, the most at once, and the names allowed (None: any idle host)."""
    names = None if spec.isdigit() else [h.strip() for h in spec.split(",") if h.strip()]
    want = int(spec) if names is None else len(names)
    deadline = time.monotonic() + wait_s
    while True:
        usable = sorted(
            str(b["host_id"])
            for b in client.hosts(idle_only=True, brief=True)
            if usable_host(b, names, tenant)
        )
        if len(usable) >= want or time.monotonic() > deadline:
            return usable[:want], want, names
        time.sleep(0.5)


def _session(
    args: argparse.Namespace, client: RoundClient, store: ArtifactStore, console: Console
) -> Session:
    for option in ("model", "script", "shards"):
        if not getattr(args, option):
            raise ValueError(
                f"--{option} is needed to start a session (only a --state-dir with a checkpoint resumes)"
            )
    params = args.params[1:] if args.params.startswith("@") else None
    hosts, want, names = wait_for_hosts(client, args.hosts, args.tenant, args.wait_hosts_s)
    if len(hosts) < max(1, args.min_hosts):
        raise RuntimeError(f"wanted {want} idle workers, found {len(hosts)}: {hosts}")
    if len(hosts) < want:
        console.print(
            f"[yellow]starting with {len(hosts)} of {want} hosts; the others join when they appear[/]"
        )
    code = Path(args.script).read_text(encoding="utf-8")
    return Session(
        hosts, publish_shards(store, shard_sources(args.shards)), code,
        params=json.loads(Path(params).read_text() if params else args.params), steps=args.steps,
        batch_size=args.batch_size, tenant=args.tenant, delta_dtype=args.delta_dtype,
        round_deadline_s=args.round_deadline_s, quorum=args.quorum, grace_s=args.grace_s,
        min_hosts=args.min_hosts, max_hosts=args.max_hosts or want, allowed_hosts=names,
        join_wait_s=args.join_wait_s, sync_timeout_s=args.sync_timeout_s, overlap=args.overlap,
        aggregation=args.aggregation,
    )  # fmt: skip


def train(
    args: argparse.Namespace, settings: Settings, console: Console, *, broker: str | None = None
) -> tuple[Orchestrator, dict[str, str]]:
    """Start or resume the session and run its rounds; returns it and what each active host holds."""
    client = RoundClient(settings.model_copy(update={"broker_url": broker or settings.broker_url}))
    with ExitStack() as stack:
        state = Path(args.state_dir) if args.state_dir else None
        root = state / "artifacts" if state else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        store = make_store(args, settings, root)
        if isinstance(store, ArtifactServer):
            stack.callback(store.stop)
        live = stack.enter_context(
            LiveProgress(client, args.steps, console, enabled=console.is_terminal and not args.no_progress)
        )
        hooks: dict[str, Any] = {
            "on_event": lambda e: live.print(event_line(e)) if e["event"] != "joining" else None,
            "on_round_start": lambda n, ids: live.new_round(n, ids),
            "on_summary": lambda summary: live.print(round_line(summary)),
        }
        if state is not None and (state / "state.json").is_file():
            orchestrator = Orchestrator.resume(client, store, state, **hooks)
            live.print(f"resuming {state} at round {orchestrator.next_round}")
        else:
            session = _session(args, client, store, console)
            outer = OuterOptimizer(args.outer_lr, args.outer_momentum, not args.no_nesterov)
            model = load_model_file(args.model)
            orchestrator = Orchestrator(client, store, model, session, outer=outer, state_dir=state, **hooks)
            live.print(f"hosts: {', '.join(session.hosts)}")
            orchestrator.load()
        stack.callback(orchestrator.close)
        orchestrator.run(args.rounds)  # each round's line printed as its summary is written
        held = {}
        for host in orchestrator.membership.active():
            try:
                held[host] = str(orchestrator.client.status(host).get(timeout=60)["model_hash"])
            except Exception as exc:  # a host lost after the last round: reported, not fatal
                held[host] = f"unknown ({type(exc).__name__})"
        return orchestrator, held


def report(
    orchestrator: Orchestrator, held: dict[str, str], png: Path, console: Console, seconds: float,
    *, require_fall: float | None = None,
) -> int:  # fmt: skip
    """The loss table, the plot and the final checks; the exit status."""
    history: list[RoundSummary] = orchestrator.history
    console.print(loss_table(history))
    if history:
        plot(history, png)
        console.print(f"plot: {png}   ({seconds:.0f} s)")
    wrong = {h: v for h, v in held.items() if v != orchestrator.global_hash}
    if wrong or not held:
        console.print(
            f"[red]hosts that do not hold the orchestrator's model {orchestrator.global_hash}: {wrong}[/]"
        )
        return 1
    losses = [s.mean_loss for s in history if s.mean_loss is not None]
    if len(losses) >= 2:
        first, last = losses[0], losses[-1]
        if require_fall is not None and not last < first * require_fall:
            console.print(f"[red]the loss did not fall enough: {first} -> {last}[/red]")
            return 1
        verb = "fell" if last < first else "went"
        console.print(
            f"loss {verb} from {first:.4f} to {last:.4f}; every worker holds the orchestrator's model"
        )
    else:
        console.print("every worker holds the orchestrator's model")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console = Console()
    started = time.monotonic()
    try:
        orchestrator, held = train(args, get_settings(), console)
    except (ValueError, RuntimeError, OSError) as exc:  # bad arguments, no hosts, files
        console.print(f"[red]roundhouse train: {exc}[/]")
        return 2
    except Exception as exc:  # Redis or the store away: the checkpoint is whole, resume later
        again = f"; run it again with --state-dir {args.state_dir} to resume" if args.state_dir else ""
        console.print(f"[red]roundhouse train stopped: {type(exc).__name__}: {exc}{again}[/]")
        return 3
    return report(orchestrator, held, Path(args.out) / "loss.png", console, time.monotonic() - started)
