"""The sandboxed runner: the child side of the protocol (:mod:`executor.sandbox._protocol`).

Started once per session inside the sandbox (``python -m executor.sandbox``), it imports
torch once and then runs each round's code in a fresh namespace — the same names, built by
the same :func:`executor.rounds.session_namespace` and run by the same
:func:`executor.rounds.play`, as in-thread. The model is re-read
from ``/model`` every round, so a sync-delta apply between rounds needs no restart.

Tenant ``print`` goes to stderr (the worker drains it into log events); the protocol uses a
private copy of the original stdout. A control thread reads the worker's messages: a stop
sets the stop flag and interrupts tenant code, like in-thread. At the end of each round
every other process in the sandbox is killed, so nothing a round started outlives it.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import queue
import resource
import signal
import sys
import threading
import time
from typing import IO, Any

import torch

from executor import errors, placement
from executor.errors import (
    ErrorInfo,
    InvalidRequest,
    RoundhouseError,
    SandboxProtocolError,
    Stopped,
    UserCodeError,
)
from executor.rounds import (
    Played,
    RoundOutputs,
    SessionView,
    failure,
    play,
    session_namespace,
    validate_script,
)
from executor.sandbox._protocol import RoundRequest, encode, read_frame
from executor.shards import load_shard_file
from executor.stopping import UserCodeShield
from executor.tensorfile import write_state

REAP_S = 60.0  # killed strays leaving at round end (a tenant's fork bomb under memory pressure)


class Channel:
    """The runner's end of the protocol: one writer lock, one reader thread."""

    def __init__(self, incoming: IO[bytes], outgoing: IO[bytes]) -> None:
        self._out = outgoing
        self._lock = threading.Lock()
        self.rounds: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.shards: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stop = threading.Event()
        self.shield = UserCodeShield(self.stop)
        self._in = incoming

    def send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._lock:
            self._out.write(data)
            self._out.flush()

    def read_init(self) -> dict[str, Any]:
        message = read_frame(self._in)
        if message is None or message.get("op") != "init":
            raise SystemExit("runner: expected an init message")
        return message

    def listen(self) -> None:
        """Control thread: route the worker's messages; end the runner when the worker goes."""
        while True:
            message = read_frame(self._in)
            if message is None:
                os._exit(0)  # the worker closed the channel: nothing left to do
            op = message.get("op")
            if op == "round":
                self.stop.clear()
                self.rounds.put(message)
            elif op == "shard":
                self.shards.put(message)
            elif op == "stop":
                self.stop.set()
                self.shield.interrupt()


class ShardClient:
    """``get_shard`` inside the sandbox: ask the worker for a path, hold one decoded shard."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._index: int | None = None
        self._data: Any = None

    def path(self, index: int) -> str:
        if not isinstance(index, int) or isinstance(index, bool):
            raise InvalidRequest(f"shard index must be an integer, got {type(index).__name__}")
        self._channel.send({"type": "shard", "index": index})
        while True:
            try:
                reply = self._channel.shards.get(timeout=0.2)
            except queue.Empty:
                if self._channel.stop.is_set():
                    raise Stopped("stopped while waiting for a shard") from None
                continue
            if reply.get("index") != index:
                continue
            if not reply.get("ok"):
                error = reply.get("error") or {}
                raise _rebuild(error)
            return str(reply["path"])

    def get(self, index: int) -> Any:
        if self._index == index:
            return self._data
        self._index, self._data = None, None
        data = load_shard_file(self.path(index))
        self._index, self._data = index, data
        return data


def _rebuild(error: dict[str, Any]) -> RoundhouseError:
    """The worker's error for a shard request, raised in tenant code with its code kept."""
    classes = (
        errors.Stopped,
        errors.ShardIndexError,
        errors.DownloadFailed,
        errors.BadArtifact,
        errors.InvalidRequest,
    )
    for cls in classes:
        if cls.code == error.get("code"):
            return cls(str(error.get("message", "")))
    exc = RoundhouseError(str(error.get("message", "shard unavailable")))
    return exc


def run_round(channel: Channel, init: dict[str, Any], request: RoundRequest, shards: ShardClient) -> None:
    """One round; always ends with a ``complete`` message."""
    started = time.monotonic()
    outputs = RoundOutputs()
    result_name = None
    try:
        _limit_file_size(request.max_file_bytes)
        with open(os.path.join(init["ro"], "code.py"), encoding="utf-8") as source:
            compiled = validate_script(source.read(), max_bytes=request.max_script_bytes)
    except BaseException as exc:
        end = Played(False, failure(exc), None, time.monotonic() - started)
    else:
        end = play(
            compiled,
            lambda: _namespace(channel, init, request, shards, outputs),
            outputs,
            channel.shield,
            training=request.spec.training,
        )
    error = end.error
    if end.trained is not None:
        result_name = f"result-{request.round_id}.safetensors"
        try:
            with open(os.path.join(init["task"], "out", result_name), "wb") as out:
                write_state(out, end.trained)
        except BaseException as exc:
            error, result_name = failure(result_too_large(exc, request.max_file_bytes)), None
    _end_round(
        channel,
        _own_pid_namespace(init),
        request.round_id,
        end.stopped,
        error,
        outputs.report,
        end.seconds,
        result_name,
    )


def result_too_large(exc: BaseException, max_bytes: int) -> BaseException:
    """A trained state over the round's file bound, said as such: a bare ``File too large``
    named neither the bound nor its source (the GPU check's probe round left a 1.6 GB
    module of its own in ``model`` beside a tiny loaded one)."""
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return UserCodeError(
            f"the trained state is larger than this round's bound for one file, {max_bytes} bytes "
            "(twice the loaded model plus headroom, at most the task dir's quota): the round's "
            "result is what save_model got, else the module left in `model`; that must be the "
            "loaded model, trained",
            {"max_file_bytes": max_bytes},
        )
    return exc


def _limit_file_size(max_bytes: int) -> None:
    """Lower RLIMIT_FSIZE, soft and hard, to the round's bound before its tenant code runs:
    a spare runner started without the model's size; once lowered, tenant code (no
    CAP_SYS_RESOURCE) cannot raise it again, and what it forks inherits it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard == resource.RLIM_INFINITY or hard > max_bytes:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))


def _namespace(
    channel: Channel, init: dict[str, Any], request: RoundRequest, shards: ShardClient, outputs: RoundOutputs
) -> dict[str, Any]:
    view = SessionView(
        model_path=request.model_path,
        bundle_root=request.bundle_root,
        preprocessor_config=request.preprocessor_config,
        params=request.params,
        batch_size=request.batch_size,
        num_shards=request.num_shards,
        host_id=str(init["host_id"]),
        offload_dir=os.path.join(init["task"], "offload"),
    )
    return session_namespace(
        view,
        request.spec,
        get_shard=shards.get,
        emit_stats=lambda data: channel.send({"type": "stats", "data": data}),
        emit_log=lambda text: channel.send({"type": "log", "text": text}),
        stop_signal=channel.stop,
        outputs=outputs,
        shield=channel.shield.callback,
    )


def _own_pid_namespace(init: dict[str, Any]) -> bool:
    """kill(-1) is only safe as a small pid of a fresh pid namespace, as an unprivileged uid."""
    return bool(init.get("kill_strays")) and os.getpid() <= 2 and os.getuid() != 0


def _end_round(
    channel: Channel,
    kill_strays: bool,
    round_id: str,
    stopped: bool,
    error: ErrorInfo | None,
    report: dict[str, Any] | None,
    seconds: float,
    result_name: str | None,
) -> None:
    if kill_strays:
        # Nothing a round started may outlive it: kill every other process of this pid
        # namespace that we may signal (not init, not ourselves).
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        _reap_children()
    gc.collect()
    placement.empty_device_cache()
    message = {
        "type": "complete",
        "round": round_id,
        "stopped": stopped,
        "error": error.to_json() if error else None,
        "report": report,
        "training_time": seconds,
        "result": None if (stopped or error) else result_name,
    }
    try:
        channel.send(message)
    except RoundhouseError:  # the report made the frame too large: send it without
        message["report"] = None
        message["error"] = SandboxProtocolError("round report exceeds the frame size").to_json()
        channel.send(message)


def _reap_children(timeout_s: float = REAP_S) -> None:
    """Wait until every other process of the namespace is gone, reaping our own killed children,
    so no zombie outlives the round either: the host freezes the sandbox once the round is
    reported, and a zombie whose parent is frozen stays (it holds a pid of the sandbox's limit).
    200 killed forks of a process with torch loaded take about a second to exit on an idle
    2-core host, many more under memory pressure, hence the generous bound. Where /proc is not
    this namespace's (the unshare launch keeps the host's), only our own children are awaited."""
    me = os.getpid()
    try:
        own_proc = os.readlink("/proc/self") == str(me)
    except OSError:
        own_proc = False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:  # no child left
            if not own_proc:
                return
        if own_proc and not [e for e in os.listdir("/proc") if e.isdigit() and int(e) not in (1, me)]:
            return
        time.sleep(0.01)


def main() -> None:
    protocol_out = os.fdopen(os.dup(1), "wb")
    protocol_in = os.fdopen(os.dup(0), "rb")
    os.dup2(2, 1)  # tenant print() goes to stderr, never into the protocol
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    channel = Channel(protocol_in, protocol_out)
    init = channel.read_init()
    os.chdir(str(init["task"]))
    threading.Thread(target=channel.listen, name="runner-control", daemon=True).start()
    channel.send(
        {"type": "ready", "torch": torch.__version__, "device": placement.local_device(), "pid": os.getpid()}
    )
    shards = ShardClient(channel)
    while True:
        message = channel.rounds.get()
        if message is None:
            return
        with open(str(message["spec"]), encoding="utf-8") as file:
            request = RoundRequest.from_json(json.load(file))
        run_round(channel, init, request, shards)
