"""Model artifacts: from a downloaded file to the executor's one canonical model file.

Whatever the orchestrator sends (safetensors, a ``torch.save`` state dict in its zip
format, or a zipped Hugging Face bundle), the executor works on
exactly one file, ``<dest_dir>/model.safetensors``, so that the sync-delta apply,
the state hash and mmap loading know one format. The format is detected by
content; the URL's suffix is only a hint for the error message of a file that
matches nothing (a ``.pt`` from ``torch.save`` is itself a zip, told apart from a
bundle by its members).

Pickle is never trusted: torch's legacy bare-pickle format is refused, a zip's pickle is
held to a budget in proportion to its storages before it is loaded
(:mod:`executor.torchzip`), and it loads with ``weights_only=True``, so a serialized
``nn.Module`` is refused; a bundle that needs remote code is refused too. A failed
preparation leaves the previous model file and bundle exactly as they were.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlparse

import torch

from executor import fileio, tensorfile, torchzip
from executor.artifacts import _bundle as bundle
from executor.artifacts._extract import is_bundle_zip
from executor.errors import BadArtifact, RoundhouseError, Translations, describe, into, map_exceptions

MODEL_FILENAME = "model.safetensors"
BUNDLE_DIRNAME = "bundle"
SAFETENSORS = "safetensors"
TORCH = "torch"
HF_BUNDLE = "hf_bundle"
_SUFFIXES = (".safetensors", ".zip", ".pth", ".bin", ".pt")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
LONG_CAUSE_CHARS = 2000
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
# What a model download's head check sees: the whole safetensors header of all but the largest
# checkpoints (a few hundred bytes a tensor), and no more than this is written before it runs.
HEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelArtifact:
    """A prepared model: the canonical safetensors file and, for a bundle, its extracted files."""

    model_path: str
    bundle_root: str | None
    preprocessor_config: dict[str, Any] = field(default_factory=dict)
    source_format: str = SAFETENSORS
    keys: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "bundle_root": self.bundle_root,
            "preprocessor_config": dict(self.preprocessor_config),
            "source_format": self.source_format,
            "keys": self.keys,
            "bytes": self.bytes,
        }


def model_suffix(url: str) -> str:
    """The model file's suffix from the URL's path (query ignored); ``.pt`` when unknown."""
    path = urlparse(url).path.lower()
    for suffix in _SUFFIXES:
        if path.endswith(suffix):
            return suffix
    return ".pt"


def detect_format(path: str, hint: str = "") -> str:
    """``safetensors`` | ``torch`` | ``hf_bundle``, by the file's first bytes and, for a zip, its members."""
    with open(path, "rb") as file:
        head = file.read(16)
    if not head:
        raise BadArtifact("model file is empty")
    if head[:4] in _ZIP_MAGICS:
        unreadable = into(BadArtifact, "model file looks like a zip but cannot be read")
        with map_exceptions({(zipfile.BadZipFile, OSError): unreadable}), zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        return HF_BUNDLE if is_bundle_zip(names) else TORCH
    # safetensors: u64le header length, then the JSON header's opening brace.
    if (
        len(head) >= 9
        and head[8:9] == b"{"
        and int.from_bytes(head[:8], "little") <= tensorfile.MAX_HEADER_BYTES
    ):
        return SAFETENSORS
    if _is_pickle(head):
        return TORCH
    # Unrecognised content: let the reader the suffix names explain what is wrong.
    if hint == ".safetensors":
        return SAFETENSORS
    if hint in _TORCH_SUFFIXES:
        return TORCH
    raise BadArtifact(
        f"model file{f' ({hint})' if hint else ''} is not safetensors, a torch checkpoint or a zip"
    )


def model_head(hint: str, max_bytes: int) -> tuple[int, Callable[[bytes], int | None]]:
    """The ``head`` hook of a model download (``transfer.fetch``): its first bytes checked
    by :func:`check_model_head` before the rest is written, the body then capped at what a
    safetensors header promises."""
    return HEAD_BYTES, partial(check_model_head, hint=hint, max_bytes=max_bytes)


def check_model_head(head: bytes, *, hint: str, max_bytes: int) -> int | None:
    """Refuse a model from its first bytes: the legacy torch format, a safetensors header
    that promises more than ``max_bytes``, or one that is not safetensors-shaped when the
    file claims to be (its first bytes, or a ``.safetensors`` URL with content that is no
    zip either). Returns the size a parsed safetensors header promises (header and data:
    the body is cut there, whatever the server sends), else None (no tighter cap).

    A header longer than ``head`` is checked only for its length here; the download's
    byte cap still bounds it, and the whole file is validated once it is on disk.
    """
    if _is_pickle(head):
        raise BadArtifact(f"model file {torchzip.LEGACY_REFUSED}")
    if head[:4] in _ZIP_MAGICS:
        return None  # a torch checkpoint or a bundle: checked whole once downloaded
    if head[8:9] != b"{":
        if hint == ".safetensors":
            raise BadArtifact("model file (.safetensors) does not start with a safetensors header")
        return None
    length = tensorfile.header_length(head[:8])
    promised = 8 + length
    parsed = 8 + length <= len(head)
    if parsed:
        header = tensorfile.parse_header(head[8 : 8 + length], None)
        promised = header.data_offset + header.data_bytes
    if promised > max_bytes:
        raise BadArtifact(
            f"model safetensors header promises {promised} bytes, more than the model cap "
            f"of {max_bytes} bytes (ROUNDHOUSE_MAX_MODEL_MB)",
            {"promised": promised, "cap": max_bytes},
        )
    return promised if parsed else None


def _is_pickle(head: bytes) -> bool:
    # torch.save's legacy format is a bare pickle (PROTO opcode, protocol 2..5): detected to be refused.
    return torchzip.is_legacy_pickle(head)


def prepare_model_artifact(
    downloaded: str, dest_dir: str, *, max_bundle_bytes: int, max_bundle_files: int
) -> ModelArtifact:
    """Validate ``downloaded`` and make it ``<dest_dir>/model.safetensors`` atomically.

    On success ``downloaded`` is consumed (moved into place or removed) and a bundle is
    extracted into ``<dest_dir>/bundle`` (a stale bundle of an earlier model is removed).
    On failure ``BadArtifact`` is raised, ``downloaded`` is left for the caller, and the
    previous model file and bundle are untouched.
    """
    os.makedirs(dest_dir, exist_ok=True)
    model_path = os.path.join(dest_dir, MODEL_FILENAME)
    bundle_dir = os.path.join(dest_dir, BUNDLE_DIRNAME)
    # A full disk is not the artifact's fault: it is StorageFull, naming the directory.
    with map_exceptions(
        {Exception: into(BadArtifact, "model artifact cannot be prepared", LONG_CAUSE_CHARS)}, where=dest_dir
    ):
        source_format = detect_format(downloaded, os.path.splitext(downloaded)[1].lower())
        if source_format == SAFETENSORS:
            keys = _install_safetensors(downloaded, model_path)
            staged = None
        else:
            keys, staged = _install_converted(
                downloaded, source_format, model_path, max_bundle_bytes, max_bundle_files
            )
        if staged is not None:
            bundle.commit_bundle(staged, bundle_dir)
        else:
            fileio.remove_tree(bundle_dir, ignore_errors=True)
    if source_format != SAFETENSORS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(downloaded)
    return ModelArtifact(
        model_path=model_path,
        bundle_root=bundle_dir if staged is not None else None,
        preprocessor_config=dict(staged.preprocessor_config) if staged is not None else {},
        source_format=source_format,
        keys=keys,
        bytes=os.path.getsize(model_path),
    )


def _install_safetensors(downloaded: str, model_path: str) -> int:
    """The download is already canonical: validate it, then move it into place."""
    keys = _count_keys(downloaded)
    if os.path.abspath(downloaded) == os.path.abspath(model_path):
        return keys
    try:
        # mkstemp-style 0600 downloads must become readable to a sandboxed runner under another uid.
        os.chmod(downloaded, _file_mode())
        os.replace(downloaded, model_path)
        return keys
    except OSError:
        pass  # another filesystem: copy into dest_dir, then replace atomically
    tmp = fileio.temp_path_for(model_path)
    try:
        shutil.copyfile(downloaded, tmp)
        _finish_temp(tmp, model_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(downloaded)
    return keys


def _install_converted(
    downloaded: str, source_format: str, model_path: str, max_bundle_bytes: int, max_bundle_files: int
) -> tuple[int, bundle.StagedBundle | None]:
    """Write a torch checkpoint's or a bundle's weights as safetensors, then replace the model file."""
    dest_dir = os.path.dirname(model_path)
    tmp = fileio.temp_path_for(model_path)
    staged = None
    try:
        if source_format == TORCH:
            state = load_torch_state(downloaded)
            with open(tmp, "r+b") as sink:  # not "wb": see fileio.temp_path_for
                tensorfile.write_state(sink, state, bundle.SAFETENSORS_METADATA)
            del state
        else:
            staged = bundle.stage_bundle(
                downloaded,
                dest_dir,
                tmp,
                max_bytes=max_bundle_bytes,
                max_files=max_bundle_files,
                load_state=load_torch_state,
            )
        keys = _count_keys(tmp)
        _finish_temp(tmp, model_path)
        return keys, staged
    except BaseException:
        if staged is not None:
            bundle.discard_bundle(staged)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _finish_temp(tmp: str, model_path: str) -> None:
    # mkstemp makes 0600; a sandboxed runner under another uid must be able to read the model.
    os.chmod(tmp, _file_mode())
    os.replace(tmp, model_path)


def _file_mode() -> int:
    """0o666 under the process umask, read without the racy ``os.umask`` set-and-restore."""
    umask = 0o022
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
    return 0o666 & ~umask


def _count_keys(path: str) -> int:
    with open(path, "rb") as file:
        header = tensorfile.read_header(file)
    if not header.specs:
        raise BadArtifact("model file holds no tensors")
    return len(header.specs)


# --- state files ---------------------------------------------------------------------------


def load_torch_state(path: str) -> dict[str, torch.Tensor]:
    """A ``torch.save`` state dict loaded with ``weights_only`` (memory-mapped), after its pickle is
    held to the budget of its storage records (:func:`executor.torchzip.check_torch_zip`): the
    legacy bare-pickle format is refused, and decoding is bounded by the file's own size."""
    with (
        map_exceptions({OSError: into(BadArtifact, "torch checkpoint cannot be read")}),
        open(path, "rb") as file,
    ):
        torchzip.check_torch_zip(file, "torch checkpoint")
    refused: Translations = {
        pickle.UnpicklingError: lambda exc: BadArtifact(
            f"serialized modules are rejected: the checkpoint holds more than tensors ({_refusal(exc)})"
        ),
        Exception: into(BadArtifact, "torch checkpoint cannot be read", LONG_CAUSE_CHARS),
    }
    with map_exceptions(refused):
        loaded = _torch_load(path)
    return state_from_loaded(loaded, BadArtifact)


def _torch_load(path: str) -> Any:
    if path.endswith(".safetensors"):
        # torch.load picks its reader by that suffix; this content was detected as a torch checkpoint.
        with open(path, "rb") as file:
            return torch.load(file, weights_only=True, map_location="cpu")
    return torch.load(path, weights_only=True, map_location="cpu", mmap=True)


def _refusal(exc: BaseException) -> str:
    """The one useful line of torch's long weights_only refusal."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:"):
            return line.removeprefix("WeightsUnpickler error:").split(" Please use", 1)[0].strip()
    return describe(exc, LONG_CAUSE_CHARS)


def state_from_loaded(loaded: Any, error: type[RoundhouseError]) -> dict[str, torch.Tensor]:
    """A flat ``{str: Tensor}`` from a state dict or ``{"state_dict": ...}``; anything else is ``error``."""
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if isinstance(loaded, torch.nn.Module):
        raise error("serialized modules are rejected: pass a state dict (model.state_dict())")
    if not isinstance(loaded, Mapping):
        raise error(f"model artifact holds a {type(loaded).__name__}, not a state dict of tensors")
    state: dict[str, torch.Tensor] = {}
    for key, value in loaded.items():
        if not isinstance(key, str):
            raise error(f"state dict key {key!r} is not a string")
        if not isinstance(value, torch.Tensor):
            raise error(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        if value.layout != torch.strided:
            raise error(
                f"state dict entry {key!r} has layout {value.layout}; only dense tensors are accepted"
            )
        state[key] = value.detach()
    if not state:
        raise error("state dict holds no tensors")
    return state


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """What user code's ``load_model(path)`` returns: a safetensors or weights-only torch state dict."""
    with map_exceptions({OSError: into(BadArtifact, "model file cannot be read")}):
        source_format = detect_format(path, os.path.splitext(path)[1].lower())
        if source_format == SAFETENSORS:
            return tensorfile.load_state(path)
        if source_format == TORCH:
            return load_torch_state(path)
    raise BadArtifact("a Hugging Face bundle zip is not a state file; load the executor's model_path instead")
