"""Model artifacts end to end on real files: every input format becomes model.safetensors."""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor.artifacts import (
    BUNDLE_DIRNAME,
    MODEL_FILENAME,
    ModelArtifact,
    checkpoint_state,
    detect_format,
    load_state_file,
    materialize_model,
    model_suffix,
    prepare_model_artifact,
)
from executor.artifacts import _bundle as bundle
from executor.artifacts import _extract as extract
from executor.errors import BadArtifact, InvalidRequest
from tests.support.engine import tiny_vit

MAX_BYTES = 64 * 1024 * 1024
MAX_FILES = 100


def tiny_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "layer.weight": torch.randn(3, 4),
        "layer.bias": torch.zeros(3),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
    }


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert actual[key].shape == value.shape, key
        assert torch.equal(actual[key], value), key


def prepare(src: Path, dest: Path, **limits: int) -> ModelArtifact:
    return prepare_model_artifact(
        str(src),
        str(dest),
        max_bundle_bytes=limits.get("max_bundle_bytes", MAX_BYTES),
        max_bundle_files=limits.get("max_bundle_files", MAX_FILES),
    )


def snapshot(dest: Path) -> dict[str, bytes]:
    """Every file under dest with its bytes: the 'left unchanged' check."""
    return {str(p.relative_to(dest)): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def expect_bad(src: Path, dest: Path, match: str, **limits: int) -> None:
    before = snapshot(dest) if dest.exists() else {}
    with pytest.raises(BadArtifact, match=match) as info:
        prepare(src, dest, **limits)
    assert info.value.code == "bad_artifact"
    assert (snapshot(dest) if dest.exists() else {}) == before
    assert src.exists()  # a failed preparation leaves the download to the caller


@pytest.fixture
def existing(tmp_path: Path) -> Path:
    """A dest dir that already holds a prepared model, which failures must not touch."""
    dest = tmp_path / "work"
    src = tmp_path / "first.safetensors"
    save_file({"old": torch.arange(6, dtype=torch.float32)}, str(src))
    prepare(src, dest)
    (dest / BUNDLE_DIRNAME).mkdir()
    (dest / BUNDLE_DIRNAME / "config.json").write_text('{"model_type": "previous"}')
    return dest


def test_model_suffix() -> None:
    assert model_suffix("https://h/x/model.safetensors?X-Amz-Signature=a.zip") == ".safetensors"
    assert model_suffix("https://h/bundle.ZIP") == ".zip"
    assert model_suffix("file:///data/ckpt.pth") == ".pth"
    assert model_suffix("https://h/pytorch_model.bin?v=1") == ".bin"
    assert model_suffix("https://h/weights.pt") == ".pt"
    assert model_suffix("https://h/download?file=model.safetensors") == ".pt"


def test_safetensors_is_moved_into_place(tmp_path: Path) -> None:
    src = tmp_path / "download.safetensors"
    state = tiny_state()
    save_file(state, str(src))
    artifact = prepare(src, tmp_path / "work")
    assert artifact.model_path == str(tmp_path / "work" / MODEL_FILENAME)
    assert (artifact.source_format, artifact.keys, artifact.bundle_root) == ("safetensors", len(state), None)
    assert artifact.bytes == os.path.getsize(artifact.model_path)
    assert not src.exists()
    assert_same_state(load_state_file(artifact.model_path), state)
    assert json.loads(json.dumps(artifact.to_json()))["source_format"] == "safetensors"


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_torch_checkpoints_become_safetensors(tmp_path: Path, suffix: str) -> None:
    src = tmp_path / f"download{suffix}"
    state = tiny_state()
    torch.save(state, str(src))
    artifact = prepare(src, tmp_path / "work")
    assert (artifact.source_format, artifact.keys) == ("torch", len(state))
    assert not src.exists()
    assert_same_state(load_state_file(artifact.model_path), state)
    with open(artifact.model_path, "rb") as file:
        assert file.read(16)[8:9] == b"{"  # really safetensors, whatever came in


def test_state_dict_wrapper_tied_and_strided_tensors(tmp_path: Path) -> None:
    shared = torch.randn(4, 4)
    state = {"a": shared, "tied": shared, "transposed": shared.t(), "column": shared[:, 1]}
    src = tmp_path / "wrapped.pt"
    torch.save({"state_dict": state, "epoch": 3}, str(src))
    artifact = prepare(src, tmp_path / "work")
    loaded = load_state_file(artifact.model_path)
    assert_same_state(loaded, {key: value.contiguous() for key, value in state.items()})
    assert loaded["a"].data_ptr() != loaded["tied"].data_ptr()


def test_suffix_is_only_a_hint(tmp_path: Path) -> None:
    src = tmp_path / "mislabelled.safetensors"
    torch.save(tiny_state(), str(src))
    assert detect_format(str(src), ".safetensors") == "torch"
    assert prepare(src, tmp_path / "work").source_format == "torch"


def test_truncated_safetensors_keeps_existing_model(tmp_path: Path, existing: Path) -> None:
    src = tmp_path / "download.safetensors"
    save_file(tiny_state(), str(src))
    src.write_bytes(src.read_bytes()[:-7])
    expect_bad(src, existing, "truncated")


def test_garbage_and_empty_files(tmp_path: Path, existing: Path) -> None:
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"definitely not a model")
    expect_bad(junk, existing, "not safetensors")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    expect_bad(empty, existing, "empty")


def test_pickled_module_is_rejected(tmp_path: Path, existing: Path) -> None:
    src = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), str(src))
    expect_bad(src, existing, "serialized modules are rejected")


def test_non_tensor_values_are_rejected(tmp_path: Path, existing: Path) -> None:
    src = tmp_path / "mixed.pt"
    torch.save({"w": torch.ones(2), "lr": 0.1}, str(src))
    expect_bad(src, existing, "'lr' is a float")


def test_compressed_torch_zip_is_rejected(tmp_path: Path, existing: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save(tiny_state(), str(plain))
    squeezed = tmp_path / "squeezed.pt"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(squeezed, "w", zipfile.ZIP_DEFLATED) as sink:
        for info in source.infolist():
            sink.writestr(info.filename, source.read(info))
    expect_bad(squeezed, existing, "compressed")


def with_pickle(plain: Path, target: Path, pickled: bytes) -> Path:
    """``plain`` (a torch.save zip) with its data.pkl replaced by ``pickled``, members stored."""
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as sink:
        for info in source.infolist():
            sink.writestr(
                info.filename, pickled if info.filename.endswith("/data.pkl") else source.read(info)
            )
    return target


def test_a_legacy_torch_checkpoint_is_refused(tmp_path: Path, existing: Path) -> None:
    src = tmp_path / "legacy.pt"
    torch.save(tiny_state(), str(src), _use_new_zipfile_serialization=False)
    expect_bad(src, existing, "legacy format")
    with pytest.raises(BadArtifact, match="legacy format"):
        load_state_file(str(src))  # user code's load_model too


def test_a_torch_pickle_is_held_to_its_storages_before_it_is_loaded(tmp_path: Path, existing: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save(tiny_state(), str(plain))
    # A set a state dict never needs: one byte each, 216 bytes of memory each once unpickled.
    sets = with_pickle(plain, tmp_path / "sets.pt", b"\x80\x02" + b"\x8f" * 1000 + b"}.")
    expect_bad(sets, existing, "opcode EMPTY_SET")
    # Opcodes a state dict may use, but far more of them than six storages need.
    lists = with_pickle(plain, tmp_path / "lists.pt", b"\x80\x02" + b"]0" * 6000 + b"}.")
    expect_bad(lists, existing, "over its budget for 70 tensors")
    # Tensors sharing storages (views) within the budget still load.
    shared = torch.randn(4, 4)
    views = {f"v{i}": shared[i % 4] for i in range(40)}
    torch.save(views, str(tmp_path / "views.pt"))
    assert prepare(tmp_path / "views.pt", tmp_path / "ok").keys == 40


# --- Hugging Face bundles ----------------------------------------------------------------


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT saved by save_pretrained with several safetensors shards."""
    model = tiny_vit(image_size=32)
    out = tmp_path_factory.mktemp("vit")
    model.save_pretrained(str(out), max_shard_size="20KB")
    (out / "preprocessor_config.json").write_text(
        json.dumps({"do_resize": True, "size": {"height": 32, "width": 32}, "image_mean": [0.5] * 3})
    )
    torch.save(checkpoint_state(model), str(out.parent / "vit_state.pt"))  # the on-disk key names
    return out


def vit_state(vit_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(str(vit_dir.parent / "vit_state.pt"), weights_only=True)


def zip_dir(directory: Path, target: Path, prefix: str = "", skip: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(directory.iterdir()):
            if path.name not in skip:
                archive.write(path, prefix + path.name)
    return target


def make_zip(target: Path, members: dict[str, bytes], **attrs: int) -> Path:
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = attrs.get(name, 0o644 << 16)
            archive.writestr(info, data)
    return target


@pytest.mark.parametrize("prefix", ["", "my-model/"])
def test_sharded_bundle_is_consolidated(tmp_path: Path, vit_dir: Path, prefix: str) -> None:
    assert len(list(vit_dir.glob("model-*.safetensors"))) > 1  # the fixture really is sharded
    src = zip_dir(vit_dir, tmp_path / "bundle.zip", prefix)
    artifact = prepare(src, tmp_path / "work")
    expected = vit_state(vit_dir)
    assert (artifact.source_format, artifact.keys) == ("hf_bundle", len(expected))
    assert artifact.bundle_root == str(tmp_path / "work" / BUNDLE_DIRNAME)
    assert artifact.preprocessor_config["size"] == {"height": 32, "width": 32}
    bundle_files = sorted(os.listdir(artifact.bundle_root))
    assert bundle_files == ["config.json", "preprocessor_config.json"]  # weights live in model_path only
    assert not src.exists()
    assert [p for p in (tmp_path / "work").iterdir() if p.name.startswith(".")] == []
    assert_same_state(load_state_file(artifact.model_path), expected)

    model, missing, unexpected = materialize_model(
        load_state_file(artifact.model_path), params={}, bundle_root=artifact.bundle_root
    )
    assert (missing, unexpected) == ([], [])
    assert type(model).__name__ == "ViTForImageClassification"
    assert_same_state(checkpoint_state(model), expected)


def test_consolidation_copies_in_bounded_chunks(
    tmp_path: Path, vit_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors larger than the copy buffer are streamed across many reads, byte for byte."""
    monkeypatch.setattr(bundle, "_COPY_CHUNK_BYTES", 1000)
    artifact = prepare(zip_dir(vit_dir, tmp_path / "bundle.zip"), tmp_path / "work")
    assert_same_state(load_state_file(artifact.model_path), vit_state(vit_dir))


def test_bundle_with_single_safetensors(tmp_path: Path, vit_dir: Path) -> None:
    staging = tmp_path / "single"
    staging.mkdir()
    (staging / "config.json").write_bytes((vit_dir / "config.json").read_bytes())
    (staging / "tokenizer.json").write_text("{}")
    expected = vit_state(vit_dir)
    save_file(expected, str(staging / "model.safetensors"))
    artifact = prepare(zip_dir(staging, tmp_path / "bundle.zip", "nested/"), tmp_path / "work")
    assert sorted(os.listdir(str(artifact.bundle_root))) == ["config.json", "tokenizer.json"]
    assert_same_state(load_state_file(artifact.model_path), expected)
    assert os.stat(artifact.model_path).st_mode & 0o044 == 0o044  # readable to a runner under another uid


def test_bundle_with_pytorch_model_bin(tmp_path: Path, vit_dir: Path) -> None:
    staging = tmp_path / "bin-bundle"
    staging.mkdir()
    (staging / "config.json").write_bytes((vit_dir / "config.json").read_bytes())
    expected = vit_state(vit_dir)
    torch.save(expected, str(staging / "pytorch_model.bin"))
    artifact = prepare(zip_dir(staging, tmp_path / "bundle.zip"), tmp_path / "work")
    assert artifact.preprocessor_config == {}
    assert os.listdir(str(artifact.bundle_root)) == ["config.json"]
    assert_same_state(load_state_file(artifact.model_path), expected)
    _, missing, unexpected = materialize_model(
        {"state_dict": load_state_file(artifact.model_path)}, params={}, bundle_root=artifact.bundle_root
    )
    assert (missing, unexpected) == ([], [])


def test_bundle_with_sharded_pytorch_model_bin(tmp_path: Path, vit_dir: Path) -> None:
    staging = tmp_path / "bin-shards"
    staging.mkdir()
    (staging / "config.json").write_bytes((vit_dir / "config.json").read_bytes())
    expected = vit_state(vit_dir)
    keys = sorted(expected)
    weight_map = {}
    for number, part in enumerate((keys[::2], keys[1::2]), start=1):
        shard = f"pytorch_model-0000{number}-of-00002.bin"
        torch.save({key: expected[key] for key in part}, str(staging / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (staging / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    artifact = prepare(zip_dir(staging, tmp_path / "bundle.zip"), tmp_path / "work")
    assert os.listdir(str(artifact.bundle_root)) == ["config.json"]
    assert_same_state(load_state_file(artifact.model_path), expected)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path: Path, vit_dir: Path, existing: Path) -> None:
    staging = tmp_path / "broken-index"
    staging.mkdir()
    for path in vit_dir.iterdir():
        (staging / path.name).write_bytes(path.read_bytes())
    index = json.loads((staging / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = sorted(set(index["weight_map"].values()))[0]
    (staging / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_bad(zip_dir(staging, tmp_path / "b.zip"), existing, "lacks tensor 'ghost.weight'")


def test_new_bundle_replaces_old_and_plain_model_drops_it(
    tmp_path: Path, vit_dir: Path, existing: Path
) -> None:
    artifact = prepare(zip_dir(vit_dir, tmp_path / "bundle.zip"), existing)
    config = json.loads((Path(str(artifact.bundle_root)) / "config.json").read_text())
    assert config["model_type"] == "vit"
    src = tmp_path / "plain.safetensors"
    save_file(tiny_state(), str(src))
    assert prepare(src, existing).bundle_root is None
    assert not (existing / BUNDLE_DIRNAME).exists()


def test_failed_bundle_keeps_existing_model_and_bundle(tmp_path: Path, vit_dir: Path, existing: Path) -> None:
    config = json.loads((vit_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    staging = tmp_path / "remote"
    staging.mkdir()
    for path in vit_dir.iterdir():
        (staging / path.name).write_bytes(path.read_bytes())
    (staging / "config.json").write_text(json.dumps(config))
    expect_bad(zip_dir(staging, tmp_path / "remote.zip"), existing, "remote code")


def test_trust_remote_code_and_missing_pieces(tmp_path: Path, existing: Path) -> None:
    weights = io.BytesIO()
    torch.save({"w": torch.ones(2)}, weights)
    remote = make_zip(tmp_path / "a.zip", {"config.json": b'{"model_type": "x", "trust_remote_code": true}'})
    expect_bad(remote, existing, "remote code")
    no_config = make_zip(tmp_path / "b.zip", {"m/pytorch_model.bin": weights.getvalue(), "m/README": b"hi"})
    expect_bad(no_config, existing, "no config.json")
    two_roots = make_zip(tmp_path / "c.zip", {"a/config.json": b"{}", "b/config.json": b"{}"})
    expect_bad(two_roots, existing, "several top-level folders")
    no_weights = make_zip(tmp_path / "d.zip", {"config.json": b'{"model_type": "vit"}'})
    expect_bad(no_weights, existing, "no weights")
    bad_json = make_zip(tmp_path / "e.zip", {"config.json": b"{not json"})
    expect_bad(bad_json, existing, "not valid JSON")
    index = json.dumps({"weight_map": {"w": "../escape.safetensors"}}).encode()
    bad_index = make_zip(tmp_path / "f.zip", {"config.json": b"{}", "model.safetensors.index.json": index})
    expect_bad(bad_index, existing, "invalid shard name")


def test_parent_path_member_writes_nothing_outside(tmp_path: Path, existing: Path) -> None:
    src = make_zip(tmp_path / "evil.zip", {"config.json": b"{}", "../evil": b"pwned", "a/../../evil2": b"x"})
    expect_bad(src, existing, r"'\.\.' component")
    assert not (existing.parent / "evil").exists()
    assert not (existing.parent / "evil2").exists()


def test_absolute_member_is_rejected(tmp_path: Path, existing: Path) -> None:
    target = tmp_path / "absolute-evil"
    src = make_zip(tmp_path / "abs.zip", {"config.json": b"{}", str(target): b"pwned"})
    expect_bad(src, existing, "absolute path")
    assert not target.exists()


def test_symlink_and_device_members_are_rejected(tmp_path: Path, existing: Path) -> None:
    link = make_zip(
        tmp_path / "link.zip",
        {"config.json": b"{}", "model.safetensors": b"/etc/passwd"},
        **{"model.safetensors": (stat.S_IFLNK | 0o777) << 16},
    )
    expect_bad(link, existing, "symbolic link")
    device = make_zip(
        tmp_path / "dev.zip", {"config.json": b"{}", "null": b""}, **{"null": (stat.S_IFCHR | 0o666) << 16}
    )
    expect_bad(device, existing, "device or special file")


def test_duplicate_members_are_rejected(tmp_path: Path, existing: Path) -> None:
    src = tmp_path / "dup.zip"
    with warnings.catch_warnings(), zipfile.ZipFile(src, "w") as archive:
        warnings.simplefilter("ignore")
        archive.writestr("config.json", b"{}")
        archive.writestr("./config.json", b'{"model_type": "other"}')
    expect_bad(src, existing, "duplicate member")


def test_too_many_members(tmp_path: Path, existing: Path) -> None:
    src = make_zip(tmp_path / "many.zip", {f"f{i}.txt": b"x" for i in range(6)} | {"config.json": b"{}"})
    expect_bad(src, existing, "more than the limit of 5", max_bundle_files=5)


def test_zip_bomb_by_ratio(tmp_path: Path, existing: Path) -> None:
    src = make_zip(tmp_path / "bomb.zip", {"config.json": b"{}", "model.safetensors": bytes(8 * 1024 * 1024)})
    assert src.stat().st_size < 64 * 1024
    expect_bad(src, existing, "zip bomb")


def test_bundle_over_byte_limit(tmp_path: Path, existing: Path) -> None:
    src = make_zip(tmp_path / "big.zip", {"config.json": b"{}", "blob.bin": os.urandom(300_000)})
    expect_bad(src, existing, "more than the limit of 200000", max_bundle_bytes=200_000)


def lie_about_size(path: Path, member: str, declared_bytes: int) -> None:
    """Rewrite the central directory's uncompressed size of ``member``."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    at = data.find(b"PK\x01\x02")
    while at != -1:
        (name_len,) = struct.unpack_from("<H", data, at + 28)
        if bytes(data[at + 46 : at + 46 + name_len]) == name:
            struct.pack_into("<I", data, at + 24, declared_bytes)
            path.write_bytes(bytes(data))
            return
        at = data.find(b"PK\x01\x02", at + 4)
    raise AssertionError(f"{member} not found")


def test_zip_bomb_with_a_lying_header(tmp_path: Path, existing: Path) -> None:
    payload = os.urandom(1024) * 2048  # 2 MiB real, declared as 1000 bytes
    src = make_zip(tmp_path / "liar.zip", {"config.json": b"{}", "model.safetensors": payload})
    lie_about_size(src, "model.safetensors", 1000)
    with zipfile.ZipFile(src) as archive:
        assert archive.getinfo("model.safetensors").file_size == 1000
    expect_bad(src, existing, "corrupt", max_bundle_bytes=100_000)


def test_extraction_counts_real_bytes(tmp_path: Path) -> None:
    """The byte limit holds even where the declared sizes passed the early check."""
    src = make_zip(tmp_path / "x.zip", {"a.bin": os.urandom(50_000), "b.bin": os.urandom(50_000)})
    root = tmp_path / "root"
    root.mkdir()
    with zipfile.ZipFile(src) as archive:
        members = {info.filename: info for info in archive.infolist()}
        with pytest.raises(BadArtifact, match="expands beyond the limit of 60000"):
            extract.extract_members(archive, members, str(root), max_bytes=60_000)
    assert sum(p.stat().st_size for p in root.iterdir()) <= 60_000


def test_torch_zip_is_not_mistaken_for_a_bundle(tmp_path: Path) -> None:
    src = tmp_path / "state.pt"
    torch.save(tiny_state(), str(src))
    with zipfile.ZipFile(src) as archive:
        assert not extract.is_bundle_zip(archive.namelist())
    assert detect_format(str(src)) == "torch"


def test_load_state_file_errors(tmp_path: Path, vit_dir: Path) -> None:
    with pytest.raises(BadArtifact, match="not a state file"):
        load_state_file(str(zip_dir(vit_dir, tmp_path / "bundle.zip")))
    with pytest.raises(BadArtifact, match="cannot be read"):
        load_state_file(str(tmp_path / "missing.safetensors"))
    module = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), str(module))
    with pytest.raises(BadArtifact, match="serialized modules"):
        load_state_file(str(module))


def test_errors_pickle() -> None:
    error = pickle.loads(pickle.dumps(BadArtifact("bundle member '../x' has a '..' component")))
    assert (error.code, error.message) == ("bad_artifact", "bundle member '../x' has a '..' component")


# --- materialize_model from params ---------------------------------------------------------


def test_materialize_timm_from_params() -> None:
    import timm

    reference = timm.create_model("test_resnet", pretrained=False, num_classes=3)
    params = {"model_name": "test_resnet", "num_classes": 3}
    model, missing, unexpected = materialize_model(
        {"state_dict": reference.state_dict()}, params=params, bundle_root=None
    )
    assert (missing, unexpected) == ([], [])
    assert_same_state(model.state_dict(), reference.state_dict())


def test_materialize_torchvision_reports_missing_and_unexpected() -> None:
    from torchvision import models

    state = models.get_model("resnet18", weights=None, num_classes=3).state_dict()
    state.pop("fc.bias")
    state["extra.weight"] = torch.ones(1)
    params = {"model_name": "resnet18", "model_backend": "torchvision", "num_classes": 3}
    model, missing, unexpected = materialize_model(state, params=params, bundle_root=None)
    assert (missing, unexpected) == (["fc.bias"], ["extra.weight"])
    assert torch.equal(model.state_dict()["fc.weight"], state["fc.weight"])


def test_materialize_huggingface_from_params_ignores_tied_head() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = {
        "model_type": "gpt2",
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 16,
        "vocab_size": 40,
        "n_positions": 8,
    }
    config_data = dict(hf_config)
    reference = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config_data.pop("model_type"), **config_data)
    )
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    params = {
        "model_name": "tiny-gpt2",
        "model_backend": "huggingface",
        "hf_config": hf_config,
        "hf_task": "causal-lm",
    }
    model, missing, unexpected = materialize_model(state, params=params, bundle_root=None)
    assert (missing, unexpected) == ([], [])
    assert torch.equal(model.state_dict()["lm_head.weight"], state["transformer.wte.weight"])


@pytest.mark.parametrize(
    ("loaded", "params", "match"),
    [
        ({"w": torch.ones(1)}, {}, "needs params.model_name"),
        (
            {"w": torch.ones(1)},
            {"model_name": "x", "model_backend": "keras"},
            "unsupported params.model_backend",
        ),
        ({"w": torch.ones(1)}, {"model_name": "no_such_net"}, "timm cannot build 'no_such_net'"),
        ({"w": torch.ones(1)}, {"model_name": "test_resnet", "num_classes": "many"}, "num_classes"),
        (
            {"w": torch.ones(1)},
            {
                "model_name": "m",
                "model_backend": "huggingface",
                "hf_config": {"model_type": "vit"},
                "hf_task": "x",
            },
            "unsupported params.hf_task",
        ),
        ({"w": torch.ones(1)}, {"model_name": "m", "model_backend": "huggingface"}, "model_type"),
        (
            {"w": torch.ones(1)},
            {
                "model_name": "m",
                "model_backend": "huggingface",
                "hf_config": {"model_type": "vit", "auto_map": {}},
            },
            "remote code",
        ),
        ([1, 2], {"model_name": "test_resnet"}, "not a state dict"),
        ({"fc.weight": torch.ones(1, 1)}, {"model_name": "test_resnet", "num_classes": 3}, "does not fit"),
    ],
)
def test_materialize_invalid_requests(loaded: object, params: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        materialize_model(loaded, params=params, bundle_root=None)
    assert info.value.code == "invalid_request"
