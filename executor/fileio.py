"""Atomic file writes: a unique temp name beside the target, ``os.replace``, unlink in ``finally``.

A reader (another process, or this one after a crash) sees either the old file
or the complete new one, never a prefix.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

MIB = 1 << 20  # the one definition of a mebibyte, for every size written in MiB
TEMP_SUFFIX = ".tmp"  # a file being written
RETIRED_SUFFIX = ".retired"  # a replaced file being unlinked (replace_retiring)


def temp_path_for(path: str) -> str:
    """A fresh, unique, already-created (empty) temp file in ``path``'s directory.

    Open it with ``"r+b"``, not ``"wb"``: truncating an existing file, even an empty one,
    makes ext4 allocate every block of what is then written when the file is closed
    (``auto_da_alloc``), which cost 0.1 s per 500 MB of shard on close (bench/zstd.py).
    """
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=TEMP_SUFFIX, dir=directory)
    os.close(fd)
    return tmp


@contextmanager
def atomic_writer(path: str, *, retire: bool = False) -> Iterator[IO[bytes]]:
    """Yield a binary file; on a clean exit it replaces ``path`` whole, on error nothing changes.

    ``retire``: a big file's replacement, by :func:`replace_retiring`."""
    tmp = temp_path_for(path)
    try:
        with open(tmp, "r+b") as file:  # not "wb": see temp_path_for
            yield file
        if retire:
            replace_retiring(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def replace_retiring(src: str, dst: str) -> None:
    """``os.replace(src, dst)`` for a big file, with neither of its two costs on the caller's path.

    Renaming over an existing file makes ext4 write the new file's blocks out on the spot
    (``auto_da_alloc``: 0.34-0.41 s for 1 GiB on this VM), and the old file's blocks are freed
    as its last name goes (1.2-2.5 s for 1 GiB on ext4 with ``discard``). So ``dst`` is first
    renamed to a temp name beside it, ``src`` then takes the free name, and the old file is
    unlinked on a thread. Between the two renames ``dst`` does not exist: a crash there leaves
    no file under that name (a load or apply in progress, which a restart treats as no model)
    and the old one under its retired name, which start-up removes. Without ``auto_da_alloc``'s
    flush a power cut can leave the new file's size without its bytes: a recorded hash is
    trusted only within the boot that wrote the file (``modelfile.model_fingerprint``).
    """
    directory, name = os.path.split(os.path.abspath(dst))
    retired = os.path.join(directory, f".{name}.{os.urandom(6).hex()}{RETIRED_SUFFIX}")
    try:
        os.rename(dst, retired)
        moved = True
    except FileNotFoundError:
        moved = False
    try:
        os.replace(src, dst)
    except BaseException:
        if moved:
            os.rename(retired, dst)
        raise
    if moved:
        threading.Thread(target=remove_quietly, args=(retired,), name="retire-file", daemon=True).start()


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_writer(path) as file:
        file.write(data)


def atomic_write_json(path: str, value: Any) -> None:
    atomic_write_bytes(path, json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def remove_quietly(path: str) -> int:
    """Unlink ``path`` if it is there; returns the bytes freed."""
    try:
        size = os.lstat(path).st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return 0


def tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def empty_dir(path: str) -> int:
    """Remove everything under ``path`` (kept, private); returns the bytes it held."""
    held = tree_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return held


def own_dir(base: str, fixed: str | None, *, prefix: str) -> str:
    """A directory only this process writes: ``fixed`` when given (a worker's, so that a
    replacement process finds what the last one left), else a fresh one under ``base``."""
    os.makedirs(base, exist_ok=True)
    if fixed is None:
        return tempfile.mkdtemp(prefix=prefix, dir=base)
    os.makedirs(fixed, mode=0o700, exist_ok=True)
    return fixed
