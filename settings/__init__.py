"""Roundhouse configuration: one :class:`Settings` object, read once, and the Celery config built from it.

The lowest layer of the project: it imports nothing of ``executor``, ``tasks`` or
``orchestrator``, so every one of them can take its settings from here.

- ``config``: the ``Settings`` object, read once from the environment and ``.env``
- ``celery``: the Celery configuration built from it (``celery_config``)
"""

from settings.celery import celery_config
from settings.config import SandboxMode, Settings, get_settings, queue_name

__all__ = ["SandboxMode", "Settings", "celery_config", "get_settings", "queue_name"]
