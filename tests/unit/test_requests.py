"""The session's requests (issue 27): each task's arguments become one typed value, checked once
where they enter; a presigned URL inside one shows itself only redacted; the manifest a
replacement process resumes from is serialised beside its dataclass and checked on the way in."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from executor.delta import QuantScheme
from executor.errors import InvalidRequest, ScriptRejected
from executor.session import LoadRequest, Manifest, QuantConfig, RoundRequest, SyncRequest, read_manifest
from executor.urls import Url
from executor.workdir import SessionDir

SIGNED = "https://bucket.example/model.safetensors?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA"
CODE = "x = 1\n"


def load(**overrides: object) -> LoadRequest:
    args: dict[str, object] = {"model_url": SIGNED, "dataset_shards": [SIGNED], "code": CODE}
    args.update(overrides)
    return LoadRequest.parse(
        args.pop("model_url"), args.pop("dataset_shards"), args.pop("code"), max_script_bytes=1024, **args
    )


def test_a_load_request_is_checked_once_and_carries_what_the_load_needs() -> None:
    request = load(
        batch_size=4, params={"lr": 0.1}, initial_shard_index=-3, tenant="acme", hash_scheme="blake3"
    )
    assert request.model_url.reveal() == SIGNED and request.code == CODE
    assert (request.tenant, request.batch_size, request.params, request.hash_scheme) == (
        "acme",
        4,
        {"lr": 0.1},
        "blake3",
    )
    assert request.initial_shard_index == 0 and request.staged_shard == 0  # the seed's clamp
    assert load(initial_shard_index=7, dataset_shards=[SIGNED] * 3).staged_shard == 1  # and its wrap
    assert load(dataset_shards=None).staged_shard is None
    assert request.compiled.co_filename  # compiled once, here


@pytest.mark.parametrize(
    ("overrides", "error", "words"),
    [
        ({"code": ""}, ScriptRejected, "empty"),
        ({"code": "x" * 2048}, ScriptRejected, "limit"),
        ({"model_url": ""}, InvalidRequest, "model_url"),
        ({"model_url": 7}, InvalidRequest, "model_url"),
        ({"dataset_shards": "one"}, InvalidRequest, "dataset_shards"),
        ({"batch_size": 0}, InvalidRequest, "batch_size"),
        ({"batch_size": True}, InvalidRequest, "batch_size"),
        ({"params": [1]}, InvalidRequest, "params"),
        ({"tenant": "../x"}, InvalidRequest, "tenant"),
        ({"hash_scheme": "md5"}, InvalidRequest, "hash_scheme"),
    ],
)
def test_a_bad_load_request_is_refused_with_its_code(
    overrides: dict[str, object], error: type, words: str
) -> None:
    with pytest.raises(error, match=words) as refused:
        load(**overrides)
    assert refused.value.code == "invalid_request"


def test_a_presigned_url_in_a_request_shows_itself_redacted() -> None:
    shown = [repr(load()), str(load()), repr(SyncRequest.parse(SIGNED, delta_url=SIGNED))]
    shown.append(repr(RoundRequest.parse(delta_url=SIGNED, quant=QuantConfig())))
    for text in shown:
        assert "bucket.example/model.safetensors" in text
        assert "deadbeef" not in text and "AKIA" not in text, text
    # The raw form is asked for by name at the wire, and survives a pickle.
    assert pickle.loads(pickle.dumps(SyncRequest.parse(SIGNED))).model_url.reveal() == SIGNED


def test_a_round_request_parses_its_delta_format_once_and_refuses_a_bad_url_before_training() -> None:
    quant = QuantConfig(block_size=64, scale_dtype="float32")
    request = RoundRequest.parse(5, 2, 3, "training", -4, delta_dtype="int8", quant=quant)
    assert (request.spec.steps, request.spec.round_num, request.spec.step_offset) == (5, 2, 0)
    assert isinstance(request.delta_format, QuantScheme) and request.delta_format.block_size == 64
    assert RoundRequest.parse(quant=quant).delta_format is torch.float16
    with pytest.raises(InvalidRequest, match="delta_dtype"):
        RoundRequest.parse(delta_dtype="int3", quant=quant)
    with pytest.raises(InvalidRequest, match="mode"):
        RoundRequest.parse(mode="eval", quant=quant)
    seen: list[Url] = []

    def policy(url: Url) -> None:
        seen.append(url)
        raise InvalidRequest(f"refused: {url}")

    with pytest.raises(InvalidRequest, match="refused") as refused:
        RoundRequest.parse(delta_url=SIGNED, quant=quant, policy=policy)
    assert seen == [Url(SIGNED)] and "deadbeef" not in str(refused.value)
    assert RoundRequest.parse(delta_url="", quant=quant, policy=policy).delta_url is None


def test_a_sync_request_keeps_absent_replacements_absent() -> None:
    request = SyncRequest.parse(SIGNED)
    assert (request.delta_url, request.params, request.descriptors) == (None, None, None)
    replaced = SyncRequest.parse(SIGNED, {"lr": 1}, [SIGNED], SIGNED, "sha256:" + "0" * 64, None)
    assert replaced.params == {"lr": 1} and len(replaced.descriptors or []) == 1
    for bad in ({"base_hash": 5}, {"params": "x"}, {"dataset_shards": "x"}, {"delta_url": 3}):
        with pytest.raises(InvalidRequest):
            SyncRequest.parse(SIGNED, **bad)  # type: ignore[arg-type]


def _manifest() -> Manifest:
    return Manifest(
        tenant="acme",
        model_url=SIGNED,
        code=CODE,
        params={"lr": 0.1},
        batch_size=4,
        shards=[{"url": SIGNED, "compression": "none", "size_bytes": 0, "sha256": None, "id": None}],
        model_hash="sha256:" + "1" * 64,
        fingerprint=[1, 2, 3, "boot"],
    )


def test_the_manifest_round_trips_through_its_json(tmp_path: Path) -> None:
    manifest = _manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.to_json()["v"] == Manifest.VERSION
    again = manifest.request(max_script_bytes=1024)
    assert again.model_url.reveal() == SIGNED and again.tenant == "acme" and len(again.descriptors) == 1


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"v": 2},
        {"v": 1, "tenant": "acme"},  # fields missing
        {**_manifest().to_json(), "fingerprint": "x"},
        {**_manifest().to_json(), "preprocessor_config": []},
    ],
)
def test_a_manifest_of_another_shape_is_refused(data: object) -> None:
    with pytest.raises(InvalidRequest):
        Manifest.from_json(data)


def test_an_unreadable_manifest_reads_as_none(tmp_path: Path) -> None:
    path = Path(SessionDir(str(tmp_path)).manifest)
    assert read_manifest(str(tmp_path)) is None  # none there
    path.write_text("{not json")
    assert read_manifest(str(tmp_path)) is None
    path.write_text('{"v": 1, "tenant": 3}')
    assert read_manifest(str(tmp_path)) is None
