"""The worker's side of the sandboxed runner: start it, drive rounds, serve shards, read results.

One :class:`Runner` per session, kept warm across rounds (a fresh interpreter pays seconds
for ``import torch`` and CUDA). Everything that comes back is checked: frames by size and
shape (:mod:`executor.protocol`), the trained state by descriptor — opened without following
links, a regular file with one link, within a size derived from the model, read only
through that descriptor — so a tenant can spoil only its own result.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch

from executor.errors import (
    RoundhouseError,
    SandboxProtocolError,
    SandboxRunnerError,
    error_info,
    map_exceptions,
)
from executor.fileio import atomic_write_json
from executor.rounds import RoundOutcome
from executor.sandbox import _seccomp as seccomp
from executor.sandbox._launch import Paths, SandboxConfig, command, prepare_dirs
from executor.sandbox._protocol import RoundRequest, checked_error, encode, read_frame
from executor.tensorfile import read_header, read_tensor

logger = logging.getLogger(__name__)

RESULT_NAME = re.compile(r"^result-[A-Za-z0-9-]{1,64}\.safetensors$")
STDERR_LINE_CHARS = 16 * 1024
STDERR_ROUND_BYTES = 1024 * 1024
MIN_RESULT_BYTES = 1024 * 1024 * 1024
RESULT_OVERHEAD_BYTES = 256 * 1024 * 1024
MAX_RESULT_BYTES = 64 * 1024 * 1024 * 1024
QUOTA_POLL_S = 0.5
QUOTA_MAX_ENTRIES = 100_000


def result_limit(model_bytes: int) -> int:
    """A trained state may be fp32 of a bf16 model: twice the model, plus headroom."""
    return min(MAX_RESULT_BYTES, max(MIN_RESULT_BYTES, model_bytes * 2 + RESULT_OVERHEAD_BYTES))


def read_result(task_dir: str, name: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """The runner's trained state, read through one descriptor that cannot be redirected."""
    if not RESULT_NAME.match(name):
        raise SandboxProtocolError("runner named an invalid result file")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    dir_fd = out_fd = -1
    unsafe = {
        OSError: lambda exc: SandboxProtocolError(f"result file cannot be opened safely: {exc.strerror}")
    }
    try:
        with map_exceptions(unsafe):
            dir_fd = os.open(task_dir, flags | os.O_DIRECTORY)
            out_fd = os.open("out", flags | os.O_DIRECTORY, dir_fd=dir_fd)
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=out_fd)
    finally:
        for opened in (dir_fd,):
            if opened >= 0:
                os.close(opened)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SandboxProtocolError("result is not a regular file")
        if st.st_nlink != 1:
            raise SandboxProtocolError("result file has other links")
        if st.st_size > max_bytes:
            raise SandboxProtocolError(f"result is {st.st_size} bytes, over its limit of {max_bytes}")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as file:
            try:
                header = read_header(file)
                return {name: read_tensor(file, header, spec) for name, spec in header.specs.items()}
            except RoundhouseError as exc:
                raise SandboxProtocolError(f"result file is not a valid state: {exc.message}") from None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=out_fd)
        os.close(out_fd)


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
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


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe that already holds ``data`` (for fds bwrap reads at start)."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, data)
    os.close(write_fd)
    return read_fd


def tree_size(path: str, limit_entries: int = QUOTA_MAX_ENTRIES) -> int:
    """Bytes under ``path`` (links not followed); absurd entry counts count as over quota."""
    total, entries = 0, 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            entries += 1
            if entries > limit_entries:
                return 1 << 62
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


class Supervisor:
    def __init__(
        self,
        mode: str,
        config: SandboxConfig,
        paths: Paths,
        *,
        host_id: str,
        cuda_visible: str | None,
        emit_log: Callable[[str], None],
        emit_stats: Callable[[dict[str, Any]], None],
        serve_shard: Callable[[int], str],
    ) -> None:
        self.mode = mode
        self.config = config
        self.paths = paths
        self._host_id = host_id
        self._cuda_visible = cuda_visible
        self._emit_log = emit_log
        self._emit_stats = emit_stats
        self._serve_shard = serve_shard
        self._process: subprocess.Popen[bytes] | None = None
        self._write_lock = threading.Lock()
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._stderr_budget = STDERR_ROUND_BYTES
        self._killed_for: str | None = None
        self._round_over = True
        self.quota_bytes = config.disk_bytes or MIN_RESULT_BYTES

    # ------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, model_path: str, bundle_root: str | None, code: str, file_bytes: int) -> None:
        prepare_dirs(self.paths, self.config)
        with open(os.path.join(self.paths.ro, "code.py"), "w", encoding="utf-8") as file:
            file.write(code)
        os.chmod(os.path.join(self.paths.ro, "code.py"), 0o644)
        self.quota_bytes = self.config.disk_bytes or file_bytes + RESULT_OVERHEAD_BYTES
        self._launch(file_bytes)
        self._send(
            {
                "op": "init",
                "ro": self.paths.inside_ro,
                "task": self.paths.inside_task,
                "model_path": self.paths.inside(model_path),
                "bundle_root": self.paths.inside(bundle_root) if bundle_root else None,
                "host_id": self._host_id,
                "kill_strays": True,
            }
        )
        started = time.monotonic()
        timer = threading.Timer(self.config.start_timeout_s, self.kill, args=("start timeout",))
        timer.start()
        try:
            message = self._read()
        finally:
            timer.cancel()
        if message is None or message.get("type") != "ready":
            self.kill("did not start")
            raise SandboxRunnerError(f"sandboxed runner did not start: {self._tail()}")
        logger.info("sandboxed runner ready (%s) in %.1fs", self.mode, time.monotonic() - started)

    def _launch(self, file_bytes: int) -> None:
        inherited: list[int] = []
        try:
            seccomp_fd = args_fd = args_write = None
            if self.mode == "bwrap":
                program = seccomp.host_filter()
                if program is not None:
                    seccomp_fd = _pipe_holding(program)
                    inherited.append(seccomp_fd)
                args_fd, args_write = os.pipe()
                inherited.append(args_fd)
            launch = command(
                self.mode, self.config, self.paths, self._cuda_visible,
                seccomp_fd=seccomp_fd, args_fd=args_fd, file_bytes=file_bytes,
            )  # fmt: skip
            if args_write is not None:
                # A few KiB: the pipe holds them until bwrap reads.
                os.write(args_write, launch.args_blob or b"")
                os.close(args_write)
            self._process = _spawn(
                launch.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},  # nothing of the worker's environment, not even for bwrap itself
                close_fds=True,
                pass_fds=tuple(inherited),
                process_group=0,
            )
        finally:
            for fd in inherited:
                os.close(fd)
        threading.Thread(target=self._drain_stderr, name="runner-stderr", daemon=True).start()

    def kill(self, reason: str = "killed") -> None:
        """End the whole sandbox: SIGKILL to bwrap takes its pid namespace down with it."""
        process = self._process
        if process is None:
            return
        self._killed_for = self._killed_for or reason
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)

    def close(self) -> None:
        self.kill("closed")
        self._process = None

    def request_stop(self) -> None:
        with contextlib.suppress(OSError, ValueError, SandboxProtocolError):
            self._send({"op": "stop"})

    # ------------------------------------------------------------ I/O

    def _send(self, message: dict[str, Any]) -> None:
        process = self._process
        if process is None or process.stdin is None:
            raise SandboxRunnerError("sandboxed runner is not running")
        data = encode(message)
        with self._write_lock:
            process.stdin.write(data)
            process.stdin.flush()

    def _read(self) -> dict[str, Any] | None:
        process = self._process
        assert process is not None and process.stdout is not None
        return read_frame(process.stdout)

    def _drain_stderr(self) -> None:
        process = self._process
        if process is None or process.stderr is None:
            return
        stream: IO[bytes] = process.stderr
        while True:
            line = stream.readline(STDERR_LINE_CHARS)
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\n")
            self._stderr_tail.append(text)
            if self._stderr_budget > 0:
                self._stderr_budget -= len(line)
                self._emit_log(text if self._stderr_budget > 0 else "[runner output truncated]")

    def _tail(self) -> str:
        return " | ".join(list(self._stderr_tail)[-5:]) or f"runner {self._killed_for or 'exited'}"

    # ------------------------------------------------------------ rounds

    def run_round(self, request: RoundRequest, stop: threading.Event, result_max_bytes: int) -> RoundOutcome:
        started = time.monotonic()
        spec_path = os.path.join(self.paths.ro, "rounds", f"{request.round_id}.json")
        atomic_write_json(spec_path, request.to_json())
        os.chmod(spec_path, 0o644)
        self._stderr_budget = STDERR_ROUND_BYTES
        self._killed_for = None
        watchdog = threading.Thread(target=self._watch, args=(stop,), name="runner-watchdog", daemon=True)
        self._round_over = False
        try:
            self._send({"op": "round", "spec": self.paths.inside(spec_path)})
            watchdog.start()
            done = self._serve_until_complete()
        except SandboxProtocolError as exc:
            self.kill("protocol error")
            return RoundOutcome.failed(exc.info(), time.monotonic() - started)
        except (OSError, ValueError):
            done = None
        finally:
            self._round_over = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec_path)
        return self._outcome(done, stop, started, result_max_bytes)

    def _serve_until_complete(self) -> dict[str, Any] | None:
        while True:
            message = self._read()
            if message is None:
                return None
            kind = message.get("type")
            if kind == "complete":
                return message
            if kind == "log":
                self._emit_log(str(message.get("text", ""))[:STDERR_LINE_CHARS])
            elif kind == "stats":
                if not isinstance(message.get("data"), dict):
                    raise SandboxProtocolError("stats must be an object")
                self._emit_stats(message["data"])
            elif kind == "shard":
                self._answer_shard(message.get("index"))
            else:
                raise SandboxProtocolError(f"unknown message type {kind!r}")

    def _answer_shard(self, index: Any) -> None:
        if not isinstance(index, int) or isinstance(index, bool):
            raise SandboxProtocolError("shard request without an integer index")
        try:
            reply: dict[str, Any] = {
                "op": "shard",
                "index": index,
                "ok": True,
                "path": self._serve_shard(index),
            }
        except RoundhouseError as exc:
            reply = {"op": "shard", "index": index, "ok": False, "error": error_info(exc).to_json()}
        self._send(reply)

    def _outcome(
        self, done: dict[str, Any] | None, stop: threading.Event, started: float, result_max_bytes: int
    ) -> RoundOutcome:
        elapsed = time.monotonic() - started
        if done is None:
            if stop.is_set():
                self.kill("stopped")
                return RoundOutcome(True, None, None, None, elapsed)
            return RoundOutcome.failed(self._death().info(), elapsed)
        try:
            error = checked_error(done.get("error"))
            report = done.get("report")
            if report is not None and not isinstance(report, dict):
                raise SandboxProtocolError("report must be an object")
            trained = None
            result = done.get("result")
            if result is not None and error is None:
                if not isinstance(result, str):
                    raise SandboxProtocolError("result must be a file name")
                trained = read_result(self.paths.task, result, result_max_bytes)
        except SandboxProtocolError as exc:
            return RoundOutcome.failed(exc.info(), elapsed)
        training_time = done.get("training_time")
        seconds = float(training_time) if isinstance(training_time, (int, float)) else elapsed
        return RoundOutcome(bool(done.get("stopped")), error, trained, report, seconds)

    def _death(self) -> SandboxRunnerError:
        """Why the runner went away in the middle of a round."""
        code = self._process.poll() if self._process is not None else None
        cause = self._killed_for  # set when we killed it: watchdog, protocol, stop
        self.kill("died")
        if cause is None:
            cause = (
                f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
            )
        tail = " | ".join(list(self._stderr_tail)[-3:])
        return SandboxRunnerError(
            f"sandboxed runner failed: {cause}" + (f" ({tail})" if tail else ""), {"exit_status": str(code)}
        )

    def _watch(self, stop: threading.Event) -> None:
        """Wall time, disk quota and the stop grace period, while a round runs."""
        started = time.monotonic()
        stop_seen: float | None = None
        while not getattr(self, "_round_over", True) and self.alive:
            time.sleep(QUOTA_POLL_S)
            now = time.monotonic()
            if stop.is_set():
                stop_seen = stop_seen or now
                if now - stop_seen > self.config.stop_grace_s:
                    self.kill("did not stop within the grace period")
                    return
            if self.config.wall_time_s is not None and now - started > self.config.wall_time_s:
                self.kill(f"wall time of {self.config.wall_time_s:.0f}s exceeded")
                return
            if tree_size(self.paths.task) > self.quota_bytes:
                self.kill(f"task directory over its quota of {self.quota_bytes} bytes")
                return
