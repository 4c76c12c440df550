"""URLs as the transfer layer shows them.

Presigned query strings are credentials, so a URL reaches messages and logs only through
:func:`redact_url`, library messages only through :func:`scrub` (also applied, by a log
filter installed on import, to urllib3's DEBUG lines). What a URL may name is the
policy's business (:mod:`._policy`).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

# Library messages are scrubbed by the error tree's one scrub (errors.py).
from executor.errors import scrub


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


class _RedactQueries(logging.Filter):
    """urllib3 logs request lines and redirects with their query strings at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "?" in message:
            record.msg, record.args = scrub(message), None
        return True


for _name in ("urllib3.connectionpool", "urllib3.poolmanager", "urllib3.util.retry"):
    logging.getLogger(_name).addFilter(_RedactQueries())
