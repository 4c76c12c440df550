"""The bit-exact sync delta (DESIGN §4): hash, build, apply, wire format."""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from executor import delta as D  # noqa: N812 - short alias, used on every line
from executor.delta import _apply as delta_apply
from executor.delta import _sync as delta_sync
from executor.delta import apply_sync_delta
from executor.errors import BadArtifact, HashMismatch, Stopped
from executor.tensorfile import dtype_from_name, tensor_bytes, write_state
from tests.support.vectors import decode

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "sync_delta_v1.json"


def spec_hash(state: dict[str, torch.Tensor]) -> str:
    """The hash written straight from DESIGN §4's text, independent of executor.delta."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].contiguous()
        kb = key.encode("utf-8")
        dn = str(t.dtype).replace("torch.", "").encode()
        h.update(struct.pack("<I", len(kb)) + kb + struct.pack("<I", len(dn)) + dn)
        h.update(struct.pack("<I", t.dim()) + b"".join(struct.pack("<Q", d) for d in t.shape))
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def write_model(path: Path, state: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as file:
        write_state(file, state)


@pytest.fixture(scope="module")
def vectors() -> list[dict]:
    return json.loads(VECTORS.read_text())["vectors"]


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(33, 17, generator=g),
        "a.bias": torch.randn(17, generator=g).half(),
        "b.weight": torch.randn(9, generator=g).bfloat16(),
        "steps": torch.tensor(3),
        "mask": torch.tensor([True, False]),
    }


def test_state_hash_matches_the_spec_text() -> None:
    state = sample_state() | {"d": torch.randn(3, 4).t(), "z": torch.empty(0), "s": torch.tensor(2.5)}
    assert D.state_hash(state) == spec_hash(state)


def test_state_hash_depends_on_dtype_shape_and_key() -> None:
    t = torch.zeros(4)
    base = D.state_hash({"k": t})
    assert base != D.state_hash({"k": t.half()})
    assert base != D.state_hash({"k": t.reshape(2, 2)})
    assert base != D.state_hash({"j": t})


@pytest.mark.parametrize("index", [0, 1, 2])
def test_shared_vectors_build_and_apply(vectors: list[dict], index: int) -> None:
    vector = vectors[index]
    base, new = decode(vector["base"]), decode(vector["new"])
    expected_delta, expected_result = decode(vector["delta"]), decode(vector["result"])
    assert D.state_hash(base) == spec_hash(base) == vector["base_hash"]
    sync = D.make_sync_delta(base, new, dtype_from_name(vector["delta_dtype"]))
    assert sync.base_hash == vector["base_hash"]
    assert sync.result_hash == vector["result_hash"]
    assert D.state_hash(sync.delta) == vector["delta_hash"]
    for name, tensor in expected_delta.items():
        assert tensor_bytes(sync.delta[name].contiguous()) == tensor_bytes(tensor)
    applied = D.apply_sync_delta_state(base, expected_delta)
    assert D.state_hash(applied) == vector["result_hash"] == spec_hash(expected_result)


def test_streaming_apply_matches_vectors(tmp_path: Path, vectors: list[dict]) -> None:
    for vector in vectors:
        model, delta_file = tmp_path / "model.safetensors", tmp_path / "delta.zst"
        write_model(model, decode(vector["base"]))
        D.write_delta(decode(vector["delta"]), str(delta_file))
        result = apply_sync_delta(
            str(model), str(delta_file), base_hash=vector["base_hash"], result_hash=vector["result_hash"]
        )
        assert result.model_hash == vector["result_hash"]
        assert D.file_state_hash(str(model)) == vector["result_hash"]
        from safetensors.torch import load_file

        loaded = load_file(str(model))
        for name, tensor in decode(vector["result"]).items():
            assert tensor_bytes(loaded[name].contiguous()) == tensor_bytes(tensor), name


@pytest.mark.parametrize(
    "slice_elements", [delta_apply.APPLY_SLICE_ELEMENTS, 3], ids=["whole", "slices-of-3"]
)
def test_the_in_place_apply_of_a_known_base_matches_the_vectors(
    tmp_path: Path, vectors: list[dict], monkeypatch: pytest.MonkeyPatch, slice_elements: int
) -> None:
    """The worker's path: it knows the hash of the model it installed (``known_base_hash``),
    so no base hash is in flight and each float32 slice is summed in place, over its read
    buffer. Slices of 3 elements cut the tensors at odd places and reuse every buffer of the
    ring; the result must still be the vectors', byte for byte."""
    from safetensors.torch import load_file

    monkeypatch.setattr(delta_apply, "APPLY_SLICE_ELEMENTS", slice_elements)
    summed_in_place: list[int] = []
    add = delta_apply._add

    def counting_add(base: torch.Tensor, delta: torch.Tensor | None, *, in_place: bool) -> torch.Tensor:
        if in_place and base.dtype == torch.float32 and delta is not None:
            summed_in_place.append(base.numel())
        return add(base, delta, in_place=in_place)

    monkeypatch.setattr(delta_apply, "_add", counting_add)
    for vector in vectors:
        model, delta_file = tmp_path / "model.safetensors", tmp_path / "delta.zst"
        base = decode(vector["base"])
        write_model(model, base)
        D.write_delta(decode(vector["delta"]), str(delta_file))
        summed_in_place.clear()
        result = apply_sync_delta(
            str(model),
            str(delta_file),
            base_hash=vector["base_hash"],
            result_hash=vector["result_hash"],
            known_base_hash=vector["base_hash"],
        )
        # Every element of the float32 keys went through the in-place sum.
        assert sum(summed_in_place) == sum(t.numel() for t in base.values() if t.dtype == torch.float32) > 0
        assert result.model_hash == vector["result_hash"]
        assert D.file_state_hash(str(model)) == vector["result_hash"]
        loaded = load_file(str(model))
        for name, tensor in decode(vector["result"]).items():
            assert loaded[name].dtype == tensor.dtype, name
            assert tensor_bytes(loaded[name].contiguous()) == tensor_bytes(tensor), name


def test_streaming_apply_in_small_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Slices of 3 elements cut every tensor at odd places; the bytes must not change.
    monkeypatch.setattr(delta_sync, "SLICE_BYTES", 24)
    base = sample_state()
    new = {k: v.float() * 1.5 if v.is_floating_point() else v for k, v in base.items()}
    sync = D.make_sync_delta(base, new)
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    write_model(model, base)
    D.write_delta(sync.delta, str(delta_file))
    apply_sync_delta(str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash)
    assert D.file_state_hash(str(model)) == sync.result_hash


def test_a_sync_delta_built_on_a_known_base_hash_is_the_same_without_hashing_the_base() -> None:
    base = sample_state()
    new = {k: v.float() * 1.5 if v.is_floating_point() else v for k, v in base.items()}
    full = D.make_sync_delta(base, new)
    known = D.make_sync_delta(base, new, base_hash=full.base_hash)
    assert (known.base_hash, known.result_hash) == (full.base_hash, full.result_hash)
    assert all(torch.equal(known.delta[k], full.delta[k]) for k in full.delta)
    # The hash given is the one carried: the caller vouches for it (the orchestrator's last result).
    assert D.make_sync_delta(base, new, base_hash="sha256:" + "0" * 64).base_hash == "sha256:" + "0" * 64


def _safetensors_reversed(state: dict[str, torch.Tensor]) -> bytes:
    """A valid safetensors file whose data lies in reverse key order."""
    names = sorted(state, reverse=True)
    header, blobs, cursor = {}, [], 0
    for name in names:
        data = bytes(tensor_bytes(state[name].contiguous()))
        header[name] = {
            "dtype": "F16",
            "shape": list(state[name].shape),
            "data_offsets": [cursor, cursor + len(data)],
        }
        blobs.append(data)
        cursor += len(data)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def test_apply_accepts_out_of_order_and_seed_format_deltas(tmp_path: Path) -> None:
    base = sample_state()
    new = {k: v.float() + 0.25 if v.is_floating_point() else v for k, v in base.items()}
    sync = D.make_sync_delta(base, new)
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    buffer = io.BytesIO()
    torch.save(sync.delta, buffer)
    for payload in (_safetensors_reversed(sync.delta), buffer.getvalue()):
        write_model(model, base)
        delta_file.write_bytes(zstandard.ZstdCompressor().compress(payload))
        apply_sync_delta(str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash)
        assert D.file_state_hash(str(model)) == sync.result_hash
        assert D.state_hash(D.read_delta(str(delta_file))) == D.state_hash(sync.delta)


def test_a_seed_format_deltas_pickle_is_held_to_the_models_floating_keys(tmp_path: Path) -> None:
    """The seed's torch format is a pickle: its objects, not only its bytes, are bounded by the
    model (one tensor per floating key) before torch.load builds any of them."""
    base = sample_state()
    floating = sum(1 for v in base.values() if v.is_floating_point())
    sync = D.make_sync_delta(
        base, {k: v.float() + 1 if v.is_floating_point() else v for k, v in base.items()}
    )
    plain = io.BytesIO()
    torch.save(sync.delta, plain)
    # The same zip, its pickle a run of NONE opcodes under an empty dict (torch would load it):
    # within its own storages' budget, over what this model's floating keys allow.
    pickled = b"\x80\x02" + b"N" * (64 * floating + 4096) + b"}."
    out = io.BytesIO()
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as sink:
        for info in source.infolist():
            sink.writestr(
                info.filename, pickled if info.filename.endswith("/data.pkl") else source.read(info)
            )
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    delta_file.write_bytes(zstandard.ZstdCompressor().compress(out.getvalue()))
    write_model(model, base)
    before = model.read_bytes()
    with pytest.raises(BadArtifact, match=f"over its budget for {floating} tensors"):
        apply_sync_delta(str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash)
    assert model.read_bytes() == before
    with pytest.raises(BadArtifact, match="over its budget"):
        D.read_delta(str(delta_file), max_tensors=D.max_delta_tensors(base))
    with pytest.raises(BadArtifact, match="torch format"):
        D.read_delta(str(delta_file), allow_torch=False)


def test_known_base_hash_skips_rehash_but_result_is_still_proven(tmp_path: Path) -> None:
    base = sample_state()
    sync = D.make_sync_delta(
        base, {k: v.float() * 2 if v.is_floating_point() else v for k, v in base.items()}
    )
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    write_model(model, base)
    D.write_delta(sync.delta, str(delta_file))
    with pytest.raises(HashMismatch):
        apply_sync_delta(
            str(model),
            str(delta_file),
            base_hash=sync.base_hash,
            result_hash=sync.result_hash,
            known_base_hash="x",
        )
    # A lying cached hash cannot make a wrong file pass: the result hash catches it. That the
    # result check is the one that fires proves the base was not hashed again (the base check
    # comes first and would have named the tampered file).
    tampered = dict(base)
    tampered["a.weight"] = base["a.weight"] + 1
    write_model(model, tampered)
    before = model.read_bytes()
    with pytest.raises(HashMismatch) as caught:
        apply_sync_delta(
            str(model),
            str(delta_file),
            base_hash=sync.base_hash,
            result_hash=sync.result_hash,
            known_base_hash=sync.base_hash,
        )
    assert "result" in str(caught.value) and caught.value.details["expected"] == sync.result_hash
    assert model.read_bytes() == before  # refused: the file is as it was
    # Without the cached hash the same file fails the base check instead.
    with pytest.raises(HashMismatch) as rehashed:
        apply_sync_delta(str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash)
    assert "not the delta's base" in str(rehashed.value), rehashed.value


def _mismatch_cases(sync: D.SyncDelta) -> dict[str, tuple[dict[str, torch.Tensor], str, str, type]]:
    unknown = dict(sync.delta) | {"nope": torch.zeros(1, dtype=torch.float16)}
    integer = dict(sync.delta) | {"steps": torch.zeros((), dtype=torch.float16)}
    shaped = dict(sync.delta) | {"a.weight": torch.zeros(17, 33, dtype=torch.float16)}
    return {
        "wrong base hash": (sync.delta, "sha256:" + "0" * 64, sync.result_hash, HashMismatch),
        "wrong result hash": (sync.delta, sync.base_hash, "sha256:" + "1" * 64, HashMismatch),
        "unknown key": (unknown, sync.base_hash, sync.result_hash, HashMismatch),
        "non-floating key": (integer, sync.base_hash, sync.result_hash, HashMismatch),
        "wrong shape": (shaped, sync.base_hash, sync.result_hash, HashMismatch),
    }


def test_every_mismatch_leaves_the_model_file_untouched(tmp_path: Path) -> None:
    base = sample_state()
    sync = D.make_sync_delta(
        base, {k: v.float() - 1 if v.is_floating_point() else v for k, v in base.items()}
    )
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    write_model(model, base)
    before = model.read_bytes()
    for label, (delta, base_hash, result_hash, error) in _mismatch_cases(sync).items():
        D.write_delta(delta, str(delta_file))
        with pytest.raises(error):
            apply_sync_delta(str(model), str(delta_file), base_hash=base_hash, result_hash=result_hash)
        assert model.read_bytes() == before, label
        assert sorted(os.listdir(tmp_path)) == ["d.zst", "m.safetensors"], label


def test_corrupt_and_truncated_deltas_are_bad_artifacts(tmp_path: Path) -> None:
    base = sample_state()
    sync = D.make_sync_delta(
        base, {k: v.float() + 3 if v.is_floating_point() else v for k, v in base.items()}
    )
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    write_model(model, base)
    before = model.read_bytes()
    D.write_delta(sync.delta, str(delta_file))
    good = delta_file.read_bytes()
    for payload in (
        b"not zstd at all",
        good[: len(good) // 2],
        zstandard.ZstdCompressor().compress(b"x" * 100),
    ):
        delta_file.write_bytes(payload)
        with pytest.raises(BadArtifact):
            apply_sync_delta(
                str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash
            )
        assert model.read_bytes() == before


def test_stop_aborts_apply_without_touching_the_model(tmp_path: Path) -> None:
    import threading

    base = sample_state()
    sync = D.make_sync_delta(base, base)
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    write_model(model, base)
    before = model.read_bytes()
    D.write_delta(sync.delta, str(delta_file))
    abort = threading.Event()
    abort.set()
    with pytest.raises(Stopped):
        apply_sync_delta(
            str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash, abort=abort
        )
    assert model.read_bytes() == before


def test_wire_format_is_one_zstd_frame_with_content_size(tmp_path: Path) -> None:
    delta = {"w": torch.randn(100, 10).half(), "b": torch.randn(10).half()}
    path = tmp_path / "d.zst"
    info = D.write_delta(delta, str(path))
    raw = path.read_bytes()
    params = zstandard.get_frame_parameters(raw)
    body = zstandard.ZstdDecompressor().decompress(raw)
    assert params.content_size == len(body)
    # One frame: decompressing exactly the first frame consumes the whole file.
    assert zstandard.frame_content_size(raw) == len(body)
    obj = zstandard.ZstdDecompressor().decompressobj()
    obj.decompress(raw)
    assert obj.unused_data == b""
    from safetensors.torch import load

    loaded = load(body)
    assert D.state_hash(loaded) == info.hash == D.state_hash(delta)
    assert info.keys == 2 and info.dtype == "float16" and info.bytes == len(raw)


def test_result_delta_is_trained_minus_original(tmp_path: Path) -> None:
    original = sample_state()
    model = tmp_path / "m.safetensors"
    write_model(model, original)
    trained = {
        k: (v.float() * 3).to(v.dtype) if v.is_floating_point() else v + 5 for k, v in original.items()
    }
    del trained["a.bias"]  # a key the trained state lacks: no entry (zero delta)
    trained["extra"] = torch.ones(2)  # a key the model lacks: ignored
    info = D.write_result_delta(str(model), trained, str(tmp_path / "r.zst"), dtype=torch.bfloat16)
    back = D.read_delta(str(tmp_path / "r.zst"))
    assert sorted(back) == ["a.weight", "b.weight"]
    expected = (trained["a.weight"].float() - original["a.weight"].float()).bfloat16()
    assert torch.equal(back["a.weight"], expected)
    assert info.hash == D.state_hash(back) and info.dtype == "bfloat16"


def test_a_plain_delta_framed_later_is_the_same_delta(tmp_path: Path) -> None:
    # An overlapped round writes its delta plain and frames it beside the next round.
    from executor.tensorfile import write_state

    original = sample_state()
    model = tmp_path / "m.safetensors"
    write_model(model, original)
    trained = {k: (v.float() + 0.5).to(v.dtype) if v.is_floating_point() else v for k, v in original.items()}
    framed = D.write_result_delta(str(model), trained, str(tmp_path / "r.zst"))
    with open(tmp_path / "r.plain", "wb") as plain:
        write_state(plain, D.read_delta(str(tmp_path / "r.zst"), allow_torch=False))
    assert D.file_state_hash(str(tmp_path / "r.plain")) == framed.hash
    size = D.compress_delta(str(tmp_path / "r.plain"), str(tmp_path / "later.zst"))
    assert size == os.path.getsize(tmp_path / "later.zst")
    assert D.state_hash(D.read_delta(str(tmp_path / "later.zst"), allow_torch=False)) == framed.hash


def test_a_stopped_compression_leaves_no_file(tmp_path: Path) -> None:
    import threading

    from executor.errors import DownloadAborted
    from executor.tensorfile import write_state

    with open(tmp_path / "r.plain", "wb") as plain:
        write_state(plain, {"w": torch.ones(1024, dtype=torch.float16)})
    stop = threading.Event()
    stop.set()
    with pytest.raises(DownloadAborted):
        D.compress_delta(str(tmp_path / "r.plain"), str(tmp_path / "later.zst"), stop)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.plain"]


def test_result_delta_rejects_shape_changes(tmp_path: Path) -> None:
    model = tmp_path / "m.safetensors"
    write_model(model, {"w": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="shape"):
        D.write_result_delta(str(model), {"w": torch.zeros(4, 3)}, str(tmp_path / "r.zst"))
    assert not (tmp_path / "r.zst").exists()


def test_hash_of_a_file_equals_hash_of_its_tensors(tmp_path: Path) -> None:
    state = sample_state() | {"big": torch.from_numpy(np.arange(10_000, dtype=np.float32))}
    model = tmp_path / "m.safetensors"
    write_model(model, state)
    assert D.file_state_hash(str(model)) == D.state_hash(state)


# ---------------------------------------------------------------- caps (DESIGN §11)

BOMB_BYTES = 1 << 30
RSS_BOUND_MIB = 200


def _zstd_file(path: Path, chunks: list[bytes], *, zeros: int, content_size: bool) -> int:
    """``chunks`` then ``zeros`` zero bytes as one zstd frame, compressed as a stream (the
    test never holds the decoded bytes); returns the file's size."""
    total = sum(map(len, chunks)) + zeros
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    block = bytes(1 << 20)
    size = total if content_size else -1
    with open(path, "wb") as raw, compressor.stream_writer(raw, size=size, closefd=False) as out:
        for chunk in chunks:
            out.write(chunk)
        for _ in range(zeros // len(block)):
            out.write(block)
        out.write(bytes(zeros % len(block)))
    return path.stat().st_size


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """1 GiB of zeros behind each prefix a decoder may take: each about 32 KB on disk."""
    root = tmp_path_factory.mktemp("bombs")
    kinds = {
        "zstd, content size": ([], True),
        "zstd, no content size": ([], False),
        "legacy torch": ([b"\x80\x02"], False),
        "torch zip": ([b"PK\x03\x04"], False),
    }
    out = {}
    for label, (chunks, sized) in kinds.items():
        path = root / (label.replace(" ", "_").replace(",", "") + ".zst")
        assert _zstd_file(path, chunks, zeros=BOMB_BYTES, content_size=sized) < 64 * 1024
        out[label] = path
    return out


def _unsorted_header_bomb(sync: D.SyncDelta, gap: int) -> bytes:
    """A safetensors delta whose data lies out of key order, with ``gap`` bytes before it."""
    names = sorted(sync.delta, reverse=True)
    header, cursor = {}, gap
    for name in names:
        nbytes = sync.delta[name].numel() * 2
        header[name] = {
            "dtype": "F16",
            "shape": list(sync.delta[name].shape),
            "data_offsets": [cursor, cursor + nbytes],
        }
        cursor += nbytes
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


# Runs in a fresh interpreter, so that its peak RSS is the bombs' alone.
RSS_CHILD = r"""
import json, resource, sys
from executor.delta import apply_sync_delta, read_delta, write_delta, make_sync_delta, state_hash
from executor.errors import RoundhouseError
from executor.tensorfile import write_state
import torch
model, warm, *bombs = sys.argv[1:]
state = {"w": torch.randn(64, 64), "b": torch.randn(64).half()}
sync = make_sync_delta(state, {k: v.float() + 1 for k, v in state.items()})
def fresh():
    with open(model, "wb") as f:
        write_state(f, state)
fresh()
write_delta(sync.delta, warm)
apply_sync_delta(model, warm, base_hash=sync.base_hash, result_hash=sync.result_hash)
fresh()
before = open(model, "rb").read()
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for bomb in bombs:
    for how in ("apply", "read"):
        try:
            if how == "apply":
                apply_sync_delta(model, bomb, base_hash=sync.base_hash, result_hash=sync.result_hash)
            else:
                read_delta(bomb, max_bytes=64 << 20)
            code, message = "ok", ""
        except RoundhouseError as exc:
            code, message = exc.code, exc.message
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline
        out[bomb + " " + how] = [code, message, growth // 1024, open(model, "rb").read() == before]
print(json.dumps(out))
"""


def test_bombs_are_refused_within_bounded_memory(tmp_path: Path, bombs: dict[str, Path]) -> None:
    """Each bomb, applied to a small model and read with a 64 MiB cap, is a bad artifact;
    the process grows by far less than the gibibyte a bomb decodes to, the model intact."""
    repo = Path(__file__).resolve().parents[2]
    paths = [str(p) for p in bombs.values()]
    args = [str(tmp_path / "m.safetensors"), str(tmp_path / "warm.zst"), *paths]
    child = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, *args], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for case, (code, message, growth_mib, intact) in results.items():
        assert code == "bad_artifact", (case, message)
        assert growth_mib < RSS_BOUND_MIB, (case, growth_mib)
        assert intact, case
    recorded = [m for c, (_, m, _, _) in results.items() if "content_size" in c and "no_content" not in c]
    assert all("frame records" in m for m in recorded), recorded  # refused before decoding
    spooled = [m for c, (_, m, _, _) in results.items() if "torch_zip" in c]
    assert all("cap" in m for m in spooled), spooled  # decoded up to the cap, then refused
    legacy = [m for c, (_, m, _, _) in results.items() if "legacy" in c]
    assert legacy and all("legacy format" in m for m in legacy), legacy  # refused from its first bytes
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "warm.zst"]  # no spool file left


def test_the_bound_is_the_models_float32_size_plus_its_framing(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 1000).bfloat16(), "steps": torch.tensor(3), "b": torch.randn(7)}
    model = tmp_path / "m.safetensors"
    write_model(model, state)
    bound = D.max_delta_bytes(str(model))
    assert bound == D.max_delta_bytes(state)
    data_offset = model.stat().st_size - sum(t.numel() * t.element_size() for t in state.values())
    # The floating keys' float32 size, the model's header, and framing: 1 KiB a key, 1 MiB a delta.
    assert bound == 4 * (300 * 1000 + 7) + data_offset + 3 * 1024 + (1 << 20)
    # A float32 delta of a bf16 model is twice the model's data, and within the bound.
    sync = D.make_sync_delta(
        state, {k: v.float() + 1 if v.is_floating_point() else v for k, v in state.items()}, torch.float32
    )
    delta = tmp_path / "d.zst"
    D.write_delta(sync.delta, str(delta))
    apply_sync_delta(str(model), str(delta), base_hash=sync.base_hash, result_hash=sync.result_hash)
    assert D.file_state_hash(str(model)) == sync.result_hash


def test_zstd_bound_covers_incompressible_data() -> None:
    for size in (0, 1, 1000, 1 << 20, (1 << 20) + 12345):
        payload = os.urandom(size)
        assert len(zstandard.ZstdCompressor(level=3).compress(payload)) <= D.zstd_bound(size)


def test_a_delta_over_its_cap_is_refused_by_its_header(tmp_path: Path) -> None:
    base = sample_state()
    sync = D.make_sync_delta(
        base, {k: v.float() + 2 if v.is_floating_point() else v for k, v in base.items()}
    )
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    write_model(model, base)
    before = model.read_bytes()
    cap = D.max_delta_bytes(str(model))
    # Out of key order (the spooled path), its data beyond the cap: refused before any is decoded.
    _zstd_file(delta_file, [_unsorted_header_bomb(sync, gap=cap)], zeros=1 << 20, content_size=False)
    with pytest.raises(BadArtifact, match="header promises"):
        apply_sync_delta(str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash)
    assert model.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["d.zst", "m.safetensors"]
    # The same layout within the cap applies (zeros for data: the result hash tells).
    _zstd_file(delta_file, [_unsorted_header_bomb(sync, gap=0)], zeros=1 << 20, content_size=False)
    with pytest.raises(HashMismatch):
        apply_sync_delta(str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash)


def test_read_delta_takes_a_cap(tmp_path: Path) -> None:
    delta = {"w": torch.randn(256, 256).half()}
    path = tmp_path / "d.zst"
    D.write_delta(delta, str(path))
    assert D.state_hash(D.read_delta(str(path))) == D.state_hash(delta)
    with pytest.raises(BadArtifact, match="frame records"):
        D.read_delta(str(path), max_bytes=256 * 256 * 2)
    # Without a recorded size, the same delta is refused by its header's promise.
    body = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    _zstd_file(path, [body], zeros=0, content_size=False)
    assert D.state_hash(D.read_delta(str(path))) == D.state_hash(delta)
    with pytest.raises(BadArtifact, match="header promises"):
        D.read_delta(str(path), max_bytes=256 * 256 * 2)
