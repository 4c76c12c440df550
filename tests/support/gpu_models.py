"""The GPU checks' models and data: a timm ResNet and a small Hugging Face GPT-2, built from
configs (no hub), their shards, and one training script that both the executor and the
bare PyTorch loop of ``bench.gpu`` run, so that the two are timed on the same work."""

from __future__ import annotations

import io
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zstandard
from safetensors.torch import save_file

# The step loop, shared word for word by the tenant script and the bare loop. It syncs once
# per step (loss.item()), as a training loop that logs its loss does.
STEP_LOOP = """
def batch_of(shard):
    if "pixel_values" in shard:
        return {"x": shard["pixel_values"].to(device, non_blocking=True).float().div_(255),
                "y": shard["labels"].to(device, non_blocking=True)}
    ids = shard["input_ids"].to(device, non_blocking=True)
    return {"input_ids": ids, "labels": ids}

def loss_of(model, batch):
    if "x" in batch:
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    return model(**batch).loss

def train(model, steps, num_shards, shard_at, on_step):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    marks = []
    for step in range(steps):
        batch = batch_of(shard_at(step % num_shards))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        on_step(step, value)
        marks.append(time.perf_counter())  # step 0 pays cuDNN autotuning and allocator growth
    # Where a gap comes from: the median step of the later half (steady state) and the size
    # of the model that trained (an untied head would be a bigger model, not a slower loop).
    late = sorted(b - a for a, b in zip(marks[len(marks) // 2 :], marks[len(marks) // 2 + 1 :]))
    detail = {"late_step_ms": 1e3 * late[len(late) // 2] if late else None,
              "params": sum(p.numel() for p in model.parameters())}
    return (steps - 1) / (marks[-1] - marks[0]), value, detail
"""

TENANT_CODE = (
    "import time\n"
    + STEP_LOOP
    + """
model = place_model(materialize_model(load_model(model_path)))
def on_step(step, value):
    should_stop()
    emit_stats({"step": step, "loss": value})
steps_per_s, last, detail = train(model, steps, num_shards, get_shard, on_step)
save_model(model)
save_report({"steps_per_s": steps_per_s, "loss": last, "device": str(device), **detail})
"""
)


def sandbox_mode() -> str:
    """``auto`` when bwrap or unshare can build the sandbox here; else ``off`` (recorded)."""
    probes = [
        ["bwrap", "--ro-bind", "/", "/", "--unshare-net", "true"],
        ["unshare", "--net", "--pid", "--fork", "true"],
    ]
    for argv in probes:
        if shutil.which(argv[0]) and subprocess.run(argv, capture_output=True, check=False).returncode == 0:
            return "auto"
    return "off"


@dataclass(frozen=True)
class GpuCase:
    name: str
    model_file: str
    shard_files: list[str]
    params: dict[str, Any]

    def build(self) -> torch.nn.Module:
        """The same architecture the executor materializes from ``params``."""
        if self.params.get("model_backend") == "huggingface":
            from transformers import AutoConfig, AutoModelForCausalLM

            config = dict(self.params["hf_config"])
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
        import timm

        return timm.create_model(
            self.params["model_name"], pretrained=False, num_classes=self.params["num_classes"]
        )


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    path.write_bytes(zstandard.ZstdCompressor().compress(buffer.getvalue()))


def make_cases(root: Path, shards: int = 4) -> dict[str, GpuCase]:
    """Write both models' weights and shards under ``root``; names are relative to it."""
    generator = torch.Generator().manual_seed(5)
    timm_case = GpuCase(
        "timm resnet50",
        "resnet50.safetensors",
        [f"img{i}.pt.zst" for i in range(shards)],
        {"model_name": "resnet50", "model_backend": "timm", "num_classes": 100, "train_mode": "all"},
    )
    hf_case = GpuCase(
        "hf gpt2 (6 layers)",
        "gpt2.safetensors",
        [f"tok{i}.pt.zst" for i in range(shards)],
        {
            "model_backend": "huggingface",
            "model_name": "gpt2",
            "hf_task": "causal-lm",
            "hf_config": {
                "model_type": "gpt2",
                "n_layer": 6,
                "n_embd": 512,
                "n_head": 8,
                "vocab_size": 8192,
                "bos_token_id": 0,
                "eos_token_id": 0,
            },
            "train_mode": "all",
        },
    )
    for case in (timm_case, hf_case):
        torch.manual_seed(0)
        model = case.build()
        # Tied weights (GPT-2's head) are stored once, as save_pretrained stores them.
        seen: set[int] = set()
        unique = {}
        for key, tensor in model.state_dict().items():
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in seen:
                seen.add(pointer)
                unique[key] = tensor.detach().contiguous().clone()
        save_file(unique, str(root / case.model_file))
    for index in range(shards):
        _write_shard(
            root / timm_case.shard_files[index],
            {
                "pixel_values": torch.randint(
                    0, 256, (64, 3, 160, 160), dtype=torch.uint8, generator=generator
                ),
                "labels": torch.randint(0, 100, (64,), generator=generator),
            },
        )
        _write_shard(
            root / hf_case.shard_files[index],
            {"input_ids": torch.randint(0, 8192, (16, 512), generator=generator)},
        )
    return {"timm": timm_case, "hf": hf_case}


def bare_loop(case: GpuCase, root: Path, steps: int) -> tuple[float, dict[str, Any]]:
    """Steps/s (and the loop's detail) of the same script run as plain PyTorch in this
    process: the reference."""
    from executor.shards import load_shard_file

    namespace: dict[str, Any] = {"torch": torch, "device": torch.device("cuda")}
    exec("import time\n" + STEP_LOOP, namespace)
    shards = []
    for name in case.shard_files:
        raw = zstandard.ZstdDecompressor().decompress((root / name).read_bytes())
        decoded = root / (name + ".bare")
        decoded.write_bytes(raw)
        shards.append(load_shard_file(str(decoded)))
    torch.manual_seed(0)
    model = case.build()
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(root / case.model_file)), strict=False)
    model = model.to("cuda")
    steps_per_s, _, detail = namespace["train"](
        model, steps, len(shards), shards.__getitem__, lambda _s, _v: None
    )
    del model
    torch.cuda.empty_cache()
    return float(steps_per_s), dict(detail)
