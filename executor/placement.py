"""Model placement: the whole model on the GPU when it fits, else GPU/CPU/disk via accelerate.

``place_model(model)`` is what user code calls. A model goes to the GPU in one
piece when its parameter and buffer bytes, times a working-memory multiplier,
fit in 85% of the free VRAM; otherwise accelerate splits it across the GPU, host
RAM and an offload directory, so a model larger than the card still runs. The
multiplier stands for what a round needs beyond the weights: activations
(inference, 1.15), a trained head (1.25), or gradients and Adam state for every
weight (``train_mode="all"``, 3.5); ``params.training_memory_multiplier`` overrides it.

Without CUDA the model goes to MPS or the CPU; a ``free_bytes`` callable then turns
the CPU into the limited fast tier (CPU + disk), which is how the offload path is
exercised on machines without a GPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from executor.errors import GpuOutOfMemory, InvalidRequest, describe, map_exceptions
from executor.fileio import MIB, remove_tree

INFERENCE_MULTIPLIER = 1.15
HEAD_TRAINING_MULTIPLIER = 1.25
FULL_TRAINING_MULTIPLIER = 3.5
# Leave the rest to the CUDA context, the allocator's fragmentation and other tenants of the card.
FIT_FRACTION = 0.85
# accelerate's per-layer estimates miss activations: give its map a little less than the fit check.
DEVICE_MAP_FRACTION = 0.82
MIN_GPU_MAP_MIB = 256
MIN_CPU_MAP_MIB = 1024

GPU_OOM_MESSAGE = (
    "GPU ran out of memory. Reduce batch_size or call place_model(model), "
    "which enables automatic module sharding."
)
PLACEMENT_LOG = "[INFO] Automatic GPU/CPU/disk model placement enabled; single-GPU VRAM was insufficient"
_CPU_OOM_MARKERS = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
_DEVICE_OOM_MARKERS = ("CUDA out of memory", "MPS backend out of memory")


def local_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def memory_multiplier(params: Mapping[str, Any], training: bool) -> float:
    default = INFERENCE_MULTIPLIER
    if training:
        full = params.get("train_mode", "head") == "all"
        default = FULL_TRAINING_MULTIPLIER if full else HEAD_TRAINING_MULTIPLIER
    raw = params.get("training_memory_multiplier", default)
    not_a_number = {
        (TypeError, ValueError): lambda _: InvalidRequest(
            f"params.training_memory_multiplier must be a number, got {raw!r}"
        )
    }
    with map_exceptions(not_a_number):
        multiplier = float(raw)
    if not multiplier > 0:
        raise InvalidRequest(f"params.training_memory_multiplier must be positive, got {raw!r}")
    return multiplier


def place_model(
    model: torch.nn.Module,
    *,
    training: bool = True,
    params: Mapping[str, Any],
    offload_dir: str,
    emit_log: Callable[[str], None],
    free_bytes: Callable[[], int] | None = None,
) -> torch.nn.Module:
    """Put ``model`` on the accelerator whole if it fits, else split it with accelerate."""
    cuda = torch.cuda.is_available()
    if not cuda and free_bytes is None:
        return model.to(local_device())
    device = "cuda" if cuda else local_device()
    free = int(free_bytes()) if free_bytes is not None else int(torch.cuda.mem_get_info()[0])
    needed = model_bytes(model) * memory_multiplier(params, training)
    if needed <= free * FIT_FRACTION:
        try:
            return model.to(device)
        except Exception as exc:
            if not is_oom(exc):
                raise
            # The estimate was too hopeful: what moved goes back, the split below takes over.
            model.to("cpu")
            empty_device_cache()
    return _dispatch(model, params=params, offload_dir=offload_dir, emit_log=emit_log, free=free, cuda=cuda)


def _dispatch(
    model: torch.nn.Module,
    *,
    params: Mapping[str, Any],
    offload_dir: str,
    emit_log: Callable[[str], None],
    free: int,
    cuda: bool,
) -> torch.nn.Module:
    def split_failed(exc: BaseException) -> GpuOutOfMemory:
        return GpuOutOfMemory(
            "Model does not fit GPU and automatic module sharding failed. "
            "Use a standard torch/torchvision/Hugging Face module tree or "
            f"configure no_split_module_classes. Cause: {exc}",
            {"model_bytes": model_bytes(model), "free_bytes": free},
            cause=describe(exc),
        )

    with map_exceptions({Exception: split_failed}):
        from accelerate import dispatch_model, infer_auto_device_map

        # One round owns this directory; stale offload files of another layout would waste gigabytes.
        remove_tree(offload_dir, ignore_errors=True)
        os.makedirs(offload_dir, exist_ok=True)
        no_split = params.get("no_split_module_classes") or []
        device_map = infer_auto_device_map(
            model,
            max_memory=_max_memory(free, cuda),
            no_split_module_classes=[str(name) for name in no_split],
        )
        device_map = _expand_whole_disk(model, device_map)
        placed = dispatch_model(model, device_map=device_map, offload_dir=offload_dir, offload_buffers=True)
    emit_log(PLACEMENT_LOG)
    return placed


def onloaded_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()``, with what accelerate offloaded read back onto the CPU.

    A module that ``_dispatch`` offloaded (to host RAM beside a GPU, or to the offload
    directory) holds meta placeholders between forwards; its real tensors live in its hook's
    weights map. A delta or ``save_model`` of such a model needs those, not the placeholders
    (the GPU check found ``Cannot copy out of meta tensor`` on the first offloaded round).
    Modules without offloaded tensors are read as they are, at no extra cost."""
    state = dict(model.state_dict())
    if not any(tensor.device.type == "meta" for tensor in state.values()):
        return state
    from accelerate.utils import align_module_device

    for prefix, module in model.named_modules():
        tensors = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        own = [name for name, t in tensors if t.device.type == "meta" and _key(prefix, name) in state]
        if not own:
            continue
        # Inside, the module's own tensors are its weights map's (the CPU copy or the offload
        # file's); outside, the placeholders again. The references taken here stay valid.
        with align_module_device(module, torch.device("cpu")):
            for name in own:
                state[_key(prefix, name)] = getattr(module, name).detach().to("cpu")
    return state


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _expand_whole_disk(model: torch.nn.Module, device_map: Mapping[str, Any]) -> dict[str, Any]:
    """accelerate writes "all on disk" as ``{"": "disk"}``, which its own dispatch cannot offload;
    naming each top-level child instead says the same thing in a form it handles."""
    if dict(device_map) != {"": "disk"}:
        return dict(device_map)
    if (
        next(model.parameters(recurse=False), None) is not None
        or next(model.buffers(recurse=False), None) is not None
    ):
        return dict(device_map)  # tensors on the root itself: nothing to split, dispatch will say so
    return {name: "disk" for name, _ in model.named_children()}


def _max_memory(free: int, cuda: bool) -> dict[int | str, int | str]:
    """accelerate's budget per tier; what fits nowhere goes to the offload directory."""
    if cuda:
        return {
            0: f"{max(MIN_GPU_MAP_MIB, int(free * DEVICE_MAP_FRACTION / MIB))}MiB",
            "cpu": f"{max(MIN_CPU_MAP_MIB, available_ram_mib() * 3 // 4)}MiB",
        }
    # No GPU: host RAM is the limited fast tier, the offload directory the rest.
    return {"cpu": max(1, int(free * DEVICE_MAP_FRACTION))}


def available_ram_mib() -> int:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / MIB)
    except (ValueError, OSError, AttributeError):
        return 4096


def empty_device_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """An allocator failure: CUDA's OutOfMemoryError, or the CPU/MPS allocator's RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(marker in text for marker in (*_CPU_OOM_MARKERS, *_DEVICE_OOM_MARKERS))
    return False


_REQUESTED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?(bytes|[KMGT]iB)")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _requested_bytes(text: str) -> float | None:
    """What the failed allocation asked for, as the allocator's message says (CUDA and CPU)."""
    match = _REQUESTED.search(text)
    return float(match.group(1)) * _UNITS[match.group(2)] if match else None


def oom_error(exc: BaseException) -> GpuOutOfMemory:
    """The ``gpu_oom`` error for an allocator failure; the CUDA cache is emptied for the next try."""
    details: dict[str, Any] = {}
    if torch.cuda.is_available():
        details["allocated_mb"] = round(torch.cuda.memory_allocated() / MIB)
        details["reserved_mb"] = round(torch.cuda.memory_reserved() / MIB)
    empty_device_cache()
    if any(marker in str(exc) for marker in _CPU_OOM_MARKERS):
        details["device"] = "cpu"  # the host allocator failed: the same remedy, a smaller batch
    requested = _requested_bytes(str(exc))
    if requested is not None:
        details["requested_mb"] = round(requested / MIB)
    return GpuOutOfMemory(GPU_OOM_MESSAGE, details, cause=str(exc))
