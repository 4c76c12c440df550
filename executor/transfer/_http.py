"""HTTP plumbing shared by ``transfer``, ``stream`` and ``ranged``: URL redaction, sessions
whose sockets an abort can shut down, response parsing and the retry loop. Copying a body
into a file is :mod:`executor.body`; the partial file and its sidecar, :mod:`executor.partial`.

Nothing here is public API; callers use :mod:`executor.transfer`.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from executor.errors import NO_SPACE_ERRNOS, DownloadFailed, Stopped
from executor.fileio import MIB
from executor.stopping import StopSignal, on_stop

if TYPE_CHECKING:
    from executor.transfer._fetch import TransferConfig

logger = logging.getLogger("executor.transfer")

# http.client sends file bodies in blocks of this size; its 16 KiB default costs a
# syscall per 16 KiB on multi-GB uploads.
SEND_BLOCK_BYTES = 1 * MIB
SIDECAR_VERSION = 1

T = TypeVar("T")


# --------------------------------------------------------------------------- URLs


def redact_url(url: str) -> str:
    """``scheme://host[:port]/path``: never the query string, fragment or userinfo."""
    parts = urlsplit(url)
    if parts.netloc:
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        try:
            port = f":{parts.port}" if parts.port else ""
        except ValueError:
            port = ""
        return f"{parts.scheme}://{host}{port}{parts.path}"
    if parts.scheme == "file":
        return f"file://{parts.path}"
    # A plain filesystem path is not a URL: '?' is a legal file name character.
    return url


def url_host(url: str) -> str:
    return urlsplit(url).hostname or ""


_QUERY_IN_TEXT = re.compile(r"\?[^\s'\"<>()]*")


def scrub(text: str) -> str:
    """Remove query strings from library messages (urllib3 puts the full request path in them)."""
    return _QUERY_IN_TEXT.sub("?<redacted>", text)


class _RedactQueries(logging.Filter):
    """urllib3 logs request lines and redirects with their query strings at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "?" in message:
            record.msg, record.args = scrub(message), None
        return True


for _name in ("urllib3.connectionpool", "urllib3.poolmanager", "urllib3.util.retry"):
    logging.getLogger(_name).addFilter(_RedactQueries())


def describe(exc: BaseException) -> str:
    text = scrub(str(exc))
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ------------------------------------------------------------------ errors of one attempt


class TransientError(Exception):
    """One attempt failed in a way that a retry (with a Range resume) may fix."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.status = status


class FinalHTTPError(Exception):
    """The server said no for good (4xx other than 408/429): retrying cannot help."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.status = status


class SourceChangedError(Exception):
    """The resource on the server is not the one the partial file holds: start over."""


class HaltedError(Exception):
    """A sibling segment failed (or the supervisor stopped the download); end quietly."""


RETRYABLE: tuple[type[BaseException], ...] = (
    TransientError,
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
)


def check_status(response: requests.Response, *, body: bool = True) -> None:
    """Raise unless the status is 2xx; callers that send a Range look at a 416 first.

    ``body``: the body is data to keep, so a Content-Encoding the client did not ask
    for is an error (its bytes would not be the file's).
    """
    status = response.status_code
    if 200 <= status < 300:
        if not body:
            return
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise FinalHTTPError(f"server applied Content-Encoding {encoding!r} despite identity", status)
        return
    if status in (408, 429) or status >= 500:
        raise TransientError(f"HTTP {status}", status)
    raise FinalHTTPError(f"HTTP {status}", status)


def run_attempts(
    operation: Callable[[int], T],
    *,
    url: str,
    config: TransferConfig,
    cancel: Cancel,
    verb: str = "download",
    failure: type[DownloadFailed] = DownloadFailed,
) -> T:
    """Run ``operation(attempt)`` up to ``config.retries`` times with linear backoff."""
    reason, status = "no attempt made", None
    for attempt in range(1, config.retries + 1):
        cancel.check()
        try:
            return operation(attempt)
        except FinalHTTPError as exc:
            cancel.check()
            raise _failed(failure, verb, url, str(exc), exc.status, attempt) from None
        except RETRYABLE as exc:
            if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
                raise  # a full disk is not a network hiccup: the caller reports it at once
            # An abort shuts sockets down, so the read error is only its echo.
            cancel.check()
            reason = str(exc) if isinstance(exc, TransientError) else describe(exc)
            status = exc.status if isinstance(exc, TransientError) else None
            if attempt < config.retries:
                logger.warning(
                    "%s of %s failed (attempt %d/%d): %s; retrying",
                    verb,
                    redact_url(url),
                    attempt,
                    config.retries,
                    reason,
                )
                cancel.sleep(config.backoff_s * attempt)
    raise _failed(failure, verb, url, reason, status, config.retries)


def _failed(
    failure: type[DownloadFailed], verb: str, url: str, reason: str, status: int | None, attempts: int
) -> DownloadFailed:
    safe_url = redact_url(url)
    message = f"{verb} of {safe_url} failed after {attempts} attempt(s): {reason}"
    details = {
        "url": safe_url,
        "host": url_host(url),
        "status": status,
        "attempts": attempts,
        "reason": reason,
    }
    return failure(message, details)


# ------------------------------------------------------------------------- abort


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


_local = threading.local()


@contextlib.contextmanager
def tracking(registry: SocketRegistry) -> Iterator[None]:
    """Register the socket of every request this thread makes inside the block."""
    previous = getattr(_local, "registry", None)
    _local.registry = registry
    try:
        yield
    finally:
        _local.registry = previous


def _track(sock: socket.socket | None) -> None:
    registry: SocketRegistry | None = getattr(_local, "registry", None)
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
    session: requests.Session | None = getattr(_local, "session", None)
    if session is None:
        session = new_session()
        _local.session = session
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


# --------------------------------------------------------------------- responses


def content_range(response: requests.Response) -> tuple[int, int | None] | None:
    """``(first byte, total or None)`` of a ``Content-Range: bytes a-b/total`` header."""
    value = response.headers.get("Content-Range", "")
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value)
    if not match:
        return None
    total = None if match.group(3) == "*" else int(match.group(3))
    return int(match.group(1)), total


def unsatisfied_total(response: requests.Response) -> int | None:
    """The total of a 416's ``Content-Range: bytes */total``."""
    match = re.fullmatch(r"\s*bytes\s+\*/(\d+)\s*", response.headers.get("Content-Range", ""))
    return int(match.group(1)) if match else None


def announced_total(response: requests.Response) -> int | None:
    """The size of the whole resource as the response announces it."""
    if response.status_code == 206:
        parsed = content_range(response)
        return parsed[1] if parsed else None
    length = response.headers.get("Content-Length")
    return int(length) if length and length.strip().isdigit() else None


def if_range(etag: str | None, last_modified: str | None) -> str | None:
    # If-Range needs a strong validator; a weak ETag would make the server send 200.
    if etag and not etag.startswith("W/"):
        return etag
    return last_modified


def request_headers(
    first_byte: int = 0, last_byte: int | None = None, validator: str | None = None
) -> dict[str, str]:
    # identity: a compressed body would make byte offsets and sizes meaningless.
    headers = {"Accept-Encoding": "identity"}
    if first_byte or last_byte is not None:
        headers["Range"] = f"bytes={first_byte}-{'' if last_byte is None else last_byte}"
        if validator:
            headers["If-Range"] = validator
    return headers
