"""Hugging Face bundle zips: staging, consolidation of the weights, commit.

A bundle is a zip of what ``save_pretrained`` writes: ``config.json`` (at the root
or inside exactly one top-level folder), the weights as ``model.safetensors``, as
``model.safetensors.index.json`` plus shards, or as ``pytorch_model.bin`` (plus an
index when sharded), and optionally ``preprocessor_config.json`` and tokenizer files.
It is extracted with the checks of :mod:`executor.artifacts._extract` into a staging
dir, and swapped in for the previous bundle only once everything succeeded.

The weights are consolidated into one safetensors file tensor by tensor, so the
peak memory is one copy buffer (safetensors shards) or one shard (``.bin`` shards),
never the whole model. The extracted bundle keeps everything except the weights,
which live only in the executor's canonical model file.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch

from executor import tensorfile
from executor.artifacts._extract import (
    CONFIG_NAME,
    MAX_JSON_BYTES,
    check_members,
    extract_members,
    find_root,
    parse_json_object,
    read_bounded,
    read_json_member,
    reject_remote_code,
)
from executor.errors import BadArtifact, into, map_exceptions
from executor.fileio import remove_tree

PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
_WEIGHT_NAMES = (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME, BIN_NAME, BIN_INDEX_NAME)
SAFETENSORS_METADATA = {"format": "pt"}
_COPY_CHUNK_BYTES = 16 * 1024 * 1024

# Loads a torch.save state dict with weights_only; _formats owns that reader (it is above).
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
    with map_exceptions(
        {(zipfile.BadZipFile, OSError): into(BadArtifact, "model bundle is not a readable zip")}
    ):
        archive = zipfile.ZipFile(zip_path)
    with archive:
        members = check_members(archive, max_bytes=max_bytes, max_files=max_files)
        prefix = find_root(members)
        config = read_json_member(archive, members[prefix + CONFIG_NAME], CONFIG_NAME)
        reject_remote_code(config, CONFIG_NAME)
        preprocessor_config: dict[str, Any] = {}
        if prefix + PREPROCESSOR_CONFIG_NAME in members:
            info = members[prefix + PREPROCESSOR_CONFIG_NAME]
            preprocessor_config = read_json_member(archive, info, PREPROCESSOR_CONFIG_NAME)
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
            remove_tree(staging_dir, ignore_errors=True)
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
        remove_tree(staged.staging_dir, ignore_errors=True)


def discard_bundle(staged: StagedBundle) -> None:
    remove_tree(staged.staging_dir, ignore_errors=True)


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
        index = parse_json_object(read_bounded(source, MAX_JSON_BYTES, index_name), index_name)
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
