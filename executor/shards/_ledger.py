"""The space ledger of a shard cache directory shared by processes.

Every byte on disk, and every byte a download has been promised, is counted
against one limit. The ledger is the directory itself — no daemon, nothing to
go stale — with one global ``flock`` serialising the count-then-evict step::

    <cache>/.lock                              global lock (held briefly)
    <cache>/reservations/<token>.json          {"bytes", "tenant", "digest", "pid"}; flocked by its owner
    <cache>/tenants/<tenant>/<digest>.bin      a complete, decoded entry
    <cache>/tenants/<tenant>/<digest>.lock     entry lock: exclusive = writing, shared = pinned
    <cache>/tenants/<tenant>/<digest>.*        in-flight files (partial download, compressed copy, temp)

A reservation whose flock is free belongs to a dead process and is dropped.
A group's in-flight files count as ``max(reserved, on disk)`` while its
reservation lives, and at their real size (as evictable leftovers) after.

The locks are ``flock`` locks (:class:`FileLock`). They belong to an open file
description, so two ``open()`` calls in one process conflict like two processes do;
that lets threads and processes use the same protocol. A lock is released when its
holder dies (kill -9 included), which is what makes stale reservations and pins
detectable.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from executor.errors import CacheTooSmall, Stopped
from executor.fileio import remove_tree

logger = logging.getLogger(__name__)

ENTRY_SUFFIX = ".bin"
LOCK_SUFFIX = ".lock"
WAIT_POLL_S = 0.2
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

    def acquire(self, *, shared: bool = False, abort: threading.Event | None = None) -> None:
        """Block until held; ``Stopped`` when ``abort`` is set."""
        while not self.try_acquire(shared=shared):
            if abort is not None and abort.is_set():
                raise Stopped(f"stopped while waiting for {os.path.basename(self.path)}")
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


def digest_of(filename: str) -> str:
    """The entry digest a cache file belongs to (``.abc.bin.x.tmp`` and ``abc.bin.partial`` → ``abc``)."""
    return filename.lstrip(".").split(".", 1)[0]


@dataclass
class Group:
    """All files of one cache entry."""

    tenant: str
    digest: str
    directory: str
    complete_bytes: int = 0
    inflight_bytes: int = 0
    mtime: float = 0.0
    files: list[str] = field(default_factory=list)

    @property
    def lock_path(self) -> str:
        return os.path.join(self.directory, self.digest + LOCK_SUFFIX)


@dataclass
class Reservation:
    tenant: str
    digest: str
    bytes: int
    path: str
    lock: FileLock


@dataclass
class Usage:
    total_bytes: int
    groups: dict[tuple[str, str], Group]
    reserved: dict[tuple[str, str], int]

    @property
    def entries(self) -> int:
        return sum(1 for g in self.groups.values() if g.complete_bytes)


class Ledger:
    def __init__(self, root: str, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.tenants_dir = os.path.join(root, "tenants")
        self.reservations_dir = os.path.join(root, "reservations")
        os.makedirs(self.tenants_dir, exist_ok=True)
        os.makedirs(self.reservations_dir, exist_ok=True)
        self._lock_path = os.path.join(root, ".lock")
        self._thread_lock = threading.Lock()
        self.evictions = 0

    @contextmanager
    def locked(self, abort: threading.Event | None = None) -> Iterator[None]:
        with self._thread_lock:
            # The directories may have been wiped (a reset of a private cache): recreate them.
            os.makedirs(self.tenants_dir, exist_ok=True)
            os.makedirs(self.reservations_dir, exist_ok=True)
            lock = FileLock(self._lock_path)
            try:
                lock.acquire(abort=abort)
                yield
            finally:
                lock.close()

    # -- counting

    def _live_reservations(self) -> dict[tuple[str, str], int]:
        """Reserved bytes per (tenant, digest); drops the files of dead owners. Under the lock."""
        reserved: dict[tuple[str, str], int] = {}
        for name in os.listdir(self.reservations_dir):
            path = os.path.join(self.reservations_dir, name)
            probe = FileLock(path)
            try:
                if probe.try_acquire():
                    os.unlink(path)  # its owner died holding it
                    continue
                with open(path, encoding="utf-8") as file:
                    record = json.load(file)
                key = (str(record["tenant"]), str(record["digest"]))
                reserved[key] = reserved.get(key, 0) + int(record["bytes"])
            except (OSError, ValueError, KeyError):
                logger.warning("unreadable cache reservation %s", name)
            finally:
                probe.close()
        return reserved

    def scan(self) -> Usage:
        """Bytes in use: complete entries, in-flight files, promised bytes. Under the lock."""
        reserved = self._live_reservations()
        groups: dict[tuple[str, str], Group] = {}
        for tenant in os.listdir(self.tenants_dir):
            directory = os.path.join(self.tenants_dir, tenant)
            try:
                names = os.listdir(directory)
            except NotADirectoryError:
                continue
            for name in names:
                if name.endswith(LOCK_SUFFIX):
                    continue
                try:
                    st = os.lstat(os.path.join(directory, name))
                except FileNotFoundError:
                    continue
                digest = digest_of(name)
                group = groups.setdefault((tenant, digest), Group(tenant, digest, directory))
                group.files.append(name)
                group.mtime = max(group.mtime, st.st_mtime)
                if name == digest + ENTRY_SUFFIX:
                    group.complete_bytes = st.st_size
                else:
                    group.inflight_bytes += st.st_size
        total = sum(g.complete_bytes for g in groups.values())
        for key in set(groups) | set(reserved):
            inflight = groups[key].inflight_bytes if key in groups else 0
            total += max(reserved.get(key, 0), inflight)
        return Usage(total, groups, reserved)

    # -- reserving

    def reserve(
        self,
        tenant: str,
        digest: str,
        nbytes: int,
        *,
        pinned_bytes: int = 0,
        abort: threading.Event | None = None,
        wait_timeout_s: float = 120.0,
    ) -> Reservation:
        """Promise ``nbytes`` to a download, evicting LRU entries; waits for other processes' space."""
        self._check_fits(nbytes, pinned_bytes)
        deadline = time.monotonic() + wait_timeout_s
        while True:
            with self.locked(abort):
                if self._make_room(nbytes, exclude=(tenant, digest)):
                    return self._write_reservation(tenant, digest, nbytes)
            self._wait(abort, deadline, nbytes)

    def grow(
        self,
        reservation: Reservation,
        nbytes: int,
        *,
        pinned_bytes: int = 0,
        abort: threading.Event | None = None,
        wait_timeout_s: float = 120.0,
    ) -> None:
        """Raise a reservation to ``nbytes`` in total (a decoded size learnt late)."""
        if nbytes <= reservation.bytes:
            return
        self._check_fits(nbytes, pinned_bytes)
        deadline = time.monotonic() + wait_timeout_s
        while True:
            with self.locked(abort):
                if self._make_room(
                    nbytes - reservation.bytes, exclude=(reservation.tenant, reservation.digest)
                ):
                    reservation.bytes = nbytes
                    self._record(reservation)
                    return
            self._wait(abort, deadline, nbytes)

    def release(self, reservation: Reservation) -> None:
        with self.locked():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(reservation.path)
            reservation.lock.close()

    def _check_fits(self, nbytes: int, pinned_bytes: int) -> None:
        if nbytes + pinned_bytes > self.max_bytes:
            raise CacheTooSmall(
                f"shard cache limit of {self.max_bytes} bytes cannot hold a shard of {nbytes} bytes "
                f"beside the {pinned_bytes} bytes of the current shard: raise ROUNDHOUSE_SHARD_CACHE_MAX_MB "
                f"to hold two shards",
                {"limit_bytes": self.max_bytes, "need_bytes": nbytes, "pinned_bytes": pinned_bytes},
            )

    def _wait(self, abort: threading.Event | None, deadline: float, nbytes: int) -> None:
        if time.monotonic() >= deadline:
            raise CacheTooSmall(
                f"no room for {nbytes} bytes in the shard cache: other processes hold the rest "
                f"(limit {self.max_bytes} bytes)",
                {"limit_bytes": self.max_bytes, "need_bytes": nbytes},
            )
        if abort is not None:
            if abort.wait(WAIT_POLL_S):
                raise Stopped("stopped while waiting for shard cache space")
        else:
            time.sleep(WAIT_POLL_S)

    def _write_reservation(self, tenant: str, digest: str, nbytes: int) -> Reservation:
        # Created and locked under the global lock, so no scan can see it unlocked.
        path = os.path.join(self.reservations_dir, f"{os.getpid()}-{uuid.uuid4().hex}.json")
        lock = FileLock(path)
        if not lock.try_acquire():  # pragma: no cover - a fresh unique file cannot be held
            lock.close()
            raise RuntimeError("could not lock a fresh reservation file")
        reservation = Reservation(tenant, digest, nbytes, path, lock)
        self._record(reservation)
        return reservation

    @staticmethod
    def _record(reservation: Reservation) -> None:
        data = json.dumps(
            {
                "bytes": reservation.bytes,
                "tenant": reservation.tenant,
                "digest": reservation.digest,
                "pid": os.getpid(),
            }
        ).encode()
        os.ftruncate(reservation.lock.fd, 0)
        os.pwrite(reservation.lock.fd, data, 0)

    # -- evicting

    def _make_room(self, nbytes: int, exclude: tuple[str, str]) -> bool:
        usage = self.scan()
        if usage.total_bytes + nbytes <= self.max_bytes:
            return True
        victims = sorted(
            (g for key, g in usage.groups.items() if key != exclude and key not in usage.reserved),
            key=lambda g: g.mtime,
        )
        need = usage.total_bytes + nbytes - self.max_bytes
        for group in victims:
            if need <= 0:
                break
            need -= self.evict_group(group)
        return need <= 0

    def evict_group(self, group: Group) -> int:
        """Delete an unpinned entry (and its leftovers); returns bytes freed, 0 when it is in use."""
        lock = FileLock(group.lock_path)
        try:
            if not lock.try_acquire():
                return 0
            freed = 0
            for name in group.files:
                path = os.path.join(group.directory, name)
                try:
                    freed += os.lstat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    continue
            if group.complete_bytes:
                self.evictions += 1
            return freed
        finally:
            lock.close()

    def remove_tenant(self, tenant: str, abort: threading.Event | None = None) -> int:
        """Delete every entry of one tenant (the tenant boundary); entries still pinned stay."""
        freed = 0
        with self.locked(abort):
            usage = self.scan()
            for (owner, _digest), group in usage.groups.items():
                if owner == tenant and (owner, _digest) not in usage.reserved:
                    freed += self.evict_group(group)
            directory = os.path.join(self.tenants_dir, tenant)
            if (
                os.path.isdir(directory)
                and not any(owner == tenant for owner, _ in usage.reserved)
                and not [n for n in os.listdir(directory) if not n.endswith(LOCK_SUFFIX)]
            ):
                remove_tree(directory, ignore_errors=True)
        return freed

    def clean_orphans(self) -> int:
        """At start: drop dead reservations and the temp files no live download owns."""
        removed = 0
        with self.locked():
            usage = self.scan()
            for key, group in usage.groups.items():
                if key in usage.reserved:
                    continue
                for name in group.files:
                    # Partial downloads stay: they resume. Temp and compressed copies go.
                    if name.endswith(".tmp") or name == group.digest + ".zst":
                        try:
                            os.unlink(os.path.join(group.directory, name))
                            removed += 1
                        except FileNotFoundError:
                            pass
        return removed
