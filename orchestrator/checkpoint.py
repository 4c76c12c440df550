"""The orchestrator's state directory: what a restarted orchestrator resumes from.

After every round (once its outer step is taken and before any worker is told to sync),
the state directory gets, atomically:

- ``model-<round>.safetensors``: the global model (the exact state every worker is to hold),
- ``outer-<round>.safetensors``: the outer optimiser's momentum,
- ``residual-<round>.safetensors`` (quantised sync deltas only): the error feedback that the
  next sync delta adds before it is quantised (``SyncFeedback.residual``),
- ``state.json``: the round number, the model's hash, the outer optimiser's settings, the
  session's settings (code, shards by name, params, deadlines), the membership and the
  history of rounds. It names the files above and is written last, with ``os.replace``:
  it is the commit point, so a crash at any moment leaves the previous round's checkpoint
  whole. Older model and momentum files are removed after the commit.

``inflight.json`` names the tasks of the round running now (so that a restarted
orchestrator stops them rather than letting them run on), and ``events.jsonl`` is the
session's story, one JSON line per membership event. Files are fsynced before they replace
the old ones: a power cut, not only a crash, leaves a checkpoint that loads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from executor.delta import state_hash
from executor.fileio import atomic_writer, read_json
from executor.tensorfile import load_state, write_state

STATE = "state.json"
INFLIGHT = "inflight.json"
EVENTS = "events.jsonl"
VERSION = 1
_ROUND_FILE = re.compile(r"^(model|outer|residual)-(-?\d+)\.safetensors$")  # -1: the initial model


class CheckpointError(Exception):
    """A state directory that cannot be resumed from (a missing file, a hash that does not hold)."""


@dataclass
class Checkpoint:
    round_done: int  # the last round whose outer step is in ``model`` (-1: the initial model)
    total_rounds: int
    model: dict[str, torch.Tensor]
    velocity: dict[str, torch.Tensor]
    outer: dict[str, Any]  # lr, momentum, nesterov
    session: dict[str, Any]
    members: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # what the caller keeps (the train command's)
    # The quantised sync deltas' error feedback (``SyncFeedback.residual``): without it a
    # resumed session would drop one round's quantisation error.
    sync_residual: dict[str, torch.Tensor] = field(default_factory=dict)
    # A sharded session's global model, as the store holds it (orchestrator.sharded): ``model``
    # is then the session's first model (the layout), this the state and velocity shards.
    sharded: dict[str, Any] | None = None

    @property
    def global_hash(self) -> str:
        return state_hash(self.model)


def _write_synced(path: Path, write: Any) -> None:
    with atomic_writer(str(path)) as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, indent=1, sort_keys=True).encode()


class StateDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        return (self.path / STATE).is_file()

    def model_file(self, round_done: int) -> Path:
        return self.path / f"model-{round_done:05d}.safetensors"

    def save(self, checkpoint: Checkpoint) -> Path:
        """Write ``checkpoint`` atomically; returns the model file (the orchestrator publishes it)."""
        self.path.mkdir(parents=True, exist_ok=True)
        n = checkpoint.round_done
        model_file = self.model_file(n)
        outer_file = self.path / f"outer-{n:05d}.safetensors"
        _write_synced(model_file, lambda f: write_state(f, checkpoint.model))
        _write_synced(outer_file, lambda f: write_state(f, checkpoint.velocity))
        residual_file = self.path / f"residual-{n:05d}.safetensors" if checkpoint.sync_residual else None
        if residual_file is not None:
            _write_synced(residual_file, lambda f: write_state(f, checkpoint.sync_residual))
        state = {
            "v": VERSION,
            "round_done": n,
            "total_rounds": checkpoint.total_rounds,
            "global_hash": checkpoint.global_hash,
            "model_file": model_file.name,
            "outer_file": outer_file.name,
            "residual_file": residual_file.name if residual_file is not None else None,
            "outer": checkpoint.outer,
            "session": checkpoint.session,
            "members": checkpoint.members,
            "history": checkpoint.history,
            "extra": checkpoint.extra,
        }
        _write_synced(self.path / STATE, lambda f: f.write(_json_bytes(state)))
        _sync_dir(self.path)
        for entry in self.path.iterdir():  # the previous rounds' files: no longer named
            match = _ROUND_FILE.match(entry.name)
            if match and int(match.group(2)) != n:
                entry.unlink(missing_ok=True)
        return model_file

    def update(self, **fields: Any) -> None:
        """Rewrite fields of ``state.json`` that do not touch the model (membership after a sync)."""
        state = read_json(str(self.path / STATE))
        state.update(fields)
        _write_synced(self.path / STATE, lambda f: f.write(_json_bytes(state)))

    def load(self) -> Checkpoint:
        try:
            state = read_json(str(self.path / STATE))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path / STATE}: {exc}") from None
        if state.get("v") != VERSION:
            raise CheckpointError(f"{self.path / STATE}: unknown version {state.get('v')!r}")
        try:
            model = load_state(str(self.path / state["model_file"]))
            velocity = load_state(str(self.path / state["outer_file"]))
            residual_name = state.get("residual_file")
            residual = load_state(str(self.path / residual_name)) if residual_name else {}
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{self.path}: {type(exc).__name__}: {exc}") from None
        checkpoint = Checkpoint(
            int(state["round_done"]), int(state["total_rounds"]), model, velocity, dict(state["outer"]),
            dict(state["session"]), dict(state["members"]), list(state.get("history", [])),
            dict(state.get("extra", {})), residual, state.get("sharded"),
        )  # fmt: skip
        if checkpoint.global_hash != state["global_hash"]:
            raise CheckpointError(f"{state['model_file']} does not hash to {state['global_hash']}")
        return checkpoint

    # ------------------------------------------------------------ the round in flight

    def save_inflight(self, round_num: int, tasks: Mapping[str, str]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        record = {"round": round_num, "tasks": dict(tasks)}
        _write_synced(self.path / INFLIGHT, lambda f: f.write(_json_bytes(record)))

    def load_inflight(self) -> tuple[int, dict[str, str]] | None:
        try:
            record = read_json(str(self.path / INFLIGHT))
        except (OSError, ValueError):
            return None
        return int(record["round"]), {str(k): str(v) for k, v in record["tasks"].items()}

    def clear_inflight(self) -> None:
        (self.path / INFLIGHT).unlink(missing_ok=True)

    # ------------------------------------------------------------ the story

    def append_event(self, event: Mapping[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / EVENTS, "a", encoding="utf-8") as file:
            file.write(json.dumps(event, sort_keys=True) + "\n")

    def events(self) -> list[dict[str, Any]]:
        try:
            with open(self.path / EVENTS, encoding="utf-8") as file:
                return [json.loads(line) for line in file if line.strip()]
        except FileNotFoundError:
            return []
