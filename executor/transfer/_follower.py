"""The sha256 of a file that is being written front to back, computed on a thread of its own
just behind the writer (and any other digest of its bytes in order: the model's state hash,
``fetch(follow=...)``).

A one-stream download with a sha256 to check used to hash the finished file in a second pass:
1.2 s more for 2 GiB on a CPU that hashes at 1.8 GB/s, after a 0.75 s download. Following
the writer, the hash is done moments after the last byte lands, on the other core. The
follower reads the partial file back (from the page cache) rather than taking the writer's
buffers, so the writer never waits for it; ``hashlib`` releases the GIL on large updates.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from functools import partial

from executor.fileio import MIB
from executor.transfer._cancel import Cancel
from executor.transfer._config import Digest, DigestFactory

READ_BYTES = 1 * MIB  # L2-sized: read back, then hashed while still in cache
TRUNCATE_GRACE_S = 0.5


class HashFollower:
    """``mark``/``add`` say how much of the file is final; ``result`` is its digest (the first
    of ``digests``: sha256 unless told), ``results`` every one."""

    def __init__(self, path: str, digests: Sequence[DigestFactory] = (hashlib.sha256,)) -> None:
        self._path = path
        self._factories = tuple(digests)
        self._cond = threading.Condition()
        self._upto = 0  # bytes [0, upto) of the file are final
        self._generation = 0  # bumped when the file is cut back below ``upto``: hash again
        self._hashed = (0, 0)  # (generation, bytes) the thread has hashed, published
        self._stopped = False
        self._failed = False
        self._digests: list[Digest] = [make() for make in self._factories]  # the thread's own
        self._thread = threading.Thread(target=self._run, name="hash-follower", daemon=True)
        self._thread.start()

    def mark(self, upto: int) -> None:
        """Bytes ``[0, upto)`` are final; less than before means the file was truncated."""
        with self._cond:
            if upto < self._upto:
                self._generation += 1
            self._upto = upto
            self._cond.notify_all()

    def add(self, count: int) -> None:
        """``count`` more bytes, right after the last ones, are final."""
        with self._cond:
            self._upto += count
            self._cond.notify_all()

    def result(self, size: int, cancel: Cancel) -> str | None:
        """The hex digest of the file's ``size`` bytes, once hashed; None when the follower did
        not see every one of them written (the caller then hashes the file itself)."""
        found = self.results(size, cancel)
        return found[0] if found is not None else None

    def results(self, size: int, cancel: Cancel) -> list[str | None] | None:
        """Every digest's hex value (each None where that digest could not make one), or None
        when the follower did not see all ``size`` bytes written."""
        with self._cond:
            while True:
                if self._failed or self._stopped or self._upto != size:
                    return None
                if self._hashed == (self._generation, size):
                    return [digest.hexdigest() for digest in self._digests]
                cancel.check()
                self._cond.wait(0.1)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _moved_on(self, generation: int) -> bool:
        return self._stopped or self._generation != generation

    def _run(self) -> None:
        view = memoryview(bytearray(READ_BYTES))
        generation, done = 0, 0
        fd: int | None = None
        try:
            while True:
                with self._cond:
                    while True:
                        if self._stopped:
                            return
                        if self._generation != generation:
                            generation, done = self._generation, 0
                            self._digests = [make() for make in self._factories]
                        if done < self._upto:
                            break
                        self._cond.wait()
                    end = self._upto
                if fd is None:
                    fd = os.open(self._path, os.O_RDONLY)
                count = os.preadv(fd, [view[: min(READ_BYTES, end - done)]], done)
                if count <= 0:
                    # A writer that truncates the file (a server ignored Range) marks it right
                    # after: wait for that; a file that stays short is a failure.
                    with self._cond:
                        if self._cond.wait_for(partial(self._moved_on, generation), TRUNCATE_GRACE_S):
                            continue
                    raise OSError(f"{self._path} is shorter than the {end} bytes marked final")
                with self._cond:
                    stale = self._generation != generation
                if stale:
                    continue  # truncated meanwhile: those bytes may be the old file's
                for digest in self._digests:
                    digest.update(view[:count])
                done += count
                with self._cond:
                    self._hashed = (generation, done)
                    self._cond.notify_all()
        except OSError:
            with self._cond:
                self._failed = True
                self._cond.notify_all()
        finally:
            if fd is not None:
                os.close(fd)
