"""Model placement on a machine without CUDA: the CPU stands in as the limited fast tier.

What needs a real GPU (``model.to("cuda")``, ``mem_get_info``, the ``{0: ..., "cpu": ...}``
budget, the CUDA details of an OOM) lives in tests/gpu.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from executor.artifacts import checkpoint_state
from executor.errors import GpuOutOfMemory, InvalidRequest
from executor.placement import (
    GPU_OOM_MESSAGE,
    PLACEMENT_LOG,
    is_oom,
    memory_multiplier,
    model_bytes,
    oom_error,
    place_model,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-CUDA path")


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


LAYER_BYTES = (64 * 64 + 64) * 4


def test_model_bytes_counts_shared_tensors_once() -> None:
    model = mlp()
    assert model_bytes(model) == 6 * LAYER_BYTES
    model[1].weight = model[0].weight
    assert model_bytes(model) == 6 * LAYER_BYTES - 64 * 64 * 4


def test_without_cuda_or_budget_the_model_goes_to_the_local_device(tmp_path: Path) -> None:
    logs: list[str] = []
    model = mlp()
    placed = place_model(model, params={}, offload_dir=str(tmp_path / "off"), emit_log=logs.append)
    assert placed is model
    assert next(placed.parameters()).device.type in ("cpu", "mps")
    assert logs == []
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize(
    ("params", "training", "expected"),
    [
        ({}, False, 1.15),
        ({}, True, 1.25),
        ({"train_mode": "head"}, True, 1.25),
        ({"train_mode": "all"}, True, 3.5),
        ({"train_mode": "all"}, False, 1.15),
        ({"train_mode": "all", "training_memory_multiplier": "2"}, True, 2.0),
    ],
)
def test_memory_multiplier(params: dict[str, object], training: bool, expected: float) -> None:
    assert memory_multiplier(params, training) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["lots", 0, -1, None])
def test_bad_multiplier_is_an_invalid_request(bad: object) -> None:
    with pytest.raises(InvalidRequest, match="training_memory_multiplier"):
        memory_multiplier({"training_memory_multiplier": bad}, True)


def test_multiplier_decides_between_whole_and_split(tmp_path: Path) -> None:
    """Free memory that holds the model for a head round but not for a full-training round."""
    size = model_bytes(mlp())
    free = int(size * 2 / 0.85)  # 1.25x fits, 3.5x does not
    logs: list[str] = []

    whole = place_model(
        mlp(), params={}, offload_dir=str(tmp_path / "a"), emit_log=logs.append, free_bytes=lambda: free
    )
    assert logs == []
    assert not hasattr(whole, "hf_device_map")

    split = place_model(
        mlp(),
        params={"train_mode": "all"},
        offload_dir=str(tmp_path / "b"),
        emit_log=logs.append,
        free_bytes=lambda: free,
    )
    assert logs == [PLACEMENT_LOG]
    assert hasattr(split, "hf_device_map")


def test_offload_really_runs_from_disk(tmp_path: Path) -> None:
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "stale.dat").write_bytes(b"left by an earlier round")
    model = mlp()
    inputs = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(inputs)
    logs: list[str] = []
    placed = place_model(
        model,
        params={},
        offload_dir=str(offload),
        emit_log=logs.append,
        free_bytes=lambda: 2 * LAYER_BYTES,
        training=False,
    )
    assert logs == [PLACEMENT_LOG]
    assert "disk" in placed.hf_device_map.values()
    files = {path.name for path in offload.iterdir()}
    assert "stale.dat" not in files
    assert any(name.endswith(".dat") for name in files)
    with torch.no_grad():
        torch.testing.assert_close(placed(inputs), expected)


def test_an_offloaded_models_state_is_its_real_weights_not_placeholders(tmp_path: Path) -> None:
    model = mlp()
    expected = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    budget = 2 * LAYER_BYTES
    placed = place_model(
        model, params={}, offload_dir=str(tmp_path), emit_log=lambda _: None, free_bytes=lambda: budget
    )
    offloaded = [key for key, tensor in placed.state_dict().items() if tensor.device.type == "meta"]
    assert offloaded, "nothing was offloaded: the check would prove nothing"
    # What a round's delta and save_model read (the GPU check saw the placeholders copied).
    state = checkpoint_state(placed)
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert state[key].device.type == "cpu"
        torch.testing.assert_close(state[key], tensor, rtol=0, atol=0)
    # Reading them back left the placement as it was.
    assert [key for key, tensor in placed.state_dict().items() if tensor.device.type == "meta"] == offloaded
    with torch.no_grad():
        torch.testing.assert_close(placed(torch.ones(1, 64)), mlp()(torch.ones(1, 64)))


def test_a_budget_below_one_layer_puts_everything_on_disk(tmp_path: Path) -> None:
    model = mlp()
    inputs = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(inputs)
    placed = place_model(
        model, params={}, offload_dir=str(tmp_path), emit_log=lambda _: None, free_bytes=lambda: 1
    )
    assert set(placed.hf_device_map.values()) == {"disk"}
    with torch.no_grad():
        torch.testing.assert_close(placed(inputs), expected)


def test_failed_split_is_a_clear_gpu_oom(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(GpuOutOfMemory, match="automatic module sharding failed") as info:
        place_model(
            mlp(),
            params={},
            offload_dir=str(blocker / "offload"),
            emit_log=lambda _: None,
            free_bytes=lambda: 1,
        )
    assert info.value.code == "gpu_oom"
    assert info.value.details["free_bytes"] == 1
    assert "NotADirectoryError" in info.value.cause and "cause" not in info.value.details


def test_a_real_cpu_allocation_failure_is_an_oom() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 60, dtype=torch.uint8)  # 1 EiB: beyond any address space
    assert is_oom(info.value)
    error = oom_error(info.value)
    assert isinstance(error, GpuOutOfMemory)
    assert error.code == "gpu_oom"
    assert error.message == GPU_OOM_MESSAGE
    # The seed's shape: ``cause`` at the top level of the error, CUDA figures in ``details``.
    assert "can't allocate memory" in error.cause and error.to_json()["cause"] == error.cause
    assert "allocated_mb" not in error.details  # CUDA details only where CUDA is
    assert error.details["device"] == "cpu"  # the host allocator, not the GPU, ran out
    assert error.details["requested_mb"] == round((1 << 60) / (1 << 20))  # what it asked for
    restored = pickle.loads(pickle.dumps(error))
    assert restored.to_json() == error.to_json()


def test_is_oom_classification() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert not is_oom(RuntimeError("size mismatch for fc.weight"))
    assert not is_oom(ValueError("DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom(MemoryError())
