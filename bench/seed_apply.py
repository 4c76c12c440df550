"""The seed executor's way of applying a sync delta, as the baseline for ``bench.sync_delta``.

Load the whole base, hash it, decompress the delta to a file on disk, load that, add
in place, hash the result, save the whole state to a temp file and rename it. Kept
here (not in the product) only to be measured against.
"""

from __future__ import annotations

import os

import torch
import zstandard
from safetensors.torch import load_file, save_file

from executor.delta import state_hash


def seed_apply(model_path: str, delta_path: str, base_hash: str, result_hash: str) -> None:
    base = load_file(model_path)
    base = {k: v.clone() for k, v in base.items()}  # the seed loaded without mmap
    if state_hash(base) != base_hash:
        raise RuntimeError("base hash mismatch")
    raw = delta_path + ".raw"
    with open(delta_path, "rb") as source, open(raw, "wb") as target:
        zstandard.ZstdDecompressor().copy_stream(source, target)
    delta = load_file(raw)
    result: dict[str, torch.Tensor] = {}
    for key in list(base):
        tensor = base.pop(key).float()
        change = delta.pop(key, None)
        if change is not None:
            tensor = tensor.contiguous().add_(change.float())
        result[key] = tensor
    if state_hash(result) != result_hash:
        raise RuntimeError("result hash mismatch")
    tmp = model_path + ".tmp"
    save_file(result, tmp)
    os.replace(tmp, model_path)
    os.unlink(raw)
