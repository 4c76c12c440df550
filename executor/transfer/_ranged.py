"""Parallel ranged download: one file, contiguous segments, N connections (one thread each)
taking the segments in file order.

Every segment retries on its own and resumes with ``Range: bytes=<done>-<end>``; the
sidecar records each segment's progress, so a crashed download resumes segment-wise.
The partial file is preallocated so that segments can ``pwrite`` at their offsets.

A large file is cut into more segments than connections (at most
``TransferConfig.segment_max_bytes`` each), and each connection takes the next one when it
is done. So the part of the file written without a gap grows steadily from the front, about
N segments behind the newest bytes, and a hash follower (:mod:`._follower`) can hash it as
it lands instead of after the last segment; with N segments of a 1/N each, the front is
complete only at the end.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import requests

from executor.errors import DownloadFailed, Stopped
from executor.fileio import MIB
from executor.transfer._body import SpeedFloor, copy_body
from executor.transfer._cancel import Cancel, HaltedError, track_response, tracking
from executor.transfer._config import TransferConfig
from executor.transfer._follower import HashFollower
from executor.transfer._http import (
    SourceChangedError,
    TransientError,
    announced_total,
    check_status,
    content_range,
    request_headers,
    run_attempts,
    send,
)
from executor.transfer._limits import Limits
from executor.transfer._partial import ProgressMeter, Sidecar
from executor.transfer._session import new_session
from executor.urls import Url

SEGMENT_ALIGN_BYTES = 64 * 1024
# A crash loses at most this much progress per segment, and the sidecar is not
# rewritten after every read.
RECORD_EVERY_BYTES = 4 * MIB
# How soon the supervisor notices a plain (callback-less) abort Event.
SUPERVISOR_POLL_S = 0.05


def plan_segments(total_bytes: int, connections: int, max_bytes: int) -> list[list[int]]:
    """Split ``[0, total_bytes)`` into aligned ``[start, end, 0]`` segments: ``connections`` of
    them, or segments of ``max_bytes`` when those would be larger."""
    count = max(1, min(connections, -(-total_bytes // SEGMENT_ALIGN_BYTES)))
    size = min(-(-total_bytes // count), max_bytes)
    size = -(-size // SEGMENT_ALIGN_BYTES) * SEGMENT_ALIGN_BYTES
    return [[start, min(start + size, total_bytes), 0] for start in range(0, total_bytes, size)]


def preallocate(path: str, total_bytes: int) -> None:
    """Reserve ``total_bytes`` for ``path`` (so a full disk fails now, not mid-way), keeping
    the bytes already there (the first connection's probe)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size > total_bytes:
            os.ftruncate(fd, total_bytes)
        try:
            os.posix_fallocate(fd, 0, total_bytes)
        except OSError:  # filesystems without fallocate (some network mounts)
            os.ftruncate(fd, total_bytes)
    finally:
        os.close(fd)


class RangedDownload:
    """Fetch the incomplete segments of ``sidecar`` into ``partial``, in parallel."""

    def __init__(
        self,
        *,
        url: Url,
        partial: str,
        sidecar_path: str,
        sidecar: Sidecar,
        config: TransferConfig,
        abort: threading.Event | None,
        meter: ProgressMeter,
        limits: Limits,
        follower: HashFollower | None = None,
    ) -> None:
        if sidecar.segments is None or sidecar.total is None:
            raise ValueError("a ranged download needs a total size and planned segments")
        self.url = url
        self.partial = partial
        self.sidecar_path = sidecar_path
        self.sidecar = sidecar
        self.segments: list[list[int]] = sidecar.segments
        self.config = config
        self.abort = abort
        self.meter = meter
        self.limits = limits
        self.follower = follower
        self._lock = threading.Lock()
        self._recorded = [seg[2] for seg in self.segments]
        self._front = 0  # every segment before this one is complete
        # One session (its connection kept alive) and one buffer per connection thread.
        self._sessions: dict[int, tuple[requests.Session, memoryview]] = {}
        self._first: requests.Response | None = None
        self._first_offset = 0

    def run(self, first: requests.Response | None = None, first_offset: int = 0) -> int:
        """Download; ``first`` is an open 200 response whose body, from file offset
        ``first_offset`` (what was read of it already), becomes segment 0.

        Returns the number of connections used; raises ``Stopped``, ``SourceChangedError``
        or the ``DownloadFailed`` of the first segment that spent its retries.
        """
        self._first = first
        self._first_offset = first_offset
        self.meter.reset(sum(seg[2] for seg in self.segments), self.sidecar.total)
        self._mark_prefix()
        todo = [i for i, (start, end, done) in enumerate(self.segments) if start + done < end]
        try:
            # Segments first, then the full size: a crash in between leaves a short file
            # that ``resumable`` discards. The other order would leave a full-size file
            # beside the probe's one-stream sidecar, which reads as a finished download.
            with self._lock:
                self.sidecar.save(self.sidecar_path)
            if first is not None:
                preallocate(self.partial, self.segments[-1][1])
            fd = os.open(self.partial, os.O_RDWR)
            try:
                errors = self._supervise(fd, todo) if todo else []
            finally:
                os.close(fd)
                with self._lock:
                    self.sidecar.save(self.sidecar_path)
        finally:
            if self._first is not None:
                self._first.close()
        self._raise_first(errors)
        if any(start + done < end for start, end, done in self.segments):
            raise DownloadFailed(  # never a preallocated file with holes under the final name
                f"download of {self.url} ended with segments missing",
                {"url": str(self.url), "host": self.url.host, "status": None},
            )
        # The first response counts even when its probe already finished segment 0.
        return min(len(todo), self._connections()) + (first is not None and 0 not in todo)

    def _connections(self) -> int:
        return max(1, self.config.parallel_connections)

    def _supervise(self, fd: int, todo: list[int]) -> list[BaseException]:
        with Cancel(self.abort, self.url) as cancel:
            cancel.watched = True  # this loop fires the cancel for a plain Event too
            threads = min(len(todo), self._connections())
            try:
                with ThreadPoolExecutor(threads, thread_name_prefix="roundhouse-segment") as pool:
                    # Submitted in file order: the pool's threads take them front to back.
                    futures = [pool.submit(self._segment, cancel, fd, index) for index in todo]
                    pending: set[Future[None]] = set(futures)
                    while pending:
                        done, pending = wait(pending, timeout=SUPERVISOR_POLL_S, return_when=FIRST_EXCEPTION)
                        if cancel.stopped() or any(f.exception() is not None for f in done):
                            # Siblings of a failed segment stop too: their progress stays recorded.
                            cancel.fire()
            finally:
                for session, _buffer in self._sessions.values():
                    session.close()
                self._sessions.clear()
            stopped = cancel.stopped()
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        if stopped and errors:
            errors.insert(0, Stopped(f"download of {self.url} stopped", {"url": str(self.url)}))
        return errors

    @staticmethod
    def _raise_first(errors: list[BaseException]) -> None:
        for kind in (Stopped, SourceChangedError, DownloadFailed, BaseException):
            for exc in errors:
                if isinstance(exc, kind) and not isinstance(exc, HaltedError):
                    raise exc

    def _segment(self, cancel: Cancel, fd: int, index: int) -> None:
        ident = threading.get_ident()
        with self._lock:
            if ident not in self._sessions:
                self._sessions[ident] = (new_session(), memoryview(bytearray(self.config.buffer_bytes)))
            session, buffer = self._sessions[ident]
        with tracking(cancel.registry):
            run_attempts(
                lambda attempt: self._attempt(session, cancel, fd, index, buffer),
                url=self.url,
                config=self.config,
                cancel=cancel,
            )

    def _take_first(self, index: int) -> requests.Response | None:
        if index != 0:
            return None
        with self._lock:
            first, self._first = self._first, None
        return first

    def _attempt(
        self, session: requests.Session, cancel: Cancel, fd: int, index: int, buffer: memoryview
    ) -> None:
        start, end, done = self.segments[index]
        pos = start + done
        if pos >= end:
            return
        response = self._take_first(index)
        body_offset: int | None = self._first_offset if response is not None else None
        if response is None:
            response = send(
                session,
                "GET",
                self.url,
                policy=self.config.policy,
                timeout=self.config.body_timeout,
                headers=request_headers(pos, end - 1, self.sidecar.validator()),
            )
        with contextlib.closing(response):
            track_response(response)
            if response.status_code == 416:  # our range lies beyond the end: the file shrank
                raise SourceChangedError()
            check_status(response)
            pos = copy_body(
                response,
                fd=fd,
                pos=pos,
                end=end,
                body_offset=self._body_offset(response, pos) if body_offset is None else body_offset,
                buffer=buffer,
                cancel=cancel,
                on_written=lambda count: self._advance(index, count),
                floor=SpeedFloor(self.config.low_speed_bytes_s, self.config.low_speed_time_s),
            )
        if pos < end:
            raise TransientError(f"segment {index} ended at byte {pos} of {start}-{end - 1}")

    def _body_offset(self, response: requests.Response, pos: int) -> int:
        """The file offset of the body's first byte, after checking it is still our file."""
        if not self.sidecar.same_source(response, announced_total(response)):
            raise SourceChangedError()
        if response.status_code != 206:
            # A 200 to a ranged request from the same resource: the server ignores
            # Range here; copy_body skips to our offset.
            return 0
        parsed = content_range(response)
        if parsed is None or parsed[0] != pos:
            raise TransientError(f"asked for bytes from {pos}, got Content-Range {parsed}")
        return parsed[0]

    def _advance(self, index: int, count: int) -> None:
        # Called after the bytes are written, so the sidecar never claims unwritten data.
        with self._lock:
            segment = self.segments[index]
            segment[2] += count
            if segment[2] - self._recorded[index] >= RECORD_EVERY_BYTES:
                self._recorded[index] = segment[2]
                self.sidecar.save(self.sidecar_path)
            if index == self._front:
                self._mark_prefix()
        self.meter.add(count)

    def _mark_prefix(self) -> None:
        """Tell the head check and the hash follower how much of the file is final."""
        if self.limits.head_pending or self.follower is not None:
            upto = self._prefix()
            self.limits.mark(upto)
            if self.follower is not None:
                self.follower.mark(upto)

    def _prefix(self) -> int:
        """How many bytes from the start of the file are written without a gap."""
        segments = self.segments
        while self._front < len(segments) - 1:
            start, end, done = segments[self._front]
            if start + done < end:
                break
            self._front += 1
        start, _end, done = segments[self._front]
        return start + done
