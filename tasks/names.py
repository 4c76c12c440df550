"""Every name Roundhouse uses on the wire: tasks, queues, Redis keys and channels.

An orchestrator needs only these strings (and JSON) to drive a worker, whatever
language it is written in; the worker, :class:`~tasks.client.RoundClient`, the demo and
the tests all take them from here.

- tasks (DESIGN §3): ``roundhouse.load_model``, ``.run_round``, ``.apply_delta``,
  ``.reset``, ``.status``
- queue of one worker (§1): ``roundhouse.<host_id>`` (:func:`queue_name`, defined in
  ``settings`` because ``Settings.queue`` needs it too)
- heartbeat (§5): key ``roundhouse:hosts:<host_id>``, JSON, short TTL
- events (§5): channel ``roundhouse:events:<host_id>``, capped stream
  ``roundhouse:events:<host_id>:log``, seq counter ``roundhouse:events:<host_id>:seq``, and
  one last-sent marker per publisher, ``roundhouse:events:<host_id>:last:<publisher>``
- stop through Redis (§6): key ``roundhouse:stop:<task_id>`` and channel
  ``roundhouse:control:<host_id>``
"""

from __future__ import annotations

from settings import queue_name

__all__ = [
    "APPLY_DELTA",
    "HEARTBEAT_PATTERN",
    "LOAD_MODEL",
    "RESET",
    "RUN_ROUND",
    "STATUS",
    "TASK_NAMES",
    "channel_name",
    "control_channel",
    "heartbeat_key",
    "last_sent_key",
    "queue_name",
    "seq_key",
    "stop_key",
    "stream_name",
]

LOAD_MODEL = "roundhouse.load_model"
RUN_ROUND = "roundhouse.run_round"
APPLY_DELTA = "roundhouse.apply_delta"
RESET = "roundhouse.reset"
STATUS = "roundhouse.status"
TASK_NAMES = (LOAD_MODEL, RUN_ROUND, APPLY_DELTA, RESET, STATUS)


def heartbeat_key(host_id: str) -> str:
    return f"roundhouse:hosts:{host_id}"


# What SCAN matches to list every live worker.
HEARTBEAT_PATTERN = heartbeat_key("*")


def channel_name(host_id: str) -> str:
    """The pub/sub channel of a worker's events."""
    return f"roundhouse:events:{host_id}"


def stream_name(host_id: str) -> str:
    """The capped stream that keeps a worker's events for replay."""
    return f"roundhouse:events:{host_id}:log"


def seq_key(host_id: str) -> str:
    """The counter that numbers a worker's events (shared by its processes, kept across restarts)."""
    return f"roundhouse:events:{host_id}:seq"


def last_sent_key(host_id: str, publisher: str) -> str:
    """One publisher's last event id and seq, so that a retried publish is not written twice."""
    return f"roundhouse:events:{host_id}:last:{publisher}"


def stop_key(task_id: str) -> str:
    return f"roundhouse:stop:{task_id}"


def control_channel(host_id: str) -> str:
    return f"roundhouse:control:{host_id}"
