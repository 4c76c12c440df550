"""Atomic file writes, and walks and removals of trees whatever their shape.

Writes: a unique temp name beside the target, ``os.replace``, unlink in ``finally``. A
reader (another process, or this one after a crash) sees either the old file or the
complete new one, never a prefix.

Trees (DESIGN §10): a tenant shapes its task dir, and a bundle's archive the dirs it
unpacks to, so a tree may nest thousands of levels — deeper than the interpreter's
recursion limit (``os.walk`` of Python 3.11 and every ``shutil.rmtree`` recurse per level)
and than ``PATH_MAX``. :func:`walk_tree` and :func:`remove_tree` keep an explicit stack of
directory descriptors and name every entry relative to one (``openat``/``unlinkat``), never
follow a link, skip what vanishes while they run, and hold a bounded number of descriptors:
a walk refuses to go deeper than ``TREE_MAX_DEPTH`` (:class:`TreeTooDeep`), a removal moves a
directory deeper than ``REMOVE_OPEN_LEVELS`` up into its root and goes on from there.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
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
def atomic_writer(path: str, *, retire: bool = False, reuse: str | None = None) -> Iterator[IO[bytes]]:
    """Yield a binary file; on a clean exit it replaces ``path`` whole, on error nothing changes.

    ``retire``: a big file's replacement, by :func:`replace_retiring`. ``reuse``: a spare file
    of the writer's own (same directory), taken as the temp file when it exists and written
    over from its start (cut to what was written): its pages or blocks are already there, a
    new file's must be allocated as it is written (on this VM's tmpfs 0.05-0.25 s of kernel
    time for 128 MB)."""
    tmp = temp_path_for(path)
    try:
        if reuse is not None:
            with contextlib.suppress(FileNotFoundError):
                os.replace(reuse, tmp)
        with open(tmp, "r+b") as file:  # not "wb": see temp_path_for
            yield file
            if reuse is not None and os.fstat(file.fileno()).st_size > file.tell():
                file.truncate()
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


def empty_dir(path: str) -> int:
    """Remove everything under ``path`` (kept, private); returns the bytes it held. What
    cannot be removed stays (as ``shutil.rmtree(ignore_errors=True)`` left it)."""
    held = remove_tree(path, ignore_errors=True, keep_root=True)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return held


# --- trees ---------------------------------------------------------------------------------

TREE_MAX_DEPTH = 128  # levels a walk descends, one open descriptor each; no real tool nests so deep
REMOVE_OPEN_LEVELS = 64  # directories a removal holds open below its root
REMOVE_MAX_RELISTS = 10_000  # re-listings of a directory that refilled meanwhile, in one removal
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeTooDeep(OSError):
    """A walk met directories nested deeper than it descends."""

    def __init__(self, path: str, max_depth: int) -> None:
        super().__init__(errno.ELOOP, f"directories nested deeper than {max_depth} levels", path)


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    """A directory's descriptor, never through a link; None when ``name`` is gone or is no
    longer a directory (the tree's owner may be changing it while we look)."""
    try:
        return os.open(name, _OPEN_DIR, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link now: O_NOFOLLOW refused it
            return None
        raise


def walk_tree(path: str, *, max_depth: int = TREE_MAX_DEPTH) -> Iterator[tuple[int, os.DirEntry[str]]]:
    """Every entry below ``path``, depth first, with the descriptor of the directory that holds
    it (valid until the next step; ``entry.name`` is relative to it). Links are yielded, never
    followed; an entry that vanishes before it is entered is skipped; a ``path`` that is gone
    or not a directory yields nothing. Raises :class:`TreeTooDeep` rather than hold more than
    ``max_depth`` descriptors."""
    stack: list[tuple[int, list[str]]] = []  # an open directory and its subdirectories to visit
    fd = _open_dir(path, None)
    try:
        while fd is not None or stack:
            if fd is not None:
                subdirs: list[str] = []
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            subdirs.append(entry.name)
                        yield fd, entry
                stack.append((fd, subdirs))
                fd = None
            parent, subdirs = stack[-1]
            if not subdirs:
                os.close(stack.pop()[0])
            elif len(stack) >= max_depth:
                raise TreeTooDeep(path, max_depth)
            else:
                fd = _open_dir(subdirs.pop(), parent)
    finally:
        if fd is not None:
            os.close(fd)
        for opened, _ in stack:
            os.close(opened)


def remove_tree(path: str, *, ignore_errors: bool = False, keep_root: bool = False) -> int:
    """Remove ``path`` and everything below it, however deep; returns the bytes its files held.
    A link or file at ``path`` is unlinked (a link is never followed); nothing there: 0.
    ``keep_root``: empty the directory, keep it. ``ignore_errors``: stop quietly at the first
    entry that cannot be removed (what was freed is still returned)."""
    freed = [0]
    try:
        try:
            root = os.open(path, _OPEN_DIR)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            return remove_quietly(path)
        try:
            _empty(root, freed)
        finally:
            os.close(root)
        if not keep_root:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(path)
    except OSError:
        if not ignore_errors:
            raise
    return freed[0]


def _empty(root: int, freed: list[int]) -> None:
    """Everything below the open directory ``root``, bytes freed added to ``freed[0]``. At most
    ``REMOVE_OPEN_LEVELS`` descriptors below ``root`` are open: a directory deeper than that is
    renamed up into ``root`` under a unique name and emptied from there."""
    # Each frame: an open directory, its name in its parent, its subdirectories still to do.
    stack: list[tuple[int, str, list[str]]] = [(root, "", [])]
    freed[0] += _unlink_files(root, stack[0][2])
    relists = 0
    try:
        while True:
            fd, name, subdirs = stack[-1]
            if subdirs:
                child = subdirs.pop()
                if len(stack) > REMOVE_OPEN_LEVELS:
                    _flatten(child, fd, root, stack[0][2])
                    continue
                opened = _open_dir(child, fd)
                if opened is None:  # gone, or no longer a directory: a file or link goes now
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                        os.unlink(child, dir_fd=fd)
                    continue
                stack.append((opened, child, []))
                freed[0] += _unlink_files(opened, stack[-1][2])
                continue
            # Every subdirectory is gone: it is empty, unless something came meanwhile.
            if len(stack) == 1:
                freed[0] += _unlink_files(root, subdirs)  # a last look: anything new goes too
                if not subdirs:
                    return
            else:
                stack.pop()
                os.close(fd)
                if _rmdir(name, stack[-1][0]):
                    continue
                stack[-1][2].append(name)  # refilled meanwhile: its turn comes again
            relists += 1
            if relists > REMOVE_MAX_RELISTS:
                raise OSError(errno.ENOTEMPTY, "the tree kept growing while it was removed")
    finally:
        for opened, _name, _subdirs in stack[1:]:
            os.close(opened)


def _rmdir(name: str, parent: int) -> bool:
    """Remove the emptied directory ``name``; False when it is not empty (any more)."""
    try:
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        return False
    return True


def _flatten(child: str, parent: int, root: int, root_subdirs: list[str]) -> None:
    """Move ``child`` (of ``parent``) up into ``root``, where it is emptied later from a
    shallow stack: the depth a removal holds open stays bounded however deep the tree is."""
    flat = f".flat-{os.urandom(8).hex()}"
    try:
        os.rename(child, flat, src_dir_fd=parent, dst_dir_fd=root)
    except FileNotFoundError:
        return
    root_subdirs.append(flat)


def _unlink_files(fd: int, subdirs: list[str]) -> int:
    """Unlink every entry of the directory ``fd`` but its subdirectories, which go to ``subdirs``."""
    freed = 0
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                continue
            except IsADirectoryError:  # became a directory after the listing
                subdirs.append(entry.name)
                continue
            freed += size
    return freed


def own_dir(base: str, fixed: str | None, *, prefix: str) -> str:
    """A directory only this process writes: ``fixed`` when given (a worker's, so that a
    replacement process finds what the last one left), else a fresh one under ``base``."""
    os.makedirs(base, exist_ok=True)
    if fixed is None:
        return tempfile.mkdtemp(prefix=prefix, dir=base)
    os.makedirs(fixed, mode=0o700, exist_ok=True)
    return fixed
