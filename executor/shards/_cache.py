"""The persistent, bounded, cross-process shard cache (DESIGN §7).

An entry lives in its tenant's directory under a name :mod:`executor.shards._access`
gives it: its content hash, or its URL and what the caller's own check of that URL
showed; who may be served which entry is decided there. A shard is downloaded once
per host: the first process takes the entry's exclusive lock and downloads; the
others wait on a shared lock and then read the finished file. A held shared lock is
a pin: pinned entries are never evicted. The space accounting lives in
:mod:`executor.shards._ledger`; a zstd shard is decoded once, on arrival, into the
entry (:mod:`executor.shards._decode`).

Every shard has a byte cap known before it is fetched: ``max_shard_bytes`` (the
operator's ``ROUNDHOUSE_MAX_SHARD_MB``) for the packed download and for the decoded
entry alike, and the descriptor's ``size_bytes``, when given, for the download exactly.
The download is refused as soon as it passes its size, the decode as soon as its
output passes the cap (or the size its frame records).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor import transfer
from executor.errors import (
    BadArtifact,
    CacheTooSmall,
    DownloadFailed,
    InvalidRequest,
    RoundhouseError,
    Stopped,
    map_exceptions,
)
from executor.fileio import temp_path_for
from executor.shards._access import Origin, check_access, content_addressed, entry_name
from executor.shards._decode import decoded_chunks, probe_decode, zstd_content_size
from executor.shards._descriptor import ShardDescriptor, check_tenant
from executor.shards._ledger import ENTRY_SUFFIX, LOCK_SUFFIX, POLL_S, FileLock, Ledger, Reservation
from executor.transfer import Progress
from executor.urls import Url

logger = logging.getLogger(__name__)

# Reservation growth step when a zstd frame does not record its decoded size.
GROW_STEP_BYTES = 64 * 1024 * 1024


class Pin:
    """A held shared lock on a complete entry: the entry cannot be evicted until ``release``.

    ``origin``: what the check of the caller's URL showed (None for a content-addressed
    entry); a session keeps it so that it checks each shard once.
    """

    def __init__(
        self,
        path: str,
        size: int,
        lock: FileLock,
        on_release: Callable[[Pin], None],
        origin: Origin | None = None,
    ) -> None:
        self.path = path
        self.size = size
        self.origin = origin
        self._lock = lock
        self._on_release = on_release

    def release(self) -> None:
        if not self._lock.closed:
            self._on_release(self)
            self._lock.close()

    @property
    def released(self) -> bool:
        return self._lock.closed


@dataclass(frozen=True)
class CacheStats:
    limit_bytes: int
    used_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    downloaded_bytes: int
    checks: int  # requests that showed a caller's URL works (one per shard per session)

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CacheLimits:
    """The largest shard, packed or decoded (``max_shard_mb``; None: the cache limit, which no
    shard can pass anyway), and how long a caller waits for room (``cache_wait_timeout_s``)."""

    max_shard_bytes: int | None = None
    wait_timeout_s: float = 120.0


class ShardCache:
    """One cache directory per host (per GPU); safe to share between processes.

    ``max_bytes``: the cache limit (bytes on disk and in flight). ``max_shard_bytes``: the
    largest shard, packed or decoded (``Settings.max_shard_mb``); left out, the cache
    limit, which no shard can pass anyway.
    """

    def __init__(
        self,
        root: str,
        max_bytes: int,
        *,
        transfer_config: transfer.TransferConfig,
        max_shard_bytes: int | None = None,
        wait_timeout_s: float = 120.0,
    ) -> None:
        if max_bytes <= 0:
            raise InvalidRequest("the shard cache limit must be positive")
        if max_shard_bytes is not None and max_shard_bytes <= 0:
            raise InvalidRequest("the shard size cap must be positive")
        os.makedirs(root, exist_ok=True)
        # Entries of every tenant live here: no other uid (a sandbox included) may look in.
        os.chmod(root, 0o700)
        self.root = root
        self.ledger = Ledger(root, max_bytes)
        self.transfer_config = transfer_config
        self.max_shard_bytes = min(max_shard_bytes or max_bytes, max_bytes)
        self.wait_timeout_s = wait_timeout_s
        self._pins_lock = threading.Lock()
        self._pinned: dict[int, tuple[str, int]] = {}  # this process's pins: id -> (path, bytes)
        self.hits = self.misses = self.downloaded_bytes = self.checks = 0
        removed = self.ledger.clean_orphans()
        if removed:
            logger.info("shard cache: removed %d orphaned temp files", removed)

    @property
    def max_bytes(self) -> int:
        return self.ledger.max_bytes

    def check_fits(self, descriptors: list[ShardDescriptor]) -> None:
        """Refuse at load, not mid-round: a URL the policy refuses (any shard, not only the
        staged one), or known shard sizes that cannot fit two at a time."""
        for descriptor in descriptors:
            transfer.check_url(descriptor.url, config=self.transfer_config)
        sizes = [d.size_bytes for d in descriptors]
        if len(sizes) < 2 or not all(sizes):
            return
        pairs = max(sizes[i] + sizes[(i + 1) % len(sizes)] for i in range(len(sizes)))
        if pairs > self.max_bytes:
            raise CacheTooSmall(
                f"shard cache limit of {self.max_bytes} bytes cannot hold two consecutive shards "
                f"({pairs} bytes): raise ROUNDHOUSE_SHARD_CACHE_MAX_MB",
                {"limit_bytes": self.max_bytes, "need_bytes": pairs},
            )

    def check(
        self, tenant: str, descriptor: ShardDescriptor, *, abort: threading.Event | None = None
    ) -> Origin | None:
        """Show that the caller's URL works (one tiny request) and what it names; None, and
        no request, for an entry the tenant is served on its hash (see ``_access``)."""
        if content_addressed(check_tenant(tenant), descriptor):
            return None
        origin = check_access(descriptor, config=self.transfer_config, abort=abort)
        self.checks += 1
        return origin

    def entry_path(self, tenant: str, descriptor: ShardDescriptor, origin: Origin | None = None) -> str:
        """Where the entry lives; ``origin`` (from :meth:`check`) names one not content-addressed."""
        name = entry_name(check_tenant(tenant), descriptor, origin)
        return os.path.join(self.ledger.tenants_dir, tenant, name + ENTRY_SUFFIX)

    def acquire(
        self,
        tenant: str,
        descriptor: ShardDescriptor,
        *,
        checked: Origin | None = None,
        abort: threading.Event | None = None,
        progress: Progress | None = None,
    ) -> Pin:
        """The shard on disk, pinned; downloaded (once per host) when missing.

        ``checked``: the caller's URL was already shown to work, with this answer (a
        session's earlier :meth:`check`); else it is checked here first.
        """
        origin = checked if checked is not None else self.check(tenant, descriptor, abort=abort)
        path = self.entry_path(tenant, descriptor, origin)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = FileLock(path[: -len(ENTRY_SUFFIX)] + LOCK_SUFFIX)
        downloaded = False
        try:
            while True:
                lock.acquire(shared=True, abort=abort)
                if os.path.exists(path):
                    if not downloaded:
                        self.hits += 1
                    return self._pin(path, lock, origin)
                lock.release()
                if not self._writer_lock(lock, path, abort):
                    continue  # someone else finished it meanwhile: read it under a shared lock
                if not os.path.exists(path):
                    self.misses += 1
                    self._download(tenant, descriptor, origin, path, abort, progress)
                    downloaded = True
                if self._downgrade(lock):
                    return self._pin(path, lock, origin)
                # Another reader took the exclusive lock in the gap; it will find the file.
        except BaseException:
            lock.close()
            raise

    @staticmethod
    def _writer_lock(lock: FileLock, path: str, abort: threading.Event | None) -> bool:
        """Take the entry's exclusive lock to download it; False as soon as the file exists.

        Readers pin a finished entry with shared locks for as long as they use it, so
        waiting for the exclusive lock alone could wait forever for a file already there.
        """
        while not lock.try_acquire():
            if os.path.exists(path):
                return False
            if abort is not None and abort.wait(POLL_S):
                raise Stopped("stopped while waiting for a shard another reader is downloading")
            if abort is None:
                time.sleep(POLL_S)
        return True

    def _downgrade(self, lock: FileLock) -> bool:
        """Exclusive to shared, with no evictor in between (they evict only under the global
        lock). Never blocks while holding the global lock: a waiter that grabs the entry in
        the gap would need that lock to finish, so a blocking wait here could deadlock."""
        with self.ledger.locked():
            lock.release()
            return lock.try_acquire(shared=True)

    def _pin(self, path: str, lock: FileLock, origin: Origin | None) -> Pin:
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the LRU
        pin = Pin(path, os.path.getsize(path), lock, self._unpinned, origin)
        with self._pins_lock:
            self._pinned[id(pin)] = (path, pin.size)
        return pin

    def _unpinned(self, pin: Pin) -> None:
        with self._pins_lock:
            self._pinned.pop(id(pin), None)

    def pinned_bytes(self, exclude: str | None = None) -> int:
        with self._pins_lock:
            return sum(size for path, size in set(self._pinned.values()) if path != exclude)

    def _download_size(
        self, descriptor: ShardDescriptor, origin: Origin | None, abort: threading.Event | None
    ) -> int:
        """The packed size to reserve and to cap the download at; refused over the shard cap."""
        if origin is not None:
            size = origin.size
        else:
            size = descriptor.size_bytes or transfer.remote_size(
                descriptor.url, config=self.transfer_config, abort=abort
            )
        safe_url = str(Url.of(descriptor.url))
        if size is None:
            raise InvalidRequest(
                f"size of shard {safe_url} is unknown: give size_bytes in the "
                "descriptor (the cache must reserve space before downloading)"
            )
        if size > self.max_shard_bytes:
            raise self._over_cap(safe_url, size, "has")
        return size

    def _over_cap(self, safe_url: str, nbytes: int, verb: str) -> DownloadFailed:
        return DownloadFailed(
            f"shard {safe_url} {verb} {nbytes} bytes, over the shard cap of {self.max_shard_bytes} "
            "bytes (ROUNDHOUSE_MAX_SHARD_MB)",
            {"url": safe_url, "bytes": nbytes, "limit_bytes": self.max_shard_bytes},
        )

    def _download(
        self,
        tenant: str,
        descriptor: ShardDescriptor,
        origin: Origin | None,
        path: str,
        abort: threading.Event | None,
        progress: Progress | None,
    ) -> None:
        size = self._download_size(descriptor, origin, abort)
        digest = os.path.basename(path)[: -len(ENTRY_SUFFIX)]
        pinned = self.pinned_bytes(exclude=path)
        reservation = self.ledger.reserve(
            tenant, digest, size, pinned_bytes=pinned, abort=abort, wait_timeout_s=self.wait_timeout_s
        )
        try:
            # A zstd shard arrives packed beside its entry and is decoded into it.
            packed = path if descriptor.compression == "none" else path[: -len(ENTRY_SUFFIX)] + ".zst"
            result = transfer.fetch(
                descriptor.url,
                packed,
                config=self.transfer_config,
                abort=abort,
                sha256=descriptor.sha256,
                size=size,
                # Never past what was reserved: a body longer than announced is refused mid-way.
                max_bytes=size,
                progress=progress,
            )
            self.downloaded_bytes += result.bytes - result.resumed_bytes
            if packed == path:
                return
            try:
                self._decompress(packed, path, reservation, size, pinned, abort, url=Url.of(descriptor.url))
            finally:
                os.unlink(packed)
        finally:
            self.ledger.release(reservation)

    def _decompress(
        self,
        packed: str,
        path: str,
        reservation: Reservation,
        packed_size: int,
        pinned: int,
        abort: threading.Event | None,
        *,
        url: Url | None = None,
    ) -> None:
        """Stream-decode ``packed`` into ``path`` with one reused buffer; room is reserved first.

        The output stops at the shard cap, or at the size the frame records (a frame's
        header is never trusted beyond the cap, nor its data beyond its header).
        """
        safe_url = str(url) if url is not None else os.path.basename(packed)
        with open(packed, "rb") as source:
            decoded = zstd_content_size(source)
            source.seek(0)
            probe_decode(source)  # a corrupt frame is bad_artifact, whatever its header says
            if decoded is not None and decoded > self.max_shard_bytes:
                raise self._over_cap(safe_url, decoded, "decodes to")
            # Unknown decoded size: grow in steps, never past what the cap lets the entry reach.
            budget = packed_size + (
                decoded if decoded is not None else min(GROW_STEP_BYTES, self.max_shard_bytes)
            )
            self._grow(reservation, budget, pinned, abort)
            source.seek(0)

            def overrun(nbytes: int) -> RoundhouseError:
                if decoded is None:
                    return self._over_cap(safe_url, nbytes, "decodes to more than")
                return BadArtifact(f"shard {safe_url} decodes past the {decoded} bytes its frame records")

            tmp = temp_path_for(path)
            try:
                with map_exceptions({}, where="the shard cache"):
                    written = self._decode_stream(
                        source,
                        tmp,
                        reservation,
                        packed_size,
                        pinned,
                        abort,
                        limit=decoded if decoded is not None else self.max_shard_bytes,
                        overrun=overrun,
                    )
                if decoded is not None and written != decoded:
                    raise BadArtifact(f"shard decoded to {written} bytes, its frame says {decoded}")
                os.replace(tmp, path)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)

    def _decode_stream(
        self,
        source: Any,
        tmp: str,
        reservation: Reservation,
        packed_size: int,
        pinned: int,
        abort: threading.Event | None,
        *,
        limit: int,
        overrun: Callable[[int], RoundhouseError],
    ) -> int:
        """The decoded bytes written; ``overrun(n)`` is raised before the output passes ``limit``."""
        written = 0
        chunks = contextlib.closing(decoded_chunks(source, abort))
        with chunks as decoded, open(tmp, "r+b") as out:  # not "wb": see temp_path_for
            for chunk in decoded:
                count = len(chunk)
                if written + count > limit:
                    raise overrun(written + count)
                if packed_size + written + count > reservation.bytes:
                    step = min(written + count + GROW_STEP_BYTES, limit)
                    self._grow(reservation, packed_size + step, pinned, abort)
                out.write(chunk)
                written += count
        return written

    def _grow(
        self, reservation: Reservation, nbytes: int, pinned: int, abort: threading.Event | None
    ) -> None:
        self.ledger.grow(
            reservation, nbytes, pinned_bytes=pinned, abort=abort, wait_timeout_s=self.wait_timeout_s
        )

    def invalidate(self, tenant: str, descriptor: ShardDescriptor, origin: Origin | None = None) -> None:
        """Drop an entry found corrupt on decode, so the next request downloads it again.

        ``origin`` names an entry that is not content-addressed (a pin's); left out, the
        URL is checked again to learn it.
        """
        if origin is None and not content_addressed(check_tenant(tenant), descriptor):
            origin = self.check(tenant, descriptor)
        path = self.entry_path(tenant, descriptor, origin)
        with self.ledger.locked():
            usage = self.ledger.scan()
            digest = os.path.basename(path)[: -len(ENTRY_SUFFIX)]
            group = usage.groups.get((tenant, digest))
            if group is not None:
                self.ledger.evict_group(group)

    def remove_tenant(self, tenant: str) -> int:
        return self.ledger.remove_tenant(check_tenant(tenant))

    def stats(self) -> CacheStats:
        with self.ledger.locked():
            usage = self.ledger.scan()
        return CacheStats(
            self.max_bytes,
            usage.total_bytes,
            usage.entries,
            self.hits,
            self.misses,
            self.ledger.evictions,
            self.downloaded_bytes,
            self.checks,
        )
