"""The names tenant code sees (DESIGN §9), identical in-thread and in the sandboxed runner.

``model_path, get_shard, num_shards, host_id, device, batch_size, params, steps,
round_num, total_rounds, step_offset, emit_stats, emit_log, save_model,
save_report, should_stop, load_model, materialize_model, place_model,
prepare_inputs, torch``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from executor import artifacts, placement
from executor.artifacts import checkpoint_state
from executor.errors import InvalidRequest, StopExecution
from executor.preprocess import ImagePreprocessor

NAMESPACE_NAMES = (
    "model_path",
    "get_shard",
    "num_shards",
    "host_id",
    "device",
    "batch_size",
    "params",
    "steps",
    "round_num",
    "total_rounds",
    "step_offset",
    "emit_stats",
    "emit_log",
    "save_model",
    "save_report",
    "should_stop",
    "load_model",
    "materialize_model",
    "place_model",
    "prepare_inputs",
    "torch",
)

# Reports and stats travel as JSON through Redis; bound them so one tenant cannot flood it.
MAX_REPORT_BYTES = 256 * 1024
MAX_STATS_BYTES = 64 * 1024
MAX_LOG_CHARS = 16 * 1024


@dataclass
class RoundOutputs:
    """What tenant code hands back during a round."""

    saved_state: dict[str, torch.Tensor] | None = None
    report: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundSpec:
    """The per-round values of the namespace (``run_round``'s arguments, checked)."""

    steps: int
    round_num: int
    total_rounds: int
    step_offset: int
    mode: str

    @property
    def training(self) -> bool:
        return self.mode == "training"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundSpec:
        """The spec ``to_json`` wrote; a field of the wrong type raises ``InvalidRequest``."""
        values: dict[str, int] = {}
        for name in ("steps", "round_num", "total_rounds", "step_offset"):
            value = data.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequest(f"round spec: {name} must be an integer, got {value!r}")
            values[name] = value
        mode = data.get("mode")
        if mode not in ("training", "inference"):
            raise InvalidRequest(f"mode must be 'training' or 'inference', got {mode!r}")
        return cls(mode=str(mode), **values)


def json_bounded(value: Any, limit: int, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} takes a dict, got {type(value).__name__}")
    try:
        encoded = json.dumps(dict(value), default=_json_default)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-serialisable: {exc}") from None
    if len(encoded) > limit:
        raise ValueError(f"{what} is {len(encoded)} bytes as JSON, the limit is {limit}")
    result: dict[str, Any] = json.loads(encoded)
    return result


def _json_default(value: Any) -> Any:
    # Scalars from tensors and numpy are the common case in stats: accept them.
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().item()
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def cpu_state(model: Any) -> dict[str, torch.Tensor]:
    """The state on the CPU. CPU tensors are not copied (as in the seed): a second full
    copy of a large model is what gets workers OOM-killed, and the delta is taken after
    the round ends anyway."""
    # Under the checkpoint file's key names: transformers renames some weights on load.
    state = checkpoint_state(model) if isinstance(model, torch.nn.Module) else model
    if not isinstance(state, Mapping):
        raise TypeError("save_model takes a torch.nn.Module or a dict of tensors")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state entry {key!r} is not a tensor")
        out[str(key)] = value.detach().cpu()
    return out


def trained_state(outputs: RoundOutputs, namespace: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """What ``save_model`` got; else the module left in ``model``; else nothing (a zero delta)."""
    if outputs.saved_state is not None:
        return outputs.saved_state
    if hasattr(namespace.get("model"), "state_dict"):
        return cpu_state(namespace["model"])
    return None


def build_namespace(
    *,
    model_path: str | None,
    get_shard: Callable[[int], Any],
    num_shards: int,
    host_id: str,
    device: str,
    batch_size: int,
    params: dict[str, Any],
    spec: RoundSpec,
    emit_stats: Callable[[dict[str, Any]], None],
    emit_log: Callable[[str], None],
    should_stop: Callable[[], bool],
    load_model: Callable[[str], Any],
    materialize_model: Callable[[Any], Any],
    place_model: Callable[..., Any],
    prepare_inputs: Callable[[Any, Any], Any],
    outputs: RoundOutputs,
    shield: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> dict[str, Any]:
    """Assemble the namespace; every helper that runs executor code is wrapped by ``shield``."""

    def save_model(model: Any) -> None:
        outputs.saved_state = cpu_state(model)

    def save_report(data: Any) -> None:
        outputs.report = json_bounded(data, MAX_REPORT_BYTES, "save_report")

    def stats(data: Any) -> None:
        emit_stats(json_bounded(data, MAX_STATS_BYTES, "emit_stats"))

    def log(text: Any) -> None:
        emit_log(str(text)[:MAX_LOG_CHARS])

    namespace: dict[str, Any] = {
        "model_path": model_path,
        "get_shard": shield(get_shard),
        "num_shards": num_shards,
        "host_id": host_id,
        "device": device,
        "batch_size": batch_size,
        "params": params,
        "steps": spec.steps,
        "round_num": spec.round_num,
        "total_rounds": spec.total_rounds,
        "step_offset": spec.step_offset,
        "emit_stats": shield(stats),
        "emit_log": shield(log),
        "save_model": shield(save_model),
        "save_report": shield(save_report),
        "should_stop": should_stop,
        "load_model": shield(load_model),
        "materialize_model": shield(materialize_model),
        "place_model": shield(place_model),
        "prepare_inputs": prepare_inputs,
        "torch": torch,
    }
    return namespace


def stop_checker(signal: Any) -> Callable[[], bool]:
    def should_stop() -> bool:
        """Raise ``StopExecution`` when the round was stopped; else False."""
        if signal.is_set():
            raise StopExecution("stopped by request")
        return False

    return should_stop


@dataclass(frozen=True)
class SessionView:
    """What the namespace needs of a loaded session, on either side of the sandbox."""

    model_path: str
    bundle_root: str | None
    preprocessor_config: Mapping[str, Any]
    params: dict[str, Any]
    batch_size: int
    num_shards: int
    host_id: str
    offload_dir: str


def session_namespace(
    view: SessionView,
    spec: RoundSpec,
    *,
    get_shard: Callable[[int], Any],
    emit_stats: Callable[[dict[str, Any]], None],
    emit_log: Callable[[str], None],
    stop_signal: Any,
    outputs: RoundOutputs,
    shield: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> dict[str, Any]:
    """The namespace of one round: the same for in-thread execution and the sandboxed runner."""

    def materialize_model(loaded: Any) -> Any:
        model, missing, unexpected = artifacts.materialize_model(
            loaded, params=view.params, bundle_root=view.bundle_root
        )
        emit_log(f"[INFO] model materialized; missing={len(missing)}, unexpected={len(unexpected)}")
        return model

    def place_model(model: Any, training: bool = True) -> Any:
        return placement.place_model(
            model, training=training, params=view.params, offload_dir=view.offload_dir, emit_log=emit_log
        )

    return build_namespace(
        model_path=view.model_path,
        get_shard=get_shard,
        num_shards=view.num_shards,
        host_id=view.host_id,
        device=placement.local_device(),
        batch_size=view.batch_size,
        params=view.params,
        spec=spec,
        emit_stats=emit_stats,
        emit_log=emit_log,
        should_stop=stop_checker(stop_signal),
        load_model=artifacts.load_state_file,
        materialize_model=materialize_model,
        place_model=place_model,
        prepare_inputs=ImagePreprocessor(view.preprocessor_config, view.params).prepare,
        outputs=outputs,
        shield=shield,
    )
