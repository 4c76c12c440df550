"""The ``roundhouse`` command line.

- ``roundhouse worker [--gpu N] [--host-id ID] [-- celery options]``: one worker for one
  GPU: sets ``CUDA_VISIBLE_DEVICES`` before anything starts, names the node
  ``gpu<N>@%h``, consumes only ``roundhouse.<host_id>``, ``-P prefork -c 1 -E``.
- ``roundhouse redis [--port P] [--dir D] [--tls] [--aclfile F]``: the embedded Redis for
  the Procfile and the demo (``tasks.embedded_redis``; ``--tls``: with the development keys).
- ``roundhouse keys init DIR``: development keys of the signed control plane (``tasks.keys``).
- ``roundhouse watch <host_id> [--since SEQ]``: a worker's events, replayed then live.
- ``roundhouse status [host_id]``: live workers from their heartbeats.
- ``roundhouse train``: DiLoCo training of your own model, script and shards (``--state-dir``
  resumes); ``roundhouse demo``: a small preset of it.
- ``roundhouse settings``: the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from settings import get_settings
from tasks.names import queue_name


def _mask(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        port = f":{parts.port}" if parts.port else ""
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}{port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


def worker_command(
    gpu: int | None, host_id: str | None, extra: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``celery worker`` for one GPU (exposed for tests)."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        env["ROUNDHOUSE_GPU"] = str(gpu)
        # One metrics port per GPU worker on a machine, unless the operator chose one.
        env.setdefault("ROUNDHOUSE_METRICS_PORT", str(9808 + gpu))
    chosen = host_id or env.get("ROUNDHOUSE_HOST_ID")
    if not chosen:
        # One worker per GPU: several on one machine need distinct ids, hence the suffix.
        base = socket.gethostname().split(".")[0] or "host"
        chosen = f"{base}-gpu{gpu}" if gpu is not None else base
    env["ROUNDHOUSE_HOST_ID"] = chosen
    node = f"gpu{gpu}@%h" if gpu is not None else f"{chosen}@%h"
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks",
        "worker",
        "-P",
        "prefork",
        "-c",
        "1",
        "-E",
        # Gossip subscribes every worker to every other's events (traffic that grows with the
        # square of the workers) and mingle asks them all at start-up: neither is needed here,
        # and a signed worker cannot say hello (docs/BENCHMARKS.md, "Idle workers in Redis").
        "--without-gossip",
        "--without-mingle",
        "-Q",
        queue_name(chosen),
        "-n",
        node,
        *extra,
    ]
    return argv, env


def _worker(args: argparse.Namespace) -> int:
    from tasks.gate import startup_problem

    if problem := startup_problem(get_settings()):
        print(f"roundhouse worker: {problem}", file=sys.stderr)
        return 2
    argv, env = worker_command(args.gpu, args.host_id, args.celery_args)
    os.execvpe(argv[0], argv, env)
    return 0  # pragma: no cover - exec does not return


def _redis(args: argparse.Namespace) -> int:
    from tasks.embedded_redis import server_argv
    from tasks.keys import ensure_keys

    os.makedirs(args.dir, exist_ok=True)
    directory = args.keys or get_settings().keys_dir or os.path.join("var", "keys")
    keys = ensure_keys(directory) if args.tls else None
    argv = server_argv(args.port, bind=args.bind, directory=args.dir, tls=keys, acl_file=args.aclfile)
    os.execv(argv[0], argv)
    return 0  # pragma: no cover


def _watch(args: argparse.Namespace) -> int:
    from tasks.client import RoundClient

    client = RoundClient()
    try:
        for event in client.events(args.host_id, since=args.since, idle_timeout_s=args.idle_timeout):
            print(json.dumps(event.to_json()), flush=True)
    except KeyboardInterrupt:
        return 130
    return 0


def _status(args: argparse.Namespace) -> int:
    from tasks.client import RoundClient

    client = RoundClient()
    shown = [client.heartbeat(args.host_id)] if args.host_id else client.hosts()
    print(json.dumps([beat for beat in shown if beat is not None], indent=2, sort_keys=True))
    return 0 if all(shown) else 1


def _settings(_: argparse.Namespace) -> int:
    values = get_settings().model_dump(mode="json")  # SecretStr fields come out masked
    for key in ("broker_url", "result_backend", "events_url"):
        if values.get(key):
            values[key] = _mask(values[key])
    print(json.dumps(values, indent=2, sort_keys=True))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import main as demo_main

    return demo_main(args.demo_args)


def _train(args: argparse.Namespace) -> int:
    from orchestrator.train import main as train_main

    return train_main(args.demo_args)


def _keys(args: argparse.Namespace) -> int:
    from tasks.keys import main as keys_main

    return keys_main(args.demo_args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roundhouse", description="Roundhouse: a GPU round executor.")
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("worker", help="run the Celery worker for one GPU")
    worker.add_argument("--gpu", type=int, default=None, help="the GPU index this worker owns")
    worker.add_argument(
        "--host-id", default=None, help="default: ROUNDHOUSE_HOST_ID, else <hostname>[-gpu<N>]"
    )
    worker.add_argument("celery_args", nargs=argparse.REMAINDER, help="more celery worker options, after --")
    redis_cmd = commands.add_parser("redis", help="run the embedded Redis server")
    redis_cmd.add_argument("--port", type=int, default=6379)
    redis_cmd.add_argument("--bind", default="127.0.0.1")
    redis_cmd.add_argument("--dir", default=os.path.join("var", "redis"))
    redis_cmd.add_argument("--tls", action="store_true", help="TLS only, with the development keys")
    redis_cmd.add_argument("--keys", default=None, help="keys dir (ROUNDHOUSE_KEYS_DIR, else var/keys)")
    redis_cmd.add_argument("--aclfile", default=None, help="users and their rules (deploy/redis/)")
    commands.add_parser("keys", help="development keys: roundhouse keys init DIR", add_help=False)
    watch = commands.add_parser("watch", help="print a worker's events, replayed then live")
    watch.add_argument("host_id")
    watch.add_argument("--since", type=int, default=None, help="only events with a larger seq")
    watch.add_argument("--idle-timeout", type=float, default=None, help="stop after this long without events")
    status = commands.add_parser("status", help="live workers, from their heartbeats")
    status.add_argument("host_id", nargs="?", default=None)
    commands.add_parser(
        "demo", help="DiLoCo training of a tiny model over real workers (options: see roundhouse demo -h)",
        add_help=False,
    )  # fmt: skip
    commands.add_parser(
        "train", help="DiLoCo training of your own model over the workers (options: see roundhouse train -h)",
        add_help=False,
    )  # fmt: skip
    commands.add_parser("settings", help="print the effective settings (secrets masked)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("demo", "train", "keys"):
        args.demo_args = extra  # these commands parse their own options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "celery_args", None) and args.celery_args[0] == "--":
        args.celery_args = args.celery_args[1:]
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "worker": _worker,
        "redis": _redis,
        "watch": _watch,
        "status": _status,
        "demo": _demo,
        "train": _train,
        "keys": _keys,
        "settings": _settings,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
