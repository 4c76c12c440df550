"""The runner protocol: JSON lines of at most 1 MiB between the worker and the sandboxed runner.

Worker → runner (runner's stdin)::

    {"op": "init", "ro": "/ro", "task": "/task", "model_path": ..., "bundle_root": ..., "host_id": ...}
    {"op": "round", "spec": "<ro>/rounds/<id>.json"}   the round's values, in a file the runner cannot write
    {"op": "shard", "index": i, "ok": true, "path": ...}   the answer to a shard request
    {"op": "shard", "index": i, "ok": false, "error": {"code", "message"}}
    {"op": "stop"}

Runner → worker (the runner's protocol fd, a copy of its original stdout)::

    {"type": "ready", "torch": "2.x", "device": "cuda"}
    {"type": "log", "text": ...}      {"type": "stats", "data": {...}}
    {"type": "shard", "index": i}     ask for a shard's path
    {"type": "complete", "stopped": bool, "training_time": s, "report": {...}|null,
     "error": {"code", "message", "details"?}|null, "result": "<file name in task/out>"|null}

Everything the runner sends is untrusted: frames are size-checked before parsing and
every field is type-checked before use.
"""

from __future__ import annotations

import json
from typing import IO, Any

from executor.errors import SandboxProtocolError, stable_codes

MAX_FRAME_BYTES = 1024 * 1024
# What a runner may report: the contract's codes (internal_error is the worker's own).
ERROR_CODES = stable_codes() - {"internal_error"}


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":"), default=str).encode() + b"\n"
    if len(data) > MAX_FRAME_BYTES:
        raise SandboxProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return data


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """One message, or None at end of stream; oversized or malformed frames raise."""
    line = stream.readline(MAX_FRAME_BYTES + 1)
    if not line:
        return None
    if len(line) > MAX_FRAME_BYTES or not line.endswith(b"\n"):
        if len(line) > MAX_FRAME_BYTES:
            raise SandboxProtocolError(f"frame exceeds {MAX_FRAME_BYTES} bytes")
        raise SandboxProtocolError("stream ended inside a frame")
    try:
        message = json.loads(line)
    except ValueError:
        raise SandboxProtocolError("frame is not JSON") from None
    if not isinstance(message, dict):
        raise SandboxProtocolError("frame is not a JSON object")
    return message


def checked_error(value: Any) -> dict[str, Any] | None:
    """An error object from the runner, reduced to known codes and bounded strings."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("code") not in ERROR_CODES:
        raise SandboxProtocolError("runner reported a malformed error")
    out: dict[str, Any] = {"code": value["code"], "message": str(value.get("message", ""))[:4096]}
    details = value.get("details")
    if isinstance(details, dict):
        out["details"] = {str(k)[:128]: str(v)[:8192] for k, v in list(details.items())[:32]}
    return out
