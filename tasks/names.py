"""Every name Roundhouse uses on the wire: tasks, queues, Redis keys and channels.

An orchestrator needs only these strings (and JSON) to drive a worker, whatever
language it is written in; the worker, :class:`~tasks.client.RoundClient`, the demo and
the tests all take them from here.

- tasks (DESIGN §3): ``roundhouse.load_model``, ``.run_round``, ``.apply_delta``,
  ``.reset``, ``.status``; ``.reduce_shard`` (a sharded round's reduction, docs/SHARDED.md)
- queue of one worker (§1): ``roundhouse.<host_id>`` (:func:`queue_name`, defined in
  ``settings`` because ``Settings.queue`` needs it too)
- heartbeat (§5): key ``roundhouse:hosts:<host_id>``, JSON, short TTL, and its brief
  ``roundhouse:hosts:<host_id>:brief`` (what a listing reads); and the fleet's index
  of beats ``roundhouse:beats`` (sorted set: host id, scored by when its beat expires), what
  :meth:`~tasks.client.RoundClient.hosts` lists from in two round trips whatever the keyspace
- events (§5): channel ``roundhouse:events:<host_id>``, capped stream
  ``roundhouse:events:<host_id>:log``, seq counter ``roundhouse:events:<host_id>:seq``,
  one last-sent marker per publisher, ``roundhouse:events:<host_id>:last:<publisher>``, and
  the stream's byte account ``roundhouse:events:<host_id>:log:sizes`` (sorted set) and
  ``roundhouse:events:<host_id>:log:bytes``
- stop through Redis (§6): key ``roundhouse:stop:<host_id>:<task_id>`` and channel
  ``roundhouse:control:<host_id>`` (per host, so that an ACL can give each worker only its own)
- the control plane (§11): the kwarg ``roundhouse_envelope`` that a signed task carries in
  its signed body (also in a signed control command's ``arguments``), and the replay record
  of each signed message a worker admitted, ``roundhouse:nonce:<host_id>:<nonce>``
- kombu's own keys, per host where kombu allows it: the worker's queue list
  ``roundhouse.<host_id>`` (one priority step, so one key), its in-flight messages
  ``roundhouse:unacked:<host_id>``, ``roundhouse:unacked_index:<host_id>``,
  ``roundhouse:unacked_mutex:<host_id>`` (:func:`unacked_keys`, defined in ``settings``);
  shared: ``_kombu.binding.*``, ``celery-task-meta-<task_id>`` (results, key and channel),
  the pub/sub channels ``/<db>.celery.pidbox`` and ``/<db>.celeryev/*``, and the reply
  queues ``<uuid>.reply.celery.pidbox`` (deploy/redis/README.md lists who needs what)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from settings import queue_name
from settings.celery import unacked_keys

__all__ = [
    "APPLY_DELTA",
    "BRIEF_FIELDS",
    "ENVELOPE_KEY",
    "HEARTBEAT_INDEX",
    "HEARTBEAT_PATTERN",
    "HOST_ID",
    "LOAD_MODEL",
    "REDUCE_SHARD",
    "RESET",
    "RUN_ROUND",
    "STATUS",
    "TASK_NAMES",
    "channel_name",
    "control_channel",
    "heartbeat_key",
    "last_sent_key",
    "nonce_key",
    "queue_beat",
    "queue_name",
    "seq_key",
    "stop_key",
    "stream_account_keys",
    "stream_name",
    "unacked_keys",
]

LOAD_MODEL = "roundhouse.load_model"
RUN_ROUND = "roundhouse.run_round"
APPLY_DELTA = "roundhouse.apply_delta"
REDUCE_SHARD = "roundhouse.reduce_shard"
RESET = "roundhouse.reset"
STATUS = "roundhouse.status"
TASK_NAMES = (LOAD_MODEL, RUN_ROUND, APPLY_DELTA, REDUCE_SHARD, RESET, STATUS)

# What a signed message binds inside its signed body (see tasks/trust/signing.py).
ENVELOPE_KEY = "roundhouse_envelope"


def heartbeat_key(host_id: str, *, brief: bool = False) -> str:
    """A worker's beat; ``brief``: the few fields a fleet's listing reads (host id, state,
    tenant, model hash, queue, time), written beside it with each beat."""
    return f"roundhouse:hosts:{host_id}" + (":brief" if brief else "")


# What SCAN matches to list every live worker (the listing of a fleet with no index yet).
HEARTBEAT_PATTERN = heartbeat_key("*")
# Every worker's host id, scored by when its last beat expires (epoch seconds): who to MGET.
HEARTBEAT_INDEX = "roundhouse:beats"
# What a beat's brief holds: what choosing hosts reads (a tenth of a whole beat's bytes).
BRIEF_FIELDS = ("host_id", "state", "tenant", "model_hash", "task_id", "queue", "ts")


def queue_beat(pipe: Any, beat: Mapping[str, Any], ttl_s: int) -> None:
    """A beat as it goes on the wire, queued on a Redis pipeline (one round trip): under its
    host's key (the authority), its brief beside it, and its entry in the fleet's index scored
    by when it expires (``beat["ts"] + ttl_s``, the worker's clock)."""
    host = str(beat["host_id"])
    pipe.set(heartbeat_key(host), json.dumps(beat), ex=ttl_s)
    pipe.set(heartbeat_key(host, brief=True), json.dumps({k: beat.get(k) for k in BRIEF_FIELDS}), ex=ttl_s)
    pipe.zadd(HEARTBEAT_INDEX, {host: float(beat["ts"]) + ttl_s})


# A host id a name may be built from (an ACL's key pattern, an index entry): no glob
# characters, no separators, bounded.
HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def channel_name(host_id: str) -> str:
    """The pub/sub channel of a worker's events."""
    return f"roundhouse:events:{host_id}"


def stream_name(host_id: str) -> str:
    """The capped stream that keeps a worker's events for replay."""
    return f"roundhouse:events:{host_id}:log"


def stream_account_keys(host_id: str) -> tuple[str, str]:
    """What the stream holds, kept beside it to bound it in bytes: each entry's id and size (a
    sorted set by seq), and the entries and bytes in all (``"<entries> <bytes>"``)."""
    return f"{stream_name(host_id)}:sizes", f"{stream_name(host_id)}:bytes"


def seq_key(host_id: str) -> str:
    """The counter that numbers a worker's events (shared by its processes, kept across restarts)."""
    return f"roundhouse:events:{host_id}:seq"


def last_sent_key(host_id: str, publisher: str) -> str:
    """One publisher's last event id and seq, so that a retried publish is not written twice."""
    return f"roundhouse:events:{host_id}:last:{publisher}"


def stop_key(host_id: str, task_id: str) -> str:
    """A stop request for ``task_id`` on ``host_id`` (readable by that worker alone)."""
    return f"roundhouse:stop:{host_id}:{task_id}"


def nonce_key(host_id: str, nonce: str) -> str:
    """What ``host_id`` remembers of one signed message it admitted (its replay guard)."""
    return f"roundhouse:nonce:{host_id}:{nonce}"


def control_channel(host_id: str) -> str:
    return f"roundhouse:control:{host_id}"


def sync_key(host_id: str, sync_id: str) -> str:
    """The sync an overlapped round of ``host_id`` awaits, named by the round's ``sync_id``."""
    return f"roundhouse:sync:{host_id}:{sync_id}"
