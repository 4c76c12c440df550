"""File locks that work across processes and threads, and wait abortably.

``flock`` locks belong to an open file description, so two ``open()`` calls in
one process conflict like two processes do; that lets threads and processes use
the same protocol. A lock is released when its holder dies (kill -9 included),
which is what makes stale reservations and pins detectable.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from executor.errors import Stopped

POLL_S = 0.02


class FileLock:
    """One open description of a lock file; ``shared`` or exclusive ``flock`` on it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"lock {self.path} is closed")
        return self._fd

    def try_acquire(self, *, shared: bool = False) -> bool:
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def acquire(
        self, *, shared: bool = False, abort: threading.Event | None = None, timeout_s: float | None = None
    ) -> None:
        """Block until held; ``Stopped`` when ``abort`` is set, ``TimeoutError`` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.try_acquire(shared=shared):
            if abort is not None and abort.is_set():
                raise Stopped(f"stopped while waiting for {os.path.basename(self.path)}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"timed out waiting for {self.path}")
            if abort is not None:
                abort.wait(POLL_S)
            else:
                time.sleep(POLL_S)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock too
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None


@contextmanager
def exclusive(path: str, *, abort: threading.Event | None = None) -> Iterator[FileLock]:
    lock = FileLock(path)
    try:
        lock.acquire(abort=abort)
        yield lock
    finally:
        lock.close()


def is_locked(path: str) -> bool:
    """Whether someone holds any flock on ``path`` right now (a probe, racy by nature)."""
    try:
        probe = FileLock(path)
    except FileNotFoundError:
        return False
    try:
        if probe.try_acquire():
            probe.release()
            return False
        return True
    finally:
        probe.close()
