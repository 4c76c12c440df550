"""Ending a transfer early: the sockets an abort shuts down, and :class:`Cancel`, which every
loop of the transfer checks between buffers.

A read blocked on a stalled server does not notice an event being set; shutting its socket
down makes it return at once. So every connection this package opens (:mod:`._session`)
registers its socket (per thread, with :func:`tracking`) in the :class:`SocketRegistry` of
the transfer it serves.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import requests

from executor.errors import DownloadAborted
from executor.stopping import StopSignal, on_stop
from executor.urls import Url


class HaltedError(Exception):
    """A sibling segment failed (or the supervisor stopped the download); end quietly."""


def _shutdown(sock: socket.socket) -> None:
    # socket.socket's own shutdown: SSLSocket.shutdown would also drop the SSL
    # object under the feet of the thread that is blocked reading it.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class SocketRegistry:
    """The sockets of one transfer's requests, shut down at once when it is cancelled.

    ``shutdown(SHUT_RDWR)`` makes a ``recv`` blocked in another thread return, which
    closing the socket does not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False

    def add(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            if not self._closed:
                self._sockets.add(sock)
                return
        _shutdown(sock)

    def shutdown_all(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _shutdown(sock)


_thread_state = threading.local()


@contextlib.contextmanager
def tracking(registry: SocketRegistry) -> Iterator[None]:
    """Register the socket of every request this thread makes inside the block."""
    previous = getattr(_thread_state, "registry", None)
    _thread_state.registry = registry
    try:
        yield
    finally:
        _thread_state.registry = previous


def track(sock: socket.socket | None) -> None:
    registry: SocketRegistry | None = getattr(_thread_state, "registry", None)
    if registry is not None:
        registry.add(sock)


def track_response(response: requests.Response) -> None:
    """Also register the response's own socket (covers proxied connections)."""
    connection = getattr(response.raw, "connection", None)
    track(getattr(connection, "sock", None))


class Cancel:
    """What ends a transfer early: the caller's abort event, or ``halt`` (a sibling failed).

    ``fire()`` sets ``halt`` and shuts down every registered socket; it runs from the
    StopSignal's callback, or from the ranged supervisor when it sees a plain Event set.
    """

    def __init__(self, abort: threading.Event | None, url: str | Url) -> None:
        self.abort = abort
        self.url = Url.of(url)
        self.halt = threading.Event()
        self.registry = SocketRegistry()
        # Whether something calls fire() when abort is set, so that waiting on halt suffices.
        self.watched = False
        self._unregister: Callable[[], None] = lambda: None

    def __enter__(self) -> Cancel:
        self._unregister = on_stop(self.abort, self.fire)
        self.watched = isinstance(self.abort, StopSignal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._unregister()

    def fire(self) -> None:
        self.halt.set()
        self.registry.shutdown_all()

    def stopped(self) -> bool:
        return self.abort is not None and self.abort.is_set()

    def check(self) -> None:
        if self.stopped():
            # The seed's name for it: a seed caller's ``except DownloadAborted`` keeps working.
            raise DownloadAborted(f"transfer of {self.url} stopped", {"url": str(self.url)})
        if self.halt.is_set():
            raise HaltedError()

    def sleep(self, seconds: float) -> None:
        self.check()
        if self.abort is not None and not self.watched:
            self.abort.wait(seconds)
        else:
            self.halt.wait(seconds)
        self.check()
