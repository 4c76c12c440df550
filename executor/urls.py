"""A URL that redacts itself (DESIGN §10, httpx's ``URL.__repr__``).

A presigned URL's query string is a credential, and so is a URL's userinfo. A :class:`Url`
shows itself, however it is shown (``str``, ``repr``, an f-string, ``%s``, a log line,
``json.dumps(default=str)``), only as ``scheme://host[:port]/path``; the raw form comes out
only through :meth:`Url.reveal`, which is called where bytes go on the wire (a request, the
URL policy's host and path checks). A message, a log line or an error's details built from
the value is redacted without anyone remembering to redact it.

It is deliberately not a ``str``: a ``Url`` handed to ``requests``, ``urllib3`` or ``open``
without ``reveal()`` is a type error (mypy), not a silent leak. It pickles with its raw
form (a value that lost its query would not work at the other end), so what an error
carries is ``str(url)``, never the value itself.

:func:`redact_url` is the same redaction for a plain ``str``.
"""

from __future__ import annotations

from typing import Any, NoReturn, final
from urllib.parse import urlsplit


def redact_url(url: str | Url) -> str:
    """``scheme://host[:port]/path``: never the query string, fragment or userinfo."""
    if isinstance(url, Url):
        return str(url)
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
    if parts.scheme and "://" in url:  # a host left out (http:///x?sig=...): still a URL
        return f"{parts.scheme}://{parts.path}"
    # A plain filesystem path is not a URL: '?' is a legal file name character.
    return url


@final
class Url:
    """An immutable URL whose every rendering is redacted; :meth:`reveal` gives the raw form.

    Equal (and hashed) by the raw form: two presigned URLs of one object are two values.
    """

    __slots__ = ("_raw", "_shown")
    _raw: str
    _shown: str

    def __init__(self, raw: str) -> None:
        if not isinstance(raw, str):
            raise TypeError(f"Url takes a str, not {type(raw).__name__} (Url.of passes a Url through)")
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_shown", redact_url(raw))

    @classmethod
    def of(cls, value: str | Url) -> Url:
        """``value`` itself when it is a Url, else a Url of the string."""
        return value if isinstance(value, Url) else cls(value)

    def reveal(self) -> str:
        """The raw URL, credentials included: for the wire and the policy's checks only."""
        return self._raw

    # ------------------------------------------------------------ what it shows

    def __str__(self) -> str:
        return self._shown

    def __repr__(self) -> str:
        return f"Url({self._shown!r})"

    def __format__(self, spec: str) -> str:
        return format(self._shown, spec)

    # ------------------------------------------------------ parts that are no secret

    @property
    def scheme(self) -> str:
        return urlsplit(self._raw).scheme.lower()

    @property
    def host(self) -> str:
        """The host name, lower case, without brackets or userinfo; "" when there is none."""
        return urlsplit(self._raw).hostname or ""

    @property
    def port(self) -> int | None:
        """The explicit port, None when there is none (or it is not a valid one)."""
        try:
            return urlsplit(self._raw).port
        except ValueError:
            return None

    # ------------------------------------------------------------------ a value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Url):
            return NotImplemented
        return self._raw == other._raw

    def __hash__(self) -> int:
        return hash((Url, self._raw))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Url, (self._raw,))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"Url is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"Url is immutable: cannot delete {name!r}")
