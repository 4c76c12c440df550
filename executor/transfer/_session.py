"""The HTTP sessions of this package, and the connections under them that the URL policy
checks and an abort can shut down.

Every new connection resolves its host once, has each address checked by the policy in
force (:meth:`UrlPolicy.addresses`) and connects only to one of those addresses, so what was
checked is what is connected to. TLS is unchanged above that socket: certificates are
verified and SNI names the URL's host. A kept-alive connection is checked again before each
request it carries, since the policy in force may have changed since it was opened.

The policy in force is the one :func:`policy_in_force` set for the calling thread
(:func:`._http.send` does, around each request); a connection opened outside of it is
refused. Sessions ignore the environment (``trust_env = False``): no proxy variables, no
``.netrc``, no CA bundle from there; a proxy comes from the policy with each request.

urllib3 logs request lines and redirects, query strings and all, at DEBUG: a log filter
installed on import scrubs them (:func:`~executor.errors.scrub`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from socket import timeout as SocketTimeout  # noqa: N812 - urllib3's own name for it
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import (
    ConnectTimeoutError,
    LocationParseError,
    NameResolutionError,
    NewConnectionError,
)
from urllib3.util import connection as urllib3_connection

from executor.errors import scrub
from executor.fileio import MIB
from executor.transfer._cancel import track
from executor.transfer._policy import AddressDenied, UrlPolicy

# http.client sends file bodies in blocks of this size; its 16 KiB default costs a
# syscall per 16 KiB on multi-GB uploads.
SEND_BLOCK_BYTES = 1 * MIB

_thread_state = threading.local()


class _RedactQueries(logging.Filter):
    """urllib3 logs request lines and redirects with their query strings at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "?" in message:
            record.msg, record.args = scrub(message), None
        return True


for _name in ("urllib3.connectionpool", "urllib3.poolmanager", "urllib3.util.retry"):
    logging.getLogger(_name).addFilter(_RedactQueries())


@contextlib.contextmanager
def policy_in_force(policy: UrlPolicy) -> Iterator[None]:
    """Check every connection this thread opens or reuses inside the block against ``policy``."""
    previous = getattr(_thread_state, "policy", None)
    _thread_state.policy = policy
    try:
        yield
    finally:
        _thread_state.policy = previous


def _policy(host: str) -> UrlPolicy:
    policy: UrlPolicy | None = getattr(_thread_state, "policy", None)
    if policy is None:
        raise AddressDenied(host, host, "no_policy", "no URL policy in force")
    return policy


class _Guarded(HTTPConnection):
    """Connects only to addresses the policy allows; registers its socket for an abort."""

    def _new_conn(self) -> Any:
        # urllib3's own _new_conn, but resolving here: create_connection is then given
        # one checked address at a time, which it connects to without another lookup.
        policy = _policy(self.host)
        try:
            addresses = policy.addresses(self._dns_host, self.port)
        except UnicodeError:  # as urllib3 reports a name IDNA cannot encode
            raise LocationParseError(f"'{self._dns_host}', label empty or too long") from None
        except OSError as exc:  # socket.gaierror, as urllib3 reports it
            raise NameResolutionError(self.host, self, exc) from exc  # type: ignore[arg-type]
        error: OSError | None = None
        for address in addresses:
            try:
                sock = urllib3_connection.create_connection(
                    (address, self.port),
                    self.timeout,
                    source_address=self.source_address,
                    socket_options=self.socket_options,
                )
            except OSError as exc:
                error = exc
                continue
            sys.audit("http.client.connect", self, self.host, self.port)
            return sock
        if isinstance(error, SocketTimeout):
            raise ConnectTimeoutError(
                self, f"Connection to {self.host} timed out. (connect timeout={self.timeout})"
            ) from error
        raise NewConnectionError(self, f"Failed to establish a new connection: {error}") from error

    # connect() covers a new connection, request() a reused one: from then on the
    # socket can be shut down, while the body is sent and while the headers are awaited.
    def connect(self) -> None:
        super().connect()
        track(self.sock)

    def request(self, *args: Any, **kwargs: Any) -> None:
        if self.sock is not None:
            _policy(self.host).check(self.host, str(self.sock.getpeername()[0]))
        track(self.sock)
        super().request(*args, **kwargs)


class _GuardedHTTPConnection(_Guarded):
    pass


class _GuardedHTTPSConnection(_Guarded, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _GuardedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _GuardedHTTPSConnection


class _AbortableAdapter(HTTPAdapter):
    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any
    ) -> None:
        pool_kwargs.setdefault("blocksize", SEND_BLOCK_BYTES)
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


def new_session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # no proxy variables, no .netrc: only what the policy says
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
