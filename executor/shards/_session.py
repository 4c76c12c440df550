"""One session's dataset: the shards it may ask for, pins on the current and the next,
a one-ahead prefetch, and the single decoded shard held in memory.

The GPU should never wait on I/O: whenever shard ``i`` is handed out, shard
``i + 1`` starts downloading in the background, so a round whose compute per
shard is longer than a fetch finds every later shard already on disk.

The session is also the "session" of the cache's access rule (``_access``): it checks
each shard's URL once, the first time it asks for that shard, and remembers what the
check showed for as long as it lives; a failed acquire forgets it, so the next one
checks again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from executor.errors import BadArtifact, RoundhouseError, ShardIndexError, Stopped
from executor.shards._access import Origin
from executor.shards._cache import Pin, ShardCache
from executor.shards._decode import load_shard_file
from executor.shards._descriptor import ShardDescriptor
from executor.stopping import DoneThread
from executor.transfer import Progress

logger = logging.getLogger(__name__)


class ShardSession:
    """The executor's view of the cache for one loaded session (tenant + descriptors)."""

    def __init__(
        self,
        cache: ShardCache,
        tenant: str,
        descriptors: Sequence[ShardDescriptor],
        *,
        abort: threading.Event,
        progress: Progress | None = None,
        retain: bool = True,
    ) -> None:
        """``retain=False`` is the seed's cache-disabled mode: no prefetch, and a shard's
        file is deleted as soon as the reader moves on (only the current one on disk)."""
        self.cache = cache
        self._retain = retain
        self.tenant = tenant
        self.descriptors = list(descriptors)
        self._abort = abort
        self._progress = progress
        self._lock = threading.Lock()
        self._pins: dict[int, Pin] = {}
        # What each descriptor's check showed (None: content-addressed, served on its hash).
        self._origins: dict[ShardDescriptor, Origin | None] = {}
        self._checking: dict[ShardDescriptor, threading.Lock] = {}
        self._prefetch: DoneThread | None = None
        self._decoded_index: int | None = None
        self._decoded: Any = None
        self._current: int | None = None

    @property
    def num_shards(self) -> int:
        return len(self.descriptors)

    @property
    def prefetch_thread(self) -> DoneThread | None:
        return self._prefetch

    def check_index(self, index: object) -> int:
        if not isinstance(index, int) or isinstance(index, bool):
            raise ShardIndexError(f"shard index must be an integer, got {type(index).__name__}")
        if not 0 <= index < self.num_shards:
            raise ShardIndexError(
                f"shard index {index} out of range (num_shards={self.num_shards})",
                {"index": index, "num_shards": self.num_shards},
            )
        return index

    def next_index(self, index: int) -> int:
        return (index + 1) % self.num_shards

    def path(self, index: int, *, prefetch: bool = True, abort: threading.Event | None = None) -> str:
        """The shard's file on disk, pinned with its successor; starts the prefetch of the next.
        ``abort`` replaces the session's stop signal for this one download."""
        index = self.check_index(index)
        self._current = index
        pin = self._ensure(index, abort)
        keep = self._wanted()
        with self._lock:
            dropped = [(i, self._pins.pop(i)) for i in list(self._pins) if i not in keep]
        for other, old in dropped:
            old.release()
            if not self._retain:
                self.cache.invalidate(self.tenant, self.descriptors[other], old.origin)
        if prefetch and self._retain and self.num_shards > 1:
            self._start_prefetch(self.next_index(index))
        return pin.path

    def get(self, index: int) -> Any:
        """The decoded shard; only one is held in memory, the previous one is dropped first."""
        index = self.check_index(index)
        if self._decoded_index == index:
            return self._decoded
        # Drop the old shard before loading the new one: holding both doubles the peak.
        self._decoded_index, self._decoded = None, None
        path = self.path(index)
        try:
            data = load_shard_file(path)
        except BadArtifact:
            self._forget(index)
            raise
        self._decoded_index, self._decoded = index, data
        return data

    def _wanted(self) -> set[int]:
        current = self._current
        return set() if current is None else {current, self.next_index(current)}

    def _ensure(self, index: int, abort: threading.Event | None = None) -> Pin:
        with self._lock:
            pin = self._pins.get(index)
        if pin is not None and not pin.released:
            return pin
        descriptor = self.descriptors[index]
        abort = self._abort if abort is None else abort
        try:
            pin = self.cache.acquire(
                self.tenant,
                descriptor,
                checked=self._checked(descriptor, abort),
                abort=abort,
                progress=self._progress,
            )
        except BaseException:
            # The object may have changed since the check: the next attempt checks again.
            with self._lock:
                self._origins.pop(descriptor, None)
            raise
        with self._lock:
            old = self._pins.get(index)
            if old is not None and not old.released:
                pin.release()  # the prefetch won the race; keep its pin
                return old
            self._pins[index] = pin
        return pin

    def _checked(self, descriptor: ShardDescriptor, abort: threading.Event) -> Origin | None:
        """The descriptor's check, made once per session: the prefetch and the reader may
        ask for one shard at the same moment, so the first to ask checks, the other waits."""
        with self._lock:
            if descriptor in self._origins:
                return self._origins[descriptor]
            gate = self._checking.setdefault(descriptor, threading.Lock())
        while not gate.acquire(timeout=0.05):
            if abort.is_set():
                raise Stopped("stopped while another thread checks a shard's URL")
        try:
            with self._lock:
                if descriptor in self._origins:
                    return self._origins[descriptor]
            origin = self.cache.check(self.tenant, descriptor, abort=abort)
            with self._lock:
                self._origins[descriptor] = origin
            return origin
        finally:
            gate.release()

    def _forget(self, index: int) -> None:
        descriptor = self.descriptors[index]
        with self._lock:
            pin = self._pins.pop(index, None)
            origin = pin.origin if pin is not None else self._origins.get(descriptor)
            known = pin is not None or descriptor in self._origins
            self._origins.pop(descriptor, None)
        if pin is not None:
            pin.release()
        if known:
            self.cache.invalidate(self.tenant, descriptor, origin)

    def _start_prefetch(self, index: int) -> None:
        with self._lock:
            if index in self._pins or (self._prefetch is not None and self._prefetch.running):
                return
            self._prefetch = DoneThread(lambda: self._prefetch_one(index), "shard-prefetch")
            self._prefetch.start()

    def _prefetch_one(self, index: int) -> None:
        # Best effort: the on-demand path still works when a prefetch fails.
        try:
            pin = self._ensure(index)
            if index not in self._wanted():  # the reader moved on meanwhile
                with self._lock:
                    if self._pins.get(index) is pin:
                        del self._pins[index]
                pin.release()
        except Stopped:
            pass
        except RoundhouseError as exc:
            logger.info("prefetch of shard %d failed: %s", index, exc)
        except Exception:
            logger.warning("prefetch of shard %d failed", index, exc_info=True)

    def pinned_indexes(self) -> list[int]:
        with self._lock:
            return [index for index, pin in self._pins.items() if not pin.released]

    def cached_path(self, index: int) -> str:
        """Where shard ``index`` lives in the cache (whether or not it is there yet), once this
        session has pinned or checked it; ``ValueError`` before (its name depends on the check)."""
        descriptor = self.descriptors[index]
        with self._lock:
            pin = self._pins.get(index)
            if pin is not None and not pin.released:
                return pin.path
            origin = self._origins.get(descriptor)
        return self.cache.entry_path(self.tenant, descriptor, origin)

    def replace_descriptors(self, descriptors: Sequence[ShardDescriptor]) -> None:
        """New presigned URLs for the same shards (they expire during long runs); pins stay
        when the shards are the same ones (same keys)."""
        if [d.key for d in descriptors] != [d.key for d in self.descriptors]:
            with self._lock:
                for pin in self._pins.values():
                    pin.release()
                self._pins.clear()
            self._current = None
            self._decoded_index, self._decoded = None, None
        with self._lock:
            # New URLs are checked afresh (a URL that worked says nothing of its replacement).
            kept = set(descriptors)
            self._origins = {d: o for d, o in self._origins.items() if d in kept}
            self._checking = {d: g for d, g in self._checking.items() if d in kept}
        self.descriptors = list(descriptors)

    def stage(self, index: int, *, abort: threading.Event | None = None, prefetch: bool = True) -> int:
        """Pin (download) one shard at load time and (``prefetch``) start its successor's
        download; ``abort`` stops this one download instead of the session's stop signal
        (``load_model`` stages beside the model download and calls it off when that fails)."""
        self.path(index, prefetch=prefetch, abort=abort)
        return index

    def prefetch_after(self, index: int) -> None:
        """Start the prefetch of the shard after ``index`` (after a ``stage(prefetch=False)``)."""
        if self._retain and self.num_shards > 1:
            self._start_prefetch(self.next_index(index))

    def wait_prefetch(self, timeout_s: float | None = None) -> bool:
        thread = self._prefetch
        return thread is None or thread.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Release pins and memory; False when the prefetch thread did not end in time."""
        ended = self.wait_prefetch(timeout_s)
        with self._lock:
            for pin in self._pins.values():
                pin.release()
            self._pins.clear()
        self._decoded_index, self._decoded = None, None
        return ended
