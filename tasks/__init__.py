"""Roundhouse's Celery glue (DESIGN §2): kept thin; the engine is ``executor``.

For now this package holds the ``roundhouse`` command line; the Celery app, the
tasks, events and revocation land here next (``celery -A tasks worker``).
"""
