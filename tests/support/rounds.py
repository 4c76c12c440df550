"""Driving rounds on a real worker from a test or a bench: the event sequence, waiting for a
log line, the stored result, and each way of stopping a task."""

from __future__ import annotations

import time
from typing import Any

from celery.result import AsyncResult

from tasks.client import RoundClient
from tasks.names import seq_key

# plain revoke, revoke with terminate (SIGUSR2), RoundClient.stop
STOP_PATHS = ("revoke", "terminate", "client")


def event_seq(client: RoundClient, host: str) -> int:
    """The host's last event number: ``client.events(host, since=...)`` starts after it."""
    return int(client.redis.get(seq_key(host)) or 0)


def wait_for_log(client: RoundClient, host: str, since: int, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    for event in client.events(host, since=since, idle_timeout_s=timeout_s):
        if event.type == "log" and text in event.data.get("text", ""):
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no log {text!r}")


def stored_result(pending: AsyncResult, timeout_s: float = 60, poll_s: float = 0.1) -> dict[str, Any]:
    """The stored result, waiting past a transient REVOKED (terminate marks it at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meta = pending.backend.get_task_meta(pending.id, cache=False)
        if meta["status"] == "SUCCESS":
            return dict(meta["result"])
        time.sleep(poll_s)
    raise AssertionError(f"no result: {pending.backend.get_task_meta(pending.id, cache=False)}")


def stop_task(client: RoundClient, how: str, task_id: str, host: str) -> None:
    """Stop a running task by one of ``STOP_PATHS``."""
    if how == "revoke":
        client.app.control.revoke(task_id)
    elif how == "terminate":
        client.app.control.revoke(task_id, terminate=True, signal="SIGUSR2")
    elif how == "client":
        client.stop(task_id, host=host)
    else:
        raise ValueError(f"unknown stop path {how!r}; use one of {STOP_PATHS}")
