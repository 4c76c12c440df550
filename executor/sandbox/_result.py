"""What the sandbox leaves on disk, as the worker reads it: the trained state and the task dir's size.

The runner names its result file in its ``complete`` message; the worker opens it with
``openat`` and ``O_NOFOLLOW`` at every step, checks by ``fstat`` that it is a regular file
with one link within a size derived from the model, unlinks it, and reads it only through
that descriptor, key by key as the round's delta is written (``ResultState``) — so a tenant
can spoil only its own result, never make the worker read or write anything else. The
task dir's size (the disk quota) is measured without following links or recursing
(:func:`executor.fileio.walk_tree`), and fails closed: an absurd number of entries, a tree
nested deeper than the walk descends, or one it cannot read counts as over quota.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import weakref
from collections.abc import Iterator, Mapping

import torch

from executor.errors import RoundhouseError, SandboxProtocolError, map_exceptions
from executor.fileio import walk_tree
from executor.tensorfile import MAX_HEADER_BYTES, Header, header_length, read_header, read_tensor

RESULT_NAME = re.compile(r"^result-[A-Za-z0-9-]{1,64}\.safetensors$")
MIN_RESULT_BYTES = 1024 * 1024 * 1024
RESULT_OVERHEAD_BYTES = 256 * 1024 * 1024
MAX_RESULT_BYTES = 64 * 1024 * 1024 * 1024
QUOTA_MAX_ENTRIES = 100_000
# Room in a result's header beyond twice the model's: keys the tenant added, metadata.
RESULT_HEADER_SLACK_BYTES = 64 * 1024
OVER_QUOTA = 1 << 62  # what tree_size says of a tree it refuses to measure


def result_limit(model_bytes: int) -> int:
    """A trained state may be fp32 of a bf16 model: twice the model, plus headroom."""
    return min(MAX_RESULT_BYTES, max(MIN_RESULT_BYTES, model_bytes * 2 + RESULT_OVERHEAD_BYTES))


def result_header_limit(model_path: str) -> int:
    """The longest header a trained state of this model needs: its keys are the model's, each
    entry at most twice as long (a wider dtype code, longer offsets). Parsing a header costs
    memory and CPU outside the sandbox's limits, so a result with a million empty tensors is
    refused unread, not parsed (measured before: +1.2 GB, 16.6 s)."""
    with open(model_path, "rb") as file:
        model_header = header_length(os.pread(file.fileno(), 8, 0))
    return min(MAX_HEADER_BYTES, 2 * model_header + RESULT_HEADER_SLACK_BYTES)


class ResultState(Mapping[str, torch.Tensor]):
    """The runner's trained state, each key read through the result's one descriptor when it is
    asked for (a round's delta reads each key once, in turn): no model-sized copy is made and
    held whole before the delta's pass starts. The file itself is already unlinked; ``close``
    (or dropping the state) closes the descriptor. Every entry lies within the file (its header
    was checked against the file's size); a read that still comes up short is the runner's
    protocol error."""

    def __init__(self, fd: int, header: Header) -> None:
        self._file = os.fdopen(fd, "rb")
        self._header = header
        self._closer = weakref.finalize(self, self._file.close)

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self._header.specs[name]
        try:
            return read_tensor(self._file, self._header, spec)
        except (RoundhouseError, OSError, ValueError) as exc:
            raise SandboxProtocolError(f"result file cannot be read: {exc}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._header.specs)

    def __len__(self) -> int:
        return len(self._header.specs)

    def close(self) -> None:
        self._closer()


def read_result(
    task_dir: str, name: str, max_bytes: int, max_header_bytes: int = MAX_HEADER_BYTES
) -> ResultState:
    """The runner's trained state, read through one descriptor that cannot be redirected;
    its header no longer than ``max_header_bytes`` (:func:`result_header_limit`). The file is
    unlinked at once; its tensors are read when asked for (:class:`ResultState`)."""
    if not RESULT_NAME.match(name):
        raise SandboxProtocolError("runner named an invalid result file")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    dir_fd = out_fd = fd = -1
    unsafe = {
        OSError: lambda exc: SandboxProtocolError(f"result file cannot be opened safely: {exc.strerror}")
    }
    try:
        with map_exceptions(unsafe):
            dir_fd = os.open(task_dir, flags | os.O_DIRECTORY)
            out_fd = os.open("out", flags | os.O_DIRECTORY, dir_fd=dir_fd)
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=out_fd)
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SandboxProtocolError("result is not a regular file")
        if st.st_nlink != 1:
            raise SandboxProtocolError("result file has other links")
        if st.st_size > max_bytes:
            raise SandboxProtocolError(f"result is {st.st_size} bytes, over its limit of {max_bytes}")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as file:
            try:
                header = read_header(file, max_header_bytes)
            except RoundhouseError as exc:
                raise SandboxProtocolError(f"result file is not a valid state: {exc.message}") from None
        state, fd = ResultState(fd, header), -1  # the state owns the descriptor now
        return state
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=out_fd)
        os.close(out_fd)


def tree_size(path: str, limit_entries: int = QUOTA_MAX_ENTRIES) -> int:
    """Disk blocks under ``path`` (links not followed). Fails closed: an absurd entry count, a
    tree nested deeper than a walk descends, or one the walk cannot read counts as over quota."""
    total, entries = 0, 0
    try:
        for _fd, entry in walk_tree(path):
            entries += 1
            if entries > limit_entries:
                return OVER_QUOTA
            with contextlib.suppress(FileNotFoundError):  # the tenant removed it meanwhile
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    except OSError:  # TreeTooDeep included
        return OVER_QUOTA
    return total
