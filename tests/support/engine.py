"""Shared material for engine tests: a tiny MLP, learnable zstd shards, the training script."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import zstandard

if TYPE_CHECKING:
    from tests.support.http_server import FaultServer

TRAIN_CODE = """
import torch.nn.functional as F
state = load_model(model_path)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
model.load_state_dict(state)
model = place_model(model)
opt = torch.optim.SGD(model.parameters(), lr=params.get("lr", 0.05))
for step in range(steps):
    should_stop()
    shard = get_shard((round_num * steps + step) % num_shards)
    x, y = shard["x"].to(device), shard["y"].to(device)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    emit_stats({"step": step_offset + step, "loss": loss})
emit_log(f"done {steps} steps on {device}")
save_model(model)
save_report({"final_loss": loss.item(), "steps": steps})
"""


def mlp_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_shards(root: Path, count: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    true_w = torch.randn(8, 1, generator=g)
    descriptors = []
    for i in range(count):
        x = torch.randn(256, 8, generator=g)
        buffer = io.BytesIO()
        torch.save({"x": x, "y": torch.tanh(x @ true_w)}, buffer)
        packed = zstandard.ZstdCompressor().compress(buffer.getvalue())
        (root / f"shard{i}.pt.zst").write_bytes(packed)
        descriptors.append({"name": f"shard{i}.pt.zst", "compression": "zstd", "size_bytes": len(packed)})
    return descriptors


def shard_descriptors(server: FaultServer, shards: list[dict], query: str | None = None) -> list[dict]:
    """``make_shards``' shards as descriptors served by ``server`` (``query``: a token in the URL)."""
    return [
        {"url": server.url(s["name"], query), "compression": "zstd", "size_bytes": s["size_bytes"]}
        for s in shards
    ]


def tiny_vit(image_size: int) -> torch.nn.Module:
    """A ViT image classifier of a few thousand weights (3 labels, 8-pixel patches), seeded."""
    from transformers import AutoConfig, AutoModelForImageClassification

    config = AutoConfig.for_model(
        "vit",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        image_size=image_size,
        patch_size=8,
        num_labels=3,
    )
    torch.manual_seed(0)
    return AutoModelForImageClassification.from_config(config)
