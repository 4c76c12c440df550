"""``python -m orchestrator.engine_demo``: the engine end to end on a tiny model, no Celery.

An HTTP server serves the model and three zstd microshards; one Executor loads
them, trains a few rounds, ships each trained delta back; a minimal outer loop
(the orchestrator's part) folds the delta into the global model, builds the fp16
sync delta and the worker applies it with the bit-exact hash check. The loss
per round is printed and must fall. (The full orchestrator demo with Celery
workers is ``roundhouse demo``.)
"""

from __future__ import annotations

import io
import logging
import sys
import tempfile
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import zstandard
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from executor import Executor
from executor.delta import make_sync_delta, read_delta, write_delta
from settings import Settings

ROUNDS = 5
STEPS = 25

TRAIN = """
import torch.nn.functional as F
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model.load_state_dict(load_model(model_path))
model = place_model(model)
opt = torch.optim.SGD(model.parameters(), lr=params["lr"])
losses = []
for step in range(steps):
    should_stop()
    shard = get_shard((round_num * steps + step) % num_shards)
    x, y = shard["x"].to(device), shard["y"].to(device)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    emit_stats({"round": round_num, "step": step_offset + step, "loss": losses[-1]})
save_model(model)
save_report({"first_loss": losses[0], "last_loss": losses[-1]})
"""


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build_artifacts(root: Path) -> list[dict[str, object]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(16, 1, generator=g) / 4
    shards = []
    for i in range(3):
        x = torch.randn(512, 16, generator=g)
        buffer = io.BytesIO()
        torch.save({"x": x, "y": torch.tanh(x @ true_w)}, buffer)
        packed = zstandard.ZstdCompressor().compress(buffer.getvalue())
        (root / f"shard{i}.pt.zst").write_bytes(packed)
        shards.append({"name": f"shard{i}.pt.zst", "compression": "zstd", "size_bytes": len(packed)})
    return shards


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="roundhouse-demo-") as tmp:
        root = Path(tmp) / "artifacts"
        root.mkdir()
        shards = build_artifacts(root)
        server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        # The demo serves its artifacts on loopback: opened for it by name (DESIGN §11).
        settings = Settings(
            work_dir=f"{tmp}/work", cache_dir=f"{tmp}/cache", host_id="demo", url_allow=["127.0.0.1"]
        )
        stats: list[dict[str, object]] = []
        ex = Executor(stats.append, lambda line: console.print(f"[dim]{line}[/dim]"), settings=settings)
        try:
            return _rounds(console, ex, root, base, shards)
        finally:
            ex.shutdown()
            server.shutdown()


def _rounds(console: Console, ex: Executor, root: Path, base: str, shards: list[dict[str, object]]) -> int:
    descriptors = [{**s, "url": f"{base}/{s['name']}"} for s in shards]
    loaded = ex.load(f"{base}/model.safetensors", descriptors, TRAIN, params={"lr": 0.2})
    console.print(f"loaded model {loaded.model_hash[:23]}… ({loaded.model_keys} tensors)")
    table = Table(title="Roundhouse engine demo")
    for column in ("round", "first loss", "last loss", "delta bytes", "sync via", "model hash"):
        table.add_column(column)
    global_state = load_file(str(root / "model.safetensors"))
    losses: list[float] = []
    start_loss = 0.0
    for round_num in range(ROUNDS):
        result = ex.run_round(steps=STEPS, round_num=round_num, total_rounds=ROUNDS)
        if result.error is not None or result.delta is None or result.delta.path is None:
            console.print(f"[red]round {round_num} failed: {result.error}[/red]")
            return 1
        delta = read_delta(result.delta.path)
        new_state = {k: v + delta[k].float() if k in delta else v for k, v in global_state.items()}
        sync = make_sync_delta(global_state, new_state)
        write_delta(sync.delta, str(root / f"sync{round_num}.zst"))
        save_file(sync.result, str(root / f"model-r{round_num}.safetensors"))
        outcome = ex.update_model(
            f"{base}/model-r{round_num}.safetensors",
            delta_url=f"{base}/sync{round_num}.zst",
            base_hash=sync.base_hash,
            result_hash=sync.result_hash,
        )
        global_state = sync.result
        report = result.report or {}
        start_loss = start_loss or float(report["first_loss"])
        losses.append(float(report["last_loss"]))
        table.add_row(
            str(round_num),
            f"{report['first_loss']:.4f}",
            f"{report['last_loss']:.4f}",
            str(result.delta.bytes),
            outcome.via.value,
            outcome.model_hash[7:19],
        )
    console.print(table)
    if not losses[-1] < losses[0]:
        console.print("[red]the loss did not fall[/red]")
        return 1
    console.print(
        f"loss fell from {start_loss:.4f} (untrained) to {losses[0]:.4f} after round 0 "
        f"and {losses[-1]:.4f} after round {ROUNDS - 1}; every sync was bit-exact"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
