"""The one error tree of Roundhouse.

Every failure that can reach an orchestrator is a ``RoundhouseError`` with a
stable ``code`` (DESIGN §3). The tree::

    RoundhouseError                       internal_error
    ├── InvalidRequest                    invalid_request
    │   ├── ScriptRejected                invalid_request   (guard: size, syntax)
    │   ├── ShardIndexError               invalid_request   (also an IndexError, as in the seed)
    │   └── CacheTooSmall                 invalid_request   (limit cannot hold two shards)
    ├── DownloadFailed                    download_failed   (retries spent, HTTP 4xx/5xx)
    │   ├── UploadFailed                  download_failed   (PUT of a result delta)
    │   └── StorageFull                   download_failed   (no space to store a download or a delta)
    ├── BadArtifact                       bad_artifact      (model, bundle, shard or delta unreadable)
    ├── HashMismatch                      hash_mismatch
    ├── UserCodeError                     user_code_error
    ├── GpuOutOfMemory                    gpu_oom
    ├── SandboxRunnerError                sandbox_runner_error
    │   └── SandboxUnavailable            sandbox_runner_error  (nothing here can isolate tenant code)
    ├── SandboxProtocolError              sandbox_protocol_error
    ├── CleanupFailed                     internal_error    (reset cannot prove the round ended;
    │                                                        also a RuntimeError, as the seed raised)
    └── Stopped                           stopped           (an explicit stop; never retried)
        └── DownloadAborted               stopped           (the seed's name for a stopped transfer)

    StopExecution (BaseException)         raised inside user code on stop, so that a
                                          tenant's ``except Exception`` cannot swallow it

Every exception pickles with its message and details intact, because Celery
serialises exceptions between the prefork child and the MainProcess.

Lower layers (the OS, zstandard, zipfile, requests, torch) raise their own exceptions;
they enter the tree in one place, :func:`map_exceptions`, under one rule for chaining:
the translated error is raised ``from None`` and its message carries the cause, described
by :func:`describe` (type and text, query strings removed, bounded). The cause itself is
dropped because its text may hold what must never reach a log or a result (a presigned
URL's query string is a credential), and a Celery result carries only the message anyway.
A full disk is never an artifact's or a server's fault: inside ``map_exceptions(...,
where=...)`` it is :class:`StorageFull`, naming that place.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ErrorInfo:
    """The JSON shape of an error in a task result: ``{"code", "message", "details"?, "cause"?}``.

    ``cause`` (the underlying exception's text) stands at the top level where the seed put it:
    its out-of-memory error did, and a seed caller reads it there.
    """

    code: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    cause: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = dict(self.details)
        if self.cause is not None:
            out["cause"] = self.cause
        return out


class RoundhouseError(Exception):
    """Base of every Roundhouse failure; ``code`` is stable and machine-readable."""

    code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, details: Mapping[str, Any] | None = None, *, cause: str | None = None
    ) -> None:
        clean = {k: v for k, v in (details or {}).items() if k != "code"}
        # args carry the code too: Celery's JSON result of a failed task is the exception's
        # type name and args, and a client without this module must still read the code.
        super().__init__(message, {"code": self.code, **clean})
        self.message = message
        self.details: dict[str, Any] = clean
        self.cause = cause

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses keep the (message, details) constructor, so one rule pickles all.
        return (_rebuild, (type(self), self.message, self.details, self.cause))

    def info(self) -> ErrorInfo:
        return ErrorInfo(self.code, self.message, self.details, self.cause)

    def to_json(self) -> dict[str, Any]:
        return self.info().to_json()


def _rebuild(
    kind: type[RoundhouseError], message: str, details: Mapping[str, Any], cause: str | None
) -> RoundhouseError:
    return kind(message, details, cause=cause)


class InvalidRequest(RoundhouseError):
    code = "invalid_request"


class ScriptRejected(InvalidRequest):
    """The guard refused user code before it ran (size, encoding, syntax)."""


class ShardIndexError(InvalidRequest, IndexError):
    """A shard index outside ``range(num_shards)``."""


class CacheTooSmall(InvalidRequest):
    """The shard cache limit cannot hold the current and the next shard."""


class DownloadFailed(RoundhouseError):
    """A transfer failed for good; the message names the URL's host, never its query."""

    code = "download_failed"


class UploadFailed(DownloadFailed):
    pass


class StorageFull(DownloadFailed):
    """The disk holding a download (work dir, cache dir) or a delta is full."""


# A write that failed for want of room: the disk, the user's quota, the file size limit.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def storage_full(exc: OSError, where: str) -> StorageFull:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return StorageFull(
        f"{reason} while writing {where}",
        {"where": where, "errno": exc.errno, "errno_name": errno.errorcode.get(exc.errno or 0, "")},
    )


class BadArtifact(RoundhouseError):
    code = "bad_artifact"


class HashMismatch(RoundhouseError):
    code = "hash_mismatch"


class UserCodeError(RoundhouseError):
    code = "user_code_error"


class GpuOutOfMemory(RoundhouseError):
    code = "gpu_oom"


class SandboxRunnerError(RoundhouseError):
    code = "sandbox_runner_error"


class SandboxUnavailable(SandboxRunnerError):
    """No mechanism can isolate tenant code here, and the operator did not choose ``off``."""


class SandboxProtocolError(RoundhouseError):
    code = "sandbox_protocol_error"


class CleanupFailed(RoundhouseError, RuntimeError):
    """``reset``/``shutdown`` could not prove that the round's threads ended: restart the worker.

    Also a ``RuntimeError``: the seed raised one, and a seed caller's ``except`` still catches it.
    """


class Stopped(RoundhouseError):
    """An explicit stop: transfers abort instead of retrying or falling back."""

    code = "stopped"


class DownloadAborted(Stopped):
    """A transfer ended by a stop (the seed's name): what the transfer layer raises, so that
    both a seed caller's ``except DownloadAborted`` and ``except Stopped`` catch it."""


class StopExecution(BaseException):
    """Raised inside user code when the round is stopped.

    A BaseException so that user ``except Exception`` blocks do not swallow it.
    """


def stable_codes() -> frozenset[str]:
    """Every code of the tree (DESIGN §3), found by walking it."""
    codes, todo = set(), [RoundhouseError]
    while todo:
        cls = todo.pop()
        codes.add(cls.code)
        todo.extend(cls.__subclasses__())
    return frozenset(codes)


def error_info(exc: BaseException) -> ErrorInfo:
    """Map any exception to the error shape of a task result."""
    if isinstance(exc, RoundhouseError):
        return exc.info()
    if isinstance(exc, StopExecution):
        return ErrorInfo(Stopped.code, "stopped by request")
    return ErrorInfo(RoundhouseError.code, f"{type(exc).__name__}: {exc}")


_QUERY_IN_TEXT = re.compile(r"\?[^\s'\"<>()]*")
CAUSE_CHARS = 300


def scrub(text: str) -> str:
    """Remove query strings from a library's message (urllib3 puts whole request paths in them)."""
    return _QUERY_IN_TEXT.sub("?<redacted>", text)


def describe(exc: BaseException, limit: int = CAUSE_CHARS) -> str:
    """``exc`` as one bounded line for an error message: type, text, no query strings."""
    text = scrub(str(exc))
    if len(text) > limit:
        text = text[:limit] + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def into(
    kind: type[RoundhouseError], what: str, limit: int = CAUSE_CHARS
) -> Callable[[BaseException], RoundhouseError]:
    """A translation for :func:`map_exceptions`: ``kind("<what>: <the cause described>")``."""
    return lambda exc: kind(f"{what}: {describe(exc, limit)}")


# Keys: an exception type or a tuple of them (as ``except`` takes them). Typed Any because a
# Mapping's key type is invariant: {OSError: ...} would not be a Mapping[type[BaseException], ...].
Translations = Mapping[Any, Callable[[BaseException], RoundhouseError]]


@contextmanager
def map_exceptions(translations: Translations, *, where: str | None = None) -> Iterator[None]:
    """Raise what the block raises as a Roundhouse error (see the module docstring for the rule).

    ``translations`` maps lower-layer exception types, tried in order, to a factory of the
    error that replaces them (:func:`into` makes the common one). Roundhouse errors pass
    through untouched, and so does anything no entry names. With ``where``, a full disk
    becomes :class:`StorageFull` first, whatever the entries say.
    """
    try:
        yield
    except RoundhouseError:
        raise
    except Exception as exc:
        if where is not None and isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            raise storage_full(exc, where) from None
        for kinds, make in translations.items():
            if isinstance(exc, kinds):
                raise make(exc) from None
        raise
