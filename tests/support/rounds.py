"""Driving rounds on a real worker from a test or a bench: the event sequence, waiting for a
log line or an event, the stored result, each way of stopping a task, and the broker's
redelivery of an unacknowledged message."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery.result import AsyncResult
from kombu import Connection

from orchestrator.demo import TRAIN
from settings import Settings
from settings.celery import celery_config
from tasks.client import RoundClient
from tasks.events import Event
from tasks.names import seq_key, unacked_keys

# plain revoke, revoke with terminate (SIGUSR2), RoundClient.stop
STOP_PATHS = ("revoke", "terminate", "client")

# The demo's training script, but the host ``params["slow_host"]`` spins in round
# ``params["slow_round"]`` until it is stopped (and says so in its log first).
SLOW_ON_CUE = (
    """
if params.get("slow_host") == host_id and round_num == params.get("slow_round"):
    emit_log("slow round started")
    while True:
        should_stop()
"""
    + TRAIN
)


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


def wait_for_event(
    client: RoundClient, host: str, since: int, matches: Callable[[Event], bool], timeout_s: float = 60
) -> Event:
    """The first event of ``host`` after ``since`` that ``matches``, waiting for it live."""
    deadline = time.monotonic() + timeout_s
    for event in client.events(host, since=since, idle_timeout_s=timeout_s):
        if matches(event):
            return event
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no matching event of {host} in {timeout_s} s")


def unacked_since(client: RoundClient, task_id: str) -> float | None:
    """When kombu delivered ``task_id`` if its message is still unacknowledged, else None
    (each worker keeps its in-flight messages under its own keys: ``unacked_keys``)."""
    for key in client.redis.scan_iter(match=unacked_keys("*")["unacked_key"]):
        host = key.decode().rsplit(":", 1)[1]
        for tag, raw in client.redis.hgetall(key).items():
            if task_id.encode() in raw:
                score = client.redis.zscore(unacked_keys(host)["unacked_index_key"], tag)
                return None if score is None else float(score)
    return None


def restore_overdue(redis_url: str, host: str, visibility_timeout_s: int) -> None:
    """Hand ``host``'s unacknowledged messages older than the visibility timeout back to its
    queue, by kombu's own sweep over that worker's unacked keys: what any consumer's restore
    tick does, at a moment the test chooses (the worker's own tick runs every ~100 s)."""
    settings = Settings(broker_url=redis_url, host_id=host, visibility_timeout_s=visibility_timeout_s)
    options = celery_config(settings)["broker_transport_options"]
    with Connection(redis_url, transport_options=options) as connection:
        connection.default_channel.qos.restore_visible(num=None)
