"""The runner protocol: JSON lines of at most 1 MiB between the worker and the sandboxed runner.

Worker → runner (runner's stdin)::

    {"op": "init", "ro": "/ro", "task": "/task", "host_id": ...}   nothing of a session: a spare
                                                       runner is started before its session is known
    {"op": "round", "spec": "<ro>/rounds/<id>.json"}   a RoundRequest, in a file the runner cannot write
                                                       (the session's code is <ro>/code.py, read per round)
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, Any

from executor.errors import (
    ErrorInfo,
    InvalidRequest,
    SandboxProtocolError,
    into,
    map_exceptions,
    stable_codes,
)
from executor.rounds import RoundSpec

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
    return parse_frame(line)


def parse_frame(line: bytes) -> dict[str, Any]:
    """One complete frame (its newline included) as a message; malformed ones raise."""
    with map_exceptions({(ValueError, RecursionError): into(SandboxProtocolError, "frame is not JSON")}):
        message = json.loads(line)
    if not isinstance(message, dict):
        raise SandboxProtocolError("frame is not a JSON object")
    return message


def checked_error(value: Any) -> ErrorInfo | None:
    """An error object from the runner, reduced to known codes and bounded strings."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("code") not in ERROR_CODES:
        raise SandboxProtocolError("runner reported a malformed error")
    details = value.get("details")
    # JSON scalars keep their type (a seed caller reads ``allocated_mb`` as a number); anything
    # else becomes a bounded string.
    bounded = (
        {str(k)[:128]: _scalar(v) for k, v in list(details.items())[:32]} if isinstance(details, dict) else {}
    )
    cause = value.get("cause")
    return ErrorInfo(
        str(value["code"]),
        str(value.get("message", ""))[:4096],
        bounded,
        str(cause)[:8192] if cause is not None else None,
    )


def _scalar(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)[:8192]


@dataclass(frozen=True)
class RoundRequest:
    """One round as the worker hands it to the runner: the spec, and the session's values
    that may change between rounds (``apply_delta`` can replace params and shards)."""

    round_id: str
    spec: RoundSpec
    params: dict[str, Any]
    batch_size: int
    num_shards: int
    preprocessor_config: dict[str, Any]
    max_script_bytes: int
    # The largest file the round may write (RLIMIT_FSIZE): the runner lowers its own limit to
    # this before any of the round's tenant code runs (a spare was started without the
    # model's size; lowering needs no privilege, and a tenant can never raise it again).
    max_file_bytes: int
    model_path: str  # the session's model and bundle, as the runner sees them
    bundle_root: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "round_id": self.round_id,
            "spec": self.spec.to_json(),
            "params": self.params,
            "batch_size": self.batch_size,
            "num_shards": self.num_shards,
            "preprocessor_config": self.preprocessor_config,
            "max_script_bytes": self.max_script_bytes,
            "max_file_bytes": self.max_file_bytes,
            "model_path": self.model_path,
            "bundle_root": self.bundle_root,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundRequest:
        """The request ``to_json`` wrote (the worker's own file: checked for shape, not trust)."""
        with map_exceptions({(KeyError, TypeError, ValueError): into(InvalidRequest, "round request")}):
            return cls(
                round_id=str(data["round_id"]),
                spec=RoundSpec.from_json(data["spec"]),
                params=dict(data.get("params") or {}),
                batch_size=int(data["batch_size"]),
                num_shards=int(data["num_shards"]),
                preprocessor_config=dict(data.get("preprocessor_config") or {}),
                max_script_bytes=int(data["max_script_bytes"]),
                max_file_bytes=int(data["max_file_bytes"]),
                model_path=str(data["model_path"]),
                bundle_root=None if data.get("bundle_root") is None else str(data["bundle_root"]),
            )
