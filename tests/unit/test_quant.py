"""Quantised deltas (issue 16): the quantiser, the wire format, the bit-exact sync apply on the
shared vectors, malformed files refused, and error feedback through the public Executor."""

from __future__ import annotations

import io
import json
import math
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save_file

from executor import Executor
from executor import delta as D  # noqa: N812 - short alias, used on every line
from executor.delta import QuantizedDelta, QuantScheme, QuantTensor
from executor.delta import _apply as delta_apply
from executor.errors import BadArtifact, HashMismatch
from executor.results import RoundStatus
from executor.tensorfile import StreamWriter, tensor_bytes, write_state
from settings import Settings
from tests.support.engine import mlp_state
from tests.support.http_server import FaultServer
from tests.support.vectors import decode

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "sync_delta_quant_v1.json"
SCHEMES = [
    QuantScheme.named(name, block, scale)
    for name in ("int8", "int4")
    for block, scale in ((64, "float32"), (7, "float16"), (2, "float32"))
]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and tensor_bytes(a.contiguous()) == tensor_bytes(b.contiguous())
    )


def element_scales(qt: QuantTensor, block: int) -> torch.Tensor:
    return qt.scales.to(torch.float32).repeat_interleave(block)[: qt.numel].reshape(qt.shape)


# ---------------------------------------------------------------- the quantiser


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-b{s.block_size}-{s.scale_dtype}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (7,), (64,), (65,), (3, 129), ()])
def test_round_trip_is_within_half_a_scale(scheme: QuantScheme, dtype: torch.dtype, shape: tuple) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(repr((scheme, dtype, shape)).encode()))
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    qt = D.quantize(x, scheme)
    back = D.dequantize(qt, scheme)
    assert back.dtype == torch.float32 and back.shape == x.shape
    s = element_scales(qt, scheme.block_size)
    # |x - dequant| <= s/2, up to the fp32 rounding of the quotient and the product.
    bound = s / 2 * (1 + 1e-5) + x.float().abs() * 2**-23
    assert bool(((x.float() - back).abs() <= bound).all())
    assert qt.scales.dtype == scheme.scale_dtype
    numel = math.prod(shape)
    assert qt.codes.shape == (numel if scheme.bits == 8 else (numel + 1) // 2,)
    assert qt.scales.shape == (-(-numel // scheme.block_size),)


def numpy_encode(x: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """The encoder written from the docs' text, with numpy (float32 throughout)."""
    qmax, block = scheme.qmax, scheme.block_size
    flat = x.astype(np.float32).reshape(-1)
    blocks = -(-flat.size // block)
    grid = np.zeros(blocks * block, dtype=np.float32)
    grid[: flat.size] = flat
    grid = grid.reshape(blocks, block)
    stored = (np.abs(grid).max(axis=1) / np.float32(qmax)).astype(np.float32)
    if scheme.scale_dtype == torch.float16:
        with np.errstate(over="ignore"):
            stored = stored.astype(np.float16)
        stored[np.isinf(stored)] = np.float16(65504)
    wide = stored.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.clip(np.rint(grid / wide[:, None]), -qmax, qmax)
    codes[wide == 0] = 0
    return codes.reshape(-1)[: flat.size].astype(np.int8), stored


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-b{s.block_size}-{s.scale_dtype}")
def test_encoder_and_decoder_match_their_definition_bit_for_bit(scheme: QuantScheme) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 77, generator=g) * torch.logspace(-6, 3, 77)  # every magnitude in one tensor
    x[0, :40] = 0.0  # whole blocks of zeros
    qt = D.quantize(x, scheme)
    codes, stored = numpy_encode(x.numpy(), scheme)
    decoded = D.dequantize(qt, scheme)
    unpacked = qt.codes.numpy() if scheme.bits == 8 else _unpack_numpy(qt.codes.numpy(), x.numel())
    assert np.array_equal(unpacked, codes)
    assert bytes(tensor_bytes(qt.scales)) == stored.tobytes()
    # The decoder: float32(code) * float32(scale), one IEEE multiply.
    expected = codes.astype(np.float32) * np.repeat(stored.astype(np.float32), scheme.block_size)[: x.numel()]
    assert bytes(tensor_bytes(decoded.reshape(-1))) == expected.tobytes()


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-b{s.block_size}-{s.scale_dtype}")
def test_the_writers_dequantized_values_are_the_decoders(scheme: QuantScheme) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1000, generator=g) * 3
    x[::7] = -1e-4  # small negatives whose codes round to -0.0 in float32: decoded as +0.0
    x[:64] = 0.0
    out = torch.empty_like(x)
    qt = D.quantize(x, scheme, dequantized=out)
    assert same_bits(out, D.dequantize(qt, scheme))
    assert same_bits(D.quantize(x, scheme).codes, qt.codes)


def _unpack_numpy(packed: np.ndarray, numel: int) -> np.ndarray:
    low, high = packed & 0xF, packed >> 4
    nibbles = np.stack([low, high], axis=1).reshape(-1)[:numel].astype(np.int16)
    return np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)


def test_int4_nibble_order_and_padding() -> None:
    scheme = QuantScheme.named("int4", 4)
    qt = D.quantize(torch.tensor([7.0, -7.0, 1.0, 0.0, -3.0]), scheme)
    # Element 2j in the low nibble of byte j, 2j+1 in the high one; the odd tail's pad is 0.
    # Block 0 (absmax 7, scale 1): 7, -7, 1, 0; block 1 (absmax 3): -3 is code -7 (nibble 9).
    assert bytes(tensor_bytes(qt.codes)) == bytes([0x97, 0x01, 0x09])
    assert D.dequantize(qt, scheme)[:4].tolist() == [7.0, -7.0, 1.0, 0.0]


def test_edge_cases_zeros_empty_scalars_and_limits() -> None:
    for scheme in SCHEMES:
        zeros = D.quantize(torch.zeros(10), scheme)
        assert not zeros.scales.float().any() and not zeros.codes.any()
        assert same_bits(D.dequantize(zeros, scheme), torch.zeros(10))  # +0.0, never -0.0
        empty = D.quantize(torch.empty(0, 3), scheme)
        assert empty.codes.numel() == empty.scales.numel() == 0
        assert D.dequantize(empty, scheme).shape == (0, 3)
        scalar = D.quantize(torch.tensor(-2.5, dtype=torch.float64), scheme)
        assert D.dequantize(scalar, scheme).shape == ()
        assert abs(float(D.dequantize(scalar, scheme)) + 2.5) <= float(scalar.scales[0]) / 2
        for bad in (float("inf"), float("-inf"), float("nan")):
            with pytest.raises(ValueError, match="inf or nan"):
                D.quantize(torch.tensor([1.0, bad]), scheme)
    # A float16 scale that would overflow is the largest float16; the codes clamp to qmax.
    big = D.quantize(torch.tensor([1e7, 1.0]), QuantScheme.named("int8", 2, "float16"))
    assert float(big.scales[0]) == 65504.0 and big.codes.tolist() == [127, 0]
    with pytest.raises(ValueError):
        QuantScheme.named("int8", 1)
    with pytest.raises(ValueError):
        D.delta_format("int2")
    assert D.delta_format("int4") == QuantScheme(4, 64, torch.float32)


# ---------------------------------------------------------------- shared vectors


@pytest.fixture(scope="module")
def vectors() -> list[dict]:
    return json.loads(VECTORS.read_text())["vectors"]


def vector_scheme(vector: dict) -> QuantScheme:
    return QuantScheme.named(vector["delta_dtype"], vector["block_size"], vector["scale_dtype"])


def test_vectors_cover_both_schemes_and_both_scale_dtypes(vectors: list[dict]) -> None:
    kinds = {(v["delta_dtype"], v["scale_dtype"]) for v in vectors}
    assert kinds == {("int8", "float32"), ("int8", "float16"), ("int4", "float32"), ("int4", "float16")}
    assert any(v["block_size"] % 2 for v in vectors)  # blocks that straddle int4 bytes


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_orchestrator_side_builds_the_vectors(vectors: list[dict], index: int, tmp_path: Path) -> None:
    vector = vectors[index]
    base, new = decode(vector["base"]), decode(vector["new"])
    sync = D.make_sync_delta(base, new, vector_scheme(vector))
    assert isinstance(sync.delta, QuantizedDelta)
    assert (sync.base_hash, sync.result_hash) == (vector["base_hash"], vector["result_hash"])
    for key, qt in sync.delta.tensors.items():
        assert bytes(tensor_bytes(qt.codes)).hex() == vector["codes"][key], key
        assert bytes(tensor_bytes(qt.scales)).hex() == vector["scales"][key], key
    for key, tensor in decode(vector["delta"]).items():
        assert same_bits(sync.delta[key], tensor), key
    assert D.state_hash(sync.delta) == vector["delta_hash"]
    for key, tensor in decode(vector["result"]).items():
        assert same_bits(sync.result[key], tensor), key
    written = D.write_delta(sync.delta, str(tmp_path / "d.zst"))
    body = zstandard.ZstdDecompressor().decompress((tmp_path / "d.zst").read_bytes())
    assert body.hex() == vector["wire"]
    assert written.hash == vector["delta_hash"] and written.dtype == vector["delta_dtype"]


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_the_vectors_follow_the_definition(vectors: list[dict], index: int) -> None:
    """Independent of executor.delta: dequant = f32(code) * f32(scale); result = f32(base) + that."""
    vector = vectors[index]
    scheme = vector_scheme(vector)
    base, expected, result = decode(vector["base"]), decode(vector["delta"]), decode(vector["result"])
    for key, item in vector["delta"].items():
        numel = math.prod(item["shape"])
        raw = np.frombuffer(
            bytes.fromhex(vector["codes"][key]), dtype=np.int8 if scheme.bits == 8 else np.uint8
        )
        codes = raw if scheme.bits == 8 else _unpack_numpy(raw, numel)
        stored = np.frombuffer(bytes.fromhex(vector["scales"][key]), dtype=np.dtype(vector["scale_dtype"]))
        scale = np.repeat(stored.astype(np.float32), scheme.block_size)[:numel]
        values = codes.astype(np.float32) * scale
        assert values.tobytes() == bytes(tensor_bytes(expected[key].reshape(-1))), key
        total = base[key].to(torch.float32).numpy().reshape(-1) + values
        assert total.tobytes() == bytes(tensor_bytes(result[key].reshape(-1))), key


def test_worker_side_applies_the_vectors_bit_exactly(
    vectors: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, delta_file = tmp_path / "model.safetensors", tmp_path / "delta.zst"
    for slice_elements in (delta_apply.APPLY_SLICE_ELEMENTS, 3):  # 3: slices start mid-byte
        monkeypatch.setattr(delta_apply, "APPLY_SLICE_ELEMENTS", slice_elements)
        for vector in vectors:
            base = decode(vector["base"])
            with open(model, "wb") as file:
                write_state(file, base)
            delta_file.write_bytes(zstandard.ZstdCompressor().compress(bytes.fromhex(vector["wire"])))
            read = D.read_delta(str(delta_file))
            assert D.state_hash(read) == vector["delta_hash"]
            assert all(same_bits(read[k], t) for k, t in decode(vector["delta"]).items())
            assert D.state_hash(D.apply_sync_delta_state(base, read)) == vector["result_hash"]
            applied = D.apply_sync_delta(
                str(model), str(delta_file), base_hash=vector["base_hash"], result_hash=vector["result_hash"]
            )
            assert applied.model_hash == D.file_state_hash(str(model)) == vector["result_hash"]


# ---------------------------------------------------------------- malformed files


def crafted(entries: list[tuple[str, torch.Tensor]], meta: dict[str, str]) -> bytes:
    """A safetensors body written from the documented layout, not by executor.delta."""
    buffer = io.BytesIO()
    writer = StreamWriter(buffer, [(n, t.dtype, tuple(t.shape)) for n, t in entries], meta)
    writer.write_header()
    for _, tensor in entries:
        writer.write(tensor_bytes(tensor.contiguous()))
    return zstandard.ZstdCompressor(write_content_size=True).compress(buffer.getvalue())


def documented(scheme: QuantScheme, tensors: dict[str, QuantTensor]) -> tuple[list, dict[str, str]]:
    """The entries and metadata the docs define: per key scales/K then codes/K, flat."""
    entries, shapes = [], {}
    for key in sorted(tensors):
        qt = tensors[key]
        entries += [(f"scales/{key}", qt.scales), (f"codes/{key}", qt.codes)]
        shapes[key] = list(qt.shape)
    meta = {
        "roundhouse.quant": scheme.name,
        "roundhouse.quant.version": "1",
        "roundhouse.quant.block_size": str(scheme.block_size),
        "roundhouse.quant.scale_dtype": str(scheme.scale_dtype).removeprefix("torch."),
        "roundhouse.quant.shapes": json.dumps(shapes),
    }
    return entries, meta


def _replace(entries: list, name: str, tensor: torch.Tensor) -> list:
    return [(n, tensor if n == name else t) for n, t in entries]


def malformed_cases(scheme: QuantScheme, tensors: dict[str, QuantTensor]) -> dict[str, bytes]:
    entries, meta = documented(scheme, tensors)
    codes = dict(entries)["codes/w"]
    scales = dict(entries)["scales/w"]
    low = (
        torch.tensor([-128], dtype=torch.int8)
        if scheme.bits == 8
        else torch.tensor([0x88], dtype=torch.uint8)
    )
    cases = {
        "missing scales": crafted([e for e in entries if e[0] != "scales/w"], meta),
        "extra entry": crafted([*entries, ("codes/x", codes)], meta),
        "a plain entry beside": crafted([*entries, ("w", torch.zeros(3))], meta),
        "codes of the wrong dtype": crafted(_replace(entries, "codes/w", codes.to(torch.int16)), meta),
        "codes of the wrong length": crafted(_replace(entries, "codes/w", codes[:-1]), meta),
        "scales of the wrong dtype": crafted(_replace(entries, "scales/w", scales.double()), meta),
        "scales of the wrong length": crafted(
            _replace(entries, "scales/w", torch.cat([scales, scales])), meta
        ),
        "version 2": crafted(entries, meta | {"roundhouse.quant.version": "2"}),
        "no version": crafted(entries, {k: v for k, v in meta.items() if k != "roundhouse.quant.version"}),
        "unknown key": crafted(entries, meta | {"roundhouse.quant.zero_point": "0"}),
        "no scheme": crafted(entries, {k: v for k, v in meta.items() if k != "roundhouse.quant"}),
        "unknown scheme": crafted(entries, meta | {"roundhouse.quant": "int3"}),
        "block 064": crafted(entries, meta | {"roundhouse.quant.block_size": "0" + str(scheme.block_size)}),
        "block 1": crafted(entries, meta | {"roundhouse.quant.block_size": "1"}),
        "scale dtype": crafted(entries, meta | {"roundhouse.quant.scale_dtype": "bfloat16"}),
        "shapes not json": crafted(entries, meta | {"roundhouse.quant.shapes": "{"}),
        "shapes a list": crafted(entries, meta | {"roundhouse.quant.shapes": "[]"}),
        "negative dim": crafted(
            entries, meta | {"roundhouse.quant.shapes": json.dumps({"w": [-4], "b": [3]})}
        ),
        "shape mismatch": crafted(
            entries, meta | {"roundhouse.quant.shapes": json.dumps({"w": [3, 3], "b": [3]})}
        ),
        "code out of range": crafted(_replace(entries, "codes/w", torch.cat([low, codes[1:]])), meta),
    }
    for label, value in (("inf", math.inf), ("nan", math.nan), ("negative", -1.0), ("-0.0", -0.0)):
        bad = scales.clone()
        bad[0] = value
        cases[f"{label} scale"] = crafted(_replace(entries, "scales/w", bad), meta)
    if scheme.bits == 4:  # "b" has 3 elements: its second byte's high nibble is padding
        pad = dict(entries)["codes/b"].clone()
        pad[-1] |= 0x10
        cases["padding nibble"] = crafted(_replace(entries, "codes/b", pad), meta)
    return cases


@pytest.mark.parametrize("scheme", SCHEMES[:2] + SCHEMES[3:5], ids=lambda s: f"{s.name}-{s.scale_dtype}")
def test_malformed_quantised_deltas_are_bad_artifacts(scheme: QuantScheme, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    base = {"w": torch.randn(4, 5, generator=g), "b": torch.randn(3, generator=g)}
    new = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    sync = D.make_sync_delta(base, new, scheme)
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    with open(model, "wb") as file:
        write_state(file, base)
    before = model.read_bytes()
    assert isinstance(sync.delta, QuantizedDelta)
    good, meta = documented(scheme, sync.delta.tensors)
    delta_file.write_bytes(crafted(good, meta))  # the documented layout itself is accepted
    assert D.state_hash(D.read_delta(str(delta_file))) == D.state_hash(sync.delta)
    for label, payload in malformed_cases(scheme, sync.delta.tensors).items():
        delta_file.write_bytes(payload)
        with pytest.raises(BadArtifact):
            D.read_delta(str(delta_file))
        with pytest.raises((BadArtifact, HashMismatch)):  # HashMismatch: entries the model lacks
            D.apply_sync_delta(
                str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash
            )
        assert model.read_bytes() == before, label
        assert sorted(os.listdir(tmp_path)) == ["d.zst", "m.safetensors"], label


def test_an_out_of_order_layout_is_spooled_and_still_exact(tmp_path: Path) -> None:
    scheme = QuantScheme.named("int4", 3, "float16")
    g = torch.Generator().manual_seed(9)
    base = {"a": torch.randn(11, generator=g), "b": torch.randn(2, 5, generator=g), "n": torch.tensor(1)}
    sync = D.make_sync_delta(
        base, {k: v + 0.5 if v.is_floating_point() else v for k, v in base.items()}, scheme
    )
    assert isinstance(sync.delta, QuantizedDelta)
    entries, meta = documented(scheme, sync.delta.tensors)
    model, delta_file = tmp_path / "m.safetensors", tmp_path / "d.zst"
    with open(model, "wb") as file:
        write_state(file, base)
    delta_file.write_bytes(crafted(list(reversed(entries)), meta))
    D.apply_sync_delta(str(model), str(delta_file), base_hash=sync.base_hash, result_hash=sync.result_hash)
    assert D.file_state_hash(str(model)) == sync.result_hash


# ---------------------------------------------------------------- error feedback, through the Executor

# Trained = original + size * noise, the noise fixed by key and round: the test knows every delta.
SHIFT_CODE = """
import zlib
state = load_model(model_path)
out = {}
for k, v in state.items():
    g = torch.Generator().manual_seed(zlib.crc32(k.encode()) + 1000 * round_num)
    out[k] = v + params["size"] * torch.randn(v.shape, generator=g)
save_model(out)
save_report({"round": round_num})
"""
SIZE = 0.01


def trained_minus_original(original: dict[str, torch.Tensor], round_num: int) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in original.items():
        g = torch.Generator().manual_seed(zlib.crc32(k.encode()) + 1000 * round_num)
        out[k] = (v + SIZE * torch.randn(v.shape, generator=g)) - v
    return out


def quantised_with(x: dict[str, torch.Tensor], residual: dict[str, torch.Tensor], scheme: QuantScheme):  # type: ignore[no-untyped-def]
    values = {k: x[k] + residual[k] if k in residual else x[k].clone() for k in x}
    sent = {k: D.dequantize(D.quantize(v, scheme), scheme) for k, v in values.items()}
    return sent, {k: values[k] - sent[k] for k in values}


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    root = tmp_path / "srv"
    (root / "uploads").mkdir(parents=True)
    save_file(mlp_state(), str(root / "model.safetensors"))
    with FaultServer(root) as server:
        yield server, root


def quant_settings(tmp_path: Path, **extra: object) -> Settings:
    return Settings(
        work_dir=str(tmp_path / "work"), cache_dir=str(tmp_path / "cache"), host_id="quant",
        quant_block_size=16, download_retries=1, download_backoff_s=0.01, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert same_bits(got[key], want[key]), key


def test_error_feedback_is_kept_added_and_dropped_at_the_right_moments(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, root = served
    settings = quant_settings(tmp_path)
    scheme = QuantScheme.named("int8", 16)
    session_dir = str(tmp_path / "work" / "session")
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings, session_dir=session_dir)
    feedback = D.ErrorFeedback(ex.work_dir)
    original = mlp_state()
    ex.load(server.url("model.safetensors"), [], SHIFT_CODE, params={"size": SIZE})
    assert not feedback.exists()

    first = ex.run_round(steps=1, round_num=0, delta_dtype="int8")
    assert first.status is RoundStatus.COMPLETED and first.delta is not None and first.delta.path
    assert first.delta.dtype == "int8"
    sent, residual = quantised_with(trained_minus_original(original, 0), {}, scheme)
    assert_bits(D.read_delta(first.delta.path), sent)
    assert D.state_hash(D.read_delta(first.delta.path)) == first.delta.hash
    assert_bits(feedback.load(), residual)

    # The next round quantises its delta plus what the first one dropped.
    second = ex.run_round(steps=1, round_num=1, delta_dtype="int8", delta_url=server.url("uploads/r1.zst"))
    assert second.status is RoundStatus.COMPLETED, second.error
    sent, residual = quantised_with(trained_minus_original(original, 1), residual, scheme)
    assert_bits(D.read_delta(str(root / "uploads" / "r1.zst")), sent)
    assert_bits(feedback.load(), residual)

    # A float round neither uses nor changes it; an upload that fails leaves it as it was.
    kept = Path(feedback.path).read_bytes()
    assert ex.run_round(steps=1, round_num=2, delta_dtype="float16").status is RoundStatus.COMPLETED
    server.add_fault("uploads/r3.zst", "status", code=500, times=-1, method="PUT")
    failed = ex.run_round(steps=1, round_num=3, delta_dtype="int8", delta_url=server.url("uploads/r3.zst"))
    assert failed.status is RoundStatus.FAILED and failed.error is not None
    assert Path(feedback.path).read_bytes() == kept

    # A replacement process (the child crashed) rehydrates the session and its residual.
    replacement = Executor(lambda _s: None, lambda _l: None, settings=settings, session_dir=session_dir)
    assert replacement.rehydrate()
    third = replacement.run_round(steps=1, round_num=4, delta_dtype="int8")
    assert third.status is RoundStatus.COMPLETED and third.delta is not None and third.delta.path
    sent, residual = quantised_with(trained_minus_original(original, 4), residual, scheme)
    assert_bits(D.read_delta(third.delta.path), sent)

    # load_model starts a new session: no residual from the old one.
    replacement.load(server.url("model.safetensors"), [], SHIFT_CODE, params={"size": SIZE})
    assert not feedback.exists()
    fresh = replacement.run_round(steps=1, round_num=5, delta_dtype="int8")
    assert fresh.delta is not None and fresh.delta.path
    sent, _ = quantised_with(trained_minus_original(original, 5), {}, scheme)
    assert_bits(D.read_delta(fresh.delta.path), sent)
    assert feedback.exists()
    replacement.reset()
    assert not feedback.exists() and not os.listdir(replacement.work_dir)
    replacement.shutdown()


def test_without_error_feedback_each_round_stands_alone(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, _root = served
    ex = Executor(
        lambda _s: None, lambda _l: None, settings=quant_settings(tmp_path, quant_error_feedback=False)
    )
    try:
        ex.load(server.url("model.safetensors"), [], SHIFT_CODE, params={"size": SIZE})
        scheme = QuantScheme.named("int4", 16)
        for round_num in (0, 1):
            result = ex.run_round(steps=1, round_num=round_num, delta_dtype="int4")
            assert result.delta is not None and result.delta.path and result.delta.dtype == "int4"
            sent, _ = quantised_with(trained_minus_original(mlp_state(), round_num), {}, scheme)
            assert_bits(D.read_delta(result.delta.path), sent)
        assert not D.ErrorFeedback(ex.work_dir).exists()
    finally:
        ex.shutdown()


def test_a_transposed_trained_tensor_is_quantised_in_row_major_order(tmp_path: Path) -> None:
    model = tmp_path / "m.safetensors"
    original = {"w": torch.zeros(6, 10)}
    with open(model, "wb") as file:
        write_state(file, original)
    trained = {"w": torch.randn(10, 6).t()}  # not contiguous
    scheme = QuantScheme.named("int8", 8)
    feedback = D.ErrorFeedback(str(tmp_path))
    with feedback.next_round() as residual:
        info = D.write_result_delta(
            str(model), trained, str(tmp_path / "d.zst"), dtype=scheme, feedback=residual
        )
        residual.commit()
    expected = D.dequantize(D.quantize(trained["w"].contiguous(), scheme), scheme)
    assert same_bits(D.read_delta(str(tmp_path / "d.zst"))["w"], expected)
    assert info.hash == D.state_hash({"w": expected}) and info.dtype == "int8"
    assert same_bits(feedback.load()["w"], trained["w"].contiguous() - expected)


def test_a_non_finite_trained_state_fails_the_round_not_the_worker(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, _root = served
    ex = Executor(lambda _s: None, lambda _l: None, settings=quant_settings(tmp_path))
    try:
        code = "state = {k: v.clone() for k, v in load_model(model_path).items()}\n"
        code += "state['0.bias'][0] = float('nan')\nsave_model(state)"
        ex.load(server.url("model.safetensors"), [], code)
        result = ex.run_round(steps=1, delta_dtype="int8")
        assert result.status is RoundStatus.FAILED and result.error is not None
        assert result.error.code == "user_code_error" and "inf or nan" in result.error.message
        assert ex.run_round(steps=1, delta_dtype="float16").status is RoundStatus.COMPLETED
    finally:
        ex.shutdown()
