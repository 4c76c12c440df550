"""The worker's replay guard (DESIGN §11): what it remembers of the signed messages it admitted.

A record per nonce: how many times the message was delivered (``"1"``, ``"2"`` …), or that
it finished (``"d"``). Two stores hold it:

- :class:`NonceLedger`, the authority: an append-only file on the worker's own disk
  (``<work_dir>/<host_id>/replay/nonces.log``, in a ``0700`` directory the sandbox's uid
  cannot enter), each record ``fsync``-ed before the message goes on, kept until the
  message would be refused as expired anyway, and read back at start-up. Nobody on the
  broker can delete it, and a Redis that loses writes (a restart, eviction, a failover)
  cannot make a finished message new again.
- Redis, ``roundhouse:nonce:<host>:<nonce>``: a second copy, so that a worker whose disk
  has failed still remembers, and so that an operator can see what a worker admitted.
  What it says can only make the guard stricter: a ``"d"`` there refuses, a missing key
  changes nothing.

The gate fails closed: a message whose record could be written to neither store is refused
(``replay_store``), since a message that ran without a record could run again.
"""

from __future__ import annotations

import os
import re
import threading
import time

import redis
from celery.utils.log import get_logger

from executor.fileio import atomic_writer
from executor.workdir import replay_dir
from tasks.names import nonce_key
from tasks.trust.signing import Refused

logger = get_logger(__name__)

DONE = "d"
LEDGER_NAME = "nonces.log"
COMPACT_MIN_LINES = 4096  # below this the file is never rewritten while the worker runs
MAX_DELIVERIES = 1_000_000  # a count beyond it (a forged Redis record) is read as this
_LINE = re.compile(r"^([0-9a-f]{16,64}) (d|[0-9]{1,7}) ([0-9]{1,12})$")


def ledger_dir(work_dir: str, host_id: str) -> str:
    return replay_dir(work_dir, host_id)


class NonceLedger:
    """This worker's own record of admitted nonces, on local disk (see the module docstring).

    Lines are ``<nonce> <record> <expires_at unix s>``; the last line for a nonce wins. At
    start-up the file is read, and rewritten with only the live records (which also drops a
    line half written by a crash); while running it is rewritten when dead lines outnumber
    live ones and there are more than ``COMPACT_MIN_LINES``. Only the worker's MainProcess
    writes it."""

    def __init__(self, directory: str, *, now: float | None = None) -> None:
        self.path = os.path.join(directory, LEDGER_NAME)
        self._directory = directory
        self._records: dict[str, tuple[str, float]] = {}  # nonce: (record, expires_at)
        self._lines = 0
        self._lock = threading.Lock()  # acks may come from a pool thread, admissions from the loop
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # the sandbox's uid must not reach it
        self._load(time.time() if now is None else now)
        self._compact()

    def get(self, nonce: str, *, now: float | None = None) -> str | None:
        found = self._records.get(nonce)
        if found is None:
            return None
        if found[1] < (time.time() if now is None else now):
            self._records.pop(nonce, None)
            return None
        return found[0]

    def put(self, nonce: str, record: str, expires_at: float) -> None:
        """Remember ``record``: in memory at once, on disk durably (``OSError`` when the disk
        refuses; the memory keeps it all the same)."""
        line = f"{nonce} {record} {int(expires_at) + 1}\n".encode()
        with self._lock:
            self._records[nonce] = (record, expires_at)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._lines += 1
            if self._lines > COMPACT_MIN_LINES and self._lines > 2 * len(self._records):
                self._prune(time.time())
                self._compact()

    def __len__(self) -> int:
        return len(self._records)

    def _load(self, now: float) -> None:
        try:
            with open(self.path, encoding="ascii", errors="replace") as file:
                lines = file.read().splitlines()
        except FileNotFoundError:
            return
        bad = 0
        for line in lines:
            match = _LINE.match(line)
            if match is None:
                bad += 1
                continue
            nonce, record, expires_at = match.group(1), match.group(2), float(match.group(3))
            if expires_at >= now:
                self._records[nonce] = (record, expires_at)
            else:
                self._records.pop(nonce, None)
        if bad:
            logger.warning("replay ledger %s: %d unreadable line(s) skipped", self.path, bad)

    def _prune(self, now: float) -> None:
        for nonce in [n for n, (_, expires_at) in self._records.items() if expires_at < now]:
            del self._records[nonce]

    def _compact(self) -> None:
        body = "".join(f"{n} {r} {int(e)}\n" for n, (r, e) in self._records.items()).encode()
        with atomic_writer(self.path) as file:
            file.write(body)
            file.flush()
            os.fsync(file.fileno())
        fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # the rename itself survives a power cut
        finally:
            os.close(fd)
        self._lines = len(self._records)


class ReplayStore:
    """The gate's replay guard: the ledger first, Redis second (see the module docstring)."""

    def __init__(self, client: redis.Redis, host_id: str, ledger: NonceLedger) -> None:
        self._client = client
        self._host = host_id
        self._ledger = ledger
        self._warned: set[str] = set()

    def admit(self, nonce: str, ttl_s: int, *, once: bool = False) -> int:
        """The delivery number of this message (1: the first); :class:`Refused` for a replay,
        or when neither store could record it. ``once``: a message that may never be
        delivered twice (a control command), recorded as finished at once."""
        seen = [self._ledger.get(nonce)]
        if seen[0] == DONE:
            raise Refused("replay", "this worker has already run this message")
        try:
            seen.append(_text(self._client.get(nonce_key(self._host, nonce))))
        except redis.RedisError as exc:
            self._warn("redis", exc)
        known = [record for record in seen if record is not None]
        if DONE in known or (once and known):
            raise Refused("replay", "this worker has already run this message")
        counts = [int(record) for record in known if record.isdigit()]
        record = DONE if once else str(min(max(counts, default=0), MAX_DELIVERIES) + 1)
        if not self._record(nonce, record, ttl_s):
            raise Refused(
                "replay_store", "neither the local nonce ledger nor Redis could record this message"
            )
        return 1 if once else int(record)

    def done(self, nonce: str, ttl_s: int) -> None:
        """The message was acknowledged (finished, revoked or expired): never again."""
        if not self._record(nonce, DONE, ttl_s):
            logger.error(
                "replay store: the end of message %s is remembered by this process only: "
                "neither the ledger nor Redis could be written",
                nonce,
            )

    def _record(self, nonce: str, record: str, ttl_s: int) -> bool:
        """Write ``record`` to both stores; whether at least one took it."""
        written = 0
        try:
            self._ledger.put(nonce, record, time.time() + ttl_s)
            written += 1
        except OSError as exc:
            self._warn("ledger", exc)
        try:
            self._client.set(nonce_key(self._host, nonce), record, ex=ttl_s)
            written += 1
        except redis.RedisError as exc:
            self._warn("redis", exc)
        return written > 0

    def _warn(self, store: str, exc: Exception) -> None:
        if store not in self._warned:  # once per store and process: Redis away is not news each time
            self._warned.add(store)
            logger.warning("replay store: %s unusable (%s); relying on the other copy", store, exc)


def _text(value: bytes | str | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
