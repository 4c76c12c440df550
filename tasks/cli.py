"""The ``roundhouse`` command line.

``roundhouse demo`` runs the engine demo; ``roundhouse settings`` prints the
effective settings (from the environment and ``.env``), with secrets in URLs
masked. The worker, watch, status and redis commands arrive with the Celery
worker.
"""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import urlsplit, urlunsplit

from settings import get_settings


def _mask(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        port = f":{parts.port}" if parts.port else ""
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}{port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


def _settings() -> int:
    values = get_settings().model_dump()
    for key in ("broker_url", "result_backend", "events_url"):
        if values.get(key):
            values[key] = _mask(values[key])
    print(json.dumps(values, indent=2, sort_keys=True))
    return 0


def _demo() -> int:
    from executor.demo import main as demo_main

    return demo_main()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roundhouse", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="train a tiny model through the engine, end to end")
    commands.add_parser("settings", help="print the effective settings (secrets masked)")
    args = parser.parse_args(argv)
    handlers = {"demo": _demo, "settings": _settings}
    return handlers[args.command]()


if __name__ == "__main__":
    sys.exit(main())
