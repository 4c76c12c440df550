"""Byte caps on models and deltas (DESIGN §11), through a real Executor and real HTTP servers.

A model body is capped at ``ROUNDHOUSE_MAX_MODEL_MB`` and its safetensors header checked
from its first bytes; a sync delta's download and decode are capped by the model it
applies to. Every refusal has its stable code, leaves nothing half-written and the
worker ready for the next task.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import zstandard
from safetensors.torch import save_file

from executor import Executor
from executor.artifacts import model_head
from executor.delta import file_state_hash
from executor.errors import BadArtifact, RoundhouseError
from settings import Settings
from tests.support.engine import mlp_state
from tests.support.http_server import FaultServer

MIB = 1 << 20
MODEL_CAP_MB = 64
ENDLESS_LIMIT = 4 << 30  # the server gives up here, so a test that fails cannot run forever
BLOCK = bytes(MIB)


# ---------------------------------------------------------------- a server of endless bodies


class _Streamer(ThreadingHTTPServer):
    daemon_threads = True
    bodies: dict[str, Callable[[], Iterator[bytes]]]
    sent: dict[str, int]
    lock: threading.Lock


class _StreamHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Streamer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = self.server.bodies.get(self.path.split("?")[0].lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        # Chunked, no Content-Length: the client learns the size only by reading.
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        try:
            for chunk in body():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                with self.server.lock:
                    self.server.sent[self.path] = self.server.sent.get(self.path, 0) + len(chunk)
                if sent >= ENDLESS_LIMIT:
                    break
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True


@pytest.fixture
def streamer() -> Iterator[_Streamer]:
    server = _Streamer(("127.0.0.1", 0), _StreamHandler)
    server.bodies, server.sent, server.lock = {}, {}, threading.Lock()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(server: _Streamer, name: str) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}/{name}"


def _endless(prefix: bytes) -> Callable[[], Iterator[bytes]]:
    def body() -> Iterator[bytes]:
        if prefix:  # an empty chunk would end the body
            yield prefix
        while True:
            yield BLOCK

    return body


def _promising_header(data_bytes: int) -> bytes:
    """A valid safetensors header for one float32 tensor of ``data_bytes``."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [data_bytes // 4], "data_offsets": [0, data_bytes]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(raw)) + raw


# ---------------------------------------------------------------- the worker


@pytest.fixture
def capped(env: Any, tmp_path: Path) -> tuple[FaultServer, Path, Settings]:
    server, root, settings, _descriptors = env
    update = {"max_model_mb": MODEL_CAP_MB, "url_allow": ["127.0.0.1"], "work_dir": str(tmp_path / "w")}
    return server, root, settings.model_copy(update=update)


def _leftovers(ex: Executor) -> list[str]:
    """Files in the work dir apart from the installed model (a refusal leaves none)."""
    found = []
    for top, _dirs, files in os.walk(ex.work_dir):
        found += [os.path.relpath(os.path.join(top, f), ex.work_dir) for f in files]
    return sorted(f for f in found if not f.startswith("model/") and f != "session.json")


def _ready(ex: Executor, server: FaultServer) -> None:
    """The worker takes the next task: a good model loads."""
    loaded = ex.load(server.url("model.safetensors"), [], "pass")
    assert loaded.model_hash == file_state_hash(ex.session.model_path)  # type: ignore[union-attr]


def test_an_endless_model_body_is_refused_at_the_cap(capped: Any, streamer: _Streamer) -> None:
    server, _root, settings = capped
    streamer.bodies["endless.pt"] = _endless(b"PK\x03\x04")  # a zip's first bytes, then zeros
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    try:
        with pytest.raises(RoundhouseError) as refused:
            ex.load(_url(streamer, "endless.pt"), [], "pass")
        assert refused.value.code == "download_failed", refused.value.message
        assert str(MODEL_CAP_MB * MIB) in refused.value.message or "cap" in refused.value.message
        sent = sum(streamer.sent.values())
        assert MODEL_CAP_MB * MIB <= sent < ENDLESS_LIMIT // 2, sent
        assert _leftovers(ex) == [] and ex.session is None
        _ready(ex, server)
    finally:
        ex.shutdown()


@pytest.mark.parametrize(
    "prefix, match",
    [
        (_promising_header(1 << 30), "promises"),  # a header that promises 1 GiB, cap 64 MiB
        (b"", "safetensors header"),  # a .safetensors URL whose bytes are no safetensors at all
    ],
    ids=["promises-more", "not-safetensors"],
)
def test_a_safetensors_head_is_refused_before_its_data(
    capped: Any, streamer: _Streamer, prefix: bytes, match: str
) -> None:
    server, _root, settings = capped
    streamer.bodies["big.safetensors"] = _endless(prefix)
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    try:
        _ready(ex, server)
        before = file_state_hash(ex.session.model_path)  # type: ignore[union-attr]
        with pytest.raises(BadArtifact, match=match) as refused:
            ex.load(_url(streamer, "big.safetensors"), [], "pass")
        assert refused.value.code == "bad_artifact"
        # Refused from the first MiB: far less than the cap was ever sent (socket buffers aside).
        sent = sum(streamer.sent.values())
        assert sent < 16 * MIB, sent
        assert _leftovers(ex) == []
        assert file_state_hash(ex.session.model_path) == before  # type: ignore[union-attr]
        _ready(ex, server)
    finally:
        ex.shutdown()


def test_the_head_check_alone() -> None:
    size, check = model_head(".safetensors", 64 * MIB)
    assert size >= 64 * 1024
    head = _promising_header(MIB)
    assert check(head + bytes(100)) == len(head) + MIB  # within the cap: the body's new cap
    with pytest.raises(BadArtifact, match="promises"):
        check(_promising_header(64 * MIB + 4))
    assert check(b"PK\x03\x04" + bytes(100)) is None  # a zip: checked whole once downloaded
    with pytest.raises(BadArtifact, match="legacy format"):
        check(b"\x80\x02" + bytes(100))  # the legacy bare pickle: refused from its first bytes
    with pytest.raises(BadArtifact, match="safetensors header"):
        check(bytes(100))
    model_head(".pt", 64 * MIB)[1](bytes(100))  # unknown bytes under another name: checked later
    # A header longer than the head is checked for its length alone.
    long = struct.pack("<Q", 2 * size) + b"{" + bytes(size)
    assert check(long) is None
    with pytest.raises(BadArtifact, match="promises"):
        model_head(".safetensors", size)[1](long)
    with pytest.raises(BadArtifact, match="not valid JSON"):
        check(struct.pack("<Q", 16) + b"{" + b"x" * 15)


# ---------------------------------------------------------------- the sync-delta bomb

# In a fresh interpreter, so that its peak RSS is the worker's alone.
CHILD = r"""
import json, resource, sys
from executor import Executor
from executor.delta import file_state_hash
from executor.errors import RoundhouseError
from settings import Settings
work, model_url, full_url, missing_url, result_hash, *bombs = sys.argv[1:]
settings = Settings(work_dir=work, cache_dir=work + "/cache", url_allow=["127.0.0.1"],
                    download_backoff_s=0.01, download_retries=1, host_id="caps")
ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
base = ex.load(model_url, [], "pass").model_hash
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for bomb in bombs:
    # Refused: the delta is a bomb and the full model is missing; the model stays as it was.
    try:
        ex.update_model(missing_url, delta_url=bomb, base_hash=base, result_hash=result_hash)
        refused = "applied"
    except RoundhouseError as exc:
        refused = exc.code
    intact = file_state_hash(ex.session.model_path) == base == ex.session.model_hash
    # Falls back: the full model replaces it.
    outcome = ex.update_model(full_url, delta_url=bomb, base_hash=base, result_hash=result_hash)
    synced = file_state_hash(ex.session.model_path) == result_hash
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) // 1024
    out[bomb] = [refused, intact, outcome.via.value, outcome.fallback_reason, synced, growth]
    base = ex.load(model_url, [], "pass").model_hash
ex.shutdown()
print(json.dumps(out))
"""


def _bomb(path: Path, prefix: bytes) -> None:
    """1 GiB of zeros behind ``prefix``, one zstd frame without a content size: ~32 KB."""
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=False)
    with open(path, "wb") as raw, compressor.stream_writer(raw, closefd=False) as out:
        out.write(prefix)
        for _ in range(1024):
            out.write(BLOCK)
    assert path.stat().st_size < 64 * 1024


def test_a_sync_delta_bomb_falls_back_within_bounded_memory(capped: Any, tmp_path: Path) -> None:
    server, root, _settings = capped
    save_file({k: v + 1 for k, v in mlp_state().items()}, str(root / "model-next.safetensors"))
    result_hash = file_state_hash(str(root / "model-next.safetensors"))
    bombs = {"zeros.zst": b"", "legacy-torch.zst": b"\x80\x02"}
    for name, prefix in bombs.items():
        _bomb(root / name, prefix)
    args = [
        str(tmp_path / "child"),
        server.url("model.safetensors"),
        server.url("model-next.safetensors"),
        server.url("missing.safetensors"),
        result_hash,
        *(server.url(name) for name in bombs),
    ]
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, *args], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(results) == len(bombs)
    for bomb, (refused, intact, via, reason, synced, growth_mib) in results.items():
        assert refused == "download_failed" and intact, (bomb, refused)
        assert via == "full" and reason.startswith("bad_artifact"), (bomb, reason)
        assert synced, bomb
        assert growth_mib < 200, (bomb, growth_mib)


def test_an_endless_sync_delta_is_capped_by_its_model(capped: Any, streamer: _Streamer) -> None:
    """The delta's download stops at what the model bounds it to (about a MiB for this model,
    against the gibibyte a body of unknown length may take), and the sync falls back."""
    server, root, settings = capped
    save_file({k: v + 1 for k, v in mlp_state().items()}, str(root / "model-next.safetensors"))
    result_hash = file_state_hash(str(root / "model-next.safetensors"))
    streamer.bodies["delta.zst"] = _endless(b"")
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    try:
        base = ex.load(server.url("model.safetensors"), [], "pass").model_hash
        outcome = ex.update_model(
            server.url("model-next.safetensors"),
            delta_url=_url(streamer, "delta.zst"),
            base_hash=base,
            result_hash=result_hash,
        )
        assert outcome.via.value == "full" and outcome.model_hash == result_hash
        assert (outcome.fallback_reason or "").startswith("download_failed"), outcome.fallback_reason
        assert sum(streamer.sent.values()) < 16 * MIB, streamer.sent
        assert _leftovers(ex) == []
    finally:
        ex.shutdown()
