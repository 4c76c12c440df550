"""Roundhouse's Celery glue (DESIGN §2), kept thin; the engine is ``executor``.

``celery -A tasks worker`` finds the app here: ``tasks.app`` is the Celery app.

Modules, each importing only those listed before it:

- ``names``: every name on the wire (tasks, queues, Redis keys and channels)
- ``events``: the event publisher; ``metrics``: the child's Prometheus metrics
- ``control``: the stop paths (revoke forwarding, SIGUSR2, stop through Redis)
- ``runtime``: the prefork child's Executor, settings, events, stops and heartbeat
- ``rounds``: the tasks of DESIGN §3
- ``app``: the Celery app and its worker hooks
- ``client``: ``RoundClient`` for orchestrators (names, events, control; not the app)
- ``cli``: the ``roundhouse`` command
"""

from tasks.app import app

__all__ = ["app"]
