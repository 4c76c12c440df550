"""What the sandbox leaves on disk, as the worker reads it: the trained state and the task dir's size.

The runner names its result file in its ``complete`` message; the worker opens it with
``openat`` and ``O_NOFOLLOW`` at every step, checks by ``fstat`` that it is a regular file
with one link within a size derived from the model, and reads it only through that
descriptor — so a tenant can spoil only its own result, never make the worker read or
write anything else. The task dir's size (the disk quota) is measured without following
links, and an absurd number of entries counts as over quota.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

import torch

from executor.errors import RoundhouseError, SandboxProtocolError, map_exceptions
from executor.tensorfile import read_header, read_tensor

RESULT_NAME = re.compile(r"^result-[A-Za-z0-9-]{1,64}\.safetensors$")
MIN_RESULT_BYTES = 1024 * 1024 * 1024
RESULT_OVERHEAD_BYTES = 256 * 1024 * 1024
MAX_RESULT_BYTES = 64 * 1024 * 1024 * 1024
QUOTA_MAX_ENTRIES = 100_000


def result_limit(model_bytes: int) -> int:
    """A trained state may be fp32 of a bf16 model: twice the model, plus headroom."""
    return min(MAX_RESULT_BYTES, max(MIN_RESULT_BYTES, model_bytes * 2 + RESULT_OVERHEAD_BYTES))


def read_result(task_dir: str, name: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """The runner's trained state, read through one descriptor that cannot be redirected."""
    if not RESULT_NAME.match(name):
        raise SandboxProtocolError("runner named an invalid result file")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    dir_fd = out_fd = -1
    unsafe = {
        OSError: lambda exc: SandboxProtocolError(f"result file cannot be opened safely: {exc.strerror}")
    }
    try:
        with map_exceptions(unsafe):
            dir_fd = os.open(task_dir, flags | os.O_DIRECTORY)
            out_fd = os.open("out", flags | os.O_DIRECTORY, dir_fd=dir_fd)
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=out_fd)
    finally:
        for opened in (dir_fd,):
            if opened >= 0:
                os.close(opened)
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
                header = read_header(file)
                return {name: read_tensor(file, header, spec) for name, spec in header.specs.items()}
            except RoundhouseError as exc:
                raise SandboxProtocolError(f"result file is not a valid state: {exc.message}") from None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=out_fd)
        os.close(out_fd)


def tree_size(path: str, limit_entries: int = QUOTA_MAX_ENTRIES) -> int:
    """Bytes under ``path`` (links not followed); absurd entry counts count as over quota."""
    total, entries = 0, 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            entries += 1
            if entries > limit_entries:
                return 1 << 62
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total
