"""Roundhouse's Celery glue (DESIGN §2), kept thin; the engine is ``executor``.

``celery -A tasks worker`` finds the app here: ``tasks.app`` is the Celery app.

Modules, each importing only those listed before it:

- ``names``: every name on the wire (tasks, queues, Redis keys and channels)
- ``keys``: development keys (``roundhouse keys init``); ``signing``: signatures, trust,
  envelopes (DESIGN §11); ``signed_app``: the Celery app that signs what it sends
- ``events``: the event publisher; ``metrics``: the child's Prometheus metrics
- ``control``: the stop paths (revoke forwarding, SIGUSR2, stop through Redis)
- ``runtime``: the prefork child's Executor, settings, events, stops and heartbeat
- ``rounds``: the tasks of DESIGN §3
- ``acl``: the Redis ACL users of a deployment (each worker its own, the orchestrator its own)
- ``replay``: the replay guard's memory of admitted signed messages (a ledger on disk, Redis)
- ``gate``: what a signed worker admits; ``embedded_redis``: the Procfile's and demo's Redis
- ``app``: the Celery app and its worker hooks
- ``client``: ``RoundClient`` for orchestrators (names, events, control; not the app)
- ``cli``: the ``roundhouse`` command
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    # The app is built on first use, not when a submodule is imported: `roundhouse keys init`
    # must run before the keys that building the app reads exist.
    if name == "app":
        from tasks.app import app

        return app
    raise AttributeError(f"module 'tasks' has no attribute {name!r}")
