"""One HTTP download into the partial file: a sequential GET resumed with ``Range`` after
each failure, which hands over to :mod:`._ranged` when the file is large, the
server takes ranges and the first connection alone is slow.

Why a probe and not always splitting: parallel connections pay off where one stream is
held back by latency or a per-connection cap (object stores, WANs), several times over.
Where one stream already runs at memory speed (a nearby nginx, a LAN cache) eight of them
gain little and cost eight threads on cores the worker also needs for decoding shards and
feeding the GPU; from nginx on loopback (bench.download, 2 GiB) one stream took 0.78 s and
eight 0.71 s. One stream is also hashed as it is written (:mod:`._follower`); a
split download is hashed in a second pass. So the first GET copies its first
``PROBE_BYTES`` and the download splits only when that ran slower than
``parallel_below_bytes_s``; the probed bytes are kept, not fetched again. What a probe
measured is remembered per origin for ``ORIGIN_RATE_TTL_S``: the next download from an origin
that ran slow splits at once, without ``PROBE_S`` on one capped stream (a shard prefetched
while the GPU computes, bench.wan: fetch and compute were within that quarter second).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import requests

from executor.errors import DownloadFailed
from executor.fileio import MIB
from executor.transfer._body import SpeedFloor, copy_body
from executor.transfer._cancel import Cancel, track_response, tracking
from executor.transfer._config import DigestFactory, TransferConfig
from executor.transfer._follower import HashFollower
from executor.transfer._http import (
    RETRYABLE,
    SourceChangedError,
    TransientError,
    announced_total,
    check_status,
    content_range,
    request_headers,
    run_attempts,
    send,
    unsatisfied_total,
)
from executor.transfer._limits import Limits
from executor.transfer._partial import ProgressMeter, Sidecar, discard, partial_paths, resumable
from executor.transfer._ranged import RangedDownload, plan_segments
from executor.transfer._session import thread_session
from executor.urls import Url

logger = logging.getLogger("executor.transfer")

# Enough to leave TCP slow start behind on a fast path, small next to a parallel file.
PROBE_BYTES = 16 * MIB
# ...or what the first connection brings in this long, whichever comes first: a stream capped
# at 12 MB/s (an object store's per-connection limit) needs 1.4 s for 16 MiB, time in which
# eight connections would have fetched eight times as much; a nearby server sends 16 MiB in
# a fraction of this.
PROBE_S = 0.25
# An origin's rate is kept this long: a link or a store's cap changes slowly, and a download
# that split at once measures no single stream, so the next one after this probes again.
ORIGIN_RATE_TTL_S = 300.0

_origin_rates: dict[tuple[str, str, int], tuple[float, float]] = {}  # origin -> (bytes/s, when)
_origin_lock = threading.Lock()


def _origin(url: Url) -> tuple[str, str, int]:
    port = url.port or (443 if url.scheme == "https" else 80)
    return url.scheme, url.host, port


def _known_rate(url: Url) -> float | None:
    with _origin_lock:
        found = _origin_rates.get(_origin(url))
    if found is None or time.monotonic() - found[1] > ORIGIN_RATE_TTL_S:
        return None
    return found[0]


def _remember_rate(url: Url, rate: float) -> None:
    now = time.monotonic()
    with _origin_lock:
        # Expired entries go: every origin a broker message ever named would otherwise stay.
        for origin in [o for o, (_, when) in _origin_rates.items() if now - when > ORIGIN_RATE_TTL_S]:
            del _origin_rates[origin]
        _origin_rates[_origin(url)] = (rate, now)


class Downloaded(NamedTuple):
    resumed_bytes: int
    connections: int
    sha256: str | None  # hashed while written (``hashed``), else None: the caller hashes
    followed: str | None  # the ``follow`` digest of every byte, None when it made none


def download(
    url: Url,
    dest: str,
    config: TransferConfig,
    cancel: Cancel,
    meter: ProgressMeter,
    size: int | None,
    limits: Limits,
    hashed: bool = False,
    follow: DigestFactory | None = None,
) -> Downloaded:
    """Fill the partial file. With ``hashed``, the bytes are hashed (sha256) as they land, and
    with ``follow`` fed to that digest: just behind the writer of one stream, and behind the
    gapless prefix of a split download (its segments are fetched in file order). A digest
    that did not see every byte land (a download resumed from ranged segments) is None."""
    partial, sidecar_path = partial_paths(dest)
    digests: list[DigestFactory] = [hashlib.sha256] if hashed else []
    digests += [follow] if follow is not None else []
    for restarted in (False, True):
        sidecar = resumable(url, partial, sidecar_path, size)
        try:
            if sidecar is not None:
                limits.announced(sidecar.total, "the partial download's server announced")
            if sidecar is not None and sidecar.segments is not None:
                resumed_bytes = sum(segment[2] for segment in sidecar.segments)
                ranged = RangedDownload(
                    url=url,
                    partial=partial,
                    sidecar_path=sidecar_path,
                    sidecar=sidecar,
                    config=config,
                    abort=cancel.abort,
                    meter=meter,
                    limits=limits,
                )
                return Downloaded(resumed_bytes, ranged.run(), None, None)
            stream = _Stream(url, dest, sidecar, config, cancel, meter, size, limits, digests)
            resumed_bytes, connections, found = stream.run()
            found = found or [None] * len(digests)
            return Downloaded(
                resumed_bytes,
                connections,
                found[0] if hashed else None,
                found[-1] if follow is not None else None,
            )
        except SourceChangedError:
            discard(partial, sidecar_path)
            if restarted:
                raise DownloadFailed(
                    f"download of {url} failed: the file changed on the server twice",
                    {"url": str(url), "host": url.host, "status": None},
                ) from None
            logger.info("%s changed on the server; starting over", url)
    raise AssertionError("unreachable")


@dataclass
class _Handover:
    """A 200 response whose first ``consumed`` body bytes are in the partial file already;
    the rest of it becomes segment 0 of a ranged download."""

    response: requests.Response
    sidecar: Sidecar
    consumed: int


class _Stream:
    """One sequential GET into the partial file, resumed with ``Range`` after each failure."""

    def __init__(
        self,
        url: Url,
        dest: str,
        sidecar: Sidecar | None,
        config: TransferConfig,
        cancel: Cancel,
        meter: ProgressMeter,
        size: int | None,
        limits: Limits,
        digests: list[DigestFactory],
    ) -> None:
        self.url = url
        self.limits = limits
        self.digests = digests
        self.follower: HashFollower | None = None
        self.partial, self.sidecar_path = partial_paths(dest)
        self.sidecar = sidecar
        self.config = config
        self.cancel = cancel
        self.meter = meter
        self.size = size
        self.session = thread_session()
        self.buffer = memoryview(bytearray(config.buffer_bytes))
        self.resumed_bytes: int | None = None

    def run(self) -> tuple[int, int, list[str | None] | None]:
        """``(resumed_bytes, connections, the digests' values or None)``."""
        flags = os.O_RDWR | os.O_CREAT | (0 if self.sidecar else os.O_TRUNC)
        fd = os.open(self.partial, flags, 0o644)
        if self.digests:
            self.follower = HashFollower(self.partial, self.digests)
        try:
            with tracking(self.cancel.registry):
                handover = run_attempts(
                    lambda attempt: self._attempt(fd), url=self.url, config=self.config, cancel=self.cancel
                )
            found = None
            if handover is None:
                if self.follower is not None:
                    found = self.follower.results(os.fstat(fd).st_size, self.cancel)
                return self.resumed_bytes or 0, 1, found
            ranged = RangedDownload(
                url=self.url,
                partial=self.partial,
                sidecar_path=self.sidecar_path,
                sidecar=handover.sidecar,
                config=self.config,
                abort=self.cancel.abort,
                meter=self.meter,
                limits=self.limits,
                follower=self.follower,
            )
            connections = ranged.run(first=handover.response, first_offset=handover.consumed)
            if self.follower is not None:
                found = self.follower.results(os.fstat(fd).st_size, self.cancel)
            return 0, connections, found
        finally:
            os.close(fd)
            if self.follower is not None:
                self.follower.close()

    def _attempt(self, fd: int) -> _Handover | None:
        pos = os.fstat(fd).st_size if self.sidecar else 0
        validator = self.sidecar.validator() if self.sidecar else None
        response = send(
            self.session,
            "GET",
            self.url,
            policy=self.config.policy,
            timeout=self.config.body_timeout,
            headers=request_headers(pos, None, validator),
        )
        handover = None
        try:
            track_response(response)
            handover = self._consume(fd, pos, response)
            return handover
        finally:
            if handover is None:
                response.close()

    def _consume(self, fd: int, pos: int, response: requests.Response) -> _Handover | None:
        floor = SpeedFloor(self.config.low_speed_bytes_s, self.config.low_speed_time_s)
        if response.status_code == 416 and pos > 0:
            self._check_complete(response, pos)
            return None
        check_status(response)
        total = announced_total(response)
        self.limits.announced(total)
        if response.status_code == 206:
            parsed = content_range(response)
            if parsed is None or parsed[0] != pos:
                raise TransientError(f"asked for bytes from {pos}, got Content-Range {parsed}")
            if self.sidecar is None or not self.sidecar.same_source(response, total):
                raise SourceChangedError()
            self._mark(pos)
        else:
            if pos:
                # The server ignored Range (or the file changed): its body starts at byte 0.
                logger.info("%s: server answered a resume with 200; restarting", self.url)
                os.ftruncate(fd, 0)
                pos = 0
            self._mark(0)
            if self.size is not None and total is not None and total != self.size:
                raise TransientError(f"server announces {total} bytes, expected {self.size}")
            fresh = self.sidecar is None
            self.sidecar = Sidecar.from_response(self.url, response, total)
            if fresh and (plan := self._parallel_plan(response, total)) is not None:
                self.sidecar.save(self.sidecar_path)  # a crash mid-probe resumes as one stream
                pos, split = self._probe(fd, response, plan, floor)
                if split:
                    plan[0][2] = pos
                    self.sidecar.segments = plan
                    return _Handover(response, self.sidecar, pos)
            self.sidecar.save(self.sidecar_path)
        if self.resumed_bytes is None:
            self.resumed_bytes = 0 if response.status_code == 200 else pos
        self.meter.reset(pos, total if total is not None else self.size)
        expected = total if total is not None else self.size
        pos = copy_body(
            response,
            fd=fd,
            pos=pos,
            # Never write past the size we were told (the shard cache reserved exactly that),
            # nor, without one, more than one byte past the cap.
            end=self.limits.copy_end(expected),
            body_offset=pos,
            buffer=self.buffer,
            cancel=self.cancel,
            on_written=self._written,
            floor=floor,
        )
        if expected is not None and pos == expected and total is None and response.raw.read1(1):
            pos += 1  # a body without Content-Length that runs past the declared size
        if expected is None:
            self.limits.written(pos)
        self._check_length(fd, pos, total)
        return None

    def _mark(self, pos: int) -> None:
        """The first ``pos`` bytes of the partial file are final (from this source)."""
        if self.follower is not None:
            self.follower.mark(pos)
        self.limits.mark(pos)

    def _written(self, count: int) -> None:
        self.meter.add(count)
        if self.follower is not None:
            self.follower.add(count)
        self.limits.add(count)

    def _check_length(self, fd: int, pos: int, total: int | None) -> None:
        expected = total if total is not None else self.size
        if expected is not None and pos < expected:
            raise TransientError(f"body ended at byte {pos} of {expected}")
        if (expected is not None and pos > expected) or (self.size is not None and pos != self.size):
            # Complete but the wrong size: what we hold is not worth resuming.
            os.ftruncate(fd, 0)
            discard(self.sidecar_path)
            self.sidecar = None
            raise TransientError(
                f"got {pos} bytes, expected {self.size if self.size is not None else expected}"
            )

    def _check_complete(self, response: requests.Response, pos: int) -> None:
        """A 416 to ``bytes=<pos>-``: fine only when the partial already holds the whole file."""
        total = unsatisfied_total(response)
        self.limits.announced(total)
        if (
            self.sidecar is not None
            and total == pos
            and self.sidecar.total in (None, pos)
            and self.size in (None, pos)
        ):
            if self.resumed_bytes is None:
                self.resumed_bytes = pos
            self._mark(pos)
            return
        raise SourceChangedError()

    def _parallel_plan(self, response: requests.Response, total: int | None) -> list[list[int]] | None:
        """The segments of a ranged download when the file is large and the server takes ranges."""
        total_bytes = total if total is not None else self.size
        if (
            total_bytes is None
            or total_bytes <= 0
            or total_bytes < self.config.parallel_min_bytes
            or self.config.parallel_connections < 2
            or not self._accepts_ranges(response)
        ):
            return None
        segments = plan_segments(total_bytes, self.config.parallel_connections, self.config.segment_max_bytes)
        return segments if len(segments) >= 2 else None

    def _probe(
        self, fd: int, response: requests.Response, plan: list[list[int]], floor: SpeedFloor
    ) -> tuple[int, bool]:
        """Copy and time the first bytes of segment 0 (``PROBE_BYTES`` or ``PROBE_S``, whichever
        comes first): ``(bytes copied, split)``. A head to check comes first in any case, so
        that it is checked before the segments start. An origin a probe found slow within
        ``ORIGIN_RATE_TTL_S`` is split at once, after the head."""
        threshold = self.config.parallel_below_bytes_s
        known = _known_rate(self.url) if threshold > 0 else None
        at_once = threshold <= 0 or (known is not None and known < threshold)
        if known is not None and at_once:
            logger.debug("%s: origin ran at %.0f MB/s: split at once", self.url, known / 1e6)
        end = min(self.limits.head_bytes if at_once else PROBE_BYTES, plan[0][1])
        if end <= 0:
            return 0, True
        self.meter.reset(0, plan[-1][1])
        started = time.monotonic()
        deadline = started + PROBE_S
        got = 0
        for stop_at, until in ((min(self.limits.head_bytes, end), None), (end, deadline)):
            if got >= stop_at:
                continue
            got = copy_body(
                response,
                fd=fd,
                pos=got,
                end=stop_at,
                body_offset=got,  # the body's next byte lands at ``got``
                buffer=self.buffer,
                cancel=self.cancel,
                on_written=self._written,
                floor=floor,
                deadline=until,
            )
            if got < stop_at and (until is None or time.monotonic() < until):
                raise TransientError(f"body ended at byte {got} of {plan[-1][1]}")
        if at_once:
            return got, True
        rate = got / max(time.monotonic() - started, 1e-9)
        logger.debug("%s: one stream at %.0f MB/s", self.url, rate / 1e6)
        _remember_rate(self.url, rate)
        return got, rate < threshold

    def _accepts_ranges(self, response: requests.Response) -> bool:
        accept = response.headers.get("Accept-Ranges", "").strip().lower()
        if accept in ("bytes", "none"):
            return accept == "bytes"
        # No word either way: ask for one byte (on a second connection; the first stays open).
        try:
            with contextlib.closing(
                send(
                    self.session,
                    "GET",
                    self.url,
                    policy=self.config.policy,
                    timeout=self.config.timeout,
                    headers=request_headers(0, 0),
                )
            ) as probe:
                return probe.status_code == 206
        except RETRYABLE:
            return False
