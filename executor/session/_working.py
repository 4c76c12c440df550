"""W, the working copy an overlapped session's rounds start from, and the pass that builds it.

In overlapped mode (docs/OVERLAP.md) the worker keeps two files in its model dir: **G**, the
installed model (``model.safetensors``), only ever changed by a sync checked against its
``result_hash`` (or a load), and **W** (``working.safetensors``), where the next round starts:
``G + gain * d + c``, with ``d`` the delta this host shipped for its last round (the values it
reported) and ``c`` the eager step's correction its sync order named: a deterministic function
of G and its own delta.

The round's end is on the GPU's critical path, so a float delta and the next W are made in one
pass over the model (:meth:`WorkingCopy.write_round_end`): each key of the trained state, of the
round's start and of G is read once, the delta's key is written plain (its hash and its zstd
frame are made beside the next round, with its upload) and W's key is written beside it. The
new W takes the old one's name by ``replace_retiring``: renamed over it, ext4 would write the
new file out and free the old one's blocks on the spot, on that path (``executor.fileio``).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO

import torch

from executor.delta import (
    apply_rule,
    max_delta_bytes,
    read_delta,
    result_dtype,
    trained_diff,
    trained_keys,
)
from executor.fileio import atomic_writer
from executor.tensorfile import StreamWriter, iter_tensors, read_header, read_tensor, tensor_bytes

WORKING_NAME = "working.safetensors"
COPY_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PlainDelta:
    """A round's delta written plain by :meth:`WorkingCopy.write_round_end` (hash still to make)."""

    bytes: int
    keys: int
    rebased: bool  # W was rebuilt on the global model in the same pass


class WorkingCopy:
    """W, the file an overlapped session's rounds start from, and the G hash it was built on."""

    def __init__(self, model_dir: str) -> None:
        self.path = os.path.join(model_dir, WORKING_NAME)
        self.base_hash: str | None = None

    def usable(self, global_hash: str) -> bool:
        return self.base_hash == global_hash and os.path.exists(self.path)

    def snapshot(self, global_path: str, global_hash: str) -> None:
        """W = G byte for byte: the start of a round that would start from G while its sync is
        applied to G in place (the round's delta is taken against the model it started from)."""
        self.base_hash = None
        with open(global_path, "rb") as source, atomic_writer(self.path, retire=True) as out:
            shutil.copyfileobj(source, out, COPY_CHUNK_BYTES)
        self._publish(global_hash)

    def write_round_end(
        self,
        start_path: str,
        trained: Mapping[str, torch.Tensor],
        delta_path: str,
        dtype: torch.dtype,
        base: tuple[str, str] | None,
        *,
        gain: float = 1.0,
        correction: Mapping[str, torch.Tensor] | None = None,
        spare: str | None = None,
    ) -> PlainDelta:
        """One pass at a round's end: its float delta ``trained - start`` written plain to
        ``delta_path`` and, when ``base`` names the global model (path, hash) the next round
        starts on, W = G + gain * that delta + ``correction`` rebuilt on it, key by key (else W
        is dropped: its sync did not come). A shape change is a ``ValueError``. ``start_path``
        may be W itself: it is read through its own descriptor, and the new W replaces it whole
        or, where it has its layout, is written over it key by key (:meth:`_rewritable`).
        ``spare``: an earlier delta's file, written over (``atomic_writer``'s ``reuse``)."""
        self.base_hash = None
        with open(start_path, "rb") as start:
            start_header = read_header(start)
            names = trained_keys(start_header, trained)
            entries = [(name, dtype, start_header.specs[name].shape) for name in names]

            def diff(name: str) -> torch.Tensor:
                return trained_diff(
                    trained[name], read_tensor(start, start_header, start_header.specs[name]), dtype
                )

            if base is None:
                self.drop()
                with atomic_writer(delta_path, reuse=spare) as out:
                    delta = StreamWriter(out, entries)
                    delta.write_header()
                    for name in names:
                        delta.write(tensor_bytes(diff(name)))
                return PlainDelta(os.path.getsize(delta_path), len(names), rebased=False)
            global_path, global_hash = base
            with open(global_path, "rb") as source:
                header = read_header(source)
                keys = sorted(header.specs)
                working = [
                    (name, result_dtype(header.specs[name].dtype), header.specs[name].shape) for name in keys
                ]
                shipped = set(names)
                rewrite = self._target(start_path, working)
                with atomic_writer(delta_path, reuse=spare) as delta_out, rewrite as working_out:
                    delta, built = StreamWriter(delta_out, entries), StreamWriter(working_out, working)
                    delta.write_header()
                    built.write_header()
                    for name in sorted(shipped | set(keys)):
                        step = diff(name) if name in shipped else None
                        if step is not None:
                            delta.write(tensor_bytes(step))
                        if name in header.specs:
                            value = read_tensor(source, header, header.specs[name])
                            built.write(tensor_bytes(apply_rule(value, _step(step, gain, correction, name))))
        self._publish(global_hash)
        return PlainDelta(os.path.getsize(delta_path), len(names), rebased=True)

    def _target(
        self, start_path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Where the next W (``entries``) is written: over the round's start (:meth:`_rewritable`),
        else a new file that replaces W once whole."""
        layout = StreamWriter(io.BytesIO(), entries)
        if self._rewritable(start_path, layout.header_bytes, layout.total_bytes):
            return _overwrite(self.path)
        return atomic_writer(self.path, retire=True)

    def _rewritable(self, start_path: str, header_bytes: bytes, total_bytes: int) -> bool:
        """The next W may overwrite the round's start where it lies: the round started from W
        and the next W has its exact layout (so each key's bytes land where that key was read
        from, after it was read). Writing into a file's existing pages allocates none: a new
        256 MB file took 0.2-0.5 s of kernel time a round on this VM, the rewrite no page at all.
        W is not usable while it is rewritten (``base_hash`` is None): a pass cut short leaves a
        W that no round starts from."""
        if os.path.abspath(start_path) != os.path.abspath(self.path):
            return False
        try:
            with open(self.path, "rb") as current:
                if os.fstat(current.fileno()).st_size != total_bytes:
                    return False
                return current.read(len(header_bytes)) == header_bytes
        except FileNotFoundError:
            return False

    def rebase(
        self,
        global_path: str,
        global_hash: str,
        delta_path: str,
        *,
        gain: float = 1.0,
        correction: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """W = G + gain * the shipped delta + ``correction``, from the delta's file (a quantised
        delta: W takes the values it reported, dequantised), key by key (G streamed, the delta
        held: it is the small one)."""
        self.drop()
        shipped = read_delta(delta_path, max_bytes=max_delta_bytes(global_path), allow_torch=False)
        with open(global_path, "rb") as source:
            header = read_header(source)
        names = sorted(header.specs)
        entries = [(name, result_dtype(header.specs[name].dtype), header.specs[name].shape) for name in names]
        with atomic_writer(self.path, retire=True) as out:
            writer = StreamWriter(out, entries)
            writer.write_header()
            for name, base in iter_tensors(global_path, names):
                writer.write(tensor_bytes(apply_rule(base, _step(shipped.get(name), gain, correction, name))))
        self._publish(global_hash)

    def drop(self) -> None:
        self.base_hash = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _publish(self, global_hash: str) -> None:
        os.chmod(self.path, 0o644)  # the sandboxed runner reads it as another uid
        self.base_hash = global_hash


@contextlib.contextmanager
def _overwrite(path: str) -> Iterator[IO[bytes]]:
    """``path`` opened to be written over where it lies (:meth:`WorkingCopy._rewritable`)."""
    with open(path, "r+b") as file:
        yield file


def _step(
    delta: torch.Tensor | None, gain: float, correction: Mapping[str, torch.Tensor] | None, name: str
) -> torch.Tensor | None:
    """What W adds to G's key: the delta itself (plain averaging), else gain * delta + the
    correction's key (the eager step); nothing for a key the round did not ship."""
    if delta is None or (gain == 1.0 and not correction):
        return delta
    out = delta.to(torch.float32) * gain
    fix = correction.get(name) if correction else None
    if fix is not None and fix.shape == out.shape:
        out.add_(fix.to(torch.float32))
    return out
