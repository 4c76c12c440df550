"""What a transfer is told and what it reports: :class:`TransferConfig` (with the URL
policy), :class:`FetchResult`, the :data:`Progress` callback type and the :data:`Head` check.

The config is built from the settings once, by ``executor.configs.transfer_config``: the
sandboxed runner imports this package and must not import pydantic or ``settings``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from executor.fileio import MIB
from executor.transfer._policy import UrlPolicy

# What a transfer reports as it goes: (bytes done, total bytes or None when unknown).
Progress = Callable[[int, int | None], None]
# fetch(head=(n_bytes, check)): check(the first n_bytes) before the rest is written; it
# raises a RoundhouseError to refuse the download, or returns a tighter byte cap for the
# whole body (what a format's header promises), or None.
Head = tuple[int, Callable[[bytes], int | None]]


class Digest(Protocol):
    """What follows a download's bytes in order, from byte 0 (hashlib's objects are ones): its
    ``hexdigest`` may be None when the bytes did not make a digest (a state hash of a file
    whose tensors are out of key order)."""

    def update(self, data: memoryview, /) -> None: ...
    def hexdigest(self) -> str | None: ...


# fetch(follow=...): a fresh Digest (made again when the file is truncated and rewritten).
DigestFactory = Callable[[], Digest]


@dataclass(frozen=True)
class TransferConfig:
    """How transfers behave; built from the settings by ``executor.configs.transfer_config``,
    the one place where the values and their defaults are written down."""

    retries: int  # attempts per transfer (and per parallel segment)
    backoff_s: float  # sleep backoff_s * attempt between attempts
    connect_timeout_s: float
    read_timeout_s: float  # a read stalled longer than this fails the attempt
    # Files are copied and hashed through one reused buffer of this size; network reads take
    # at most this much per call, into the same kind of buffer (_body.body_reader).
    buffer_bytes: int
    parallel_min_bytes: int
    parallel_connections: int
    # Split only when the first connection ran slower than this over its first 16 MiB
    # (_stream.PROBE_BYTES); 0: always split.
    parallel_below_bytes_s: int
    # A server that trickles below this rate for this long fails the attempt (slow loris).
    low_speed_bytes_s: int
    low_speed_time_s: float
    # What URLs may name and which addresses a connection may reach (DESIGN §11).
    policy: UrlPolicy
    # The cap on a body of unknown length (no Content-Length) when the caller names no size.
    max_unknown_bytes: int
    # At 12 MB/s (a per-connection cap) 128 MiB is about 11 s a request, and N connections run
    # N * 128 MiB ahead of the gapless front that the hash follows. Smaller segments cost more
    # than their requests' round trips: forced to 8 connections on loopback (2 cores, /dev/shm),
    # 1 GiB took 0.709 s with 32 MiB segments, 0.564 s with 128 MiB (= 1/8), and with its sha256
    # 1.416 s against 1.271 s; 2 GiB 1.481 s (32 MiB), 1.155 s (128), 1.108 s (256 = 1/8); over
    # the shaped WAN link (bench.wan's, 1 GiB `Executor.load`) 12.41 s against 12.07 s.
    segment_max_bytes: int = 128 * MIB  # a split download's segments, in file order

    @property
    def timeout(self) -> tuple[float, float]:
        return (self.connect_timeout_s, self.read_timeout_s)

    @property
    def body_timeout(self) -> tuple[float, float]:
        """The timeouts of a download's body GET. A read that waits longer than the speed
        floor's window has brought nothing in it, which the floor fails anyway; but the floor
        only sees bytes that arrive, so without this a connection gone silent (no RST, no
        byte) held the download for the whole read timeout (300 s by default)."""
        if self.low_speed_bytes_s > 0 and self.low_speed_time_s > 0:
            return (self.connect_timeout_s, min(self.read_timeout_s, self.low_speed_time_s))
        return self.timeout


@dataclass(frozen=True)
class RemoteInfo:
    """What a server says of a URL without sending it: size and validators, each None if unsaid."""

    size: int | None
    etag: str | None
    last_modified: str | None


@dataclass(frozen=True)
class FetchResult:
    bytes: int
    seconds: float
    resumed_bytes: int  # already on disk from an earlier attempt or process
    connections: int  # HTTP streams used; 0 for a local copy
    sha256: str | None  # hex digest, only when it was checked
    # fetch(follow=...)'s digest of every byte as it landed; None when it made none (a local
    # copy, a resumed split download, a digest that declined): the caller reads the file then.
    followed: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "seconds": self.seconds,
            "resumed_bytes": self.resumed_bytes,
            "connections": self.connections,
            "sha256": self.sha256,
        }
