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
- Signed control plane (DESIGN §11) when the settings name a trust store or a signing key:
  tasks and control commands travel in Celery's ``auth`` serializer (``application/data``,
  RSA-PSS over the JSON body), and a worker accepts nothing else; results and events stay
  JSON. ``tasks.trust.signing`` registers the keys and replaces ``"auth"`` with its own signer's
  serializer name.
- Redis over TLS: a ``rediss://`` broker or backend is checked against ``tls_ca_file``
  (certificate required). One priority step, and in-flight messages under the worker's own
  keys (:func:`unacked_keys`): each worker's kombu state is keys an ACL can give to it alone.
- Results expire (``result_expires_s``): a ``noeviction`` Redis never drops them, so they
  must not pile up.
"""

from __future__ import annotations

import ssl
from typing import Any

from settings.config import Settings

# The content type of Celery's auth serializer: the only one a signed worker accepts.
AUTH_CONTENT_TYPE = "application/data"


def unacked_keys(host_id: str) -> dict[str, str]:
    """kombu's bookkeeping of one worker's delivered, unacknowledged messages (Redis).

    kombu shares one ``unacked`` hash among all consumers by default, so every worker could
    read every other worker's in-flight task bodies (tenant code, presigned URLs); per host,
    an ACL can give each worker its own. A worker restores its own unacknowledged messages
    when it starts again (same host id)."""
    return {
        "unacked_key": f"roundhouse:unacked:{host_id}",
        "unacked_index_key": f"roundhouse:unacked_index:{host_id}",
        "unacked_mutex_key": f"roundhouse:unacked_mutex:{host_id}",
    }


def tls_options(settings: Settings) -> dict[str, Any]:
    """kombu / Celery ``*_use_ssl`` for a ``rediss://`` server: its certificate is required."""
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if settings.tls_ca_file:
        options["ssl_ca_certs"] = settings.tls_ca_file
    return options


def _security(settings: Settings) -> dict[str, Any]:
    if not settings.signed:
        return {"task_serializer": "json", "accept_content": ["json"]}
    return {
        "task_serializer": "auth",
        "accept_content": [AUTH_CONTENT_TYPE],
        "security_key": settings.signing_key,
        "security_certificate": settings.signing_cert,
        "security_cert_store": settings.trusted_certs,
        "security_digest": "sha256",
    }


def is_redis(url: str) -> bool:
    return url.split("://", 1)[0] in ("redis", "rediss", "sentinel", "redis+socket")


def celery_config(settings: Settings) -> dict[str, Any]:
    transport: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout_s}
    broker_transport = dict(transport)
    if is_redis(settings.broker_url):
        # One list per queue (no priority lists) and this host's own in-flight keys.
        broker_transport.update(priority_steps=[0], **unacked_keys(settings.host_id))
    config: dict[str, Any] = {
        "broker_url": settings.broker_url,
        "result_backend": settings.results_url,
        **_security(settings),
        "result_serializer": "json",
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": is_redis(settings.broker_url),
        "worker_concurrency": 1,
        "worker_max_tasks_per_child": None,
        "worker_max_memory_per_child": None,
        # A child imports torch and builds its Executor before billiard hears it is up; the
        # default 4 s is less than that on a busy host, and a replacement child (after a crash)
        # would then be killed and replaced forever.
        "worker_proc_alive_timeout": 120.0,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "task_time_limit": None,
        "task_soft_time_limit": settings.soft_time_limit_s,
        "broker_transport_options": broker_transport,
        "result_backend_transport_options": dict(transport),
        "broker_connection_retry_on_startup": True,
        # A result is never dropped because Redis blinked: storing it is retried with backoff.
        "result_backend_always_retry": True,
        "result_backend_max_retries": 120,
        "broker_connection_max_retries": None,
        # Off: an extended result would keep the task's kwargs — presigned URLs, tokens and
        # all — in Redis for result_expires. The orchestrator knows what it sent.
        "result_extended": False,
        "result_expires": settings.result_expires_s,
        "task_default_queue": settings.queue,
    }
    if settings.broker_url.startswith("rediss://"):
        config["broker_use_ssl"] = tls_options(settings)
    if settings.results_url.startswith("rediss://"):
        config["redis_backend_use_ssl"] = tls_options(settings)
    return config
