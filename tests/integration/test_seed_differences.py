"""The minor differences from the seed (issue 18), each through the public API with the seed's
own constructor: what a seed caller now gets, as docs/ARCHITECTURE.md's "Differences from
the seed" table says. The seed's whole call sequence is ``test_seed_contract.py``."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor import Executor
from executor.delta import make_sync_delta, state_hash, write_delta
from executor.errors import BadArtifact
from executor.results import ApplyVia, RoundStatus
from tests.support.engine import mlp_state, tiny_vit


def seed_executor(settings, tmp_path: Path, host_id: str = "seed-host") -> Executor:  # type: ignore[no-untyped-def]
    # Executor(emit_stats, emit_log, host_id, shard_cache_max_mb, stage_first_shard, work_dir, sandboxed)
    return Executor(
        lambda _s: None, lambda _l: None, host_id, 64, True, str(tmp_path / "w"), False, settings=settings
    )


def test_an_empty_host_id_is_the_settings_host_id(env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, _root, settings, descriptors = env
    ex = seed_executor(settings, tmp_path, host_id="")
    try:
        ex.load(server.url("model.safetensors"), descriptors, "save_report({'host': host_id})")
        result = ex.run_round(steps=1, mode="inference")
        assert result.report == {"host": settings.host_id} and settings.host_id, result
    finally:
        ex.shutdown()


def test_load_model_in_tenant_code_gives_a_flat_state_dict(env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, root, settings, descriptors = env
    # A training checkpoint as the seed's callers publish them: the weights wrapped with extras.
    torch.save({"state_dict": mlp_state(), "epoch": 3, "optimizer": {"lr": 0.1}}, root / "ckpt.pt")
    code = (
        "state = load_model(model_path)\n"
        "save_report({'type': type(state).__name__, 'keys': sorted(state),\n"
        "             'tensors': all(isinstance(v, torch.Tensor) for v in state.values())})\n"
    )
    ex = seed_executor(settings, tmp_path)
    try:
        loaded = ex.load(server.url("ckpt.pt"), descriptors, code)
        assert loaded.model_hash == state_hash(mlp_state())  # the wrapper is gone, the weights kept
        report = ex.run_round(steps=1, mode="inference").report
        assert report == {"type": "dict", "keys": sorted(mlp_state()), "tensors": True}, report
    finally:
        ex.shutdown()


def test_a_malformed_preprocessor_config_fails_the_load_and_keeps_the_session(env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, root, settings, descriptors = env
    bundle = tmp_path / "bundle"
    tiny_vit(image_size=16).save_pretrained(bundle)
    (bundle / "preprocessor_config.json").write_text('{"do_resize": true, "size": ')  # cut short
    with zipfile.ZipFile(root / "vit.zip", "w") as archive:
        for path in bundle.iterdir():
            archive.write(path, f"vit/{path.name}")
    ex = seed_executor(settings, tmp_path)
    try:
        first = ex.load(server.url("model.safetensors"), descriptors, "pass")
        with pytest.raises(BadArtifact) as caught:
            ex.load(server.url("vit.zip"), descriptors, "pass")
        assert caught.value.code == "bad_artifact" and "preprocessor_config.json" in str(caught.value)
        assert ex.session is not None and ex.session.model_hash == first.model_hash
        assert ex.run_round(steps=1, mode="inference").status is RoundStatus.COMPLETED
    finally:
        ex.shutdown()


def test_a_changed_model_file_falls_back_to_the_full_model(env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The delta is fetched before the changed file's hash is known (its hash comes out of the
    # apply's own pass); the apply then finds the base wrong and the full model is used.
    server, root, settings, descriptors = env
    ex = seed_executor(settings, tmp_path)
    try:
        ex.load(server.url("model.safetensors"), descriptors, "pass")
        base = mlp_state()
        sync = make_sync_delta(base, {k: v + 0.5 for k, v in base.items()})
        write_delta(sync.delta, str(root / "sync.zst"))
        save_file(sync.result, str(root / "full.safetensors"))
        assert ex.session is not None
        tampered = {k: v + 1 for k, v in base.items()}
        save_file(tampered, ex.session.model_path)  # changed behind the executor's back
        outcome = ex.update_model(
            server.url("full.safetensors"),
            None,
            None,
            server.url("sync.zst"),
            sync.base_hash,
            sync.result_hash,
        )
        assert outcome.via is ApplyVia.FULL and outcome.model_hash == sync.result_hash, outcome
        assert "base" in (outcome.fallback_reason or ""), outcome
        # Fetched, then found not to apply (a check of the file before the fetch, which costs a
        # pass over the model, would refuse it unfetched: either keeps the model right).
        assert server.count("sync.zst") <= 1
    finally:
        ex.shutdown()
