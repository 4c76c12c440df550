"""The stop signal of one executor, and the asynchronous stop of a Python thread.

``StopSignal`` is a ``threading.Event`` (the seed's ``abort_event`` stays one) that
also runs callbacks when it is set, so that a transfer blocked in ``recv`` on a
stalled server can close its socket at once instead of waiting for a read
timeout. ``interrupt_thread`` delivers ``StopExecution`` at the next bytecode of
a thread that is busy in a Python loop and never calls ``should_stop()``.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections.abc import Callable

from executor.errors import StopExecution

logger = logging.getLogger(__name__)


class StopSignal(threading.Event):
    """An Event whose ``set()`` also runs registered callbacks (once per set)."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._callbacks_lock = threading.Lock()
        self._ids = itertools.count()

    def add_callback(self, callback: Callable[[], None]) -> int:
        """Register ``callback``; it runs at once when the signal is already set."""
        with self._callbacks_lock:
            handle = next(self._ids)
            self._callbacks[handle] = callback
        if self.is_set():
            _run(callback)
        return handle

    def remove_callback(self, handle: int) -> None:
        with self._callbacks_lock:
            self._callbacks.pop(handle, None)

    def set(self) -> None:
        super().set()
        with self._callbacks_lock:
            callbacks = list(self._callbacks.values())
        for callback in callbacks:
            _run(callback)


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # a failing abort hook must not stop the others
        logger.debug("stop callback failed", exc_info=True)


def on_stop(signal: threading.Event | None, callback: Callable[[], None]) -> Callable[[], None]:
    """Register ``callback`` on a StopSignal; returns the function that unregisters it."""
    if isinstance(signal, StopSignal):
        handle = signal.add_callback(callback)
        return lambda: signal.remove_callback(handle)
    return lambda: None


def interrupt_thread(thread: threading.Thread) -> bool:
    """Raise ``StopExecution`` asynchronously in ``thread`` (CPython only).

    The exception arrives at the thread's next bytecode; a thread inside one long
    native call (a CUDA kernel, a blocking read) sees it only when that returns.
    """
    ident = thread.ident
    if ident is None or not thread.is_alive():
        return False
    affected = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(StopExecution)
    )
    if affected > 1:
        # Never expected; undo rather than stop threads we do not own.
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
        return False
    return affected == 1


class UserCodeShield:
    """Knows when the executor thread is inside tenant code, so an async stop lands only there.

    The executor's own helpers that user code calls (``get_shard``, ``save_model``, ...)
    run shielded: a stop then aborts them through the stop signal they check, and
    ``StopExecution`` is raised as they return to tenant code — never in the middle
    of a cache update or a file write.
    """

    def __init__(self, signal: threading.Event) -> None:
        self._signal = signal
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._depth = 0  # > 0 while inside a shielded helper

    def enter(self) -> None:
        with self._lock:
            self._thread = threading.current_thread()
            self._depth = 0

    def leave(self) -> None:
        with self._lock:
            self._thread = None

    def callback(self, fn: Callable[..., object]) -> Callable[..., object]:
        def shielded(*args: object, **kwargs: object) -> object:
            with self._lock:
                self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._depth -= 1
                if self._signal.is_set() and threading.current_thread() is self._thread:
                    raise StopExecution("stopped by request")

        shielded.__name__ = getattr(fn, "__name__", "callback")
        shielded.__doc__ = getattr(fn, "__doc__", None)
        return shielded

    def interrupt(self) -> bool:
        """Deliver ``StopExecution`` to the tenant thread if it is in tenant code now."""
        with self._lock:
            thread = self._thread
            if thread is None or self._depth > 0:
                return False
            return interrupt_thread(thread)


class DoneThread(threading.Thread):
    """A thread whose end is an Event, so that waiting for it is safe from signal handlers.

    CPython's ``Thread.join``, when a signal handler raises in the waiting thread (Celery's
    soft time limit does), can mark a thread that is still running as stopped. Waiting on
    an Event has no such side effect.
    """

    def __init__(self, target: Callable[[], None], name: str) -> None:
        super().__init__(target=target, name=name, daemon=True)
        self.done = threading.Event()

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the thread's work is over (it may still be unwinding for a moment)."""
        return self.done.wait(timeout_s)

    @property
    def running(self) -> bool:
        return self.is_alive() and not self.done.is_set()
