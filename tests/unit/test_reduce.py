"""The sharded round's pieces (executor.reduce): the partition, a delta's shard files, a shard's
reduction against the star path's outer step and sync delta."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor.delta import QuantScheme, make_sync_delta, read_delta, write_delta, write_result_delta
from executor.errors import BadArtifact, InvalidRequest
from executor.reduce import (
    OuterRule,
    align_for,
    model_partition,
    partition,
    read_delta_shard,
    reduce_shard,
    write_delta_shards,
)
from executor.session import SyncRequest
from executor.tensorfile import read_header
from orchestrator.outer import OuterOptimizer


def keys_of(*sizes: int) -> list[tuple[str, int]]:
    return [(f"k{i:02d}", size) for i, size in enumerate(sizes)]


@pytest.mark.parametrize("count", [1, 2, 3, 7, 16])
def test_the_partition_covers_every_element_once_cut_on_block_boundaries(count: int) -> None:
    keys = keys_of(100_000, 7, 0, 250_001, 4096 * 5, 33)
    split = partition(keys, count, align=64)
    seen = {name: [] for name, _ in keys}
    total = sum(n for _, n in keys)
    for index in range(count):
        for piece in split.shard(index):
            seen[piece.key].append((piece.start, piece.stop))
            assert piece.start % 64 == 0 and 0 <= piece.start < piece.stop  # a block never straddles
    for name, numel in keys:  # each key: contiguous runs, in shard order, end to end
        runs = seen[name]
        if numel == 0:
            assert runs == []
            continue
        assert [a for a, _ in runs] == [0] + [b for _, b in runs[:-1]] and runs[-1][1] == numel
    sizes = [split.numel(i) for i in range(count)]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 2 * 64 + 1
    assert partition(keys, count, align=64) == split  # a function of the keys and N only


def test_a_partition_of_more_shards_than_blocks_has_empty_shards_and_bad_counts_are_refused() -> None:
    split = partition(keys_of(10), 4, align=4096)
    assert [split.numel(i) for i in range(4)] == [0, 0, 0, 10]
    for bad in (0, -1, 1025, True, 2.0):
        with pytest.raises(ValueError):
            partition(keys_of(10), bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        partition([("b", 1), ("a", 1)], 2)
    with pytest.raises(ValueError):
        split.shard(4)
    assert align_for([64, 96]) % 96 == 0 and align_for([64]) == 4096


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 70, generator=g),
        "b.bias": torch.randn(5000, generator=g),
        "c.steps": torch.tensor([3, 4]),
        "d.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("fmt", ["float16", "int8"])
def test_a_deltas_shards_are_the_slices_of_its_whole_delta(tmp_path: Path, fmt: str) -> None:
    start = model(0)
    trained = {
        k: v + 0.01 * torch.randn_like(v.float()).to(v.dtype) if v.is_floating_point() else v
        for k, v in start.items()
    }
    save_file(start, str(tmp_path / "start.safetensors"))
    with open(tmp_path / "start.safetensors", "rb") as f:
        split = model_partition(read_header(f).specs, 3, align=64)
    dtype = torch.float16 if fmt == "float16" else QuantScheme.named("int8")
    paths = [str(tmp_path / f"shard-{i}") for i in range(3)]
    files = write_delta_shards(str(tmp_path / "start.safetensors"), trained, split, dtype, paths)
    whole = write_result_delta(
        str(tmp_path / "start.safetensors"), trained, str(tmp_path / "whole"), dtype=dtype
    )
    assert whole.keys == 3 and all(f.hash.startswith("sha256:") for f in files)
    expected = read_delta(str(tmp_path / "whole"))
    pieces = {key: [] for key in expected}
    for index in range(3):
        for key, value in read_delta_shard(paths[index], split, index).items():
            pieces[key].append(value.float())
    for key, value in expected.items():  # bit for bit, int8 blocks included
        assert torch.equal(torch.cat(pieces[key]), value.float().reshape(-1)), key


def test_a_shard_file_that_does_not_fit_its_slices_is_a_bad_artifact(tmp_path: Path) -> None:
    split = partition([("a", 8192), ("b", 100)], 2, align=4096)
    path = str(tmp_path / "shard")
    good = {"a": torch.zeros(4096, dtype=torch.float16)}
    write_delta(good, path)
    assert set(read_delta_shard(path, split, 0)) == {"a"}
    hostile = [
        {"b": torch.zeros(100)},  # a key of another shard
        {"a": torch.zeros(4095)},  # short
        {"a": torch.zeros(64, 64)},  # 2-D
        {"a": torch.zeros(4096, dtype=torch.int32)},  # not floating
        {"a": torch.zeros(4096), "zz": torch.zeros(1)},  # a key the model lacks
        {"a": torch.zeros(1 << 16)},  # more than the shard's bound
    ]
    for value in hostile:
        write_delta(value, path)
        with pytest.raises(BadArtifact):
            read_delta_shard(path, split, 0)


def test_the_sharded_reduction_is_the_star_paths_outer_step_and_sync_bit_for_bit() -> None:
    """Three rounds of three hosts: the star path's mean, Nesterov step and float16 sync delta
    on whole keys, against four reducers on their slices (the same elementwise rule)."""
    theta = {k: v for k, v in model(1).items() if k != "d.weight"}
    star = OuterOptimizer()
    velocities: list[dict[str, torch.Tensor] | None] = [None] * 4
    keys = [(k, v.numel()) for k, v in sorted(theta.items()) if v.is_floating_point()]
    split = partition(keys, 4, align=64)
    for round_num in range(3):
        g = torch.Generator().manual_seed(round_num)
        deltas = [
            {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in theta.items() if v.is_floating_point()}
            for _ in range(3)
        ]
        mean = {k: sum((d[k] for d in deltas[1:]), deltas[0][k].clone()) / 3 for k in deltas[0]}
        sync = make_sync_delta(theta, star.step(theta, mean))
        for index in range(4):
            pieces = split.shard(index)
            mine = {p.key: theta[p.key].reshape(-1)[p.start : p.stop] for p in pieces}
            slices = [{p.key: d[p.key].reshape(-1)[p.start : p.stop] for p in pieces} for d in deltas]
            out = reduce_shard(OuterRule(), mine, slices, velocities[index], torch.float16)
            velocities[index] = out.velocity
            for p in pieces:
                assert torch.equal(out.sync[p.key], sync.delta[p.key].reshape(-1)[p.start : p.stop]), p
                assert torch.equal(out.result[p.key], sync.result[p.key].reshape(-1)[p.start : p.stop]), p
                assert torch.equal(out.velocity[p.key], star.velocity[p.key].reshape(-1)[p.start : p.stop])
        theta = sync.result


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantised_shards_with_error_feedback_are_the_whole_deltas_slices_round_after_round(
    tmp_path: Path, fmt: str
) -> None:
    """Two rounds with the session's residual: each round's shards dequantise to the slices of
    the whole delta written with the same residual, and the residual they leave is the same."""
    from executor.delta import ErrorFeedback

    start = {k: v for k, v in model(3).items() if k != "d.weight"}
    save_file(start, str(tmp_path / "start.safetensors"))
    with open(tmp_path / "start.safetensors", "rb") as f:
        split = model_partition(read_header(f).specs, 3, align=4096)
    scheme = QuantScheme.named(fmt)
    (tmp_path / "sharded").mkdir()
    (tmp_path / "whole").mkdir()
    for round_num in range(2):
        g = torch.Generator().manual_seed(round_num)
        trained = {
            k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in start.items()
        }
        paths = [str(tmp_path / f"s{round_num}-{j}") for j in range(3)]
        with ErrorFeedback(str(tmp_path / "sharded")).next_round() as residual:
            write_delta_shards(
                str(tmp_path / "start.safetensors"), trained, split, scheme, paths, feedback=residual
            )
            residual.commit()
        with ErrorFeedback(str(tmp_path / "whole")).next_round() as residual:
            write_result_delta(
                str(tmp_path / "start.safetensors"),
                trained,
                str(tmp_path / "w"),
                dtype=scheme,
                feedback=residual,
            )
            residual.commit()
        expected = read_delta(str(tmp_path / "w"))
        pieces: dict[str, list[torch.Tensor]] = {}
        for j in range(3):
            for key, value in read_delta_shard(paths[j], split, j).items():
                pieces.setdefault(key, []).append(value)
        for key, value in expected.items():
            assert torch.equal(torch.cat(pieces[key]), value.reshape(-1)), (round_num, key)
    left = ErrorFeedback(str(tmp_path / "sharded")).load()
    whole = ErrorFeedback(str(tmp_path / "whole")).load()
    assert set(left) == set(whole) and all(torch.equal(left[k], whole[k]) for k in whole)


def test_a_store_order_names_its_files_only_by_exact_hashes() -> None:
    """A sharded apply's ``store`` order names the files it PUTs by their hashes in the work
    dir: anything but an exact hash (a path, a short or upper-case hex) is refused where the
    request enters, for the velocity and for the shard's ``result_hash``."""
    good = "sha256:" + "ab" * 32
    shard = {"url": "http://store/s0", "hash": good, "result_hash": good}
    order = {"state_url": "http://store/st", "velocity_url": "http://store/v", "velocity_hash": good}
    parsed = SyncRequest.parse("http://store/model", delta_url=[{**shard, "store": order}, shard]).sharded
    assert parsed is not None and parsed.shards[0].store is not None and parsed.shards[1].store is None
    for bad in ("sha256:../../../etc/passwd", "sha256:" + "AB" * 32, "sha256:abc", "md5:" + "ab" * 32, 7):
        with pytest.raises(InvalidRequest, match="velocity_hash"):
            SyncRequest.parse(
                "http://store/model", delta_url=[{**shard, "store": {**order, "velocity_hash": bad}}, shard]
            )
        if isinstance(bad, str):
            with pytest.raises(InvalidRequest, match="result_hash"):
                SyncRequest.parse(
                    "http://store/model", delta_url=[{**shard, "result_hash": bad, "store": order}, shard]
                )
    with pytest.raises(InvalidRequest, match="store must be an object"):
        SyncRequest.parse("http://store/model", delta_url=[{**shard, "store": "everything"}, shard])
