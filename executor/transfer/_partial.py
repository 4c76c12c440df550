"""The progress of a download: the partial file and its sidecar on disk, and the meter that reports it.

``dest.partial`` holds the bytes; ``dest.partial.json`` says what they are (the URL
without its query, ETag / Last-Modified, total size) and, for a ranged download, how
far each segment got. Both names are stable so that a later process can resume.

Resume is safe against the death of the process (kill -9, OOM): a segment's progress
is recorded only after its bytes were written. Neither file is fsynced, so after a
power loss the sidecar may claim bytes that never reached the disk; the sha256
check of ``fetch`` is the guard there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import requests

from executor.errors import Stopped
from executor.transfer._config import Progress
from executor.transfer._http import if_range
from executor.urls import Url

logger = logging.getLogger("executor.transfer")

SIDECAR_VERSION = 1


def partial_paths(dest: str) -> tuple[str, str]:
    """The partial file and its JSON sidecar, stable across processes for resume."""
    return dest + ".partial", dest + ".partial.json"


@dataclass
class Sidecar:
    """What the partial file holds, so that a later process can resume it.

    ``segments`` lists ``[start, end, done]`` per ranged segment (``done`` never
    counts bytes that were not written yet); ``None`` means one sequential stream,
    whose progress is the size of the partial file.
    """

    url: str
    etag: str | None
    last_modified: str | None
    total: int | None
    segments: list[list[int]] | None = None

    @classmethod
    def from_response(cls, url: Url, response: requests.Response, total: int | None) -> Sidecar:
        headers = response.headers
        # The redacted form: a re-presigned URL of the same object resumes what another left.
        return cls(str(url), headers.get("ETag"), headers.get("Last-Modified"), total)

    def validator(self) -> str | None:
        return if_range(self.etag, self.last_modified)

    def same_source(self, response: requests.Response, total: int | None) -> bool:
        """False when the server names a different ETag, Last-Modified or size."""
        etag, modified = response.headers.get("ETag"), response.headers.get("Last-Modified")
        if self.etag and etag and etag != self.etag:
            return False
        if not (self.etag and etag) and self.last_modified and modified and modified != self.last_modified:
            return False
        return self.total is None or total is None or total == self.total

    @classmethod
    def load(cls, path: str) -> Sidecar | None:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            if data.pop("v", None) != SIDECAR_VERSION:
                return None
            sidecar = cls(**data)
            if sidecar.segments is not None and not all(
                len(seg) == 3 and 0 <= seg[2] <= seg[1] - seg[0] for seg in sidecar.segments
            ):
                return None
        except (OSError, ValueError, TypeError, AttributeError):
            return None
        return sidecar

    def save(self, path: str) -> None:
        directory, name = os.path.split(path)
        fd, tmp_path = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"v": SIDECAR_VERSION, **asdict(self)}, fh)
            os.replace(tmp_path, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)


def discard(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def resumable(url: Url, partial: str, sidecar_path: str, size: int | None) -> Sidecar | None:
    """The sidecar of a partial file that can be resumed, or None after removing leftovers."""
    sidecar = Sidecar.load(sidecar_path)
    try:
        partial_bytes: int | None = os.path.getsize(partial)
    except OSError:
        partial_bytes = None
    usable = (
        sidecar is not None
        and partial_bytes is not None
        and sidecar.url == str(url)  # redacted, as saved
        and (size is None or sidecar.total in (None, size))
        and (sidecar.total is None or partial_bytes <= sidecar.total)
        and (sidecar.segments is None or partial_bytes == sidecar.total)
    )
    if not usable:
        discard(partial, sidecar_path)
        return None
    return sidecar


class ProgressMeter:
    """Counts bytes from any thread and calls ``callback(done, total)`` at most every ``interval_s``."""

    def __init__(
        self,
        callback: Progress | None,
        interval_s: float = 0.25,
    ) -> None:
        self._callback = callback
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last_call = time.monotonic()
        self.done = 0
        self.total: int | None = None

    def reset(self, done: int, total: int | None) -> None:
        with self._lock:
            self.done, self.total = done, total

    def add(self, count: int) -> None:
        with self._lock:
            self.done += count
            now = time.monotonic()
            if self._callback is None or now - self._last_call < self._interval_s:
                return
            self._last_call = now
            self._call()

    def finish(self) -> None:
        with self._lock:
            self._call()

    def _call(self) -> None:
        if self._callback is None:
            return
        try:
            self._callback(self.done, self.total)
        except Stopped:
            raise
        except Exception:  # a broken progress hook must not fail the transfer
            logger.debug("progress callback failed", exc_info=True)
