"""Decoding one shard file; shared by the executor and the sandboxed runner (no cache code)."""

from __future__ import annotations

from typing import Any

import torch

from executor.errors import BadArtifact

_ZIP_MAGIC = b"PK\x03\x04"


def load_shard_file(path: str) -> Any:
    """Decode one shard file: a ``torch.save`` object (weights_only, mmap when possible) or safetensors."""
    with open(path, "rb") as file:
        magic = file.read(8)
    try:
        if magic.startswith(_ZIP_MAGIC):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if magic[:1] == b"\x80":  # the legacy (pre-zip) torch.save format cannot be mapped
            return torch.load(path, map_location="cpu", weights_only=True)
        from safetensors.torch import load_file

        return load_file(path)
    except Exception as exc:
        raise BadArtifact(f"shard is neither a weights-only torch file nor safetensors: {exc}") from None
