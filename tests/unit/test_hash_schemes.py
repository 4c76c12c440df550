"""The state hash's two schemes (``sha256:``, ``blake3:``) and the state hash of a safetensors
file computed from its bytes as they arrive (``delta.StreamStateHash``), which ``load_model``
uses to hash the model while it downloads."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import save_file

from executor.delta import (
    SCHEMES,
    StreamStateHash,
    apply_sync_delta,
    file_state_hash,
    make_sync_delta,
    scheme_of,
    state_hash,
    write_delta,
)
from executor.errors import HashMismatch, InvalidRequest
from executor.tensorfile import write_state
from tests.support.vectors import decode

VECTORS = Path(__file__).resolve().parents[1] / "vectors"


def _layout_bytes(encoded: dict[str, dict[str, object]]) -> bytes:
    """DESIGN §4's bytes, written out by hand from the vectors' hex (no project code)."""
    out = b""
    for name in sorted(encoded):
        entry = encoded[name]
        key, kind, dims = name.encode(), str(entry["dtype"]).encode(), list(entry["shape"])  # type: ignore[call-overload]
        out += struct.pack("<I", len(key)) + key + struct.pack("<I", len(kind)) + kind
        out += struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += bytes.fromhex(str(entry["hex"]))
    return out


def test_both_schemes_match_the_shared_vectors_and_the_layout_by_hand() -> None:
    source = json.loads((VECTORS / "sync_delta_v1.json").read_text())["vectors"]
    pinned = json.loads((VECTORS / "hash_schemes_v1.json").read_text())["vectors"]
    assert len(source) == len(pinned)
    for vector, hashes in zip(source, pinned, strict=True):
        assert vector["delta_dtype"] == hashes["delta_dtype"]
        for part in ("base", "delta", "result"):
            state = decode(vector[part])
            raw = _layout_bytes(vector[part])
            assert hashes["hashes"][part]["sha256"] == "sha256:" + hashlib.sha256(raw).hexdigest()
            assert hashes["hashes"][part]["blake3"] == "blake3:" + blake3.blake3(raw).hexdigest()
            for scheme in SCHEMES:
                assert state_hash(state, scheme=scheme) == hashes["hashes"][part][scheme], (part, scheme)
        assert vector["base_hash"] == hashes["hashes"]["base"]["sha256"]  # sha256 stays the default


def test_a_hash_names_its_scheme() -> None:
    assert scheme_of("blake3:ab") == "blake3" and scheme_of("sha256:ab") == "sha256"
    assert scheme_of("md5:ab", "sha256") == "sha256"  # compared in the default: it cannot match
    with pytest.raises(InvalidRequest):
        scheme_of("md5:ab")
    with pytest.raises(InvalidRequest):
        state_hash({}, scheme="md5")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "b.weight": torch.randn(300, 7, generator=g),
        "a.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "norm.num_batches_tracked": torch.tensor(9),
        "empty": torch.empty(0, 4),
        "c": torch.arange(1000, dtype=torch.int16),
    }


def _fed(path: Path, scheme: str, step: int) -> str | None:
    digest = StreamStateHash(scheme)
    data = path.read_bytes()
    for start in range(0, len(data), step):
        digest.update(memoryview(data)[start : start + step])
    return digest.hexdigest()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_the_stream_hash_of_a_key_ordered_file_is_its_state_hash(
    tmp_path: Path, scheme: str, step: int
) -> None:
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as file:
        write_state(file, _state())  # sorted key order, as every writer of the project
    assert (
        _fed(path, scheme, step)
        == file_state_hash(str(path), scheme=scheme)
        == state_hash(_state(), scheme=scheme)
    )


def test_the_stream_hash_declines_what_it_cannot_follow(tmp_path: Path) -> None:
    state = _state()
    grouped = tmp_path / "grouped.safetensors"
    save_file(state, str(grouped))  # safetensors groups keys by dtype: not key order
    assert _fed(grouped, "sha256", 4096) is None
    ordered = tmp_path / "ordered.safetensors"
    with open(ordered, "wb") as file:
        write_state(file, state)
    data = ordered.read_bytes()
    (tmp_path / "short").write_bytes(data[:-10])
    assert _fed(tmp_path / "short", "sha256", 4096) is None  # ended early
    (tmp_path / "zip").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert _fed(tmp_path / "zip", "sha256", 4096) is None
    (tmp_path / "bad").write_bytes(struct.pack("<Q", 5) + b"{oops" + b"\0" * 64)
    assert _fed(tmp_path / "bad", "sha256", 3) is None
    (tmp_path / "trailing").write_bytes(data + b"extra bytes after the tensors")
    assert _fed(tmp_path / "trailing", "sha256", 4096) == file_state_hash(str(ordered))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_apply_follows_the_scheme_of_its_hashes(tmp_path: Path, scheme: str) -> None:
    base = {"w": torch.randn(64, 32), "n": torch.tensor(3)}
    new = {"w": base["w"] + 0.01, "n": base["n"]}
    sync = make_sync_delta(base, new, scheme=scheme)
    assert sync.base_hash.startswith(scheme + ":") and sync.result_hash.startswith(scheme + ":")
    model, delta = tmp_path / "m.safetensors", tmp_path / "d.zst"
    with open(model, "wb") as file:
        write_state(file, base)
    write_delta(sync.delta, str(delta))
    other = "sha256" if scheme == "blake3" else "blake3"
    with pytest.raises(HashMismatch):  # a base hash of another state, in the other scheme
        apply_sync_delta(
            str(model), str(delta), base_hash=state_hash(new, scheme=other), result_hash=sync.result_hash
        )
    # Each hash is checked in the scheme it names, even when the two differ.
    apply_sync_delta(
        str(model), str(delta), base_hash=state_hash(base, scheme=other), result_hash=sync.result_hash
    )
    assert file_state_hash(str(model), scheme=scheme) == sync.result_hash
