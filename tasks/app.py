"""The Celery app (``tasks.app``), built from the one Settings object, and its worker hooks.

The MainProcess imports neither torch nor the executor: the child builds its
:class:`~tasks.child.ChildRuntime` in ``worker_process_init``, after the fork, so
CUDA is initialised only where it may be (CUDA is not fork-safe).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from celery import Celery, signals

from settings import Settings, celery_config, get_settings
from tasks.control import RevokeForwarder

if TYPE_CHECKING:
    from tasks.child import ChildRuntime

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def runtime_settings() -> Settings:
    return get_settings()


def create_app(settings: Settings) -> Celery:
    celery = Celery("roundhouse", set_as_current=True)
    celery.conf.update(celery_config(settings))
    celery.steps["worker"].add(RevokeForwarder)
    return celery


app = create_app(runtime_settings())

_runtime: ChildRuntime | None = None


def runtime() -> ChildRuntime:
    """The child's runtime (built on first use when a task runs outside a prefork child)."""
    global _runtime
    if _runtime is None:
        from tasks.child import ChildRuntime

        _runtime = ChildRuntime(runtime_settings())
    return _runtime


@signals.worker_process_init.connect
def _child_init(**_: Any) -> None:
    # Warm the child now (imports torch, starts the event and stop threads, installs the
    # SIGUSR2 handler, which billiard leaves alone) so the first task does not pay for it.
    runtime()


@signals.worker_process_shutdown.connect
def _child_shutdown(**_: Any) -> None:
    if _runtime is not None:
        _runtime.events.close(timeout_s=2.0)


import tasks.rounds  # noqa: E402, F401 - registers the tasks on the app
