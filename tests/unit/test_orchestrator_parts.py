"""The orchestrator's parts without workers: artifact serving, the outer step, S3 presigning."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
import requests
import torch

from executor import transfer
from orchestrator.artifacts import ArtifactServer
from orchestrator.diloco import OuterOptimizer, mean_delta
from orchestrator.s3 import presign
from settings import Settings


@pytest.fixture
def store(tmp_path: Path):
    with ArtifactServer(tmp_path / "store") as server:
        yield server


def test_signed_urls_are_required_and_expire(store: ArtifactServer, tmp_path: Path) -> None:
    source = tmp_path / "blob"
    source.write_bytes(os.urandom(1000))
    url = store.publish("a/blob", source)
    assert requests.get(url, timeout=10).content == source.read_bytes()
    unsigned = url.split("?")[0]
    assert requests.get(unsigned, timeout=10).status_code == 403
    assert requests.get(url.replace("X-Signature=", "X-Signature=0"), timeout=10).status_code == 403
    assert requests.put(url, data=b"x", timeout=10).status_code == 403  # a GET signature cannot PUT
    assert requests.get(store.url_get("a/blob", expires_s=-1), timeout=10).status_code == 403
    traversal = store.url_get("../../etc/passwd")
    assert requests.get(traversal, timeout=10).status_code in (403, 404)


def test_ranges_and_atomic_puts_work_with_the_executors_transfer(
    store: ArtifactServer, tmp_path: Path
) -> None:
    data = os.urandom(3 << 20)
    (tmp_path / "big").write_bytes(data)
    url = store.publish("big", tmp_path / "big")
    ranged = requests.get(url, headers={"Range": "bytes=10-19"}, timeout=10)
    assert ranged.status_code == 206 and ranged.content == data[10:20]
    config = transfer.TransferConfig.from_settings(
        Settings(
            parallel_min_bytes=1 << 20,
            parallel_connections=3,
            parallel_below_bytes_s=0,
            download_backoff_s=0.01,
        )
    )
    result = transfer.fetch(url, str(tmp_path / "copy"), config=config)
    assert (tmp_path / "copy").read_bytes() == data and result.connections == 3
    transfer.upload(str(tmp_path / "copy"), store.url_put("up/delta.zst"), config=config)
    fetched = tmp_path / "fetched"
    store.fetch("up/delta.zst", fetched)
    assert fetched.read_bytes() == data


def test_mean_delta_and_plain_averaging() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])}
    b = {"w": torch.tensor([3.0, 6.0])}  # no "b": counts as zero
    mean = mean_delta([a, b])
    assert torch.equal(mean["w"], torch.tensor([2.0, 4.0])) and torch.equal(mean["b"], torch.tensor([2.0]))
    params = {"w": torch.zeros(2), "b": torch.zeros(1), "steps": torch.tensor(3)}
    plain = OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False).step(params, mean)
    assert torch.equal(plain["w"], mean["w"]) and torch.equal(plain["steps"], torch.tensor(3))


def test_nesterov_momentum_follows_its_formula() -> None:
    opt = OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True)
    theta = {"w": torch.tensor([1.0])}
    delta = {"w": torch.tensor([0.2])}
    first = opt.step(theta, delta)  # g = -0.2, v = -0.2, update = g + 0.9 v = -0.38
    assert torch.allclose(first["w"], torch.tensor([1.0 + 0.5 * 0.38]))
    second = opt.step(first, delta)  # v = 0.9 * -0.2 - 0.2 = -0.38, update = -0.2 + 0.9 * -0.38
    assert torch.allclose(second["w"], first["w"] + 0.5 * (0.2 + 0.9 * 0.38))


def test_s3_presigning_matches_the_aws_documented_example() -> None:
    # AWS's published query-string authentication example (Signature Version 4, GET).
    url = presign(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        access_key="AKIAIOSFODNN7EXAMPLE",
        secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        expires_s=86400,
        now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC),
    )
    assert url.endswith("X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404")
