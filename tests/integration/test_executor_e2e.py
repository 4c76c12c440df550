"""The engine end to end without Celery: real HTTP server, real files, real training."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor import Executor
from executor.delta import file_state_hash, make_sync_delta, read_delta, state_hash, write_delta
from executor.errors import BadArtifact, ScriptRejected
from executor.results import ApplyVia, ExecutorState, RoundStatus
from settings import Settings
from tests.support.engine import TRAIN_CODE, mlp_state, tiny_vit


def new_executor(settings: Settings, sink: dict) -> Executor:
    sink.setdefault("stats", [])
    sink.setdefault("logs", [])
    return Executor(sink["stats"].append, sink["logs"].append, settings=settings)


@pytest.mark.parametrize("model_name", ["model.safetensors", "model.pt"])
def test_rounds_and_bit_exact_sync(env, model_name: str) -> None:
    server, root, settings, descriptors = env
    sink: dict = {}
    ex = new_executor(settings, sink)
    loaded = ex.load(
        server.url(model_name, "sig=abc"), descriptors, TRAIN_CODE, batch_size=16, params={"lr": 0.1}
    )
    original = mlp_state()
    assert loaded.model_hash == state_hash(original)
    assert (loaded.model_keys, loaded.staged_shard) == (4, 0)
    assert ex.state is ExecutorState.LOADED

    first = ex.run_round(steps=6, round_num=0, total_rounds=3)
    assert first.status is RoundStatus.COMPLETED, first.error
    assert len(sink["stats"]) == 6 and isinstance(sink["stats"][0]["loss"], float)
    assert any("done 6 steps" in line for line in sink["logs"])
    assert first.report is not None and first.report["steps"] == 6
    assert first.delta is not None and first.delta.path and first.delta.keys == 4
    delta = read_delta(first.delta.path)
    assert state_hash(delta) == first.delta.hash
    assert any(float(t.abs().max()) > 0 for t in delta.values())

    # The orchestrator's side: the new global model, the fp16 sync delta, the exact fallback.
    new_global = {k: original[k] + delta[k].float() for k in original}
    sync = make_sync_delta(original, new_global)
    write_delta(sync.delta, str(root / "sync.zst"))
    save_file(sync.result, str(root / "full.safetensors"))
    outcome = ex.update_model(
        server.url("full.safetensors"),
        delta_url=server.url("sync.zst", "sig=1"),
        base_hash=sync.base_hash,
        result_hash=sync.result_hash,
    )
    assert outcome.via is ApplyVia.DELTA and outcome.model_hash == sync.result_hash
    assert file_state_hash(ex.session.model_path) == sync.result_hash
    assert server.count("full.safetensors") == 0
    again = ex.update_model(
        server.url("full.safetensors"),
        delta_url=server.url("sync.zst"),
        base_hash=sync.base_hash,
        result_hash=sync.result_hash,
    )
    assert again.noop and server.count("sync.zst") == 1  # applied once, not twice

    second = ex.run_round(
        steps=6, round_num=1, total_rounds=3, delta_url=server.url("uploads/r1.zst", "sig=put")
    )
    assert second.status is RoundStatus.COMPLETED, second.error
    assert second.delta is not None and second.delta.url and "sig" not in second.delta.url
    assert state_hash(read_delta(str(root / "uploads" / "r1.zst"))) == second.delta.hash
    # Where shipping went, timed: the write and the PUT (bench.goodput reads them).
    shipped = second.to_json()["delta"]
    assert shipped["write_s"] > 0 and shipped["upload_s"] > 0, shipped
    assert server.requests[-1].method == "PUT"
    # Round 1 trains on from round 0's synced model, so it is strictly better, step for step on
    # average (deterministic: CPU, seeded model and shards) — a round that restarted from the
    # original model, or lost the sync, would not be.
    losses = [float(s["loss"]) for s in sink["stats"]]
    assert len(losses) == 12, losses
    assert sum(losses[6:]) / 6 < sum(losses[:6]) / 6, losses
    assert second.report["final_loss"] < losses[0], losses
    # The shards were fetched once each, across rounds (round 1 reused what round 0 cached);
    # the session showed each shard's URL once (a one-byte ranged GET: DESIGN §11, tenant data).
    for i in range(3):
        assert server.bodies(f"shard{i}.pt.zst") == 1
        assert server.count(f"shard{i}.pt.zst") == 2, server.requests
    ex.shutdown()


def test_fallbacks_corrupt_delta_wrong_base_and_missing_base(env) -> None:
    server, root, settings, descriptors = env
    ex = new_executor(settings, {})
    ex.load(server.url("model.safetensors"), descriptors, TRAIN_CODE)
    original = mlp_state()
    target = {k: v + 0.5 for k, v in original.items()}
    sync = make_sync_delta(original, target)
    save_file(sync.result, str(root / "full.safetensors"))
    (root / "corrupt.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage that is not a delta")
    corrupt = ex.update_model(
        server.url("full.safetensors"),
        delta_url=server.url("corrupt.zst"),
        base_hash=sync.base_hash,
        result_hash=sync.result_hash,
    )
    assert corrupt.via is ApplyVia.FULL and corrupt.model_hash == sync.result_hash
    assert "bad_artifact" in (corrupt.fallback_reason or "")
    # Why, as every other result says it: a code to branch on, not text to parse.
    assert corrupt.fallback is not None and corrupt.fallback.code == "bad_artifact", corrupt
    assert corrupt.to_json()["fallback"]["code"] == "bad_artifact"
    assert file_state_hash(ex.session.model_path) == sync.result_hash

    # Wrong base: the local model is now sync.result, not the base of this next delta.
    sync2 = make_sync_delta(original, {k: v - 0.25 for k, v in original.items()})
    write_delta(sync2.delta, str(root / "sync.zst"))
    save_file(sync2.result, str(root / "full2.safetensors"))
    wrong = ex.update_model(
        server.url("full2.safetensors"),
        delta_url=server.url("sync.zst"),
        base_hash=sync2.base_hash,
        result_hash=sync2.result_hash,
    )
    assert wrong.via is ApplyVia.FULL and wrong.model_hash == sync2.result_hash
    assert server.count("sync.zst") == 0, "a known-wrong base must not even download the delta"
    assert "base" in (wrong.fallback_reason or "")
    assert wrong.fallback is not None and wrong.fallback.code == "hash_mismatch", wrong
    assert wrong.fallback.details == {"expected": sync2.base_hash, "got": sync.result_hash}

    # Missing base: a fresh executor has no model at all.
    fresh = new_executor(settings, {})
    missing = fresh.update_model(
        server.url("full.safetensors"),
        delta_url=server.url("sync.zst"),
        base_hash=sync.base_hash,
        result_hash=sync.result_hash,
    )
    assert missing.via is ApplyVia.FULL and missing.model_hash == sync.result_hash
    assert missing.fallback is not None and missing.fallback.code == "no_base_model", missing
    assert missing.to_json()["fallback"] == {"code": "no_base_model", "message": "no local base model"}
    ex.shutdown()
    fresh.shutdown()


def _zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_bad_inputs_leave_model_file_and_cache_unchanged(env, tmp_path: Path) -> None:
    server, root, settings, descriptors = env
    ex = new_executor(settings, {})
    ex.load(server.url("model.safetensors"), descriptors, TRAIN_CODE)
    model_file = Path(ex.session.model_path)
    before = model_file.read_bytes()

    def cache_listing() -> dict[str, int]:
        cache = tmp_path / "cache" / "tenants"
        # Entry lock files (empty, kept on purpose: see executor/shards/_ledger.py) are not content.
        return {
            str(p.relative_to(cache)): p.stat().st_size
            for p in cache.rglob("*")
            if p.is_file() and p.suffix != ".lock"
        }

    ex.session.dataset.wait_prefetch()
    cache_before = cache_listing()
    good = (root / "model.safetensors").read_bytes()
    (root / "truncated.safetensors").write_bytes(good[: len(good) // 2])
    torch.save(torch.nn.Linear(2, 2), root / "module.pt")
    (root / "escape.zip").write_bytes(_zip_bytes({"config.json": b"{}", "../evil.txt": b"x"}))
    (root / "bomb.zip").write_bytes(
        _zip_bytes({"config.json": b'{"model_type": "vit"}', "model.safetensors": b"\0" * (64 << 20)})
    )
    small = settings.model_copy(update={"bundle_max_bytes": 8 << 20})
    ex.settings = small
    for name in ("truncated.safetensors", "module.pt", "escape.zip", "bomb.zip"):
        with pytest.raises(BadArtifact) as caught:
            ex.load(server.url(name), descriptors, TRAIN_CODE)
        assert caught.value.code == "bad_artifact", name
        assert model_file.read_bytes() == before, name
        assert cache_listing() == cache_before, name
        assert ex.state is ExecutorState.LOADED, name
    with pytest.raises(ScriptRejected) as rejected:
        ex.load(server.url("model.safetensors"), descriptors, "def broken(:\n")
    assert rejected.value.code == "invalid_request" and rejected.value.details["line"] == 1

    (root / "shard9.pt.zst").write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(512))
    bad_shards = [
        *descriptors,
        {"url": server.url("shard9.pt.zst"), "compression": "zstd", "size_bytes": 516},
    ]
    ex.load(server.url("model.safetensors"), bad_shards, "get_shard(3)")
    result = ex.run_round(steps=1)
    assert result.status is RoundStatus.FAILED and result.error.code == "bad_artifact"
    ex.load(server.url("model.safetensors"), descriptors, "get_shard(99)")
    result = ex.run_round(steps=1)
    # Tenant code asked for a shard that is not there: its error, as the seed said
    # (user_code_error), with the helper's own code kept beside it.
    assert result.status is RoundStatus.FAILED and result.error.code == "user_code_error"
    assert result.error.details["helper_code"] == "invalid_request"
    assert "out of range" in result.error.message
    assert model_file.read_bytes() == before
    assert cache_listing() == cache_before

    # And the worker is still good for a real round afterwards.
    ex.load(server.url("model.safetensors"), descriptors, TRAIN_CODE)
    assert ex.run_round(steps=2).status is RoundStatus.COMPLETED
    ex.shutdown()


def test_user_errors_are_reported_with_codes(env) -> None:
    server, _root, settings, descriptors = env
    ex = new_executor(settings, {})
    ex.load(server.url("model.safetensors"), descriptors, "x = 1 / 0")
    result = ex.run_round(steps=1)
    assert result.status is RoundStatus.FAILED and result.error.code == "user_code_error"
    assert "ZeroDivisionError" in result.error.message
    ex.load(server.url("model.safetensors"), descriptors, "torch.empty(1 << 60, dtype=torch.uint8)")
    oom = ex.run_round(steps=1)
    assert oom.status is RoundStatus.FAILED and oom.error.code == "gpu_oom", oom.error
    # The seed's shape (cause at the top level) and what the CPU allocator tells: device and size.
    assert "can't allocate memory" in oom.to_json()["error"]["cause"]
    assert oom.error.details["device"] == "cpu" and oom.error.details["requested_mb"] > 0, oom.error
    ex.shutdown()


def load_file_keys(path: str) -> dict[str, bool]:
    from safetensors.torch import load_file

    return {k: v.is_floating_point() for k, v in load_file(path).items()}


def _run_and_stop(ex: Executor, after_s: float) -> tuple[float, object]:
    import threading
    import time

    ex.run(steps=1)
    time.sleep(after_s)
    started = time.monotonic()
    stopper = threading.Thread(target=ex.stop)
    stopper.start()
    ex.wait()
    stopper.join()
    return time.monotonic() - started, ex.finish_round()


def test_stop_interrupts_a_tight_loop_and_keeps_the_session(env) -> None:
    server, _root, settings, descriptors = env
    ex = new_executor(settings, {})
    ex.load(server.url("model.safetensors"), descriptors, "n = 0\nwhile True:\n    n += 1\n")
    before = Path(ex.session.model_path).read_bytes()
    latency, result = _run_and_stop(ex, 0.3)
    assert result.status is RoundStatus.STOPPED and result.error is None, result
    assert latency < 5, f"stop took {latency:.2f}s"
    assert Path(ex.session.model_path).read_bytes() == before
    assert ex.state is ExecutorState.LOADED
    print(f"stop latency, tight loop: {latency * 1000:.0f} ms")


def test_stop_reaches_code_that_swallows_one_stop(env) -> None:
    server, _root, settings, descriptors = env
    ex = new_executor(settings, {})
    code = (
        "caught = 0\n"
        "while True:\n"
        "    try:\n"
        "        while True:\n"
        "            pass\n"
        "    except BaseException:\n"
        "        caught += 1\n"
        "        if caught > 1:\n"
        "            raise\n"
    )
    ex.load(server.url("model.safetensors"), descriptors, code)
    latency, result = _run_and_stop(ex, 0.2)
    assert result.status is RoundStatus.STOPPED
    print(f"stop latency, one stop swallowed: {latency * 1000:.0f} ms")


def test_stop_aborts_a_blocked_shard_download(env) -> None:
    server, _root, settings, descriptors = env
    ex = new_executor(settings, {})
    ex.load(server.url("model.safetensors"), descriptors, "get_shard(2)\nwhile True:\n    pass\n")
    ex.session.dataset.wait_prefetch()
    ex.cache.remove_tenant("default")  # shard 1 was prefetched; make shard 2 a real download
    ex.session.dataset.close()
    server.add_fault("shard2.pt.zst", "stall", after_bytes=10, bodies_only=True)  # not the URL check
    try:
        ex.run(steps=1)
        assert server.wait_for_stalls(1, timeout_s=20)
        import time

        started = time.monotonic()
        ex.stop()
        ex.wait()
        latency = time.monotonic() - started
    finally:
        server.release_stalls()
    result = ex.finish_round()
    assert result.status is RoundStatus.STOPPED, result
    assert latency < 3, f"stop of a blocked download took {latency:.2f}s"
    print(f"stop latency, blocked download: {latency * 1000:.0f} ms")
    # The next round runs on the same session, no reload.
    ex.session.compiled = compile("pass", "<round-script>", "exec")
    assert ex.run_round(steps=1).status is RoundStatus.COMPLETED


def test_reset_wipes_work_dir_and_tenant_cache(env, tmp_path: Path) -> None:
    server, _root, settings, descriptors = env
    ex = new_executor(settings, {})
    ex.load(server.url("model.safetensors"), descriptors, TRAIN_CODE, tenant="acme")
    assert ex.run_round(steps=2).status is RoundStatus.COMPLETED
    ex.session.dataset.wait_prefetch()
    work = Path(ex.work_dir)
    wiped = ex.reset()
    assert wiped > 0
    assert ex.state is ExecutorState.IDLE and list(work.iterdir()) == []
    tenant_dir = tmp_path / "cache" / "tenants" / "acme"
    assert not tenant_dir.exists() or not [p for p in tenant_dir.iterdir() if p.suffix != ".lock"]
    # Ready for the next tenant.
    ex.load(server.url("model.safetensors"), descriptors, TRAIN_CODE, tenant="globex")
    assert ex.run_round(steps=1).status is RoundStatus.COMPLETED
    ex.shutdown()
    assert not work.exists()


def test_hf_bundle_with_preprocessing_trains_and_syncs(env, tmp_path: Path) -> None:
    server, root, settings, _ = env
    model = tiny_vit(image_size=16)
    bundle = tmp_path / "bundle"
    model.save_pretrained(bundle, max_shard_size="20KB")
    (bundle / "preprocessor_config.json").write_text(
        '{"do_resize": true, "size": {"height": 16, "width": 16}, "do_rescale": true, '
        '"rescale_factor": 0.00392156862745098, "do_normalize": true, '
        '"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}'
    )
    with zipfile.ZipFile(root / "vit.zip", "w") as archive:
        for path in bundle.iterdir():
            archive.write(path, f"vit/{path.name}")
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (12, 3, 24, 24), dtype=torch.uint8, generator=g)
    buffer = io.BytesIO()
    torch.save({"pixel_values": images, "labels": torch.randint(0, 3, (12,), generator=g)}, buffer)
    (root / "img.pt").write_bytes(buffer.getvalue())
    code = (
        "model = place_model(materialize_model(load_model(model_path)))\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        "shard = get_shard(0)\n"
        "for step in range(steps):\n"
        "    x = prepare_inputs(shard['pixel_values'], model)\n"
        "    assert tuple(x.shape[-2:]) == (16, 16) and float(x.min()) >= -1.01\n"
        "    out = model(pixel_values=x.to(device), labels=shard['labels'].to(device))\n"
        "    opt.zero_grad(); out.loss.backward(); opt.step()\n"
        "    emit_stats({'loss': out.loss.item()})\n"
        "save_model(model)\n"
    )
    sink: dict = {}
    ex = new_executor(settings, sink)
    loaded = ex.load(server.url("vit.zip"), [server.url("img.pt")], code)
    assert loaded.source_format == "hf_bundle" and loaded.model_keys == len(model.state_dict())
    result = ex.run_round(steps=2)
    assert result.status is RoundStatus.COMPLETED, result.error
    assert result.delta is not None
    delta = read_delta(result.delta.path)
    # Every trained weight maps back to the checkpoint's own key names.
    floating = {k for k, is_float in load_file_keys(ex.session.model_path).items() if is_float}
    assert set(delta) == floating and result.delta.keys == len(floating)
    from safetensors.torch import load_file

    base = load_file(ex.session.model_path)
    sync = make_sync_delta(
        base, {k: v.float() + delta[k].float() if k in delta else v for k, v in base.items()}
    )
    write_delta(sync.delta, str(root / "vit-sync.zst"))
    save_file(sync.result, str(root / "vit-full.safetensors"))
    outcome = ex.update_model(
        server.url("vit-full.safetensors"),
        delta_url=server.url("vit-sync.zst"),
        base_hash=sync.base_hash,
        result_hash=sync.result_hash,
    )
    assert outcome.via is ApplyVia.DELTA and file_state_hash(ex.session.model_path) == sync.result_hash
    assert ex.run_round(steps=1).status is RoundStatus.COMPLETED  # the bundle still materializes
    ex.shutdown()
