"""Untrusted URLs and artifacts cannot reach the host (issue 12), through a real worker.

Each finding of the issue, replayed as an orchestrator (or whoever can enqueue a task)
would send it: a real ``celery worker`` (prefork, sandboxed by bwrap where it can be), a
real Redis, real HTTP servers. Every refusal has its stable code, leaves nothing
half-written, and the worker serves the next task. The policy's own rules are tested in
``tests/unit/test_url_policy.py``, the caps in ``test_caps.py`` and the cache's rule in
``test_cache_access.py``; this module proves they hold where the tasks arrive.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from safetensors.torch import save_file

from executor.delta import max_delta_bytes, state_hash
from orchestrator.artifacts import ArtifactServer
from settings import Settings
from tasks.client import RoundClient
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.redis_server import RedisServer
from tests.support.worker import WorkerProcess

pytestmark = pytest.mark.timeout(300)

HOST = "dp1"
MODEL_CAP_MB = 8
# The tenant reads a shard and reports what it got, or the error it met.
READ_SHARD = """
try:
    got = get_shard(params["index"])
    save_report({"read": repr(got)[:200]})
except Exception as exc:
    save_report({"error": type(exc).__name__, "text": str(exc)[:300]})
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("srv")
    save_file(mlp_state(), str(root / "model.safetensors"))
    save_file(mlp_state(1), str(root / "other.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        yield server, root, shard_descriptors(server, shards)


@pytest.fixture(scope="module")
def secrets_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A "metadata service" on a loopback address the session does not allow (127.0.0.2)."""
    root = tmp_path_factory.mktemp("metadata")
    (root / "credentials").write_text('{"AccessKeyId": "AKIA-LEAKED", "SecretAccessKey": "s3cr3t"}')
    with FaultServer(root, host="127.0.0.2") as server:
        yield server


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    env = {"ROUNDHOUSE_MAX_MODEL_MB": str(MODEL_CAP_MB)}
    process = WorkerProcess(HOST, redis_server.url, tmp_path_factory.mktemp(HOST), env=env)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> RoundClient:
    return RoundClient(Settings(broker_url=redis_server.url, host_id="dp-client"))


def refusal(client: RoundClient, pending: Any) -> tuple[str, str, dict[str, Any]]:
    """(exception type, message, details) of a task that failed, as Redis stores it."""
    with pytest.raises(Exception):  # noqa: B017 - the worker's error class, rebuilt by Celery
        pending.get(timeout=120)
    raw = client.redis.get(f"celery-task-meta-{pending.id}")
    meta = json.loads(raw)
    assert meta["status"] == "FAILURE", meta
    message, details = meta["result"]["exc_message"]
    return meta["result"]["exc_type"], message, details


def ready(client: RoundClient, served: Any, code: str = "pass") -> dict[str, Any]:
    """The worker takes the next task: a good session loads and a round completes."""
    server, _root, descriptors = served
    loaded = client.load_model(HOST, server.url("model.safetensors"), descriptors, code).get(timeout=120)
    assert loaded["model_hash"] == state_hash(mlp_state())
    done = client.run_round(HOST, steps=1, mode="inference").get(timeout=120)
    assert done["status"] == "completed", done
    return dict(loaded)


def work_files(worker: WorkerProcess) -> list[str]:
    """Files in the worker's work dir outside the installed session (a refusal adds none)."""
    top = worker.directory / "work"
    found = [str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()]
    return sorted(f for f in found if "/incoming/" in f or f.endswith((".partial", ".tmp")))


def test_a_file_url_or_a_plain_path_never_reaches_tenant_code(worker, served, client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, _root, descriptors = served
    secret = tmp_path / "root-only"
    secret.write_text("ROUNDHOUSE_BROKER_URL=redis://:password@broker")
    secret.chmod(0o600)
    for url in ("file:///proc/self/environ", f"file://{secret}", str(secret)):
        shards = [{"url": url, "compression": "none"}, *descriptors]
        pending = client.load_model(HOST, server.url("model.safetensors"), shards, READ_SHARD)
        kind, message, details = refusal(client, pending)
        assert details["code"] == "invalid_request" and details["rule"] in ("scheme", "file_roots"), details
        assert "password" not in message
    # A URL the tenant's shard list names later (not staged at load) fails its read, not the host.
    shards = [*descriptors, {"url": "file:///proc/self/environ", "compression": "none"}]
    pending = client.load_model(HOST, server.url("model.safetensors"), shards, READ_SHARD)
    kind, _message, details = refusal(client, pending)
    assert details["code"] == "invalid_request", (kind, details)
    ready(client, served)


def test_a_redirect_to_a_denied_address_is_not_followed(worker, served, secrets_server, client) -> None:  # type: ignore[no-untyped-def]
    server, _root, descriptors = served
    leak = secrets_server.url("credentials")
    server.add_fault("shard-leak.pt.zst", "redirect", location=leak, times=-1)
    shards = [*descriptors, {"url": server.url("shard-leak.pt.zst"), "compression": "none"}]
    client.load_model(HOST, server.url("model.safetensors"), shards, READ_SHARD, params={"index": 3}).get(
        timeout=120
    )
    result = client.run_round(HOST, steps=1, mode="inference").get(timeout=120)
    report = result["report"] or {}
    assert "AKIA" not in json.dumps(result), result
    assert "error" in report, result  # the tenant's read ran, and failed
    assert "127.0.0.2" in report["text"] or "loopback" in report["text"], report
    assert secrets_server.count("credentials") == 0, "the worker connected to a denied address"
    # The model itself behind a redirect to the metadata address: refused at load.
    server.add_fault(
        "model-leak.safetensors", "redirect", location="http://169.254.169.254/latest/", times=-1
    )
    kind, _message, details = refusal(
        client, client.load_model(HOST, server.url("model-leak.safetensors"), descriptors, "pass")
    )
    assert details["code"] == "download_failed" and details.get("rule") == "cloud_metadata", (kind, details)
    server.clear_faults()
    ready(client, served)


def test_a_delta_url_that_is_a_path_is_refused_before_the_round_runs(
    worker, served, client, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    ready(client, served)
    target = tmp_path / "not-here" / "evil"
    for url in (str(target), f"file://{target}", "ftp://example.invalid/x"):
        kind, _message, details = refusal(client, client.run_round(HOST, steps=1, delta_url=url))
        assert details["code"] == "invalid_request", (kind, details)
    assert not target.parent.exists(), "a directory was created for a refused upload"
    ready(client, served)


def _bomb(size_bytes: int) -> bytes:
    """A zstd frame of zeros without a recorded content size (a streamed compressor's)."""
    out = zstandard.ZstdCompressor(level=3).compressobj()
    block = bytes(1 << 20)
    parts = [out.compress(block) for _ in range(size_bytes >> 20)]
    return b"".join(parts) + out.flush()


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_sync_delta_bomb_falls_back_without_growing_the_child(worker, served, client) -> None:  # type: ignore[no-untyped-def]
    server, root, _descriptors = served
    loaded = ready(client, served)
    (root / "bomb.zst").write_bytes(_bomb(1 << 30))
    assert (root / "bomb.zst").stat().st_size < 64 << 10
    child = worker.child_pid()
    before = _peak_rss_mb(child)
    applied = client.apply_delta(
        HOST,
        server.url("other.safetensors"),
        delta_url=server.url("bomb.zst"),
        base_hash=loaded["model_hash"],
        result_hash=state_hash(mlp_state(1)),
    ).get(timeout=120)
    assert applied["via"] == "full" and applied["model_hash"] == state_hash(mlp_state(1)), applied
    assert applied.get("fallback_reason"), applied
    # The task's result carries the fallback's error as {code, message, details?}.
    assert applied["fallback"]["code"] == "bad_artifact" and applied["fallback"]["message"], applied
    assert worker.child_pid() == child
    assert _peak_rss_mb(child) - before < 128, "the bomb was decoded in memory"
    assert not work_files(worker)
    ready(client, served)


def _promising_header(data_bytes: int) -> bytes:
    """A valid safetensors header for one float32 tensor of ``data_bytes``."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [data_bytes // 4], "data_offsets": [0, data_bytes]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(raw)) + raw


def test_an_endless_model_body_is_refused_at_the_cap(worker, served, client) -> None:  # type: ignore[no-untyped-def]
    server, root, descriptors = served
    # Endless zeros: refused at its first bytes (no safetensors header), nothing kept.
    server.add_fault("endless.safetensors", "endless", times=-1, chunk_bytes=1 << 20)
    kind, message, details = refusal(
        client, client.load_model(HOST, server.url("endless.safetensors"), descriptors, "pass")
    )
    assert details["code"] == "bad_artifact" and "safetensors header" in message, (kind, details)
    # A plausible head, then a body of unknown length that goes on past the cap: cut at the cap.
    with open(root / "long.safetensors", "wb") as out:
        out.write(_promising_header(4 << 20))
        out.truncate(8 * (MODEL_CAP_MB << 20))
    server.add_fault("long.safetensors", "chunked", times=-1)
    kind, message, details = refusal(
        client, client.load_model(HOST, server.url("long.safetensors"), descriptors, "pass")
    )
    assert details["code"] == "download_failed" and "long.safetensors" in message, (kind, details)
    assert str(MODEL_CAP_MB << 20) in json.dumps(details) or "cap" in message, (message, details)
    assert not work_files(worker), work_files(worker)
    server.clear_faults()
    ready(client, served)


def _reset_peak_rss(pid: int) -> None:
    # Writing 5 to clear_refs resets VmHWM: the next peak is this test's alone.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# torch.save's legacy format opens with this pickle (its magic number), then pickles a protocol number.
LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)


def _sets(count: int) -> bytes:
    """A pickle of ``count`` EMPTY_SET opcodes: a byte each, a 216-byte set each once unpickled."""
    return b"\x80\x02" + b"\x8f" * count + b"}."


def _torch_zip(pickled: bytes) -> bytes:
    """A real torch.save zip (one tensor) with ``pickled`` as its data.pkl, members stored."""
    plain = io.BytesIO()
    torch.save({"w": torch.zeros(1)}, plain)
    out = io.BytesIO()
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as sink:
        for info in source.infolist():
            sink.writestr(
                info.filename, pickled if info.filename.endswith("/data.pkl") else source.read(info)
            )
    return out.getvalue()


def test_a_pickle_that_builds_objects_from_nothing_is_refused_unbuilt(worker, served, client) -> None:  # type: ignore[no-untyped-def]
    """Issue 25 item 2: weights_only bounds a pickle's bytes, not the objects it builds. A sync
    delta (legacy prefix, or a zip) and a .pt model full of EMPTY_SET are refused before
    torch.load, and the worker's child does not grow (each was 216x its bytes before)."""
    server, root, descriptors = served
    loaded = ready(client, served)
    sets = max_delta_bytes(mlp_state()) - 8192  # within the delta's decode cap for this model
    zstd = zstandard.ZstdCompressor(level=3)
    (root / "legacy-sets.zst").write_bytes(zstd.compress(LEGACY_MAGIC + _sets(sets)))
    (root / "zip-sets.zst").write_bytes(zstd.compress(_torch_zip(_sets(sets))))
    child = worker.child_pid()
    for name, reason in (("legacy-sets.zst", "legacy format"), ("zip-sets.zst", "budget")):
        _reset_peak_rss(child)
        before = _peak_rss_mb(child)
        applied = client.apply_delta(
            HOST,
            server.url("other.safetensors"),
            delta_url=server.url(name),
            base_hash=loaded["model_hash"],
            result_hash=state_hash(mlp_state(1)),
        ).get(timeout=120)
        assert _peak_rss_mb(child) - before < 48, (name, _peak_rss_mb(child) - before)
        assert applied["via"] == "full" and reason in applied.get("fallback_reason", ""), (name, applied)
        ready(client, served)
    big = (MODEL_CAP_MB << 20) - (1 << 20)  # a model within the byte cap: 7 MiB of sets
    (root / "legacy-sets.pt").write_bytes(LEGACY_MAGIC + _sets(big))
    (root / "zip-sets.pt").write_bytes(_torch_zip(_sets(big)))
    for name, reason in (("legacy-sets.pt", "legacy format"), ("zip-sets.pt", "budget")):
        _reset_peak_rss(child)
        before = _peak_rss_mb(child)
        kind, message, details = refusal(
            client, client.load_model(HOST, server.url(name), descriptors, "pass")
        )
        assert _peak_rss_mb(child) - before < 48, (name, _peak_rss_mb(child) - before)
        assert details["code"] == "bad_artifact" and reason in message, (name, kind, message)
        assert worker.child_pid() == child and not work_files(worker)
    ready(client, served)


def test_a_safetensors_body_is_cut_at_what_its_header_promises(worker, served, client) -> None:  # type: ignore[no-untyped-def]
    """Issue 25 item 5: once a safetensors header is parsed, the body is capped at what it
    promises (header and data), not at ROUNDHOUSE_MAX_MODEL_MB: a body of unknown length is
    cut as soon as it runs past, and an announced length over the promise is refused at once."""
    server, root, descriptors = served
    raw = json.dumps({"w": {"dtype": "U8", "shape": [135], "data_offsets": [0, 135]}}).encode()
    raw += b" " * (-len(raw) % 8)
    promised = 8 + len(raw) + 135
    with open(root / "promise.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        out.truncate(6 << 20)  # under the model cap (8 MiB): nothing else would stop it
    for fault in ("chunked", None):
        if fault is not None:
            server.add_fault("promise.safetensors", fault, times=-1)
        kind, message, details = refusal(
            client, client.load_model(HOST, server.url("promise.safetensors"), descriptors, "pass")
        )
        assert details["code"] == "download_failed" and details["cap"] == promised, (fault, kind, details)
        assert "promises" in message, message
        assert not work_files(worker), work_files(worker)
        server.clear_faults()
    ready(client, served)


def test_a_forged_shard_url_is_not_served_from_the_cache(worker, client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "store"
    root.mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with ArtifactServer(root) as store:
        model = store.url_get("model.safetensors")
        good = [{"url": store.url_get(s["name"]), "compression": "zstd"} for s in shards]
        client.load_model(HOST, model, good, READ_SHARD, params={"index": 0}, tenant="acme").get(timeout=120)
        assert "read" in client.run_round(HOST, steps=1, mode="inference").get(timeout=120)["report"]
        forged = [
            {"url": d["url"].rsplit("X-Signature=", 1)[0] + "X-Signature=" + "0" * 64, "compression": "zstd"}
            for d in good
        ]
        for tenant in ("acme", "default"):
            kind, message, details = refusal(
                client, client.load_model(HOST, model, forged, READ_SHARD, params={"index": 0}, tenant=tenant)
            )
            assert details["code"] == "download_failed" and "403" in message, (kind, details)
            assert "X-Signature" not in message and "0" * 64 not in message
    assert os.path.isdir(worker.directory / "work")
