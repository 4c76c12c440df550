"""The worker's side of the sandboxed runner: start it, drive rounds, serve shards, read results.

One :class:`Supervisor` per session, kept warm across rounds (a fresh interpreter pays seconds
for ``import torch`` and CUDA). The runner is untrusted for its whole life, because tenant
code shares its interpreter, so everything is enforced from outside the sandbox:

- every frame is checked (:mod:`executor.sandbox._protocol`), and one that comes while no
  round is open ends the runner (:mod:`executor.sandbox._process`);
- the sandbox lives in a confinement of its own (:mod:`executor.sandbox._cgroup`: a cgroup
  with memory — shared memory and tmpfs included — and process limits, or its pid
  namespace): between rounds it is frozen, and at the end of each round every process but
  the ones that were there when the runner said "ready" is killed from outside;
- a watchdog enforces the wall time, the disk quota and the stop grace while a round runs;
- the trained state is read by descriptor (:mod:`executor.sandbox._result`).

A tenant can therefore spoil only its own round, never outlive it, outgrow its limits or make
the worker read or write anything else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from executor.errors import (
    RoundhouseError,
    SandboxProtocolError,
    SandboxRunnerError,
    SandboxUnavailable,
    error_info,
)
from executor.fileio import TREE_MAX_DEPTH, atomic_write_json
from executor.rounds import RoundOutcome
from executor.sandbox import _seccomp as seccomp
from executor.sandbox._cgroup import Confinement, confine
from executor.sandbox._launch import (
    RUNNER_PROGRAM,
    Paths,
    SandboxConfig,
    command,
    prepare_dirs,
    probe_program,
)
from executor.sandbox._process import Ended, RunnerProcess, pipe_holding, spawn
from executor.sandbox._protocol import RoundRequest, checked_error
from executor.sandbox._result import (
    MIN_RESULT_BYTES,
    OVER_QUOTA,
    QUOTA_MAX_ENTRIES,
    RESULT_OVERHEAD_BYTES,
    read_result,
    tree_size,
)
from executor.tensorfile import MAX_HEADER_BYTES

logger = logging.getLogger(__name__)

LOG_LINE_CHARS = 16 * 1024
WATCH_POLL_S = 0.1
INBOX_POLL_S = 0.5
PROBE_TIMEOUT_S = 60.0
QUIESCE_PASSES = 4


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
        self._process: RunnerProcess | None = None
        self._confinement: Confinement | None = None
        self._keep: set[int] = set()  # the sandbox's processes at "ready": bwrap, its init, the runner
        self._round_open = False
        self._closed = False  # close() came, maybe from another thread while start() ran
        # kill() and close() from several threads (the watchdog, a stop, a reset, a spare's
        # discard while its start fails) run one at a time: a close between another's look at
        # the confinement and its use of it would leave that one acting on nothing.
        self._ending = threading.RLock()
        self.quota_bytes = config.disk_bytes or MIN_RESULT_BYTES

    # ------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.alive

    @property
    def confinement(self) -> str:
        return self._confinement.kind if self._confinement is not None else "none"

    def start(self, code: str, file_bytes: int) -> None:
        self.launch(file_bytes)
        self.assign(code, file_bytes)

    def assign(self, code: str, file_bytes: int) -> None:
        """Give the started runner its session: the code every round reads (``/ro/code.py``:
        the worker's file, never writable inside) and the task dir's quota. Each round's
        request carries the file size limit the runner sets before the round's tenant code."""
        path = os.path.join(self.paths.ro, "code.py")
        with open(path, "w", encoding="utf-8") as file:
            file.write(code)
        os.chmod(path, 0o644)
        self.quota_bytes = self.config.disk_bytes or file_bytes + RESULT_OVERHEAD_BYTES

    def launch(self, file_bytes: int | None, *, spare: bool = False) -> None:
        """Start the runner and wait for its "ready", then freeze it. ``file_bytes`` None (a
        spare's): no file size limit until its first round sets the session's."""
        prepare_dirs(self.paths, self.config)
        confinement = self._confinement = self._confine("spare" if spare else "runner")
        process = self._process = self._launch(confinement, file_bytes)
        if self._closed:  # closed while it launched: close() may not have seen this process
            confinement.kill(keep=set())
            confinement.thaw()
            process.kill("closed")
            confinement.close()
            raise SandboxRunnerError("sandboxed runner was closed while it started")
        confinement.started(process.pid)
        process.send(
            {
                "op": "init",
                "ro": self.paths.inside_ro,
                "task": self.paths.inside_task,
                "host_id": self._host_id,
                "kill_strays": True,
            }
        )
        started = time.monotonic()
        message = self._next(process, deadline=started + self.config.start_timeout_s)
        if not isinstance(message, dict) or message.get("type") != "ready":
            self.kill("did not start")
            raise SandboxRunnerError(
                f"sandboxed runner did not start: {process.tail() or process.killed_for}"
            )
        process.close_round()
        # Before any tenant code ran: what is here now is the sandbox itself; all else is a stray.
        self._keep = confinement.pids()
        confinement.freeze()
        seconds = time.monotonic() - started
        what = "spare sandboxed runner" if spare else "sandboxed runner"
        logger.info("%s ready (%s, %s) in %.1fs", what, self.mode, confinement.kind, seconds)

    def _launch(self, confinement: Confinement, file_bytes: int | None) -> RunnerProcess:
        with self._argv(confinement, file_bytes, RUNNER_PROGRAM) as (argv, fds):
            return RunnerProcess(argv, fds, emit_log=self._emit_log, on_violation=self.kill)

    @contextlib.contextmanager
    def _argv(
        self, confinement: Confinement, file_bytes: int | None, program: tuple[str, ...]
    ) -> Iterator[tuple[list[str], tuple[int, ...]]]:
        """The launch command and the descriptors it inherits (closed here once it has started)."""
        inherited: list[int] = []
        try:
            seccomp_fd = args_fd = args_write = None
            if self.mode == "bwrap":
                filter_program = seccomp.host_filter()
                if filter_program is not None:
                    seccomp_fd = pipe_holding(filter_program)
                    inherited.append(seccomp_fd)
                args_fd, args_write = os.pipe()
                inherited.append(args_fd)
            launch = command(
                self.mode, self.config, self.paths, self._cuda_visible,
                seccomp_fd=seccomp_fd, args_fd=args_fd, file_bytes=file_bytes, program=program,
            )  # fmt: skip
            if args_write is not None:
                # A few KiB: the pipe holds them until bwrap reads.
                os.write(args_write, launch.args_blob or b"")
                os.close(args_write)
            yield [*confinement.launch_prefix(), *launch.argv], tuple(inherited)
        finally:
            for fd in inherited:
                os.close(fd)

    def probe(self) -> None:
        """Run exactly the launch a runner gets, with a probe for a program: a mechanism that
        cannot start here is refused now (``SandboxUnavailable``), not at every round."""
        prepare_dirs(self.paths, self.config)
        confinement = self._confine("probe")
        program = probe_program(self.paths.inside_task)
        try:
            with self._argv(confinement, MIN_RESULT_BYTES, program) as (argv, fds):
                process = spawn(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env={}, close_fds=True, pass_fds=fds, process_group=0,
                )  # fmt: skip
            confinement.started(process.pid)
            try:
                _out, err = process.communicate(timeout=PROBE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                _out, err = process.communicate()
        finally:
            confinement.close()
        if process.returncode != 0:
            reason = err.decode("utf-8", "replace").strip()[-1000:] or f"exit status {process.returncode}"
            raise SandboxUnavailable(
                f"sandbox {self.mode!r} cannot start tenant code here ({confinement.kind}, uid "
                f"{self.config.uid}): {reason}",
                {"mode": self.mode, "confinement": confinement.kind, "uid": self.config.uid},
            )

    def _confine(self, role: str) -> Confinement:
        # Unique per sandbox: two sandboxes of one worker process (a probe and a runner, two
        # Executors of one library caller) never share a group. The group's name also says
        # whose it is (the host id, this process): what a dead worker left is found by it.
        return confine(
            f"{self._host_id}-{role}-{uuid.uuid4().hex[:8]}",
            memory_bytes=self.config.data_limit,
            max_procs=self.config.max_procs,
            prefer=self.config.confinement,
            host_id=self._host_id,
        )

    def kill(self, reason: str = "killed") -> None:
        """End the whole sandbox, whatever state it is in (frozen included). Idempotent."""
        with self._ending:
            process, confinement = self._process, self._confinement
            if process is not None:
                process.killed_for = process.killed_for or reason
            if confinement is not None:
                confinement.kill(keep=set())  # nothing of the sandbox runs another instruction
                confinement.thaw()  # so that the killed processes can exit
            if process is not None:
                process.kill(reason)

    def close(self) -> None:
        """End the sandbox and remove its confinement. Idempotent, and safe from any thread."""
        self._closed = True  # before the lock: a launch in progress checks it without waiting
        with self._ending:
            self.kill("closed")
            if self._confinement is not None:
                self._confinement.close()
            self._process = self._confinement = None

    def request_stop(self) -> None:
        process = self._process
        if process is not None:
            with contextlib.suppress(OSError, ValueError, RoundhouseError):
                process.send({"op": "stop"})

    # ------------------------------------------------------------ rounds

    def run_round(
        self,
        request: RoundRequest,
        stop: threading.Event,
        result_max_bytes: int,
        result_max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> RoundOutcome:
        process, confinement = self._process, self._confinement
        if process is None or confinement is None or not process.alive:
            raise SandboxRunnerError("sandboxed runner is not running")
        started = time.monotonic()
        spec_path = os.path.join(self.paths.ro, "rounds", f"{request.round_id}.json")
        atomic_write_json(spec_path, request.to_json())
        os.chmod(spec_path, 0o644)
        process.killed_for = None
        process.open_round()
        self._round_open = True
        confinement.thaw()
        watchdog = threading.Thread(target=self._watch, args=(stop,), name="runner-watchdog", daemon=True)
        try:
            process.send({"op": "round", "spec": self.paths.inside(spec_path)})
            watchdog.start()
            done = self._serve_until_complete(process, request.round_id)
        except SandboxProtocolError as exc:
            self.kill("protocol error")
            return RoundOutcome.failed(exc.info(), time.monotonic() - started)
        except (OSError, ValueError):
            done = None
        finally:
            self._round_open = False
            process.close_round()
            self._quiesce()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec_path)
        violation = self._violation(process)
        if violation is not None:  # it kept talking after it said "complete": nothing it said counts
            return RoundOutcome.failed(violation.info(), time.monotonic() - started)
        return self._outcome(process, done, stop, started, (result_max_bytes, result_max_header_bytes))

    @staticmethod
    def _violation(process: RunnerProcess) -> SandboxProtocolError | None:
        """A protocol violation the reader saw once the round was closed (the runner is dead then)."""
        while True:
            try:
                item = process.inbox.get_nowait()
            except queue.Empty:
                return None
            if isinstance(item, Ended) and item.violation is not None:
                return item.violation

    def _quiesce(self) -> None:
        """Between rounds nothing of the sandbox runs: freeze it, and kill whatever the round started."""
        confinement, process = self._confinement, self._process
        if confinement is None or process is None or not process.alive:
            return
        try:
            confinement.freeze()
            process.settle()  # what it wrote before the freeze is read: a late frame is seen now
            # Nothing of the sandbox runs during a kill (under the v1 freezer the runner is held
            # by SIGSTOP while the killed die): a second pass finds none, unless it cannot be held.
            for _ in range(QUIESCE_PASSES):
                strays = confinement.kill(keep=self._keep)
                if not strays:
                    return
                logger.info("killed %d process(es) the round left behind", strays)
        except SandboxRunnerError as exc:
            logger.warning("sandbox cannot be quiesced: %s", exc.message)
        self.kill("it kept starting processes after its round")  # the next round gets a fresh one

    def _next(self, process: RunnerProcess, deadline: float | None = None) -> dict[str, Any] | Ended:
        """The runner's next frame (or the end of its channel), waiting at most until ``deadline``."""
        while True:
            try:
                return process.inbox.get(timeout=INBOX_POLL_S)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    process.kill("start timeout")
                    return Ended(None)

    def _serve_until_complete(self, process: RunnerProcess, round_id: str) -> dict[str, Any] | None:
        while True:
            message = self._next(process)
            if isinstance(message, Ended):
                if message.violation is not None:
                    raise message.violation
                return None
            kind = message.get("type")
            if kind == "complete":
                if message.get("round") != round_id:
                    raise SandboxProtocolError("runner completed a round that is not the current one")
                return message
            if kind == "log":
                self._emit_log(str(message.get("text", ""))[:LOG_LINE_CHARS])
            elif kind == "stats":
                if not isinstance(message.get("data"), dict):
                    raise SandboxProtocolError("stats must be an object")
                self._emit_stats(message["data"])
            elif kind == "shard":
                self._answer_shard(process, message.get("index"))
            else:
                raise SandboxProtocolError(f"unknown message type {kind!r}")

    def _answer_shard(self, process: RunnerProcess, index: Any) -> None:
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
        process.send(reply)

    def _outcome(
        self,
        process: RunnerProcess,
        done: dict[str, Any] | None,
        stop: threading.Event,
        started: float,
        result_bounds: tuple[int, int],  # the result file's bytes, its header's bytes
    ) -> RoundOutcome:
        elapsed = time.monotonic() - started
        if done is None:
            if stop.is_set():
                self.kill("stopped")
                return RoundOutcome(True, None, None, None, elapsed)
            death = process.death()
            self.kill("died")
            return RoundOutcome.failed(death.info(), elapsed)
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
                trained = read_result(self.paths.task, result, *result_bounds)
        except SandboxProtocolError as exc:
            return RoundOutcome.failed(exc.info(), elapsed)
        training_time = done.get("training_time")
        seconds = float(training_time) if isinstance(training_time, (int, float)) else elapsed
        return RoundOutcome(bool(done.get("stopped")), error, trained, report, seconds)

    def _watch(self, stop: threading.Event) -> None:
        """Wall time, disk quota and the stop grace period, while a round runs (between rounds
        the sandbox is frozen: nothing in it can spend time or write). Fails closed: a watchdog
        that cannot watch any more (any exception in it) ends the sandbox, so the round fails."""
        try:
            self._watch_round(stop)
        except BaseException as exc:  # whatever it was, nothing watches the round any more
            reason = f"its watchdog failed: {type(exc).__name__}: {exc}"[:500]
            logger.error("sandbox watchdog failed, ending the sandbox: %s", reason, exc_info=True)
            try:
                self.kill(reason)
            finally:
                process = self._process
                if process is not None:  # even where the confinement's kill raised
                    process.kill(reason)

    def _watch_round(self, stop: threading.Event) -> None:
        started = time.monotonic()
        stop_seen: float | None = None
        while self._round_open and self.alive:
            time.sleep(WATCH_POLL_S)
            now = time.monotonic()
            if stop.is_set():
                stop_seen = stop_seen or now
                if now - stop_seen > self.config.stop_grace_s:
                    self.kill("did not stop within the grace period")
                    return
            if self.config.wall_time_s is not None and now - started > self.config.wall_time_s:
                self.kill(f"wall time of {self.config.wall_time_s:.0f}s exceeded")
                return
            size = tree_size(self.paths.task)
            if size >= OVER_QUOTA:
                self.kill(
                    f"task directory over its quota of {self.quota_bytes} bytes (unmeasurable: more "
                    f"than {QUOTA_MAX_ENTRIES} entries, nested deeper than {TREE_MAX_DEPTH} levels, "
                    "or unreadable)"
                )
                return
            if size > self.quota_bytes:
                self.kill(f"task directory over its quota of {self.quota_bytes} bytes")
                return
