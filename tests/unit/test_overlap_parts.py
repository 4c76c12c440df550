"""Overlapped rounds' parts (docs/OVERLAP.md): the round's ``overlap`` argument and the sync order
refused when hostile, the working copy W = G + the shipped delta, and the orchestrator's wait
for the deltas whose PUT runs beside the next round (the heartbeats are the test's own data)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import orchestrator.overlap as overlap
from executor.delta import apply_rule, read_delta, write_result_delta
from executor.errors import InvalidRequest
from executor.session import NotInSync, Overlap, OverlapSpec, WorkingCopy
from executor.tensorfile import load_state
from orchestrator.aggregate import DeltaFolder
from tasks.overlap import BadOrder, SyncOrder

HASH = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    "value",
    [
        "x",
        [],
        {"sync_id": "abc"},  # no base hash
        {"base_hash": 7},
        {"base_hash": "h" * 300},
        {"base_hash": HASH, "sync_id": "../etc"},
        {"base_hash": HASH, "sync_id": "a" * 65},
        {"base_hash": HASH, "sync_id": 5},
        {"base_hash": HASH, "sync_wait_s": math.nan},
        {"base_hash": HASH, "sync_wait_s": -1},
        {"base_hash": HASH, "sync_wait_s": True},
        {"base_hash": HASH, "sync_wait_s": "10"},
        {"base_hash": HASH, "sync_wait_s": 1e12},
        {"base_hash": HASH, "gain": -1},
        {"base_hash": HASH, "gain": math.inf},
        {"base_hash": HASH, "gain": "2"},
    ],
)
def test_a_hostile_overlap_argument_is_an_invalid_request(value: Any) -> None:
    with pytest.raises(InvalidRequest):
        OverlapSpec.parse(value)


def test_an_overlap_argument_parses() -> None:
    assert OverlapSpec.parse(None) is None
    spec = OverlapSpec.parse({"base_hash": HASH, "sync_id": "ab12", "sync_wait_s": 5, "gain": 1.33})
    assert spec == OverlapSpec(HASH, "ab12", 5.0, 1.33)


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"sync_id": "a", "round": -1, "model_url": "u", "base_hash": "b", "result_hash": "r"},
        {"sync_id": "a", "round": True, "model_url": "u", "base_hash": "b", "result_hash": "r"},
        {"sync_id": "a", "round": 1, "model_url": "", "base_hash": "b", "result_hash": "r"},
        {"sync_id": "a", "round": 1, "model_url": "u", "base_hash": "b"},
        {"sync_id": "a", "round": 1, "model_url": "u", "delta_url": 3, "base_hash": "b", "result_hash": "r"},
        {"sync_id": "a", "round": 1, "model_url": "u" * 70000, "base_hash": "b", "result_hash": "r"},
    ],
)
def test_a_malformed_sync_order_is_refused(data: Any) -> None:
    with pytest.raises(BadOrder):
        SyncOrder.from_json(data)


def test_a_sync_order_round_trips() -> None:
    order = SyncOrder("ab", 3, "http://m", None, "b", "r")
    assert SyncOrder.from_json(order.to_json()) == order


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_the_working_copy_is_the_global_model_plus_the_shipped_delta(tmp_path: Path, dtype: str) -> None:
    from executor.session import QuantConfig

    torch.manual_seed(0)
    start = {"w": torch.randn(64, 33), "b": torch.randn(33), "steps": torch.tensor([3])}
    trained = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in start.items()}
    glob = {k: v + 0.5 if v.is_floating_point() else v for k, v in start.items()}  # the sync moved it
    save_file(start, str(tmp_path / "start.safetensors"))
    save_file(glob, str(tmp_path / "global.safetensors"))
    delta_path = str(tmp_path / "delta.zst")
    write_result_delta(
        str(tmp_path / "start.safetensors"), trained, delta_path, dtype=QuantConfig().delta_format(dtype)
    )
    copy = WorkingCopy(str(tmp_path))
    copy.rebase(str(tmp_path / "global.safetensors"), HASH, delta_path)
    working, delta = load_state(copy.path), read_delta(delta_path)
    assert set(working) == set(glob)
    for key, value in glob.items():  # bit-exact: the sync's own rule, on the values reported
        assert torch.equal(working[key], apply_rule(value, delta.get(key))), key
    # The eager step of a momentum optimiser: gain * the delta + the common correction.
    correction = {"w": torch.full((64, 33), 0.25, dtype=torch.float16)}
    copy.rebase(str(tmp_path / "global.safetensors"), HASH, delta_path, gain=1.7, correction=correction)
    eager = load_state(copy.path)
    assert torch.equal(eager["w"], apply_rule(glob["w"], delta["w"].float() * 1.7 + 0.25))
    assert torch.equal(eager["b"], apply_rule(glob["b"], delta["b"].float() * 1.7))
    assert copy.usable(HASH) and not copy.usable("sha256:" + "b" * 64)
    copy.drop()
    assert not copy.usable(HASH) and not Path(copy.path).exists()


def test_the_round_ends_pass_writes_the_same_delta_and_working_copy_as_the_two_steps(tmp_path: Path) -> None:
    """The fused pass (delta plain + the next W) against the sequential path's delta and the
    rebase from it: the same hash, the same W bit for bit; its start may be W itself."""
    from executor.delta import file_state_hash

    torch.manual_seed(1)
    start = {"w": torch.randn(64, 33), "b": torch.randn(33), "steps": torch.tensor([3])}
    trained = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in start.items()}
    glob = {k: v + 0.5 if v.is_floating_point() else v for k, v in start.items()}
    save_file(glob, str(tmp_path / "global.safetensors"))
    copy = WorkingCopy(str(tmp_path))
    save_file(start, copy.path)  # the round started from W
    framed = write_result_delta(copy.path, trained, str(tmp_path / "two-step.zst"))
    two_step = WorkingCopy(str(tmp_path / "elsewhere"))
    Path(two_step.path).parent.mkdir()
    correction = {"w": torch.full((64, 33), 0.25, dtype=torch.float16)}
    two_step.rebase(
        str(tmp_path / "global.safetensors"),
        HASH,
        str(tmp_path / "two-step.zst"),
        gain=1.7,
        correction=correction,
    )
    written = copy.write_round_end(
        copy.path, trained, str(tmp_path / "plain"), torch.float16,
        (str(tmp_path / "global.safetensors"), HASH), gain=1.7, correction=correction,
    )  # fmt: skip
    assert written.rebased and written.keys == 2 and copy.usable(HASH)
    assert file_state_hash(str(tmp_path / "plain")) == framed.hash
    built, expected = load_state(copy.path), load_state(two_step.path)
    assert set(built) == set(expected) and all(torch.equal(built[k], expected[k]) for k in expected)
    # No sync came: the delta is still written (against the W it started from), W is dropped.
    save_file(start, copy.path)
    copy.base_hash = HASH
    unsynced = copy.write_round_end(copy.path, trained, str(tmp_path / "plain2"), torch.float16, None)
    assert not unsynced.rebased and not copy.usable(HASH) and not Path(copy.path).exists()
    assert file_state_hash(str(tmp_path / "plain2")) == framed.hash


def test_the_next_working_copy_is_written_over_the_last_where_it_has_its_layout(tmp_path: Path) -> None:
    """Round after round W keeps its layout: the pass writes the next W over the one the round
    started from (same inode, no new pages), bit for bit what a fresh file gets, and the delta
    over the spare an ended upload left. A pass cut short leaves a W no round starts from."""
    from executor.fileio import atomic_writer

    torch.manual_seed(2)
    glob = {"w": torch.randn(64, 33), "b": torch.randn(33), "steps": torch.tensor([3])}
    save_file(glob, str(tmp_path / "global.safetensors"))
    base = (str(tmp_path / "global.safetensors"), HASH)
    copy, fresh = WorkingCopy(str(tmp_path)), WorkingCopy(str(tmp_path / "fresh"))
    Path(fresh.path).parent.mkdir()
    copy.snapshot(*base)  # safetensors' own layout: the first pass writes a new file
    spare = tmp_path / ".spare-delta.tmp"
    for round_num in range(3):
        start = load_state(copy.path)
        trained = {k: v + 0.01 * (round_num + 1) if v.is_floating_point() else v for k, v in start.items()}
        inode = Path(copy.path).stat().st_ino
        with atomic_writer(fresh.path) as out:  # the same start, as a file of its own
            out.write(Path(copy.path).read_bytes())
        spare_inode = spare.stat().st_ino if spare.exists() else None
        delta = tmp_path / f"round-{round_num}"
        copy.write_round_end(copy.path, trained, str(delta), torch.float16, base, gain=1.3, spare=str(spare))
        fresh.write_round_end(
            fresh.path, trained, str(tmp_path / "fresh-delta"), torch.float16, base, gain=1.3
        )
        assert (Path(copy.path).stat().st_ino == inode) == (round_num > 0), round_num
        assert Path(copy.path).read_bytes() == Path(fresh.path).read_bytes()
        assert delta.read_bytes() == (tmp_path / "fresh-delta").read_bytes()
        assert spare_inode is None or (delta.stat().st_ino == spare_inode and not spare.exists())
        assert copy.usable(HASH)
        delta.rename(spare)  # what the upload does once it has ended
    spare.write_bytes(spare.read_bytes() + b"x" * 4096)  # a longer spare is cut to what is written
    copy.write_round_end(copy.path, trained, str(tmp_path / "cut"), torch.float16, base, spare=str(spare))
    assert (tmp_path / "cut").stat().st_size == (tmp_path / "fresh-delta").stat().st_size

    class Broken(dict[str, torch.Tensor]):
        def __getitem__(self, name: str) -> torch.Tensor:
            if name == "w":
                raise OSError("the result went away")
            return super().__getitem__(name)

    with pytest.raises(OSError):
        copy.write_round_end(copy.path, Broken(trained), str(tmp_path / "x"), torch.float16, base)
    assert not copy.usable(HASH)  # rewritten in part: no round starts from it


def test_a_round_that_starts_from_the_global_model_with_a_sync_due_starts_from_a_snapshot(
    tmp_path: Path,
) -> None:
    """The sync is applied to G in place while the round trains: the round's start (what its
    delta is taken against) must be a copy that the sync does not touch."""
    glob = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(8)}, str(glob))
    keeper = Overlap(str(tmp_path), None, 1.0)  # type: ignore[arg-type]  # no upload runs here
    spec = OverlapSpec(HASH, None, 5.0)
    assert keeper.start_path(spec, str(glob), HASH, unchanged=True) is None  # no sync due: G itself
    due = OverlapSpec(HASH, "abc123", 5.0)
    start = keeper.start_path(due, str(glob), HASH, unchanged=True)
    assert start == keeper.working.path and Path(start).read_bytes() == glob.read_bytes()
    assert Path(start).stat().st_mode & 0o777 == 0o644  # the sandboxed runner reads it
    assert keeper.start_path(due, str(glob), HASH, unchanged=True) == start  # usable: not copied again
    with pytest.raises(NotInSync):
        keeper.start_path(OverlapSpec("sha256:" + "c" * 64, "abc123", 5.0), str(glob), HASH, unchanged=True)


class Beats:
    """What each host's heartbeat says, round after round of polls (the test's own data)."""

    def __init__(self, script: dict[str, list[dict[str, Any] | None]]) -> None:
        self.script = script

    def __call__(self, hosts: Any) -> dict[str, dict[str, Any] | None]:
        return {h: (self.script[h].pop(0) if len(self.script[h]) > 1 else self.script[h][0]) for h in hosts}


H = {n: f"sha256:{n:064x}" for n in range(1, 9)}  # well-formed state hashes


def upload(round_num: int, delta_hash: object, state: str, **more: Any) -> dict[str, Any]:
    return {
        "uploads": [
            {"round": round_num - 1, "hash": H[8], "state": "done"},  # an earlier round's: not this one
            {"round": round_num, "hash": delta_hash, "state": state, **more},
        ]
    }


def test_a_deferred_delta_is_fetched_only_once_its_upload_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(overlap, "UPLOAD_POLL_S", 0.01)
    monkeypatch.setattr(overlap, "UPLOAD_UNREPORTED_S", 0.2)
    submitted: dict[str, str] = {}
    folder = DeltaFolder(object(), str(tmp_path), {"w": torch.zeros(2)})  # type: ignore[arg-type]
    monkeypatch.setattr(folder, "submit", lambda host, name, h: submitted.__setitem__(host, h))
    folder.deferred = {
        "ok": ("n1", 3, H[1]),  # running twice, then done: fetched
        "hashed-beside": ("n6", 3, None),  # a plain delta: its hash comes with its upload's report
        "failed": ("n2", 3, H[2]),
        "lost": ("n3", 3, H[3]),
        "forgotten": ("n4", 3, H[4]),  # a restarted worker's beats do not mention it
        "hostile": ("n5", 3, H[5]),  # a beat that is not what a worker writes
        "other-hash": ("n7", 3, H[7]),  # done, but with another hash than its result's
        "no-hash": ("n8", 3, None),  # done, with no hash a worker would write
    }
    beats = Beats(
        {
            "ok": [upload(3, H[1], "running"), upload(3, H[1], "running"), upload(3, H[1], "done")],
            "hashed-beside": [upload(3, None, "running"), upload(3, H[6], "done")],
            "failed": [upload(3, H[2], "failed", error={"code": "download_failed", "message": "HTTP 403"})],
            "lost": [upload(3, H[3], "running"), None],
            "forgotten": [{"uploads": []}],
            "hostile": [{"uploads": "nonsense"}],
            "other-hash": [upload(3, H[1], "done")],
            "no-hash": [upload(3, "sha256:../../etc/passwd" + "0" * 40, "done")],
        }
    )
    overlap.await_uploads(folder, beats, bound_s=30)
    assert submitted == {"ok": H[1], "hashed-beside": H[6]} and not folder.deferred
    errors = {host: f.error for host, f in folder.results().items()}
    assert "HTTP 403" in str(errors["failed"]) and "lost" in str(errors["lost"])
    assert "not reported" in str(errors["forgotten"]) and "not reported" in str(errors["hostile"])
    assert "another than its result" in str(errors["other-hash"])
    assert "reports no hash" in str(errors["no-hash"])
    folder.close()


def test_an_upload_that_never_ends_is_given_up_at_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(overlap, "UPLOAD_POLL_S", 0.01)
    folder = DeltaFolder(object(), str(tmp_path), {"w": torch.zeros(2)})  # type: ignore[arg-type]
    folder.deferred = {"slow": ("n", 2, None)}
    overlap.await_uploads(folder, Beats({"slow": [upload(2, None, "running")]}), bound_s=0.1)
    assert "did not end within 0.1 s" in str(folder.results()["slow"].error)
    folder.close()


def test_the_eager_step_of_the_outer_optimiser_is_its_next_step_with_one_hosts_delta() -> None:
    """gain * d + correction is exactly the step the orchestrator would take with ``d`` as the
    mean (the host steps ahead alone: docs/OVERLAP.md)."""
    from orchestrator.outer import OuterOptimizer

    torch.manual_seed(1)
    theta, first, second = (torch.randn(100) for _ in range(3))
    for nesterov in (True, False):
        outer = OuterOptimizer(0.7, 0.9, nesterov)
        outer.step({"w": theta}, {"w": first})  # a velocity to carry
        correction = outer.eager_correction()["w"].float()
        ahead = theta + outer.eager_gain() * second + correction
        stepped = outer.step({"w": theta}, {"w": second})["w"]
        assert torch.allclose(ahead, stepped, atol=2e-3), (nesterov, (ahead - stepped).abs().max())
    assert OuterOptimizer(1.0, 0.0).eager_correction() == {} and OuterOptimizer(1.0, 0.0).eager_gain() == 1.0
