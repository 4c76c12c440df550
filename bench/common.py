"""What every benchmark does the same way: its scratch directory, its size and run
arguments, and where its JSON goes."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def add_size_and_runs(
    parser: argparse.ArgumentParser, mb: int, runs: int, mb_help: str = "size in MiB"
) -> None:
    parser.add_argument("--mb", type=int, default=mb, help=mb_help)
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument(
        "--dir", default=None, help="where to put the files (default: a temp dir under ./var)"
    )


@contextmanager
def scratch(parent: str | None = None) -> Iterator[Path]:
    """A temp directory under ``parent`` (default ./var, on the disk being measured rather
    than a tmpfs), absolute (nginx and redis-server resolve paths from their own working
    directory), removed afterwards."""
    root = Path(parent or "var")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        yield Path(tmp).resolve()


def save(name: str, record: dict[str, Any]) -> Path:
    """``bench/results/<name>.json``."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2))
    return path
