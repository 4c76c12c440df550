"""The session's model file in the work dir: fetched beside it, checked, swapped in atomically.

Every way a model file arrives (``load_model``, the sync delta, the full-download
fallback) goes through here, so the rule holds everywhere: the file at
``<work>/model.safetensors`` is always a complete model whose hash we know, and a
bad download, a bad artifact or a hash mismatch leaves it as it was. Every download
here has a byte cap known before it starts (DESIGN §11): a model (and the full-download
fallback) ``max_model_bytes``, a sync delta what the model it applies to bounds it to.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from executor import artifacts, transfer
from executor.delta import (
    DEFAULT_SCHEME,
    StreamStateHash,
    apply_sync_delta,
    file_state_hash,
    max_delta_bytes,
    scheme_of,
    zstd_bound,
)
from executor.errors import BadArtifact, ErrorInfo, HashMismatch, Stopped, error_info
from executor.fileio import (
    RETIRED_SUFFIX,
    TEMP_SUFFIX,
    TREE_MAX_DEPTH,
    TreeTooDeep,
    remove_quietly,
    remove_tree,
    replace_retiring,
    walk_tree,
)
from executor.results import ApplyVia
from executor.transfer import Progress
from executor.urls import Url
from executor.workdir import SessionDir

logger = logging.getLogger(__name__)

Fingerprint = tuple[int, int, int, str]

# Why a sync took the full download where no error was raised (ApplyOutcome.fallback's code).
NO_DELTA = "delta_not_offered"
NO_BASE = "no_base_model"


def model_fingerprint(path: str) -> Fingerprint:
    """Identity of the model file as this process wrote it (inode, size, mtime) in this boot:
    the file is installed without a flush (``fileio.replace_retiring``), so after a power cut
    its size and mtime may stand for bytes that never reached the disk, and its hash is
    computed again from the file."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns, _boot_id())


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:  # not Linux: the fingerprint holds no boot
        return ""


@dataclass(frozen=True)
class InstalledModel:
    """A model file in place, with its hash and what later rounds need to know about it."""

    path: str
    bundle_root: str | None
    preprocessor_config: Mapping[str, Any]
    model_hash: str
    fingerprint: Fingerprint

    def file_unchanged(self) -> bool:
        """Whether the file is still the one whose hash we hold."""
        try:
            return model_fingerprint(self.path) == self.fingerprint
        except FileNotFoundError:
            return False


@dataclass(frozen=True)
class Synced:
    """What a sync left in place, how, and why not by delta when it was not."""

    via: ApplyVia
    model: InstalledModel
    reason: ErrorInfo | None
    noop: bool = False


@dataclass(frozen=True)
class ModelLimits:
    """What a model download may be: its bytes (``max_model_mb``), and the files and bytes of
    the bundle beside it (``bundle_max_files``, ``bundle_max_bytes``)."""

    max_model_bytes: int
    bundle_max_bytes: int
    bundle_max_files: int


class ModelFiles:
    """Downloads, stages and installs model files in one work dir."""

    def __init__(
        self,
        work_dir: str,
        limits: ModelLimits,
        *,
        transfer_config: transfer.TransferConfig,
        abort: threading.Event,
        progress: Callable[[str], Progress] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.dirs = SessionDir(work_dir)
        self._transfer = transfer_config
        self._abort = abort
        self._limits = limits
        self._progress = progress

    def clean_leftovers(self) -> int:
        """At start: temp files and the staging dir of a process that died writing them.

        One process owns a work dir at a time, so whatever temp file is here now is an
        orphan (partial downloads under ``incoming/`` stay: they resume).
        """
        removed = 0
        for directory in (
            self.work_dir,
            self.model_dir,
            self.dirs.deltas,
            self.dirs.results,
        ):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(directory):
                    if name.startswith(".") and name.endswith((TEMP_SUFFIX, RETIRED_SUFFIX)):
                        removed += remove_quietly(os.path.join(directory, name)) >= 0
        staging = self.dirs.staging
        if os.path.isdir(staging):
            remove_tree(staging, ignore_errors=True)
            removed += 1
        return removed

    @property
    def incoming(self) -> str:
        path = self.dirs.incoming
        os.makedirs(path, exist_ok=True)
        return path

    @contextmanager
    def staging(self) -> Iterator[str]:
        """A scratch dir beside the installed model; always removed afterwards."""
        staging = self.dirs.staging
        os.makedirs(self.incoming, exist_ok=True)
        remove_tree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            yield staging
        finally:
            remove_tree(staging, ignore_errors=True)

    def fetch_hashed(
        self,
        model_url: Url,
        what: str,
        dest_dir: str,
        *,
        scheme: str = DEFAULT_SCHEME,
        abort: threading.Event | None = None,
        on_head: Callable[[bytes], None] | None = None,
    ) -> tuple[artifacts.ModelArtifact, str]:
        """Download a model, turn it into the canonical file in ``dest_dir``, and hash it.

        The body is capped at ``max_model_bytes`` and a safetensors header is checked from
        its first bytes (``artifacts.model_head``), so an endless body or a header that
        promises more than the cap is refused before the rest is written; ``on_head`` then
        sees those bytes. The state hash (in ``scheme``) follows the bytes as they land when
        the file is safetensors with its tensors in key order (``delta.StreamStateHash``);
        any other file is hashed once it is canonical. ``abort`` replaces the stop signal.
        """
        suffix = artifacts.model_suffix(str(model_url))  # the path only
        download = os.path.join(self.incoming, what + suffix)
        head_bytes, check_head = artifacts.model_head(suffix, self._limits.max_model_bytes)

        def head(first: bytes) -> int | None:
            cap = check_head(first)  # a parsed safetensors header caps the body at what it promises
            if on_head is not None:
                on_head(first)
            return cap

        fetched = transfer.fetch(
            model_url,
            download,
            config=self._transfer,
            abort=self._abort if abort is None else abort,
            max_bytes=self._limits.max_model_bytes,
            head=(head_bytes, head),
            progress=self._progress(what) if self._progress else None,
            follow=lambda: StreamStateHash(scheme),
        )
        try:
            artifact = artifacts.prepare_model_artifact(
                download,
                dest_dir,
                max_bundle_bytes=self._limits.bundle_max_bytes,
                max_bundle_files=self._limits.bundle_max_files,
            )
        finally:
            if os.path.exists(download):
                os.unlink(download)
        # A safetensors download is the canonical file byte for byte (moved, not rewritten).
        followed = fetched.followed if artifact.source_format == artifacts.SAFETENSORS else None
        return artifact, followed or file_state_hash(artifact.model_path, scheme=scheme)

    @property
    def model_dir(self) -> str:
        path = self.dirs.model
        os.makedirs(path, mode=0o755, exist_ok=True)
        return path

    @property
    def model_path(self) -> str:
        """Where the installed model file is (or will be)."""
        return os.path.join(self.model_dir, artifacts.MODEL_FILENAME)

    def install(self, artifact: artifacts.ModelArtifact, model_hash: str) -> InstalledModel:
        """Move a staged model (and its bundle) into the model dir; each move is atomic."""
        target = self.model_path
        _readable(artifact.model_path, artifact.bundle_root)
        # Neither the old file's freeing nor ext4's flush of the new one on a rename over it
        # (together 1.6-2.9 s for 1 GiB here, bench.load) is on the load's path.
        replace_retiring(artifact.model_path, target)
        bundle_root = os.path.join(self.model_dir, artifacts.BUNDLE_DIRNAME)
        remove_tree(bundle_root, ignore_errors=True)
        if artifact.bundle_root is not None:
            os.replace(artifact.bundle_root, bundle_root)
        return InstalledModel(
            target,
            bundle_root if artifact.bundle_root is not None else None,
            dict(artifact.preprocessor_config),
            model_hash,
            model_fingerprint(target),
        )

    def installed(
        self, recorded_hash: str, recorded: Sequence[object], preprocessor_config: Mapping[str, Any]
    ) -> InstalledModel | None:
        """The model a previous process left in the model dir (None when there is none).

        Its recorded hash is trusted only while the file is the one it was recorded for
        (inode, size, mtime); otherwise the hash is recomputed from the file.
        """
        path = os.path.join(self.model_dir, artifacts.MODEL_FILENAME)
        try:
            fingerprint = model_fingerprint(path)
        except OSError:
            return None
        # Replaced since it was recorded: an apply that crashed late.
        if list(fingerprint) == list(recorded):
            model_hash = recorded_hash
        else:
            model_hash = file_state_hash(path, scheme=scheme_of(recorded_hash, DEFAULT_SCHEME))
        bundle_root = os.path.join(self.model_dir, artifacts.BUNDLE_DIRNAME)
        return InstalledModel(
            path,
            bundle_root if os.path.isdir(bundle_root) else None,
            dict(preprocessor_config),
            model_hash,
            fingerprint,
        )

    def download(
        self, model_url: Url, what: str, *, expect_hash: str | None = None, scheme: str = DEFAULT_SCHEME
    ) -> InstalledModel:
        """Fetch, check and install a whole model; ``expect_hash`` must match when given (its
        prefix names the scheme; without one the model is hashed in ``scheme``)."""
        if expect_hash:
            scheme = scheme_of(expect_hash, scheme)
        with self.staging() as staging:
            artifact, model_hash = self.fetch_hashed(model_url, what, staging, scheme=scheme)
            if expect_hash and model_hash != expect_hash:
                raise HashMismatch(
                    "the full model does not match result_hash; the local model is unchanged",
                    {"expected": expect_hash, "got": model_hash},
                )
            return self.install(artifact, model_hash)

    def sync(
        self,
        current: InstalledModel | None,
        model_url: Url,
        delta_url: Url | None,
        base_hash: str | None,
        result_hash: str | None,
    ) -> Synced:
        """The delta path on ``current`` (the installed model), else the full download; nothing
        when ``current`` already is the result (a redelivered apply)."""
        if (
            current is not None
            and result_hash
            and current.model_hash == result_hash
            and current.file_unchanged()
        ):
            return Synced(ApplyVia.DELTA, current, None, noop=True)
        reason: ErrorInfo | None = ErrorInfo(NO_DELTA, "no delta offered")
        if delta_url and base_hash and result_hash:
            if current is None:
                reason = ErrorInfo(NO_BASE, "no local base model")
            else:
                # The hash we hold counts only in the scheme the orchestrator names (sha256 or
                # blake3) and while the file is the one it was computed for.
                same_scheme = scheme_of(current.model_hash, DEFAULT_SCHEME) == scheme_of(
                    base_hash, DEFAULT_SCHEME
                )
                reason = self.apply_sync(
                    current.path,
                    delta_url,
                    base_hash=base_hash,
                    result_hash=result_hash,
                    known_hash=current.model_hash if same_scheme and current.file_unchanged() else None,
                )
        if reason is None and current is not None and result_hash:
            model = replace(current, model_hash=result_hash, fingerprint=model_fingerprint(current.path))
            return Synced(ApplyVia.DELTA, model, None)
        logger.warning("sync: %s; downloading the full model", reason.message if reason else "")
        scheme = scheme_of(current.model_hash, DEFAULT_SCHEME) if current is not None else DEFAULT_SCHEME
        full = self.download(model_url, "model-full", expect_hash=result_hash, scheme=scheme)
        return Synced(ApplyVia.FULL, full, reason)

    def apply_sync(
        self, model_path: str, delta_url: Url, *, base_hash: str, result_hash: str, known_hash: str | None
    ) -> ErrorInfo | None:
        """Apply a sync delta in place; None on success, else why it could not be used.

        ``known_hash`` is the hash of the file as this process installed it (None when
        the file may have changed since); a known mismatch skips the download entirely.
        Only a stop propagates: every other failure is a reason to fall back.
        """
        if not os.path.exists(model_path):
            return ErrorInfo(NO_BASE, "no local base model")
        if known_hash is not None and known_hash != base_hash:
            return HashMismatch(
                "local model is not the delta's base (hash mismatch)",
                {"expected": base_hash, "got": known_hash},
            ).info()
        delta_path = os.path.join(self.incoming, "sync-delta.zst")
        try:
            # The model bounds what its delta decodes to, and so what the zstd file can take.
            cap = zstd_bound(max_delta_bytes(model_path))
            transfer.fetch(delta_url, delta_path, config=self._transfer, abort=self._abort, max_bytes=cap)
            apply_sync_delta(
                model_path,
                delta_path,
                base_hash=base_hash,
                result_hash=result_hash,
                abort=self._abort,
                known_base_hash=known_hash,
            )
        except Stopped:
            raise
        except Exception as exc:
            info = error_info(exc)
            logger.warning("sync delta not applied (%s): %s", info.code, info.message)
            return info
        finally:
            if os.path.exists(delta_path):
                os.unlink(delta_path)
        return None


def _readable(model_path: str, bundle_root: str | None) -> None:
    """World-readable, nobody-writable: the sandboxed runner reads the model dir as another uid."""
    os.chmod(model_path, 0o644)
    if bundle_root is None:
        return
    os.chmod(bundle_root, 0o755)
    try:  # an archive shapes this tree: walked without recursion, links never followed
        for fd, entry in walk_tree(bundle_root):
            if not entry.is_symlink():
                os.chmod(entry.name, 0o755 if entry.is_dir(follow_symlinks=False) else 0o644, dir_fd=fd)
    except TreeTooDeep:
        raise BadArtifact(f"bundle nests directories deeper than {TREE_MAX_DEPTH} levels") from None
