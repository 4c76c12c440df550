"""Roundhouse's Celery glue (DESIGN §2), kept thin; the engine is ``executor``.

``celery -A tasks worker`` finds the app here: ``tasks.app`` is the Celery app.
"""

from tasks.app import app

__all__ = ["app"]
