"""The persistent, bounded, cross-process shard cache (DESIGN §7).

Entries are keyed by ``(tenant, ShardDescriptor.key)``. A shard is downloaded once
per host: the first process takes the entry's exclusive lock and downloads; the
others wait on a shared lock and then read the finished file. A held shared lock is
a pin: pinned entries are never evicted. The space accounting lives in
:mod:`executor.shards._ledger`; a zstd shard is decoded once, on arrival, into the
entry (:mod:`executor.shards._decode`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor import transfer
from executor.errors import BadArtifact, CacheTooSmall, InvalidRequest, Stopped, map_exceptions
from executor.fileio import temp_path_for
from executor.shards._decode import decoded_chunks, probe_decode, zstd_content_size
from executor.shards._descriptor import ShardDescriptor, check_tenant
from executor.shards._ledger import ENTRY_SUFFIX, LOCK_SUFFIX, POLL_S, FileLock, Ledger, Reservation
from executor.transfer import Progress

logger = logging.getLogger(__name__)

# Reservation growth step when a zstd frame does not record its decoded size.
GROW_STEP_BYTES = 64 * 1024 * 1024


class Pin:
    """A held shared lock on a complete entry: the entry cannot be evicted until ``release``."""

    def __init__(self, path: str, size: int, lock: FileLock, on_release: Callable[[Pin], None]) -> None:
        self.path = path
        self.size = size
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

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


class ShardCache:
    """One cache directory per host (per GPU); safe to share between processes."""

    def __init__(
        self,
        root: str,
        max_bytes: int,
        *,
        transfer_config: transfer.TransferConfig,
        wait_timeout_s: float = 120.0,
    ) -> None:
        if max_bytes <= 0:
            raise InvalidRequest("the shard cache limit must be positive")
        os.makedirs(root, exist_ok=True)
        # Entries of every tenant live here: no other uid (a sandbox included) may look in.
        os.chmod(root, 0o700)
        self.root = root
        self.ledger = Ledger(root, max_bytes)
        self.transfer_config = transfer_config
        self.wait_timeout_s = wait_timeout_s
        self._pins_lock = threading.Lock()
        self._pinned: dict[int, tuple[str, int]] = {}  # this process's pins: id -> (path, bytes)
        self.hits = self.misses = self.downloaded_bytes = 0
        removed = self.ledger.clean_orphans()
        if removed:
            logger.info("shard cache: removed %d orphaned temp files", removed)

    @property
    def max_bytes(self) -> int:
        return self.ledger.max_bytes

    def check_fits(self, descriptors: list[ShardDescriptor]) -> None:
        """Refuse at load, not mid-round, when known shard sizes cannot fit two at a time."""
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

    def entry_path(self, tenant: str, descriptor: ShardDescriptor) -> str:
        digest = hashlib.sha256(descriptor.key.encode()).hexdigest()[:40]
        return os.path.join(self.ledger.tenants_dir, check_tenant(tenant), digest + ENTRY_SUFFIX)

    def acquire(
        self,
        tenant: str,
        descriptor: ShardDescriptor,
        *,
        abort: threading.Event | None = None,
        progress: Progress | None = None,
    ) -> Pin:
        """The shard on disk, pinned; downloaded (once per host) when missing."""
        path = self.entry_path(tenant, descriptor)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = FileLock(path[: -len(ENTRY_SUFFIX)] + LOCK_SUFFIX)
        downloaded = False
        try:
            while True:
                lock.acquire(shared=True, abort=abort)
                if os.path.exists(path):
                    if not downloaded:
                        self.hits += 1
                    return self._pin(path, lock)
                lock.release()
                if not self._writer_lock(lock, path, abort):
                    continue  # someone else finished it meanwhile: read it under a shared lock
                if not os.path.exists(path):
                    self.misses += 1
                    self._download(tenant, descriptor, path, abort, progress)
                    downloaded = True
                if self._downgrade(lock):
                    return self._pin(path, lock)
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

    def _pin(self, path: str, lock: FileLock) -> Pin:
        with contextlib.suppress(OSError):
            os.utime(path)  # recency for the LRU
        pin = Pin(path, os.path.getsize(path), lock, self._unpinned)
        with self._pins_lock:
            self._pinned[id(pin)] = (path, pin.size)
        return pin

    def _unpinned(self, pin: Pin) -> None:
        with self._pins_lock:
            self._pinned.pop(id(pin), None)

    def pinned_bytes(self, exclude: str | None = None) -> int:
        with self._pins_lock:
            return sum(size for path, size in set(self._pinned.values()) if path != exclude)

    def _download(
        self,
        tenant: str,
        descriptor: ShardDescriptor,
        path: str,
        abort: threading.Event | None,
        progress: Progress | None,
    ) -> None:
        size = descriptor.size_bytes or transfer.remote_size(
            descriptor.url, config=self.transfer_config, abort=abort
        )
        if size is None:
            raise InvalidRequest(
                f"size of shard {transfer.redact_url(descriptor.url)} is unknown: give size_bytes in the "
                "descriptor (the cache must reserve space before downloading)"
            )
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
                progress=progress,
            )
            self.downloaded_bytes += result.bytes - result.resumed_bytes
            if packed == path:
                return
            try:
                self._decompress(packed, path, reservation, size, pinned, abort)
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
    ) -> None:
        """Stream-decode ``packed`` into ``path`` with one reused buffer; room is reserved first."""
        with open(packed, "rb") as source:
            decoded = zstd_content_size(source)
            source.seek(0)
            probe_decode(source)
            budget = packed_size + (decoded if decoded is not None else GROW_STEP_BYTES)
            self._grow(reservation, budget, pinned, abort)
            source.seek(0)
            tmp = temp_path_for(path)
            try:
                with map_exceptions({}, where="the shard cache"):
                    written = self._decode_stream(source, tmp, reservation, packed_size, pinned, abort)
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
    ) -> int:
        written = 0
        chunks = contextlib.closing(decoded_chunks(source, abort))
        with chunks as decoded, open(tmp, "r+b") as out:  # not "wb": see temp_path_for
            for chunk in decoded:
                count = len(chunk)
                if packed_size + written + count > reservation.bytes:
                    self._grow(reservation, packed_size + written + count + GROW_STEP_BYTES, pinned, abort)
                out.write(chunk)
                written += count
        return written

    def _grow(
        self, reservation: Reservation, nbytes: int, pinned: int, abort: threading.Event | None
    ) -> None:
        self.ledger.grow(
            reservation, nbytes, pinned_bytes=pinned, abort=abort, wait_timeout_s=self.wait_timeout_s
        )

    def invalidate(self, tenant: str, descriptor: ShardDescriptor) -> None:
        """Drop an entry found corrupt on decode, so the next request downloads it again."""
        path = self.entry_path(tenant, descriptor)
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
        )
