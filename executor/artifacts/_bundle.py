"""Hugging Face bundle zips: safe extraction and consolidation of the weights.

A bundle is a zip of what ``save_pretrained`` writes: ``config.json`` (at the root
or inside exactly one top-level folder), the weights as ``model.safetensors``, as
``model.safetensors.index.json`` plus shards, or as ``pytorch_model.bin`` (plus an
index when sharded), and optionally ``preprocessor_config.json`` and tokenizer files.

The zip comes from a tenant, so it is treated as hostile: every name is checked
before a single byte is written (no absolute paths, no ``..``, no links or device
files, no duplicates), the member count is bounded, and the uncompressed size is
bounded by counting the bytes actually written, because a zip's headers can lie.
A config that needs remote code is refused; nothing from the bundle is executed.

The weights are consolidated into one safetensors file tensor by tensor, so the
peak memory is one copy buffer (safetensors shards) or one shard (``.bin`` shards),
never the whole model. The extracted bundle keeps everything except the weights,
which live only in the executor's canonical model file.

The model is rebuilt from config.json with ``from_pretrained(None, state_dict=...)``:
only that path applies transformers 5's checkpoint key conversions, and it never
touches the hub. ``checkpoint_state`` maps a model's state back to the file's names.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch

from executor import tensorfile
from executor.errors import BadArtifact, InvalidRequest, RoundhouseError

CONFIG_NAME = "config.json"
PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
_WEIGHT_NAMES = (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME, BIN_NAME, BIN_INDEX_NAME)
SAFETENSORS_METADATA = {"format": "pt"}

# Real checkpoints deflate to ~1.1x and JSON/tokenizer files to ~10x; a member that
# claims more than this is a bomb (deflate alone reaches ~1000x, bzip2 far more).
MAX_COMPRESSION_RATIO = 200
# Small members may compress absurdly well (a zero-filled buffer) and cost nothing.
RATIO_CHECK_MIN_BYTES = 1024 * 1024
MAX_JSON_BYTES = 16 * 1024 * 1024
_COPY_CHUNK_BYTES = 16 * 1024 * 1024
_MAX_CAUSE_CHARS = 2000

# Loads a torch.save state dict with weights_only; artifacts.py owns that reader.
StateLoader = Callable[[str], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class StagedBundle:
    """An extracted, consolidated bundle waiting to be committed into place."""

    staging_dir: str  # temp dir inside dest_dir; removed by commit_bundle / discard_bundle
    root: str  # the folder inside staging_dir that holds config.json
    preprocessor_config: dict[str, Any]


def stage_bundle(
    zip_path: str,
    dest_dir: str,
    model_out: str,
    *,
    max_bytes: int,
    max_files: int,
    load_state: StateLoader,
) -> StagedBundle:
    """Extract ``zip_path`` into a temp dir of ``dest_dir`` and write its weights to ``model_out``.

    Nothing outside the staging dir and ``model_out`` is touched; on failure the
    staging dir is removed and ``BadArtifact`` raised.
    """
    try:
        archive = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise BadArtifact(f"model bundle is not a readable zip: {exc}") from None
    with archive:
        members = check_members(archive, max_bytes=max_bytes, max_files=max_files)
        prefix = find_root(members)
        config = _read_json_member(archive, members[prefix + CONFIG_NAME], CONFIG_NAME)
        reject_remote_code(config, CONFIG_NAME)
        preprocessor_config: dict[str, Any] = {}
        if prefix + PREPROCESSOR_CONFIG_NAME in members:
            info = members[prefix + PREPROCESSOR_CONFIG_NAME]
            preprocessor_config = _read_json_member(archive, info, PREPROCESSOR_CONFIG_NAME)
            reject_remote_code(preprocessor_config, PREPROCESSOR_CONFIG_NAME)
        staging_dir = tempfile.mkdtemp(prefix=".bundle-", dir=dest_dir)
        try:
            root = os.path.join(staging_dir, "root")
            os.mkdir(root)
            wanted = {name[len(prefix) :]: info for name, info in members.items() if name.startswith(prefix)}
            extract_members(archive, wanted, root, max_bytes=max_bytes)
            consolidate_weights(root, model_out, load_state)
            return StagedBundle(staging_dir, root, preprocessor_config)
        except BaseException:
            shutil.rmtree(staging_dir, ignore_errors=True)
            raise


def commit_bundle(staged: StagedBundle, bundle_dir: str) -> None:
    """Swap the staged bundle in for ``bundle_dir``; the old one goes only once the new is in place."""
    old = None
    if os.path.lexists(bundle_dir):
        old = os.path.join(staged.staging_dir, "previous")
        os.rename(bundle_dir, old)
    try:
        os.rename(staged.root, bundle_dir)
    except BaseException:
        if old is not None:
            os.rename(old, bundle_dir)
        raise
    finally:
        shutil.rmtree(staged.staging_dir, ignore_errors=True)


def discard_bundle(staged: StagedBundle) -> None:
    shutil.rmtree(staged.staging_dir, ignore_errors=True)


def cause(exc: BaseException) -> str:
    """An exception as one bounded line for an error message (size-mismatch reports run long)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_CAUSE_CHARS else text[:_MAX_CAUSE_CHARS] + " ..."


def is_bundle_zip(names: list[str]) -> bool:
    """A zip that is a bundle rather than a ``torch.save`` archive (``<name>/data.pkl``)."""
    torch_archive = any(n.count("/") == 1 and n.endswith("/data.pkl") for n in names)
    has_config = any(n == CONFIG_NAME or n.endswith("/" + CONFIG_NAME) for n in names)
    return has_config or not torch_archive


# --- member checks -------------------------------------------------------------------------


def safe_member_name(raw: str) -> str:
    """The normalised relative path of a member, or ``BadArtifact`` if it could escape."""
    if "\x00" in raw or "\\" in raw:
        raise BadArtifact(f"bundle member {raw!r} has a NUL or backslash in its name")
    if raw.startswith("/") or (len(raw) >= 2 and raw[1] == ":"):
        raise BadArtifact(f"bundle member {raw!r} has an absolute path")
    parts = [part for part in raw.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise BadArtifact(f"bundle member {raw!r} has a '..' component")
    return "/".join(parts)


def check_members(archive: zipfile.ZipFile, *, max_bytes: int, max_files: int) -> dict[str, zipfile.ZipInfo]:
    """Validate every member before anything is extracted; returns files by normalised name."""
    infos = archive.infolist()
    if len(infos) > max_files:
        raise BadArtifact(f"bundle has {len(infos)} members, more than the limit of {max_files}")
    seen: set[str] = set()
    files: dict[str, zipfile.ZipInfo] = {}
    declared_bytes = 0
    for info in infos:
        name = safe_member_name(info.filename)
        if name in seen:
            raise BadArtifact(f"bundle has a duplicate member {name!r}")
        seen.add(name)
        kind = stat.S_IFMT(info.external_attr >> 16)
        if kind == stat.S_IFLNK:
            raise BadArtifact(f"bundle member {name!r} is a symbolic link; links are rejected")
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise BadArtifact(f"bundle member {name!r} is a device or special file")
        if info.flag_bits & 0x1:
            raise BadArtifact(f"bundle member {name!r} is encrypted")
        if info.is_dir() or not name:
            continue
        declared_bytes += info.file_size
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size >= RATIO_CHECK_MIN_BYTES and ratio > MAX_COMPRESSION_RATIO:
            raise BadArtifact(f"bundle member {name!r} compresses {ratio:.0f}:1 (a zip bomb?)")
        files[name] = info
    if declared_bytes > max_bytes:
        raise BadArtifact(
            f"bundle declares {declared_bytes} uncompressed bytes, more than the limit of {max_bytes}"
        )
    return files


def find_root(members: Mapping[str, zipfile.ZipInfo]) -> str:
    """The member-name prefix of the bundle: ``""`` or ``"<folder>/"`` holding config.json."""
    if CONFIG_NAME in members:
        return ""
    folders = sorted(
        name.split("/")[0] for name in members if name.count("/") == 1 and name.endswith("/" + CONFIG_NAME)
    )
    if len(folders) == 1:
        return folders[0] + "/"
    if not folders:
        raise BadArtifact("bundle has no config.json at its root or in a single top-level folder")
    raise BadArtifact(f"bundle has config.json in several top-level folders: {', '.join(folders)}")


def reject_remote_code(config: Mapping[str, Any], name: str) -> None:
    if "auto_map" in config or config.get("trust_remote_code"):
        raise BadArtifact(
            f"bundle {name} needs remote code (auto_map/trust_remote_code); it is never executed"
        )


def _read_json_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str) -> dict[str, Any]:
    with archive.open(info) as source:
        raw = _read_bounded(source, MAX_JSON_BYTES, name)
    return parse_json_object(raw, name)


def parse_json_object(raw: bytes, name: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadArtifact(f"bundle {name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadArtifact(f"bundle {name} is not a JSON object")
    return value


def _read_bounded(source: IO[bytes], limit: int, name: str) -> bytes:
    try:
        data = source.read(limit + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise BadArtifact(f"bundle member {name} cannot be read: {exc}") from None
    if len(data) > limit:
        raise BadArtifact(f"bundle {name} is larger than {limit} bytes")
    return data


# --- extraction ----------------------------------------------------------------------------


def extract_members(
    archive: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], root: str, *, max_bytes: int
) -> int:
    """Extract regular files under ``root``, counting real bytes; returns the bytes written."""
    written = 0
    for name in sorted(members):
        info = members[name]
        target = os.path.join(root, *name.split("/"))
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # O_EXCL | O_NOFOLLOW: never write through something that is already there.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except OSError as exc:
            raise BadArtifact(f"bundle member {name!r} cannot be extracted: {exc}") from None
        with os.fdopen(fd, "wb") as sink:
            written = _copy_member(archive, info, name, sink, written, max_bytes)
    return written


def _copy_member(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, sink: IO[bytes], written: int, max_bytes: int
) -> int:
    member_bytes = 0
    try:
        with archive.open(info) as source:
            while chunk := source.read(1024 * 1024):
                member_bytes += len(chunk)
                written += len(chunk)
                if written > max_bytes:
                    raise BadArtifact(f"bundle expands beyond the limit of {max_bytes} bytes")
                if member_bytes > info.file_size:
                    raise BadArtifact(f"bundle member {name!r} is larger than its header says")
                sink.write(chunk)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
        # zipfile stops at the declared size, so a lying header surfaces here as a bad CRC.
        raise BadArtifact(f"bundle member {name!r} is corrupt: {exc}") from None
    except OSError as exc:
        raise BadArtifact(f"bundle member {name!r} cannot be extracted: {exc}") from None
    return written


# --- weights -------------------------------------------------------------------------------


def consolidate_weights(root: str, model_out: str, load_state: StateLoader) -> None:
    """Write the bundle's weights as one safetensors file and drop them from the bundle."""
    present = {name for name in _WEIGHT_NAMES if os.path.isfile(os.path.join(root, name))}
    if SAFETENSORS_NAME in present:
        # Already the canonical format: validate it and move it, no copy of a multi-GB file.
        single = os.path.join(root, SAFETENSORS_NAME)
        with open(single, "rb") as file:
            tensorfile.read_header(file)
        os.replace(single, model_out)
    elif SAFETENSORS_INDEX_NAME in present:
        weight_map = _read_index(root, SAFETENSORS_INDEX_NAME)
        shards = {shard: os.path.join(root, shard) for shard in sorted(set(weight_map.values()))}
        _write_safetensors_shards(shards, weight_map, model_out)
    elif BIN_NAME in present or BIN_INDEX_NAME in present:
        if BIN_NAME in present:
            bin_shards = [os.path.join(root, BIN_NAME)]
        else:
            bin_map = _read_index(root, BIN_INDEX_NAME)
            bin_shards = [os.path.join(root, shard) for shard in sorted(set(bin_map.values()))]
        _write_bin_shards(bin_shards, model_out, load_state)
    else:
        raise BadArtifact(f"bundle has no weights ({', '.join(_WEIGHT_NAMES)})")
    _drop_weight_files(root)


def _read_index(root: str, index_name: str) -> dict[str, str]:
    with open(os.path.join(root, index_name), "rb") as source:
        index = parse_json_object(_read_bounded(source, MAX_JSON_BYTES, index_name), index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadArtifact(f"bundle {index_name} has no weight_map")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise BadArtifact(f"bundle {index_name} maps {key!r} to an invalid shard name {shard!r}")
        if not os.path.isfile(os.path.join(root, shard)):
            raise BadArtifact(f"bundle {index_name} names shard {shard!r}, which the zip does not contain")
    return {str(key): shard for key, shard in weight_map.items()}


def _write_safetensors_shards(shards: dict[str, str], weight_map: Mapping[str, str], model_out: str) -> None:
    """Copy tensors byte range by byte range; nothing bigger than a copy buffer is held."""
    files = {shard: open(path, "rb") for shard, path in shards.items()}  # noqa: SIM115 - closed below
    try:
        headers = {shard: tensorfile.read_header(file) for shard, file in files.items()}
        plan: list[tuple[str, tensorfile.TensorSpec]] = []
        for shard, header in headers.items():
            wanted = [key for key, name in weight_map.items() if name == shard]
            for key in wanted:
                if key not in header.specs:
                    raise BadArtifact(f"bundle shard {shard!r} lacks tensor {key!r} named by the index")
            plan.extend(sorted(((shard, header.specs[k]) for k in wanted), key=lambda item: item[1].start))
        with open(model_out, "wb") as sink:
            writer = tensorfile.StreamWriter(
                sink, [(spec.name, spec.dtype, spec.shape) for _, spec in plan], SAFETENSORS_METADATA
            )
            writer.write_header()
            for shard, spec in plan:
                for chunk in _iter_range(files[shard], headers[shard].data_offset + spec.start, spec.nbytes):
                    writer.write(chunk)
    finally:
        for file in files.values():
            file.close()


def _iter_range(file: IO[bytes], offset: int, length: int) -> Iterator[bytes]:
    done = 0
    while done < length:
        chunk = os.pread(file.fileno(), min(_COPY_CHUNK_BYTES, length - done), offset + done)
        if not chunk:
            raise BadArtifact("unexpected end of file while copying tensor data")
        done += len(chunk)
        yield chunk


def _write_bin_shards(paths: list[str], model_out: str, load_state: StateLoader) -> None:
    """Two passes over the ``.bin`` shards: shapes first (for the header), then data, one shard at a time."""
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    seen: set[str] = set()
    for path in paths:
        state = load_state(path)
        for key in sorted(state):
            if key in seen:
                raise BadArtifact(f"bundle tensor {key!r} appears in more than one shard")
            seen.add(key)
            entries.append((key, state[key].dtype, tuple(state[key].shape)))
        del state
    with open(model_out, "wb") as sink:
        writer = tensorfile.StreamWriter(sink, entries, SAFETENSORS_METADATA)
        writer.write_header()
        for path in paths:
            state = load_state(path)
            for key in sorted(state):
                data = tensorfile.tensor_bytes(state[key].detach().contiguous())
                if len(data) != writer.sizes.get(key):
                    raise BadArtifact(f"bundle shard {os.path.basename(path)!r} changed while being read")
                writer.write(data)
            del state


def _drop_weight_files(root: str) -> None:
    """The canonical model file holds the weights; a second copy in the bundle would go stale."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        is_weight = name in _WEIGHT_NAMES or (
            name.endswith((".safetensors", ".bin")) and name.startswith(("model-", "pytorch_model-"))
        )
        if is_weight and os.path.isfile(path):
            os.unlink(path)


# --- building the model ----------------------------------------------------------------------


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state under the key names of its checkpoint file.

    transformers 5 renames some weights when it loads a checkpoint (ViT's
    ``encoder.layer.0.attention.attention.query`` is ``layers.0.attention.q_proj`` in
    memory) and reverts that on save; a delta against the canonical model file must
    use the file's names, so this applies the same revert.
    """
    state = dict(model.state_dict())
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    if isinstance(model, PreTrainedModel):
        return dict(revert_weight_conversion(model, state))
    return state


def _hf_factory(params: Mapping[str, Any]) -> Any:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageClassification,
        AutoModelForSequenceClassification,
    )

    factories = {
        "causal-lm": AutoModelForCausalLM,
        "image-classification": AutoModelForImageClassification,
        "sequence-classification": AutoModelForSequenceClassification,
    }
    task = str(params.get("hf_task") or "image-classification")
    if task not in factories:
        raise InvalidRequest(f"unsupported params.hf_task {task!r}; use one of {', '.join(factories)}")
    return factories[task]


def _task_class(factory: Any, config: Any, error: type[RoundhouseError]) -> type:
    """The concrete class an Auto factory would build (Auto classes cannot load a bare state dict)."""
    try:
        cls = factory._model_mapping[type(config)]
    except KeyError:
        raise error(f"{factory.__name__} has no model for model_type {config.model_type!r}") from None
    return cls[0] if isinstance(cls, list | tuple) else cls


def hf_class_from_params(params: Mapping[str, Any]) -> tuple[type, Any]:
    from transformers import AutoConfig

    raw = params.get("hf_config") or {}
    if not isinstance(raw, Mapping):
        raise InvalidRequest("params.hf_config must be an object")
    config_data = dict(raw)
    model_type = config_data.pop("model_type", None)
    if not model_type:
        raise InvalidRequest("Hugging Face models need params.hf_config.model_type")
    if "auto_map" in config_data or config_data.get("trust_remote_code"):
        raise InvalidRequest("params.hf_config must not ask for remote code (auto_map/trust_remote_code)")
    factory = _hf_factory(params)
    try:
        config = AutoConfig.for_model(str(model_type), **config_data)
    except Exception as exc:
        raise InvalidRequest(f"params.hf_config cannot be built: {cause(exc)}") from None
    return _task_class(factory, config, InvalidRequest), config


def bundle_model_class(bundle_root: str, params: Mapping[str, Any]) -> tuple[type, Any]:
    """The bundle's own architecture (config.json ``architectures``), else the ``hf_task`` class."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(
            bundle_root, trust_remote_code=False, local_files_only=True
        )
    except Exception as exc:
        raise BadArtifact(f"bundle config.json cannot be loaded: {cause(exc)}") from None
    if getattr(config, "auto_map", None):
        raise BadArtifact("bundle config.json needs remote code (auto_map); it is never executed")
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls, config
    return _task_class(_hf_factory(params), config, BadArtifact), config


def load_hf_model(
    cls: Any, config: Any, state: dict[str, torch.Tensor], error: type[RoundhouseError]
) -> tuple[torch.nn.Module, list[str], list[str]]:
    """``from_pretrained`` on a state dict: it applies transformers' checkpoint key conversions."""
    dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.get_default_dtype())
    try:
        # The model's dtype follows its config, as from_config would, not the state's.
        model, info = cls.from_pretrained(
            None,
            config=config,
            state_dict=state,
            dtype=dtype,
            output_loading_info=True,
            local_files_only=True,
        )
    except RuntimeError as exc:
        raise error(f"the state dict does not fit {cls.__name__}: {cause(exc)}") from None
    except Exception as exc:
        raise error(f"{cls.__name__} cannot be built: {cause(exc)}") from None
    return model, sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
