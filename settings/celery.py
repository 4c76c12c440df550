"""The Celery configuration, built from :class:`Settings` (read once, passed in).

Choices that matter for GPU rounds, and why:

- JSON only, in and out; pickle is refused (a task message must never run code).
- One task at a time per child, nothing reserved ahead: ``worker_prefetch_multiplier=1``
  and, on Redis, ``worker_disable_prefetch`` — a round must not sit in a busy worker's
  buffer while another GPU is idle.
- ``task_acks_late`` with ``task_reject_on_worker_lost``: a message is acknowledged when
  the task ends, so a crashed child's task is delivered again (the tasks are idempotent:
  see ``tasks/rounds.py``).
- A Redis visibility timeout longer than the longest round, in the broker's and in the
  result backend's transport options: otherwise a round still running is delivered twice.
- No ``max_tasks_per_child`` / ``max_memory_per_child``: recycling the child would drop
  the loaded model and the GPU context; no hard time limit on rounds.
- Events on (``worker_send_task_events``, ``task_send_sent_event``) for Flower.
"""

from __future__ import annotations

from typing import Any

from settings.config import Settings


def is_redis(url: str) -> bool:
    return url.split("://", 1)[0] in ("redis", "rediss", "sentinel", "redis+socket")


def celery_config(settings: Settings) -> dict[str, Any]:
    transport = {"visibility_timeout": settings.visibility_timeout_s}
    config: dict[str, Any] = {
        "broker_url": settings.broker_url,
        "result_backend": settings.results_url,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": is_redis(settings.broker_url),
        "worker_concurrency": 1,
        "worker_max_tasks_per_child": None,
        "worker_max_memory_per_child": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "task_time_limit": None,
        "task_soft_time_limit": settings.soft_time_limit_s,
        "broker_transport_options": dict(transport),
        "result_backend_transport_options": dict(transport),
        "broker_connection_retry_on_startup": True,
        # A result is never dropped because Redis blinked: storing it is retried with backoff.
        "result_backend_always_retry": True,
        "result_backend_max_retries": 120,
        "broker_connection_max_retries": None,
        # Off: an extended result would keep the task's kwargs — presigned URLs, tokens and
        # all — in Redis for result_expires. The orchestrator knows what it sent.
        "result_extended": False,
        "result_expires": 7 * 24 * 3600,
        "task_default_queue": settings.queue,
    }
    return config
