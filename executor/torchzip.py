"""A ``torch.save`` zip checked before ``torch.load`` reads it: its pickle bounded, no objects built.

``torch.load(weights_only=True)`` refuses what a state dict never holds, but it bounds
the *bytes* of the pickle, not the objects its unpickler builds: one byte of
``EMPTY_SET`` is a 216-byte set, so a 9 MB pickle grew a worker by 2 GB. Nothing here
runs the pickle: :func:`check_torch_zip` walks it with :func:`pickletools.genops`
(opcodes and their arguments, no object of the pickle's making) and refuses it unless

- the file is the zip format (the legacy bare pickle is a stream of several pickles
  whose storages torch reads inline: refused, with a clear message);
- every member is stored (``torch.save`` never compresses) and named once, under one
  archive directory that holds exactly one ``data.pkl``;
- the pickle's bytes, opcodes, calls (``REDUCE``/``BUILD``/``NEWOBJ``) and storage
  references are within a budget in proportion to the tensors the caller allows, and
  every opcode is one a state dict can need (no sets, no buffers, no extensions).

Every object the unpickler builds comes from an opcode or a call, so the objects are
bounded by the tensors allowed: for a sync delta the model's floating key count, for a
model its storage records (at most :data:`MAX_TENSORS`) plus :data:`SHARED_VIEWS`
tensors that share a storage (tied weights). An honest state dict spends ~35 opcodes,
2 calls and ~100 pickle bytes a tensor (measured on torch 2.14, module metadata
included); the budgets give it about twice that.
"""

from __future__ import annotations

import io
import pickletools
import re
import zipfile
from dataclasses import dataclass
from typing import IO

from executor.errors import BadArtifact

ZIP_MAGIC = b"PK\x03\x04"
# Per tensor allowed, and once per file (the dict, the OrderedDict's metadata, a checkpoint's extras).
OPS_PER_TENSOR = 64
FIXED_OPS = 4096
CALLS_PER_TENSOR = 4
FIXED_CALLS = 64
PICKLE_BYTES_PER_TENSOR = 1024
FIXED_PICKLE_BYTES = 64 << 10
# Members besides the storages: data.pkl, version, byteorder, .format_version, .storage_alignment,
# .data/serialization_id, and a few that later torch versions may add.
FIXED_MEMBERS = 16
# A model's tensors beyond its storage records (views of a shared storage: tied weights).
SHARED_VIEWS = 64
# The most tensors a model checkpoint may hold (~1.4x the largest public checkpoints' key count).
MAX_TENSORS = 1 << 17

CALLS = frozenset({"REDUCE", "BUILD", "NEWOBJ"})
# What torch.save writes (protocol 2 by default) and what a later protocol may use for the same values.
ALLOWED_OPS = frozenset(
    {
        "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
        "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
        "BINUNICODE", "SHORT_BINUNICODE", "BINBYTES", "SHORT_BINBYTES",
        "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
        "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS",
        "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "BINPERSID",
        "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET",
    }
)  # fmt: skip
_STORAGE = re.compile(r"data/\d+")

LEGACY_REFUSED = (
    "is in torch.save's legacy format (a bare pickle), which is refused: "
    "save it with torch.save's default zip format, or as safetensors"
)


@dataclass(frozen=True)
class PickleBudget:
    """What one pickle may spend, for ``tensors`` tensors."""

    tensors: int

    @property
    def bytes(self) -> int:
        return PICKLE_BYTES_PER_TENSOR * self.tensors + FIXED_PICKLE_BYTES

    @property
    def ops(self) -> int:
        return OPS_PER_TENSOR * self.tensors + FIXED_OPS

    @property
    def calls(self) -> int:
        return CALLS_PER_TENSOR * self.tensors + FIXED_CALLS


def is_zip(head: bytes) -> bool:
    return head[:4] == ZIP_MAGIC


def is_legacy_pickle(head: bytes) -> bool:
    """torch.save's legacy format: a bare pickle (PROTO opcode, protocol 2..5)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def check_torch_zip(file: IO[bytes], what: str, max_tensors: int | None = None) -> int:
    """Refuse ``file`` (a seekable torch.save file) unless its pickle fits the budget of
    ``max_tensors`` tensors (None: a model's, from its storage records); returns that budget.

    ``what`` names the file in messages ("delta", "torch checkpoint"). Leaves ``file`` at 0.
    """
    file.seek(0)
    head = file.read(4)
    file.seek(0)
    if not is_zip(head):
        if is_legacy_pickle(head):
            raise BadArtifact(f"{what} {LEGACY_REFUSED}")
        raise BadArtifact(f"{what} is not a torch.save zip")
    try:
        with zipfile.ZipFile(file) as archive:
            infos = archive.infolist()
            pickled, storages = _members(infos, what)
            tensors = max_tensors if max_tensors is not None else min(storages + SHARED_VIEWS, MAX_TENSORS)
            budget = PickleBudget(tensors)
            if storages > tensors or len(infos) > tensors + FIXED_MEMBERS:
                raise BadArtifact(
                    f"{what} holds {len(infos)} zip members ({storages} storages), "
                    f"more than its {tensors} tensors allow",
                    {"tensors": tensors},
                )
            if pickled.file_size > budget.bytes or pickled.compress_size > budget.bytes:
                raise _over(what, f"{pickled.file_size} pickle bytes", budget.bytes, tensors)
            data = archive.read(pickled)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as exc:
        raise BadArtifact(f"{what} is not a readable zip: {type(exc).__name__}: {str(exc)[:200]}") from None
    finally:
        file.seek(0)
    scan_pickle(data, budget, what)
    return tensors


def _members(infos: list[zipfile.ZipInfo], what: str) -> tuple[zipfile.ZipInfo, int]:
    """The one ``<archive>/data.pkl`` and the count of storage records, all members checked."""
    names: set[str] = set()
    prefix = infos[0].filename.split("/", 1)[0] + "/" if infos else ""
    pickled = None
    storages = 0
    for info in infos:
        name = info.filename
        if name in names or not name.startswith(prefix):
            raise BadArtifact(f"{what} zip member {name!r} is repeated or outside the archive directory")
        names.add(name)
        if info.compress_type != zipfile.ZIP_STORED:
            raise BadArtifact(f"{what} zip member {name!r} is compressed; torch.save never is")
        rest = name[len(prefix) :]
        if rest == "data.pkl":
            pickled = info
        elif _STORAGE.fullmatch(rest):
            storages += 1
    if pickled is None:
        raise BadArtifact(f"{what} zip holds no data.pkl (not a torch.save file)")
    return pickled, storages


def scan_pickle(data: bytes, budget: PickleBudget, what: str) -> None:
    """Walk the pickle's opcodes (nothing is built) and refuse one over ``budget``."""
    if len(data) > budget.bytes:
        raise _over(what, f"{len(data)} pickle bytes", budget.bytes, budget.tensors)
    ops = calls = storages = 0
    try:
        for opcode, _arg, _pos in pickletools.genops(io.BytesIO(data)):
            name = opcode.name
            if name not in ALLOWED_OPS:
                raise BadArtifact(f"{what} pickle uses opcode {name}, which a state dict never needs")
            ops += 1
            if name in CALLS:
                calls += 1
            elif name == "BINPERSID":
                storages += 1
            if ops > budget.ops or calls > budget.calls or storages > budget.tensors:
                raise _over(
                    what, f"{ops} opcodes, {calls} calls, {storages} storages", budget.ops, budget.tensors
                )
    except BadArtifact:
        raise
    except Exception as exc:  # genops on hostile bytes: ValueError, UnicodeDecodeError, struct.error
        raise BadArtifact(f"{what} pickle is malformed: {type(exc).__name__}: {str(exc)[:200]}") from None


def _over(what: str, spent: str, cap: int, tensors: int) -> BadArtifact:
    return BadArtifact(
        f"{what} pickle is over its budget for {tensors} tensors ({spent}; cap {cap})",
        {"cap": cap, "tensors": tensors},
    )
