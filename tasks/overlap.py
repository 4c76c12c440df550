"""The sync of an overlapped round: an order through Redis, never a second task (docs/OVERLAP.md).

In overlapped mode (``run_round(..., overlap=...)``) the orchestrator builds round k's sync
while the hosts already train round k+1. Concurrency stays 1, so the sync cannot be a task:
the orchestrator writes a :class:`SyncOrder` under ``roundhouse:sync:<host>:<sync_id>``
(:func:`send_sync`), and the child's :class:`SyncInbox`, a thread that lives as long as the
round, reads it, checks it and hands it to the executor, which applies it to the global copy
beside the running round.

What makes the order safe to act on, with the broker and Redis hostile (DESIGN §11):

- on the signed control plane it is a signed token naming its host
  (``tasks.trust.signing.sync_token``); one that does not verify is refused, reported as a
  ``refused`` state event, and the round goes on waiting for a genuine one;
- its ``sync_id`` is a fresh random id that the round's own (signed, replay-guarded) task
  message named: a captured order of another round or session names another id and is never
  read; a second copy of the same order is the same order;
- what it installs is checked as every sync is: the delta applies only onto the base it names
  and must leave ``result_hash`` (else the full model, which must hash to ``result_hash``).

The inbox reads its key every ``POLL_S`` while the round runs, and stops once it has the
order: a fleet of N hosts costs Redis N GETs per ``POLL_S`` only while syncs are outstanding.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from tasks.names import sync_key
from tasks.trust.signing import Refused, Signer, sync_token

logger = logging.getLogger(__name__)

POLL_S = 0.05
SYNC_KEY_TTL_S = 6 * 3600


class BadOrder(ValueError):
    """A sync order that is not one (its fields' types, a missing field)."""


def _text(data: dict[str, Any], name: str, *, optional: bool = False) -> str | None:
    value = data.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > 65536:
        raise BadOrder(f"sync order field {name!r} must be a non-empty string")
    return value


@dataclass(frozen=True)
class SyncOrder:
    """Bring the global copy from ``base_hash`` to ``result_hash``: the delta at ``delta_url``
    (None: the model did not change), else the full model at ``model_url``."""

    sync_id: str
    round_num: int
    model_url: str
    delta_url: str | None
    base_hash: str
    result_hash: str
    # The common part of the next outer step (its file and hash), for the host's eager step.
    eager_url: str | None = None
    eager_hash: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "sync_id": self.sync_id,
            "round": self.round_num,
            "model_url": self.model_url,
            "delta_url": self.delta_url,
            "base_hash": self.base_hash,
            "result_hash": self.result_hash,
            "eager_url": self.eager_url,
            "eager_hash": self.eager_hash,
        }

    @classmethod
    def from_json(cls, data: object) -> SyncOrder:
        if not isinstance(data, dict):
            raise BadOrder("a sync order is an object")
        round_num = data.get("round")
        if not isinstance(round_num, int) or isinstance(round_num, bool) or round_num < 0:
            raise BadOrder("sync order field 'round' must be an integer >= 0")
        return cls(
            str(_text(data, "sync_id")),
            round_num,
            str(_text(data, "model_url")),
            _text(data, "delta_url", optional=True),
            str(_text(data, "base_hash")),
            str(_text(data, "result_hash")),
            _text(data, "eager_url", optional=True),
            _text(data, "eager_hash", optional=True),
        )


def send_sync(client: redis.Redis, host_id: str, order: SyncOrder, signer: Signer | None = None) -> None:
    """Leave ``order`` for ``host_id``'s round (signed on the signed control plane)."""
    body = order.to_json()
    token = sync_token(signer, host_id, body) if signer is not None else json.dumps(body)
    client.set(sync_key(host_id, order.sync_id), token, ex=SYNC_KEY_TTL_S)


class SyncInbox:
    """Child: waits in a thread for the order named ``sync_id`` and calls ``apply(order)``.

    ``verify`` (the signed control plane) turns a token into the order's JSON or raises
    :class:`Refused`; without it the key holds the order's JSON. ``apply`` returns what the
    round reports of the sync (its outcome's JSON) or raises; either ends the inbox."""

    def __init__(
        self,
        client: redis.Redis,
        host_id: str,
        sync_id: str,
        apply: Callable[[SyncOrder], dict[str, Any]],
        *,
        verify: Callable[[bytes], Any] | None = None,
        on_refused: Callable[[Refused], None] | None = None,
        stop: threading.Event,
    ) -> None:
        self._client, self._key = client, sync_key(host_id, sync_id)
        self._sync_id = sync_id
        self._apply, self._verify, self._on_refused = apply, verify, on_refused
        self._stop = stop
        self._refused: set[bytes] = set()  # a refused token is reported once, not every poll
        self.outcome: dict[str, Any] | None = None
        self.error: str | None = None
        self.applied_at: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="roundhouse-sync-inbox", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Until the order is applied (True), it failed, the stop is set or ``timeout_s`` passed."""
        until = time.monotonic() + timeout_s
        while not self._done.is_set() and not self._stop.is_set() and time.monotonic() < until:
            self._done.wait(min(0.05, max(0.0, until - time.monotonic())))
        return self.outcome is not None

    def close(self) -> None:
        """The round is over: the thread ends at its next poll (an apply in progress finishes
        or aborts with the executor's stop)."""
        self._done.set()

    def _run(self) -> None:
        try:
            while not self._done.is_set() and not self._stop.is_set():
                order = self._read()
                if order is not None:
                    self.outcome = self._apply(order)
                    self.applied_at = time.monotonic()
                    return
                self._done.wait(POLL_S)
        except Exception as exc:  # the apply failed: the round reports it, the host re-syncs
            logger.warning("overlapped sync not applied: %s", exc)
            self.error = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            self._done.set()

    def _read(self) -> SyncOrder | None:
        try:
            raw = self._client.get(self._key)
        except redis.RedisError as exc:
            logger.debug("sync inbox: Redis away (%s)", exc)
            return None
        if raw is None:
            return None
        data = raw if isinstance(raw, bytes) else str(raw).encode()
        if data in self._refused:
            return None
        try:
            body = self._verify(data) if self._verify is not None else json.loads(data)
            order = SyncOrder.from_json(body)
            if order.sync_id != self._sync_id:
                raise Refused("wrong_id", f"a sync order for {order.sync_id!r} under this round's key")
        except (Refused, BadOrder, ValueError) as exc:
            refusal = exc if isinstance(exc, Refused) else Refused("malformed", str(exc))
            logger.warning("refused sync order: %s", refusal)
            self._refused.add(data)
            if len(self._refused) > 64:  # a flood of forgeries stays bounded
                self._refused.clear()
            if self._on_refused is not None:
                self._on_refused(refusal)
            return None
        return order
