"""What a download may hold: its byte cap and its head check, the same in every path (one
stream, ranged segments, resume, local copies).

- The cap: ``fetch(max_bytes=...)``; for a body of unknown length whose caller names no
  size either, ``TransferConfig.max_unknown_bytes``. A size announced over it (the caller's,
  a Content-Length, a Content-Range total, a local file's) is refused before a byte is
  written; a body that grows past it is refused once it has, with one byte more than the
  cap copied at most.
- The head check: ``fetch(head=(n, check))`` runs ``check`` on the first ``n`` bytes as soon
  as they are in the partial file (or at the end of a shorter body), once per fetch. What it
  returns, if not None, caps the body from then on (a format's header promising its size):
  a size announced over it is refused at once, a body that grows past it as soon as it does.

Either refusal is :class:`~._http.Refused`: never retried, and ``fetch`` removes the partial
file before it raises the error inside.
"""

from __future__ import annotations

import os
import threading

from executor.errors import DownloadFailed, RoundhouseError, Stopped
from executor.transfer._config import Head
from executor.transfer._http import Refused
from executor.urls import Url


class Limits:
    """The cap and the head check of one fetch; ``mark``/``add`` may come from any thread."""

    def __init__(
        self,
        url: Url,
        partial: str,
        *,
        max_bytes: int | None,
        unknown_cap: int | None,
        head: Head | None = None,
    ) -> None:
        self.url = url
        self.partial = partial
        self.max_bytes = max_bytes
        self.unknown_cap = unknown_cap if max_bytes is None else None
        self._head = head
        self._lock = threading.Lock()
        self._upto = 0
        self._checked = head is None
        self._announced: int | None = None
        self._head_cap: int | None = None  # the head check's cap on the body, once it returned one

    # ------------------------------------------------------------------ cap

    def announced(self, total: int | None, what: str = "the server announces") -> None:
        """Refuse a size announced over ``max_bytes``, before anything is written."""
        if total is not None and self.max_bytes is not None and total > self.max_bytes:
            raise self._over(f"{what} {total} bytes", self.max_bytes)
        if total is not None:
            self._announced = total
            if self._head_cap is not None and total > self._head_cap:
                raise self._promised(f"{what} {total} bytes")

    def copy_end(self, expected: int | None) -> int | None:
        """Where a copy stops: the expected size, else one byte past the cap (to see it broken)."""
        if expected is not None:
            return expected
        cap = self.max_bytes if self.max_bytes is not None else self.unknown_cap
        return None if cap is None else cap + 1

    def written(self, size: int) -> None:
        """Refuse a body of unknown length once ``size`` bytes of it are past the cap."""
        if self.max_bytes is not None and size > self.max_bytes:
            raise self._over(f"the body runs past {self.max_bytes} bytes", self.max_bytes)
        if self._head_cap is not None and size > self._head_cap:
            raise self._promised(f"the body runs past {self._head_cap} bytes")
        if self.unknown_cap is not None and size > self.unknown_cap:
            raise self._over(
                f"a body of unknown length runs past {self.unknown_cap} bytes "
                "(ROUNDHOUSE_MAX_UNKNOWN_DOWNLOAD_MB, unless the task names the size)",
                self.unknown_cap,
            )

    def _promised(self, what: str) -> Refused:
        assert self._head_cap is not None
        return self._over(f"{what}, more than its head promises", self._head_cap)

    def _over(self, what: str, cap: int) -> Refused:
        message = f"download of {self.url} refused: {what}, over the cap of {cap} bytes"
        details = {
            "url": str(self.url),
            "host": self.url.host,
            "status": None,
            "rule": "max_bytes",
            "cap": cap,
        }
        return Refused(DownloadFailed(message, details))

    # ----------------------------------------------------------------- head

    @property
    def head_bytes(self) -> int:
        return self._head[0] if self._head is not None else 0

    @property
    def head_pending(self) -> bool:
        return not self._checked

    def mark(self, upto: int) -> None:
        """Bytes ``[0, upto)`` of the partial file are final."""
        if self._checked and self._head_cap is None:
            return
        with self._lock:
            self._upto = upto
            self._check_head(final=False)
            self._check_promise()

    def add(self, count: int) -> None:
        """``count`` more bytes, right after the last ones, are final."""
        if self._checked and self._head_cap is None:
            return
        with self._lock:
            self._upto += count
            self._check_head(final=False)
            self._check_promise()

    def _check_promise(self) -> None:
        # Past the head's promise: refused as soon as the bytes land, not at the model cap.
        if self._head_cap is not None and self._upto > self._head_cap:
            raise self._promised(f"the body runs past {self._head_cap} bytes")

    def finish(self) -> None:
        """The body is complete: check a head shorter than ``n`` bytes."""
        if not self._checked:
            with self._lock:
                self._check_head(final=True)

    def _check_head(self, final: bool) -> None:
        if self._checked or self._head is None or (self._upto < self._head[0] and not final):
            return
        self._checked = True
        n_bytes, check = self._head
        first = bytearray()
        fd = os.open(self.partial, os.O_RDONLY)
        try:
            while len(first) < n_bytes and (chunk := os.pread(fd, n_bytes - len(first), len(first))):
                first += chunk
        finally:
            os.close(fd)
        try:
            cap = check(bytes(first))
        except Stopped:
            raise
        except RoundhouseError as exc:
            raise Refused(exc) from None
        if cap is not None and (self.max_bytes is None or cap < self.max_bytes):
            self._head_cap = cap
            if self._announced is not None and self._announced > cap:
                raise self._promised(f"the server announces {self._announced} bytes")
