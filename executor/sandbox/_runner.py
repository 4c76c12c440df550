"""The sandboxed runner: the child side of :mod:`executor.protocol`.

Started once per session inside the sandbox (``python -m executor.runner``), it imports
torch once and then runs each round's code in a fresh namespace — the same names, built by
the same :func:`executor.namespace.build_namespace`, as in-thread. The model is re-read
from ``/model`` every round, so a sync-delta apply between rounds needs no restart.

Tenant ``print`` goes to stderr (the worker drains it into log events); the protocol uses a
private copy of the original stdout. A control thread reads the worker's messages: a stop
sets the stop flag and interrupts tenant code, like in-thread. At the end of each round
every other process in the sandbox is killed, so nothing a round started outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
from typing import IO, Any

from executor.errors import InvalidRequest, RoundhouseError, StopExecution, Stopped
from executor.sandbox._protocol import encode, read_frame
from executor.stopping import UserCodeShield


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
        from executor.shards import load_shard_file

        if self._index == index:
            return self._data
        self._index, self._data = None, None
        data = load_shard_file(self.path(index))
        self._index, self._data = index, data
        return data


def _rebuild(error: dict[str, Any]) -> RoundhouseError:
    """The worker's error for a shard request, raised in tenant code with its code kept."""
    from executor import errors

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


def run_round(channel: Channel, init: dict[str, Any], spec: dict[str, Any], shards: ShardClient) -> None:
    """One round; always ends with a ``complete`` message."""
    from executor.rounds import (
        RoundOutputs,
        RoundSpec,
        SessionView,
        cpu_state,
        failure,
        session_namespace,
        validate_script,
    )
    from executor.tensorfile import write_state

    started = time.monotonic()
    outputs = RoundOutputs()
    stopped, error, result_name = False, None, None
    namespace: dict[str, Any] = {}
    try:
        with open(os.path.join(init["ro"], "code.py"), encoding="utf-8") as source:
            compiled = validate_script(source.read(), max_bytes=int(spec["max_script_bytes"]))
        params = dict(spec.get("params") or {})
        mode = str(spec["mode"])
        training = mode == "training"
        view = SessionView(
            model_path=init["model_path"],
            bundle_root=init.get("bundle_root"),
            preprocessor_config=spec.get("preprocessor_config") or {},
            params=params,
            batch_size=int(spec["batch_size"]),
            num_shards=int(spec["num_shards"]),
            host_id=str(init["host_id"]),
            offload_dir=os.path.join(init["task"], "offload"),
        )
        round_spec = RoundSpec(
            int(spec["steps"]),
            int(spec["round_num"]),
            int(spec["total_rounds"]),
            int(spec["step_offset"]),
            mode,
        )
        namespace = session_namespace(
            view,
            round_spec,
            get_shard=shards.get,
            emit_stats=lambda data: channel.send({"type": "stats", "data": data}),
            emit_log=lambda text: channel.send({"type": "log", "text": text}),
            stop_signal=channel.stop,
            outputs=outputs,
            shield=channel.shield.callback,
        )
        channel.shield.enter()
        try:
            from executor.rounds import execute_script

            execute_script(compiled, namespace)
        finally:
            channel.shield.leave()
        if training:
            state = outputs.saved_state
            if state is None and hasattr(namespace.get("model"), "state_dict"):
                state = cpu_state(namespace["model"])
            if state is not None:
                result_name = f"result-{spec['round_id']}.safetensors"
                with open(os.path.join(init["task"], "out", result_name), "wb") as out:
                    write_state(out, state)
    except (StopExecution, Stopped):
        stopped = True
    except BaseException as exc:
        error = failure(exc)
    finally:
        namespace.clear()
    _end_round(
        channel,
        _own_pid_namespace(init),
        stopped,
        error,
        outputs.report,
        time.monotonic() - started,
        result_name,
    )


def _own_pid_namespace(init: dict[str, Any]) -> bool:
    """kill(-1) is only safe as a small pid of a fresh pid namespace, as an unprivileged uid."""
    return bool(init.get("kill_strays")) and os.getpid() <= 2 and os.getuid() != 0


def _end_round(
    channel: Channel,
    kill_strays: bool,
    stopped: bool,
    error: dict[str, Any] | None,
    report: dict[str, Any] | None,
    seconds: float,
    result_name: str | None,
) -> None:
    import gc

    from executor import placement

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
        "stopped": stopped,
        "error": error,
        "report": report,
        "training_time": seconds,
        "result": None if (stopped or error) else result_name,
    }
    try:
        channel.send(message)
    except RoundhouseError:  # the report made the frame too large: send it without
        message["report"] = None
        message["error"] = {
            "code": "sandbox_protocol_error",
            "message": "round report exceeds the frame size",
        }
        channel.send(message)


def _reap_children(timeout_s: float = 5.0) -> None:
    """Collect our killed children, so no zombie outlives the round either."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
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
    import torch

    from executor import placement

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
            spec = json.load(file)
        run_round(channel, init, spec, shards)
