"""The state hash's schemes, and the state hash of a safetensors file computed from its byte
stream while the file is still arriving.

Two versioned schemes hash the very same bytes (DESIGN §4's layout) and differ only in the
function and the prefix: ``sha256:`` (the default, and the only one a worker assumes
unasked) and ``blake3:`` (BLAKE3, whose tree mode spreads one hash over every core: on a
GPU host a 14 GB model costs ~10 s of one-core sha256, and a fraction of that in BLAKE3).
A hash names its scheme in its prefix, so an orchestrator picks one per session
(``load_model(hash_scheme=...)``; ``apply_delta`` follows the prefixes of the hashes it is
given) and a worker never compares hashes of different schemes.

:class:`StreamStateHash` turns the file's bytes, fed front to back (by the download's
follower, :mod:`executor.transfer`), into ``state_hash`` of the tensors in it. The layout
of DESIGN §4 maps onto the file stream when the tensors' data lies in sorted key order, as
:func:`executor.tensorfile.write_state` (and so the orchestrator, ``make_sync_delta``'s
result and every file the worker writes) lays it out: then each key's header is hashed as
its data begins and the data as it streams past. Other layouts (``safetensors.save_file``
groups keys by dtype first) give no digest here, and the caller hashes the finished file.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Iterable
from typing import Any

import torch

from executor.errors import BadArtifact, InvalidRequest
from executor.tensorfile import MAX_HEADER_BYTES, TensorSpec, dtype_name, header_length, parse_header

SHA256 = "sha256"
BLAKE3 = "blake3"
SCHEMES = (SHA256, BLAKE3)
DEFAULT_SCHEME = SHA256
# One BLAKE3 update of this size or more is split across cores; smaller ones run on one.
BLAKE3_PARALLEL_BYTES = 1 << 20


def check_scheme(scheme: object) -> str:
    """A known scheme's name; anything else is ``InvalidRequest``."""
    if scheme not in SCHEMES:
        raise InvalidRequest(f"hash_scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    return str(scheme)


def scheme_of(value: str, default: str | None = None) -> str:
    """The scheme a hash string names by its prefix. An unknown one is ``InvalidRequest``, or
    ``default`` when given: a hash compared in that scheme then simply does not match."""
    name, sep, digest = value.partition(":")
    if sep and digest and name in SCHEMES:
        return name
    if default is not None:
        return check_scheme(default)
    raise InvalidRequest(f"a hash must be '<scheme>:<hex>' with a scheme of {list(SCHEMES)}, got {value!r}")


def hash_prefix(scheme: str) -> str:
    return check_scheme(scheme) + ":"


def new_hasher(scheme: str = DEFAULT_SCHEME) -> Any:
    """A fresh hasher (``update``, ``hexdigest``) for ``scheme``.

    BLAKE3 uses every core for large updates (its Rust thread pool); it is imported on first
    use, so that a process that only ever hashes sha256 (the sandboxed runner) never loads it.
    """
    if check_scheme(scheme) == SHA256:
        return hashlib.sha256()
    import blake3

    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def hash_entry_header(hasher: Any, name: str, dtype: torch.dtype, shape: Iterable[int]) -> None:
    """One key's header in the state hash: ``u32 len, key, u32 len, dtype, u32 ndim, u64 dims``."""
    dims = [int(d) for d in shape]
    key = name.encode("utf-8")
    kind = dtype_name(dtype).encode("ascii")
    hasher.update(
        struct.pack(
            f"<I{len(key)}sI{len(kind)}sI{len(dims)}Q", len(key), key, len(kind), kind, len(dims), *dims
        )
    )


class StreamStateHash:
    """``state_hash`` of a safetensors file from its bytes, fed in order from byte 0.

    ``update`` takes the next bytes; ``hexdigest`` is the prefixed hash once every tensor's
    bytes went through, or None: the stream was not a safetensors file, its tensors do not
    lie in sorted key order, or it ended early. None is never an error: the file is checked
    whole once it is complete, and hashed from disk then.
    """

    def __init__(self, scheme: str = DEFAULT_SCHEME) -> None:
        self._scheme = check_scheme(scheme)
        self._hasher = new_hasher(scheme)
        self._prefix = bytearray()  # the 8-byte length and the JSON header, until parsed
        self._plan: list[TensorSpec] | None = None
        self._data_offset = 0
        self._pos = 0  # file offset of the next byte fed
        self._index = 0  # the tensor of the plan being hashed
        self._header_done = False  # its entry header is in the hasher
        self.usable = True

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if not self.usable:
            return
        if self._plan is None:
            view = self._take_header(view)
            if self._plan is None or not view:
                return
        self._feed(view)

    def hexdigest(self) -> str | None:
        if not self.usable or self._plan is None or self._index < len(self._plan):
            return None
        return self._scheme + ":" + str(self._hasher.hexdigest())

    def _take_header(self, view: memoryview) -> memoryview:
        """Collect the header; returns what of ``view`` lies past it (the data section)."""
        need = 8 if len(self._prefix) < 8 else 8 + self._length()
        while len(self._prefix) < need:
            take = min(need - len(self._prefix), len(view))
            self._prefix += view[:take]
            self._pos += take
            view = view[take:]
            if len(self._prefix) < need:
                return view
            if need == 8:
                try:
                    need = 8 + self._length()
                except BadArtifact:
                    self.usable = False
                    return view
        try:
            header = parse_header(bytes(self._prefix[8:]), None)
        except BadArtifact:
            self.usable = False
            return view
        plan = [header.specs[name] for name in sorted(header.specs)]
        # The stream maps onto the hash's layout only when sorted keys mean rising offsets.
        if any(later.start < earlier.end for earlier, later in itertools.pairwise(plan)):
            self.usable = False
            return view
        self._plan, self._data_offset = plan, header.data_offset
        self._prefix = bytearray()
        return view

    def _length(self) -> int:
        length = header_length(bytes(self._prefix[:8]))
        if length > MAX_HEADER_BYTES:
            raise BadArtifact("header too long")
        return length

    def _feed(self, view: memoryview) -> None:
        plan = self._plan
        assert plan is not None
        while view and self._index < len(plan):
            spec = plan[self._index]
            start, end = self._data_offset + spec.start, self._data_offset + spec.end
            if self._pos < start:  # a gap between tensors: not part of any tensor's bytes
                skip = min(start - self._pos, len(view))
                self._pos += skip
                view = view[skip:]
                continue
            if not self._header_done:
                hash_entry_header(self._hasher, spec.name, spec.dtype, spec.shape)
                self._header_done = True
            take = min(end - self._pos, len(view))
            if take:
                self._hasher.update(view[:take])
                self._pos += take
                view = view[take:]
            if self._pos >= end:
                self._index += 1
                self._header_done = False
        self._pos += len(view)  # trailing bytes after the last tensor are not hashed
