"""One HTTP request and the loop around it: :func:`send` (one request, its redirects
followed by hand, each hop checked), the errors an attempt ends with, the status check,
the retry loop (:func:`run_attempts`), and the headers a transfer sends and reads.

An attempt raises :class:`TransientError` (or a network error) when a retry with a
``Range`` resume may fix it, :class:`FinalHTTPError` when the server said no for good,
:class:`SourceChangedError` when the file on the server is not the one being resumed.
:func:`run_attempts` turns the last of them into the caller's ``DownloadFailed``; an
address the policy refuses (``AddressDenied``) becomes one at once, and :class:`Refused`
(a byte cap, a failed head check) passes through for the caller to clean up.
"""

from __future__ import annotations

import http.client
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urljoin

import requests
import urllib3

from executor.errors import NO_SPACE_ERRNOS, DownloadFailed, InvalidRequest, RoundhouseError, describe
from executor.transfer._cancel import Cancel
from executor.transfer._config import TransferConfig
from executor.transfer._policy import AddressDenied, UrlPolicy
from executor.transfer._session import policy_in_force
from executor.urls import Url

logger = logging.getLogger("executor.transfer")

T = TypeVar("T")


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


class Refused(Exception):
    """The download is refused for good (over a byte cap, a failed head check): never
    retried; ``fetch`` removes what was written and raises ``error``."""

    def __init__(self, error: RoundhouseError) -> None:
        super().__init__(error)
        self.error = error


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
    url: Url,
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
        except AddressDenied as exc:
            raise _failed(failure, verb, url, str(exc), None, attempt, rule=exc.rule) from None
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
                    url,
                    attempt,
                    config.retries,
                    reason,
                )
                cancel.sleep(config.backoff_s * attempt)
    raise _failed(failure, verb, url, reason, status, config.retries)


def _failed(
    failure: type[DownloadFailed],
    verb: str,
    url: Url,
    reason: str,
    status: int | None,
    attempts: int,
    rule: str | None = None,
) -> DownloadFailed:
    message = f"{verb} of {url} failed after {attempts} attempt(s): {reason}"
    details: dict[str, Any] = {
        "url": str(url),
        "host": url.host,
        "status": status,
        "attempts": attempts,
        "reason": reason,
    }
    if rule is not None:
        details["rule"] = rule
    return failure(message, details)


# -------------------------------------------------------------------- requests

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
# Only these keep the method and the body by definition; a PUT answered with another is an error.
_BODY_REDIRECTS = (307, 308)


def send(
    session: requests.Session,
    method: str,
    url: Url,
    *,
    policy: UrlPolicy,
    timeout: tuple[float, float],
    headers: Mapping[str, str],
    body: Callable[[], Any] | None = None,
) -> requests.Response:
    """One request (streamed), redirects followed by hand: at most :data:`MAX_REDIRECTS`, each
    hop an http(s) URL and its connection checked by ``policy``, a loop refused.

    ``body`` makes the request body afresh for each hop. Raises :class:`FinalHTTPError` for a
    refused redirect, ``AddressDenied`` for a refused address.
    """
    seen = {url}
    for hop in range(MAX_REDIRECTS + 1):
        if policy.proxy:
            policy.check_proxied(url)
        try:
            with policy_in_force(policy):
                response = session.request(
                    method,
                    url.reveal(),
                    headers=dict(headers),
                    data=body() if body is not None else None,
                    stream=True,
                    timeout=timeout,
                    allow_redirects=False,
                    proxies=policy.proxies,
                )
        except AddressDenied as exc:
            if hop:
                exc.url = str(url)
            raise
        status, location = response.status_code, response.headers.get("Location")
        if status not in _REDIRECTS or not location or (method != "GET" and status not in _BODY_REDIRECTS):
            return response
        response.close()
        following = Url(urljoin(url.reveal(), location))
        if following in seen:
            raise FinalHTTPError(f"redirect loop: {url} redirects to {following}")
        if hop == MAX_REDIRECTS:
            raise FinalHTTPError(f"more than {MAX_REDIRECTS} redirects (the last to {following})")
        try:
            policy.target(following)
        except InvalidRequest as exc:
            raise FinalHTTPError(f"redirect refused: {exc}", status) from None
        if following.scheme not in ("http", "https"):
            raise FinalHTTPError(f"redirect to {following} refused: not http(s)", status)
        seen.add(following)
        url = following
    raise AssertionError("unreachable")


# --------------------------------------------------------------------- headers


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
