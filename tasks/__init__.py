"""Roundhouse's Celery glue (DESIGN §2), kept thin; the engine is ``executor``.

``celery -A tasks worker`` finds the app here: ``tasks.app`` is the Celery app.

Modules, each importing only those listed before it (``trust``'s gate also needs ``events``:
it publishes refusals):

- ``names``: every name on the wire (tasks, queues, Redis keys and channels)
- ``trust``: the signed control plane (DESIGN §11), a package: development keys, signatures
  and envelopes, the app that signs what it sends, the gate on the worker's MainProcess and
  its replay guard, the Redis ACL users of a deployment
- ``events``: the event publisher; ``metrics``: the child's Prometheus metrics
- ``control``: the stop paths (revoke forwarding, SIGUSR2, stop through Redis)
- ``overlap``: an overlapped round's sync order, through Redis (``send_sync``, ``SyncInbox``)
- ``runtime``: the prefork child's Executor, settings, events, stops and heartbeat
- ``rounds``: the tasks of DESIGN §3
- ``embedded_redis``: the Procfile's and demo's Redis
- ``app``: the Celery app and its worker hooks
- ``client``: ``RoundClient`` for orchestrators (names, events, control; not the app)
- ``cli``: the worker side's ``roundhouse`` subcommands (``orchestrator.cli`` is the command)
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
