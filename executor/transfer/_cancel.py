"""Ending a transfer early: HTTP sessions whose sockets an abort can shut down, and
:class:`Cancel`, which every loop of the transfer checks between buffers.

A read blocked on a stalled server does not notice an event being set; shutting its socket
down makes it return at once. So every connection this package opens registers its socket
(per thread, with :func:`tracking`) in the :class:`SocketRegistry` of the transfer it serves.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from executor.errors import Stopped
from executor.fileio import MIB
from executor.stopping import StopSignal, on_stop
from executor.transfer._urls import redact_url

# http.client sends file bodies in blocks of this size; its 16 KiB default costs a
# syscall per 16 KiB on multi-GB uploads.
SEND_BLOCK_BYTES = 1 * MIB


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


def _track(sock: socket.socket | None) -> None:
    registry: SocketRegistry | None = getattr(_thread_state, "registry", None)
    if registry is not None:
        registry.add(sock)


def track_response(response: requests.Response) -> None:
    """Also register the response's own socket (covers proxied connections)."""
    connection = getattr(response.raw, "connection", None)
    _track(getattr(connection, "sock", None))


class _TrackedHTTPConnection(HTTPConnection):
    # connect() covers a new connection, request() a reused one: from then on the
    # socket can be shut down, while the body is sent and while the headers are awaited.
    def connect(self) -> None:
        super().connect()
        _track(self.sock)

    def request(self, *args: Any, **kwargs: Any) -> None:
        _track(self.sock)
        super().request(*args, **kwargs)


class _TrackedHTTPSConnection(HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        _track(self.sock)

    def request(self, *args: Any, **kwargs: Any) -> None:
        _track(self.sock)
        super().request(*args, **kwargs)


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


class _AbortableAdapter(HTTPAdapter):
    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        pool_kwargs.setdefault("blocksize", SEND_BLOCK_BYTES)
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


def new_session() -> requests.Session:
    session = requests.Session()
    adapter = _AbortableAdapter()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def thread_session() -> requests.Session:
    """The calling thread's session: keep-alive connections survive across transfers."""
    session: requests.Session | None = getattr(_thread_state, "session", None)
    if session is None:
        session = new_session()
        _thread_state.session = session
    return session


class Cancel:
    """What ends a transfer early: the caller's abort event, or ``halt`` (a sibling failed).

    ``fire()`` sets ``halt`` and shuts down every registered socket; it runs from the
    StopSignal's callback, or from the ranged supervisor when it sees a plain Event set.
    """

    def __init__(self, abort: threading.Event | None, url: str) -> None:
        self.abort = abort
        self.url = url
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
            raise Stopped(f"transfer of {redact_url(self.url)} stopped", {"url": redact_url(self.url)})
        if self.halt.is_set():
            raise HaltedError()

    def sleep(self, seconds: float) -> None:
        self.check()
        if self.abort is not None and not self.watched:
            self.abort.wait(seconds)
        else:
            self.halt.wait(seconds)
        self.check()
