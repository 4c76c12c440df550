"""Overlapped rounds on the worker: the global copy G, and the working copy W rounds start from.

In overlapped mode (docs/OVERLAP.md) round k+1 trains while round k's deltas are folded, so the
sync that brings the global model from θ_k to θ_{k+1} arrives during a round. The worker keeps
two files in its model dir:

- **G**, the installed model (``model.safetensors``): only ever changed by a sync checked
  against its ``result_hash`` (or a load), so what every host holds of the global model is
  provably the same;
- **W**, ``working.safetensors``: where the next round starts, ``G + d`` with ``d`` the delta
  this host shipped for its last round (the values it reported, dequantised: a deterministic
  function of G and its own delta). A round of an overlapped session starts from W when W was
  built on the G the round names, else from G (a host whose own progress was lost, by a stop,
  a crash or a re-sync, starts from the global model like a new one).

Every other way the model changes (a load, ``apply_delta``, a sequential round, a reset)
drops W.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

from executor.delta import apply_rule, max_delta_bytes, read_delta, result_dtype
from executor.errors import HashMismatch, InvalidRequest
from executor.fileio import atomic_writer
from executor.tensorfile import StreamWriter, iter_tensors, read_header, tensor_bytes

WORKING_NAME = "working.safetensors"
MAX_SYNC_WAIT_S = 24 * 3600.0
SYNC_ID_CHARS = 64


class NotInSync(HashMismatch):
    """An overlapped round names a global model this host does not hold: it must re-sync
    (``hash_mismatch``, the contract's code for a model that is not the one named)."""


@dataclass(frozen=True)
class OverlapSpec:
    """``run_round``'s ``overlap``: the global model the round starts on (``base_hash``), the
    id of the sync it awaits (None: none is outstanding) and how long it waits for it at its end."""

    base_hash: str
    sync_id: str | None
    sync_wait_s: float

    @classmethod
    def parse(cls, value: object) -> OverlapSpec | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidRequest(f"overlap must be an object, got {type(value).__name__}")
        base_hash, sync_id, wait = (
            value.get("base_hash"),
            value.get("sync_id"),
            value.get("sync_wait_s", 600.0),
        )
        if not isinstance(base_hash, str) or not base_hash or len(base_hash) > 256:
            raise InvalidRequest("overlap.base_hash must be a model hash")
        if sync_id is not None and (
            not isinstance(sync_id, str) or not sync_id.isalnum() or not 0 < len(sync_id) <= SYNC_ID_CHARS
        ):
            raise InvalidRequest(f"overlap.sync_id must be 1-{SYNC_ID_CHARS} letters or digits")
        if (
            not isinstance(wait, (int, float))
            or isinstance(wait, bool)
            or not math.isfinite(wait)
            or not 0 <= wait <= MAX_SYNC_WAIT_S
        ):
            raise InvalidRequest(f"overlap.sync_wait_s must be seconds in [0, {MAX_SYNC_WAIT_S:g}]")
        return cls(base_hash, sync_id, float(wait))


class WorkingCopy:
    """W, the file an overlapped session's rounds start from, and the G hash it was built on."""

    def __init__(self, model_dir: str) -> None:
        self.path = os.path.join(model_dir, WORKING_NAME)
        self.base_hash: str | None = None

    def usable(self, global_hash: str) -> bool:
        return self.base_hash == global_hash and os.path.exists(self.path)

    def rebase(self, global_path: str, global_hash: str, delta_path: str) -> None:
        """W = G + the shipped delta, key by key (G streamed, the delta held: it is the small one)."""
        self.drop()
        delta = read_delta(delta_path, max_bytes=max_delta_bytes(global_path), allow_torch=False)
        with open(global_path, "rb") as source:
            header = read_header(source)
        names = sorted(header.specs)
        entries = [(name, result_dtype(header.specs[name].dtype), header.specs[name].shape) for name in names]
        with atomic_writer(self.path) as out:
            writer = StreamWriter(out, entries)
            writer.write_header()
            for name, base in iter_tensors(global_path, names):
                writer.write(tensor_bytes(apply_rule(base, delta.get(name)).contiguous()))
        os.chmod(self.path, 0o644)  # the sandboxed runner reads it as another uid
        self.base_hash = global_hash

    def drop(self) -> None:
        self.base_hash = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
