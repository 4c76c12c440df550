"""The two models ``bench.quant`` trains: the demo's MLP and a tiny GPT-2 built from a config.

Each is a :class:`BenchModel`: its initial state, its shards (zstd ``torch.save`` files, as
the demo ships them), the tenant script a worker runs, the script's params, and an
evaluation of a state on held-out data (the loss the table reports, computed by the bench,
never taken from a worker's report).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zstandard

from orchestrator.demo import TRAIN as DEMO_TRAIN
from orchestrator.demo import build_model as demo_model
from orchestrator.demo import build_shards as demo_shards


@dataclass
class BenchModel:
    name: str
    state: dict[str, torch.Tensor]
    shards: list[tuple[str, Path]]  # (name in the artifact store, local file)
    code: str
    params: dict[str, Any]
    batch_size: int
    evaluate: Callable[[dict[str, torch.Tensor]], float]

    @property
    def parameters(self) -> int:
        return sum(t.numel() for t in self.state.values() if t.is_floating_point())


# ---------------------------------------------------------------- the demo's MLP


def mlp(directory: Path) -> BenchModel:
    """``roundhouse demo``'s model, shards and script, evaluated on all its shards."""
    shards = demo_shards(directory)
    data = [_load_shard(path) for _, path in shards]

    def evaluate(state: dict[str, torch.Tensor]) -> float:
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        model.load_state_dict(state)
        with torch.no_grad():
            losses = [torch.nn.functional.mse_loss(model(d["x"]), d["y"]).item() for d in data]
        return sum(losses) / len(losses)

    return BenchModel("demo MLP", demo_model(), shards, DEMO_TRAIN, {"lr": 0.05}, 32, evaluate)


def _load_shard(path: Path) -> dict[str, torch.Tensor]:
    raw = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    loaded = torch.load(io.BytesIO(raw), weights_only=True)
    assert isinstance(loaded, dict)
    return loaded


# ---------------------------------------------------------------- a tiny GPT-2

GPT2_CONFIG = {
    "vocab_size": 64,
    "n_positions": 32,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "tie_word_embeddings": False,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
SEQUENCES_PER_SHARD = 256

GPT2_TRAIN = """
import zlib
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(zlib.crc32(host_id.encode()) + round_num)
model = GPT2LMHeadModel(GPT2Config(**params["config"]))
model.load_state_dict(load_model(model_path))
model = place_model(model)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], weight_decay=0.0)
first = zlib.crc32(host_id.encode())
losses = []
for step in range(steps):
    should_stop()
    ids = get_shard((first + step_offset + step) % num_shards)["ids"]
    rows = torch.randint(0, ids.shape[0], (batch_size,))
    batch = ids[rows].to(device)
    loss = model(input_ids=batch, labels=batch).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
save_model(model)
save_report({"final_loss": sum(losses[-5:]) / len(losses[-5:])})
"""


def _markov_text(generator: torch.Generator, rows: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences from a fixed, sparse order-1 Markov chain: a language a small model can learn."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(vocab, vocab, generator=g) * 3
    transition = torch.softmax(logits, dim=1)
    out = torch.empty(rows, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (rows,), generator=generator)
    for t in range(1, length):
        out[:, t] = torch.multinomial(transition[out[:, t - 1]], 1, generator=generator).squeeze(1)
    return out


def gpt2(directory: Path, shard_count: int = 4) -> BenchModel:
    """A 2-layer GPT-2 (about 0.1 M parameters) from a config, on a synthetic Markov language."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    vocab, length = int(str(GPT2_CONFIG["vocab_size"])), int(str(GPT2_CONFIG["n_positions"]))
    shards = []
    for index in range(shard_count):
        buffer = io.BytesIO()
        torch.save({"ids": _markov_text(g, SEQUENCES_PER_SHARD, length, vocab)}, buffer)
        path = directory / f"gpt2-shard-{index}.pt.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))
        shards.append((f"gpt2/shard-{index}.pt.zst", path))
    held_out = _markov_text(torch.Generator().manual_seed(99), 128, length, vocab)

    def evaluate(trained: dict[str, torch.Tensor]) -> float:
        evaluated = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
        evaluated.load_state_dict(trained)
        evaluated.eval()
        with torch.no_grad():
            return float(evaluated(input_ids=held_out, labels=held_out).loss)

    params = {"lr": 3e-3, "config": GPT2_CONFIG}
    return BenchModel("tiny GPT-2", state, shards, GPT2_TRAIN, params, 16, evaluate)


MODELS: dict[str, Callable[[Path], BenchModel]] = {"mlp": mlp, "gpt2": gpt2}
