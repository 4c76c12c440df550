"""``roundhouse demo`` as a user runs it: embedded Redis, two real workers, a falling loss, a plot;
signed with development keys it makes when missing, its Redis over TLS on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tasks.embedded_redis import tls_binary
from tasks.trust.keys import DevKeys
from tests.support.worker import REPO

pytestmark = pytest.mark.timeout(300)


def test_demo_trains_and_plots(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDHOUSE_")}
    out = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "demo", "--rounds", "4", "--steps", "20",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "loss fell from" in run.stdout and "every worker holds the orchestrator's model" in run.stdout
    over = "TLS" if tls_binary() is not None else "plain"
    assert f"Redis: {over}, loopback only" in run.stdout, run.stdout[-2000:]
    assert "control plane: signed with the keys in" in run.stdout, run.stdout[-2000:]
    assert DevKeys(REPO / "var" / "keys").complete()
    png = out / "loss.png"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] >= 400 and image.size[1] >= 300
        colors = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colors is None or len(colors) > 50, "the plot is blank"


def test_demo_overlapped_trains_and_every_worker_ends_on_the_model(tmp_path: Path) -> None:
    """``roundhouse demo --overlap`` (docs/OVERLAP.md): the same preset with overlapped rounds; the
    demo's own check (the loss fell by a fifth, every worker holds the final model) must pass."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDHOUSE_")}
    run = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "demo", "--overlap", "--rounds", "4", "--steps", "20",
         "--out", str(tmp_path / "demo")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "loss fell from" in run.stdout and "every worker holds the orchestrator's model" in run.stdout
    rounds = [line for line in run.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 4 and all("hosts 2" in line for line in rounds), rounds
