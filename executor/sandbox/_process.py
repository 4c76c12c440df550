"""The sandboxed runner's process, as the worker holds it: spawned, listened to for its whole life, killed.

Tenant code shares the runner's interpreter, so the runner is untrusted from its first
instruction to its death. One reader thread (the worker's, outside the sandbox) reads every
frame the runner sends for as long as it lives: a frame while a round is open goes to that
round's inbox; any frame while no round is open — a tenant that forged a ``complete`` and
kept talking, a daemon writing to a descriptor it kept — ends the runner, and so does a
malformed or oversized frame. The runner's stderr (tenant ``print``) is drained by another
thread into log events, within a budget per round.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

from executor.errors import SandboxProtocolError, SandboxRunnerError
from executor.sandbox._protocol import MAX_FRAME_BYTES, encode, parse_frame

logger = logging.getLogger(__name__)

STDERR_LINE_CHARS = 16 * 1024
STDERR_ROUND_BYTES = 1024 * 1024
READ_BYTES = 256 * 1024
SETTLE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Ended:
    """What the reader puts in the inbox when the runner's channel is over."""

    violation: SandboxProtocolError | None  # None: end of stream (the runner exited or was killed)


Inbound = dict[str, Any] | Ended

_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Popen from one long-lived thread: bwrap's --die-with-parent is PR_SET_PDEATHSIG, which
    fires when the *thread* that forked it ends — a round's thread would take the sandbox
    down with it at the end of that round."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, **kwargs)

    return _spawner.submit(popen).result()


def pipe_holding(data: bytes) -> int:
    """The read end of a pipe that already holds ``data`` (for fds bwrap reads at start)."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, data)
    os.close(write_fd)
    return read_fd


class RunnerProcess:
    """One runner process: its channel in, its frames out (through :attr:`inbox`), its stderr."""

    def __init__(
        self,
        argv: list[str],
        pass_fds: tuple[int, ...],
        *,
        emit_log: Callable[[str], None],
        on_violation: Callable[[str], None],
    ) -> None:
        self._emit_log = emit_log
        self._on_violation = on_violation
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self.killed_for: str | None = None
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._open = True  # the start ("ready") counts as open: the runner's first frame is expected
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._stderr_budget = STDERR_ROUND_BYTES
        self.process = spawn(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},  # nothing of the worker's environment, not even for bwrap itself
            close_fds=True,
            pass_fds=pass_fds,
            process_group=0,
        )
        self._idle = threading.Event()
        self._reader = threading.Thread(target=self._read_frames, name="runner-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=self._drain_stderr, name="runner-stderr", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    # ------------------------------------------------------------ rounds open and close

    def open_round(self) -> None:
        """From now on the runner may talk (until it sends ``complete``)."""
        with self._state_lock:
            self._open = True
        self._stderr_budget = STDERR_ROUND_BYTES

    def close_round(self) -> None:
        with self._state_lock:
            self._open = False

    def _read_frames(self) -> None:
        """Whole frames from the raw pipe, handed on one by one; ``idle`` is set only while
        blocked on the pipe with nothing unread, so :meth:`settle` can tell when all is read."""
        stdout = self.process.stdout
        assert stdout is not None
        fd, pending = stdout.fileno(), bytearray()
        while True:
            self._idle.set()
            try:
                chunk = os.read(fd, READ_BYTES)
            except OSError:
                chunk = b""
            self._idle.clear()
            if not chunk:
                self.inbox.put(
                    Ended(SandboxProtocolError("stream ended inside a frame") if pending else None)
                )
                return
            pending += chunk
            while (end := pending.find(b"\n")) >= 0:
                line, pending = bytes(pending[: end + 1]), pending[end + 1 :]
                if not self._route(line):
                    return
            if len(pending) > MAX_FRAME_BYTES:
                self._violated(SandboxProtocolError(f"frame exceeds {MAX_FRAME_BYTES} bytes"))
                return

    def _route(self, line: bytes) -> bool:
        """One frame to the inbox; False (and the runner killed) when it breaks the protocol."""
        try:
            if len(line) > MAX_FRAME_BYTES:
                raise SandboxProtocolError(f"frame exceeds {MAX_FRAME_BYTES} bytes")
            message = parse_frame(line)
        except SandboxProtocolError as exc:
            self._violated(exc)
            return False
        with self._state_lock:
            allowed = self._open
            if message.get("type") == "complete":
                self._open = False  # the round is over for the runner the moment it says so
        if not allowed:
            self._violated(SandboxProtocolError(f"runner sent {message.get('type')!r} outside a round"))
            return False
        self.inbox.put(message)
        return True

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Return once every byte the runner wrote so far has been read and routed (call it
        when the runner can no longer write: frozen, or dead)."""
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._reader.is_alive():
            unread = select.select([stdout.fileno()], [], [], 0)[0]
            if self._idle.is_set() and not unread:
                return
            time.sleep(0.001)

    def _violated(self, error: SandboxProtocolError) -> None:
        logger.warning("sandboxed runner killed: %s", error.message)
        self.killed_for = self.killed_for or "protocol violation: " + error.message
        self.inbox.put(Ended(error))
        # The owner kills: the sandbox may be frozen, and only its confinement can end it then.
        self._on_violation(self.killed_for)

    # ------------------------------------------------------------ I/O

    def send(self, message: dict[str, Any]) -> None:
        stdin = self.process.stdin
        if stdin is None or not self.alive:
            raise SandboxRunnerError("sandboxed runner is not running")
        data = encode(message)
        with self._write_lock:
            stdin.write(data)
            stdin.flush()

    def _drain_stderr(self) -> None:
        stream: IO[bytes] | None = self.process.stderr
        if stream is None:
            return
        while True:
            line = stream.readline(STDERR_LINE_CHARS)
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\n")
            self._stderr_tail.append(text)
            if self._stderr_budget > 0:
                self._stderr_budget -= len(line)
                self._emit_log(text if self._stderr_budget > 0 else "[runner output truncated]")

    def tail(self, lines: int = 5) -> str:
        return " | ".join(list(self._stderr_tail)[-lines:])

    # ------------------------------------------------------------ the end

    def kill(self, reason: str) -> None:
        """End the whole sandbox: SIGKILL to bwrap's process group takes its pid namespace down."""
        self.killed_for = self.killed_for or reason
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)

    def death(self) -> SandboxRunnerError:
        """Why the runner went away in the middle of a round."""
        code = self.process.poll()
        cause = self.killed_for  # set when we killed it: watchdog, protocol, stop
        self.kill("died")
        if cause is None:
            cause = (
                f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
            )
        tail = self.tail(3)
        return SandboxRunnerError(
            f"sandboxed runner failed: {cause}" + (f" ({tail})" if tail else ""), {"exit_status": str(code)}
        )
