"""The script guard: early, clear errors for tenant code, and how that code is run.

:func:`play` is the one way a round's code runs, in-thread and in the sandboxed runner
alike: under the stop shield, its end classified (completed, stopped, failed with a stable
code) and, for a training round, its trained state resolved.

This is NOT a security boundary. ``validate_script`` rejects code that cannot
run (too large, not text, a syntax error) at ``load_model`` time, so that the
tenant hears about it before any download or GPU time is spent. Isolation from
the host is the sandbox's job (``executor.sandbox``, DESIGN §8); in-thread
execution (sandbox ``off``) trusts the code with everything the worker has.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

from executor.errors import (
    ErrorInfo,
    ScriptRejected,
    StopExecution,
    Stopped,
    Translations,
    UserCodeError,
    into,
    map_exceptions,
)
from executor.rounds._namespace import RoundOutputs, trained_state
from executor.rounds._outcome import failure
from executor.stopping import UserCodeShield

SCRIPT_FILENAME = "<round-script>"


def validate_script(code: object, *, max_bytes: int = 1024 * 1024) -> CodeType:
    """Check user code and compile it; raises ``ScriptRejected`` (code ``invalid_request``)."""
    if not isinstance(code, str):
        raise ScriptRejected(f"code must be a string, got {type(code).__name__}")
    size = len(code.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise ScriptRejected(f"code is {size} bytes, the limit is {max_bytes}", {"bytes": size})
    if "\x00" in code:
        raise ScriptRejected("code contains a NUL character")
    if not code.strip():
        raise ScriptRejected("code is empty")
    rejected: Translations = {
        SyntaxError: _syntax_error,
        (ValueError, RecursionError, MemoryError): into(ScriptRejected, "code cannot be compiled"),
    }
    with map_exceptions(rejected):
        tree = ast.parse(code, filename=SCRIPT_FILENAME, mode="exec")
        return compile(tree, SCRIPT_FILENAME, "exec", dont_inherit=True)


def _syntax_error(exc: BaseException) -> ScriptRejected:
    assert isinstance(exc, SyntaxError)
    line = (exc.text or "").rstrip("\n")
    return ScriptRejected(
        f"syntax error in code at line {exc.lineno}: {exc.msg}",
        {"line": exc.lineno, "offset": exc.offset, "text": line[:200]},
    )


def execute_script(code: str | CodeType, namespace: dict[str, Any]) -> None:
    """Run user code in ``namespace`` (its globals). ``SystemExit(0)`` is a normal end.

    Exceptions propagate unchanged (the caller maps them to error codes);
    a non-zero ``sys.exit`` becomes ``UserCodeError``.
    """
    compiled = validate_script(code) if isinstance(code, str) else code
    namespace.setdefault("__name__", "__roundhouse__")
    namespace.setdefault("__builtins__", __builtins__)
    try:
        exec(compiled, namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise UserCodeError(f"code called sys.exit({exc.code!r})", {"exit_code": str(exc.code)}) from None


# What an error raised inside tenant code (its own, or a helper's it called) is reported as.
# The seed reported everything but a CUDA OOM as user_code_error; a helper's own code is kept
# where it tells the orchestrator something the tenant's code did not cause — memory, the
# transfer, the data, a stop — and otherwise the error is the tenant code's, with the helper's
# code in ``details["helper_code"]`` (docs/ARCHITECTURE.md, "Differences from the seed").
KEPT_INSIDE_TENANT_CODE = frozenset(
    {"gpu_oom", "download_failed", "bad_artifact", "stopped", "user_code_error"}
)


def tenant_failure(exc: BaseException) -> ErrorInfo:
    """The error of a round whose tenant code raised ``exc``."""
    info = failure(exc)
    if info.code in KEPT_INSIDE_TENANT_CODE:
        return info
    return ErrorInfo(UserCodeError.code, info.message, {**info.details, "helper_code": info.code}, info.cause)


@dataclass(frozen=True)
class Played:
    """How tenant code ended: stopped, failed (``error``), or completed (``trained`` maybe)."""

    stopped: bool
    error: ErrorInfo | None
    trained: dict[str, torch.Tensor] | None
    seconds: float  # tenant code only, without building the namespace's state after it


def play(
    compiled: CodeType,
    build: Callable[[], dict[str, Any]],
    outputs: RoundOutputs,
    shield: UserCodeShield,
    *,
    training: bool,
) -> Played:
    """Build the namespace, run the code in it under ``shield``, classify the end. Never raises
    for anything tenant code does; the namespace is cleared before returning."""
    started = time.monotonic()
    namespace: dict[str, Any] = {}
    stopped, error, trained = False, None, None
    try:
        namespace = build()
    except BaseException as exc:  # the worker's part failed: its own code stands
        return Played(False, failure(exc), None, time.monotonic() - started)
    try:
        shield.enter()
        try:
            execute_script(compiled, namespace)
        finally:
            shield.leave()
    except (StopExecution, Stopped):
        stopped = True
    except BaseException as exc:
        error = tenant_failure(exc)
    seconds = time.monotonic() - started
    try:
        if training and not stopped and error is None:
            trained = trained_state(outputs, namespace)
    except StopExecution:  # a stop that raced the end of tenant code
        stopped, trained = True, None
    except BaseException as exc:  # what the code left in ``model`` is not a state
        error = failure(exc)
    finally:
        namespace.clear()
    return Played(stopped, error, trained, seconds)
