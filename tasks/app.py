"""The Celery app (``tasks.app``), built from the one Settings object, and its worker hooks.

The top of ``tasks``: it imports the tasks and the child's runtime, and nothing imports
it back. The MainProcess imports neither torch nor the executor's engine: the child
builds its :class:`~tasks.runtime.ChildRuntime` in ``worker_process_init``, after the
fork, so CUDA is initialised only where it may be (CUDA is not fork-safe).
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals

from settings import Settings, celery_config, get_settings
from tasks.control import RevokeForwarder
from tasks.rounds import register
from tasks.runtime import close_runtime, runtime
from tasks.trust.gate import Gate
from tasks.trust.signed_app import SignedCelery


def create_app(settings: Settings) -> Celery:
    # Signed when the settings name keys (DESIGN §11): the same app serves the worker (which
    # verifies) and Flower / `celery inspect` (which sign with the operator's key).
    celery = SignedCelery("roundhouse", set_as_current=True)
    celery.conf.update(celery_config(settings))
    celery.use_settings(settings)
    celery.steps["worker"].add(RevokeForwarder)
    celery.steps["consumer"].add(Gate)
    register(celery, settings)
    return celery


app = create_app(get_settings())


@signals.worker_process_init.connect
def _child_init(**_: Any) -> None:
    # Warm the child now (imports torch, starts the event and stop threads, installs the
    # SIGUSR2 handler, which billiard leaves alone) so the first task does not pay for it.
    runtime()


@signals.worker_process_shutdown.connect
def _child_shutdown(**_: Any) -> None:
    close_runtime(timeout_s=2.0)
