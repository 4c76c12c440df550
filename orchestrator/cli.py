"""The ``roundhouse`` command: the worker side's subcommands and the orchestrator's, in one.

``roundhouse train`` (:mod:`orchestrator.train`) and ``roundhouse demo``
(:mod:`orchestrator.demo`) run an orchestrator; every other subcommand (``worker``,
``flower``, ``redis``, ``keys``, ``watch``, ``status``, ``settings``) is :mod:`tasks.cli`'s.
The entry point stands here, on top of both, so that ``tasks`` never imports the
orchestrator. ``python -m orchestrator.cli`` is the same command.
"""

from __future__ import annotations

import argparse
import sys

from tasks.cli import Subcommand
from tasks.cli import command_parser as worker_parser
from tasks.cli import main as worker_main


def _demo(argv: list[str]) -> int:
    # Imported when run: `roundhouse worker` and the others never load the orchestrator (torch).
    from orchestrator.demo import main as demo_main

    return demo_main(argv)


def _train(argv: list[str]) -> int:
    from orchestrator.train import main as train_main

    return train_main(argv)


COMMANDS = {
    "demo": Subcommand(
        "DiLoCo training of a tiny model over real workers (options: see roundhouse demo -h)", _demo
    ),
    "train": Subcommand(
        "DiLoCo training of your own model over the workers (options: see roundhouse train -h)", _train
    ),
}


def command_parser() -> argparse.ArgumentParser:
    """The whole command's parser: every subcommand, ``demo`` and ``train`` included."""
    return worker_parser(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return worker_main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
