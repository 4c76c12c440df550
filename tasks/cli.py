"""The worker side of the ``roundhouse`` command line (:mod:`orchestrator.cli` adds ``train``
and ``demo`` on top: this package does not import the orchestrator).

- ``roundhouse worker [--gpu N] [--host-id ID] [--keys DIR] [-- celery options]``: one worker
  for one GPU: sets ``CUDA_VISIBLE_DEVICES`` before anything starts, names the node
  ``gpu<N>@%h``, consumes only ``roundhouse.<host_id>``, ``-P prefork -c 1 -E``.
- ``roundhouse flower [--keys DIR] [--address A] [--port P] [-- flower options]``: Flower, on
  127.0.0.1 unless told otherwise, refusing to start without a password (``FLOWER_BASIC_AUTH``).
  ``--keys DIR`` (both): the role's own directory of a ``roundhouse keys init`` set, made when
  missing, and no other key (``role_env``).
- ``roundhouse redis [--port P] [--dir D] [--tls] [--aclfile F]``: the embedded Redis for
  the Procfile and the demo (``tasks.embedded_redis``; ``--tls``: with the development keys).
- ``roundhouse keys init DIR``: development keys of the signed control plane (``tasks.trust.keys``).
- ``roundhouse watch <host_id> [--since SEQ]``: a worker's events, replayed then live.
- ``roundhouse status [host_id]``: live workers from their heartbeats.
- ``roundhouse settings``: the settings.

``command_parser(more)`` and ``main(argv, more)`` take the subcommands of a package above
(``Subcommand``: each parses its own options); the ``roundhouse`` entry point passes
``train`` and ``demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from settings import get_settings
from tasks.names import queue_name


def mask_password(url: str) -> str:
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


# What each role of a deployment is given from a `roundhouse keys init` directory (tasks.trust.keys):
# its own directory's paths, every other key setting blanked, so that neither
# ROUNDHOUSE_KEYS_DIR (which names the orchestrator's key) nor a .env file adds one.
_KEY_SETTINGS = ("TRUSTED_CERTS", "CONTROL_CERTS", "SIGNING_KEY", "SIGNING_CERT", "TLS_CA_FILE", "KEYS_DIR")
_ROLE_PATHS = {
    "worker": {"TRUSTED_CERTS": "trusted", "CONTROL_CERTS": "control", "TLS_CA_FILE": "ca.crt"},
    "flower": {"SIGNING_KEY": "flower.key", "SIGNING_CERT": "flower.crt", "TLS_CA_FILE": "ca.crt"},
}
# Flower's password: set by the operator, never a default a file of this project once held.
FLOWER_MIN_PASSWORD = 12
FLOWER_KNOWN_PASSWORDS = frozenset({"change-me", "changeme", "password", "secret"})


def role_env(role: str, keys_dir: str) -> dict[str, str]:
    """The ``ROUNDHOUSE_*`` key settings of ``role`` ("worker", "flower") for ``keys_dir``."""
    paths = _ROLE_PATHS[role]
    root = os.path.join(keys_dir, role)
    return {
        f"ROUNDHOUSE_{name}": os.path.join(root, paths[name]) if name in paths else ""
        for name in _KEY_SETTINGS
    }


def _take_keys(role: str, keys_dir: str | None) -> None:
    if keys_dir:
        from tasks.trust.keys import ensure_keys

        ensure_keys(keys_dir)
        os.environ.update(role_env(role, keys_dir))  # before the settings are first read


def flower_problem(env: Mapping[str, str], extra: list[str]) -> str | None:
    """Why Flower must not start, or None: it commands the workers (revoke, shutdown …)
    to whoever logs in, so it needs a password the operator set."""
    options = {arg.lstrip("-").split("=", 1)[0].replace("-", "_") for arg in extra if arg.startswith("--")}
    if options & {"basic_auth", "unauthenticated_api"}:
        return "Flower's login is FLOWER_BASIC_AUTH only (not --basic-auth: ps shows it; not unauthenticated)"
    if env.get("FLOWER_UNAUTHENTICATED_API", "").strip().lower() in ("1", "true", "yes", "on"):
        return "FLOWER_UNAUTHENTICATED_API would let anyone who reaches Flower command the workers"
    entries = [entry for entry in env.get("FLOWER_BASIC_AUTH", "").split(",") if entry.strip()]
    if not entries:
        return "FLOWER_BASIC_AUTH is not set: set it to user:password (a password of your own)"
    for entry in entries:
        user, _, password = entry.strip().partition(":")
        if not user or password.lower() in FLOWER_KNOWN_PASSWORDS or len(password) < FLOWER_MIN_PASSWORD:
            return (
                f"FLOWER_BASIC_AUTH: {user or '(no user)'}'s password is missing, a known default or "
                f"shorter than {FLOWER_MIN_PASSWORD} characters: set one of your own"
            )
    return None


def flower_command(address: str, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks",
        "flower",
        f"--address={address}",
        f"--port={port}",
        *extra,
    ]


def _flower(args: argparse.Namespace) -> int:
    if problem := flower_problem(os.environ, args.flower_args):
        print(f"roundhouse flower: refusing to start: {problem}", file=sys.stderr)
        return 2
    _take_keys("flower", args.keys)
    argv = flower_command(args.address, args.port, args.flower_args)
    os.execv(argv[0], argv)
    return 0  # pragma: no cover - exec does not return


def _worker(args: argparse.Namespace) -> int:
    from tasks.trust.gate import startup_problem

    _take_keys("worker", args.keys)
    if problem := startup_problem(get_settings()):
        print(f"roundhouse worker: {problem}", file=sys.stderr)
        return 2
    argv, env = worker_command(args.gpu, args.host_id, args.celery_args)
    os.execvpe(argv[0], argv, env)
    return 0  # pragma: no cover - exec does not return


def _redis(args: argparse.Namespace) -> int:
    from tasks.embedded_redis import server_argv
    from tasks.trust.keys import ensure_keys

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
            values[key] = mask_password(values[key])
    print(json.dumps(values, indent=2, sort_keys=True))
    return 0


@dataclass(frozen=True)
class Subcommand:
    """A subcommand that parses its own options: ``run`` is given the rest of the command line."""

    help: str
    run: Callable[[list[str]], int]


def _keys(argv: list[str]) -> int:
    from tasks.trust.keys import main as keys_main

    return keys_main(argv)


KEYS = Subcommand("development keys: roundhouse keys init DIR", _keys)


def command_parser(more: Mapping[str, Subcommand] | None = None) -> argparse.ArgumentParser:
    """The parser of this package's subcommands and of ``more`` (a package above's)."""
    parser = argparse.ArgumentParser(prog="roundhouse", description="Roundhouse: a GPU round executor.")
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("worker", help="run the Celery worker for one GPU")
    worker.add_argument("--gpu", type=int, default=None, help="the GPU index this worker owns")
    worker.add_argument(
        "--host-id", default=None, help="default: ROUNDHOUSE_HOST_ID, else <hostname>[-gpu<N>]"
    )
    keys_help = "take this role's keys from DIR/<role>/ of `roundhouse keys init DIR` (made when missing)"
    worker.add_argument("--keys", default=None, metavar="DIR", help=keys_help)
    worker.add_argument("celery_args", nargs=argparse.REMAINDER, help="more celery worker options, after --")
    flower = commands.add_parser("flower", help="run Flower (needs FLOWER_BASIC_AUTH)")
    flower.add_argument("--keys", default=None, metavar="DIR", help=keys_help)
    flower.add_argument("--address", default="127.0.0.1", help="the address Flower listens on (127.0.0.1)")
    flower.add_argument("--port", type=int, default=5555)
    flower.add_argument("flower_args", nargs=argparse.REMAINDER, help="more celery flower options, after --")
    redis_cmd = commands.add_parser("redis", help="run the embedded Redis server")
    redis_cmd.add_argument("--port", type=int, default=6379)
    redis_cmd.add_argument("--bind", default="127.0.0.1")
    redis_cmd.add_argument("--dir", default=os.path.join("var", "redis"))
    redis_cmd.add_argument("--tls", action="store_true", help="TLS only, with the development keys")
    redis_cmd.add_argument("--keys", default=None, help="keys dir (ROUNDHOUSE_KEYS_DIR, else var/keys)")
    redis_cmd.add_argument("--aclfile", default=None, help="users and their rules (deploy/redis/)")
    commands.add_parser("keys", help=KEYS.help, add_help=False)
    watch = commands.add_parser("watch", help="print a worker's events, replayed then live")
    watch.add_argument("host_id")
    watch.add_argument("--since", type=int, default=None, help="only events with a larger seq")
    watch.add_argument("--idle-timeout", type=float, default=None, help="stop after this long without events")
    status = commands.add_parser("status", help="live workers, from their heartbeats")
    status.add_argument("host_id", nargs="?", default=None)
    for name, subcommand in (more or {}).items():
        commands.add_parser(name, help=subcommand.help, add_help=False)
    commands.add_parser("settings", help="print the effective settings (secrets masked)")
    return parser


def main(argv: list[str] | None = None, more: Mapping[str, Subcommand] | None = None) -> int:
    parser = command_parser(more)
    args, extra = parser.parse_known_args(argv)
    own_options = {"keys": KEYS, **(more or {})}
    if args.command in own_options:
        return own_options[args.command].run(extra)  # these commands parse their own options
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    for name in ("celery_args", "flower_args"):
        if getattr(args, name, None) and getattr(args, name)[0] == "--":
            setattr(args, name, getattr(args, name)[1:])
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "worker": _worker,
        "flower": _flower,
        "redis": _redis,
        "watch": _watch,
        "status": _status,
        "settings": _settings,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
