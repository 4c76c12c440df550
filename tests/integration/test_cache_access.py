"""The shard cache serves an entry only to a caller who could have downloaded it (issue 12).

Against real servers that check a signature in the query string, as an object store
checks a presigned URL: :class:`SigServer` below (accepts ``?sig=`` one of its good
signatures, answers 403 otherwise, and records every request so that a test can tell
a one-byte URL check from a download), and the orchestrator's :class:`ArtifactServer`
(HMAC-signed, expiring URLs) for the executor's end to end case. Real ``ShardCache``,
``ShardSession`` and ``Executor`` objects, real processes for the concurrent case.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import torch
from safetensors.torch import save_file

from executor import Executor, transfer
from executor.configs import transfer_config
from executor.errors import DownloadFailed
from executor.results import ExecutorState
from executor.shards import ShardCache, ShardDescriptor, ShardSession
from orchestrator.artifacts import ArtifactServer, reply, send_file_head
from settings import Settings
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state

REPO = Path(__file__).resolve().parents[2]
CHECK_RANGE = "bytes=0-0"
FAST = transfer_config(
    Settings(download_retries=2, download_backoff_s=0.01, read_timeout_s=10, url_allow=["127.0.0.1"])
)


@dataclass(frozen=True)
class Seen:
    path: str
    sig: str | None
    range_header: str | None
    status: int


class SigServer:
    """Files under ``root`` for a GET whose ``sig`` is one of ``good``; 403 for any other.

    ``delay_s`` sleeps between 64 KiB pieces of a body (a slow link, so that concurrent
    downloads overlap).
    """

    def __init__(self, root: Path, good: tuple[str, ...] = ("good", "good2"), delay_s: float = 0.0) -> None:
        self.root, self.good, self.delay_s = root, good, delay_s
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._httpd = _QuietServer(("127.0.0.1", 0), _SigHandler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> SigServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def url(self, name: str, sig: str = "good") -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/{name}?sig={sig}"

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def bodies(self, name: str) -> int:
        """GETs of ``name`` that sent its body."""
        with self._lock:
            return sum(
                1 for s in self.seen if s.path == name and s.status < 300 and s.range_header != CHECK_RANGE
            )

    def checks(self, name: str) -> int:
        with self._lock:
            return sum(1 for s in self.seen if s.path == name and s.range_header == CHECK_RANGE)

    def refused(self, name: str) -> int:
        with self._lock:
            return sum(1 for s in self.seen if s.path == name and s.status == 403)

    def total(self) -> int:
        with self._lock:
            return len(self.seen)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: SigServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a URL check hangs up after the headers: that is normal


class _SigHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _QuietServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        owner = self.server.owner
        parts = urlsplit(self.path)
        name = unquote(parts.path).lstrip("/")
        sig = parse_qs(parts.query).get("sig", [None])[0]
        path = owner.root / name
        status = 403 if sig not in owner.good else 200 if path.is_file() else 404
        owner.record(Seen(name, sig, self.headers.get("Range"), status))
        if status != 200:
            reply(self, status, b"refused\n" if status == 403 else b"not found\n")
            return
        with open(path, "rb") as file:
            span = send_file_head(self, os.fstat(file.fileno()))
            if span is None:
                return
            offset, end = span
            while offset < end:
                if owner.delay_s and offset > span[0]:
                    time.sleep(owner.delay_s)
                offset += self.connection.sendfile(file, offset, min(64 * 1024, end - offset))


def shard_bytes(index: int) -> bytes:
    g = torch.Generator().manual_seed(index)
    buffer = io.BytesIO()
    torch.save({"x": torch.randn(32 * 1024, generator=g), "index": torch.tensor(index)}, buffer)
    return buffer.getvalue()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[SigServer, Path]]:
    root = tmp_path / "srv"
    root.mkdir()
    for i in range(4):
        (root / f"s{i}.pt").write_bytes(shard_bytes(i))
    with SigServer(root) as server:
        yield server, root


def descriptor(
    server: SigServer, root: Path, i: int, sig: str = "good", *, sha: bool = False
) -> ShardDescriptor:
    data = (root / f"s{i}.pt").read_bytes()
    return ShardDescriptor(
        server.url(f"s{i}.pt", sig), "none", len(data), hashlib.sha256(data).hexdigest() if sha else None
    )


def new_cache(tmp_path: Path) -> ShardCache:
    return ShardCache(str(tmp_path / "cache"), 16 << 20, transfer_config=FAST)


def session(cache: ShardCache, tenant: str, descriptors: list[ShardDescriptor]) -> ShardSession:
    return ShardSession(cache, tenant, descriptors, abort=threading.Event(), retain=True)


def cache_listing(tmp_path: Path) -> dict[str, int]:
    tenants = tmp_path / "cache" / "tenants"
    return {
        str(p.relative_to(tenants)): p.stat().st_size
        for p in tenants.rglob("*")
        if p.suffix != ".lock" and p.is_file()
    }


# ---------------------------------------------------------------- not addressed by content


def test_a_forged_url_is_refused_after_a_valid_one_filled_the_cache(store, tmp_path: Path) -> None:
    server, root = store
    cache = new_cache(tmp_path)
    first = session(cache, "acme", [descriptor(server, root, 0)])
    assert int(first.get(0)["index"]) == 0
    first.close()
    before = cache_listing(tmp_path)

    forged = session(cache, "acme", [descriptor(server, root, 0, "forged")])
    with pytest.raises(DownloadFailed) as caught:
        forged.get(0)
    assert caught.value.code == "download_failed" and "403" in caught.value.message
    assert "forged" not in caught.value.message and server.url("s0.pt").split("?")[0] in caught.value.message
    forged.close()
    # Nothing changed for the callers who can reach it: the entry stays, nothing half-written.
    assert cache_listing(tmp_path) == before and not list((tmp_path / "cache" / "reservations").iterdir())
    assert (server.bodies("s0.pt"), server.refused("s0.pt")) == (1, 1)

    again = session(cache, "acme", [descriptor(server, root, 0, "good2")])  # another valid signature
    assert int(again.get(0)["index"]) == 0
    again.close()
    assert server.bodies("s0.pt") == 1, "a caller whose URL works is served the entry"


def test_new_urls_for_a_session_are_checked_too(store, tmp_path: Path) -> None:
    server, root = store
    cache = new_cache(tmp_path)
    warm = session(cache, "acme", [descriptor(server, root, i, "good2") for i in range(4)])
    for i in range(4):
        warm.get(i)  # every shard in the cache, through someone else's valid URLs
    warm.close()
    dataset = session(cache, "acme", [descriptor(server, root, i) for i in range(4)])
    dataset.get(0)
    dataset.wait_prefetch()
    # apply_delta(dataset_shards=...) hands the session re-signed URLs; a forged one is refused.
    dataset.replace_descriptors([descriptor(server, root, i, "forged") for i in range(4)])
    assert int(dataset.get(0)["index"]) == 0  # already held by this session: no new request
    with pytest.raises(DownloadFailed):
        dataset.get(2)
    assert (server.bodies("s2.pt"), server.refused("s2.pt")) == (1, 1)
    dataset.close()


def test_a_changed_object_is_downloaded_again(store, tmp_path: Path) -> None:
    server, root = store
    cache = new_cache(tmp_path)
    first = session(cache, "acme", [ShardDescriptor(server.url("s0.pt"))])  # no size in the descriptor
    assert int(first.get(0)["index"]) == 0
    first.close()
    (root / "s0.pt").write_bytes(shard_bytes(7) + b"\0" * 16)  # another object, another size
    second = session(cache, "acme", [ShardDescriptor(server.url("s0.pt"))])
    assert int(second.get(0)["index"]) == 7, "the old object was served stale"
    second.close()
    assert server.bodies("s0.pt") == 2


@pytest.mark.skipif(
    not hasattr(transfer, "remote_info"),
    reason="needs the validators (ETag, Last-Modified) from transfer.remote_info",
)
def test_a_changed_object_of_the_same_size_is_downloaded_again(store, tmp_path: Path) -> None:
    server, root = store
    cache = new_cache(tmp_path)
    first = session(cache, "acme", [descriptor(server, root, 0)])
    first.get(0)
    first.close()
    replacement = shard_bytes(5)
    assert len(replacement) == (root / "s0.pt").stat().st_size
    time.sleep(0.01)  # another mtime: another ETag and Last-Modified
    (root / "s0.pt").write_bytes(replacement)
    second = session(cache, "acme", [descriptor(server, root, 0)])
    assert int(second.get(0)["index"]) == 5
    second.close()


# ---------------------------------------------------------------- content-addressed and tenants


def test_a_content_addressed_entry_is_served_within_its_tenant_without_asking(store, tmp_path: Path) -> None:
    server, root = store
    cache = new_cache(tmp_path)
    first = session(cache, "acme", [descriptor(server, root, 1, sha=True)])
    first.get(0)
    first.close()
    asked = server.total()
    # The hash proves the content and the tenant already holds it: no request at all.
    later = session(cache, "acme", [descriptor(server, root, 1, "expired", sha=True)])
    assert int(later.get(0)["index"]) == 1
    later.close()
    assert server.total() == asked and cache.stats().checks == 0


def test_another_tenant_is_never_served(store, tmp_path: Path) -> None:
    server, root = store
    cache = new_cache(tmp_path)
    mine = session(cache, "acme", [descriptor(server, root, 1, sha=True)])
    mine.get(0)
    mine.close()
    for tenant in ("globex", "default"):
        theirs = session(cache, tenant, [descriptor(server, root, 1, "forged", sha=True)])
        with pytest.raises(DownloadFailed):
            theirs.get(0)
        theirs.close()
    assert server.bodies("s1.pt") == 1
    honest = session(cache, "globex", [descriptor(server, root, 1, sha=True)])
    honest.get(0)  # downloads its own copy
    assert honest.cached_path(0) != mine.cached_path(0)
    honest.close()
    assert server.bodies("s1.pt") == 2


def test_the_anonymous_tenant_is_never_served_on_a_hash(store, tmp_path: Path) -> None:
    server, root = store
    cache = new_cache(tmp_path)
    first = session(cache, "default", [descriptor(server, root, 2, sha=True)])
    first.get(0)
    first.close()
    # Two anonymous callers are not one party: a known hash is not access.
    stranger = session(cache, "default", [descriptor(server, root, 2, "forged", sha=True)])
    with pytest.raises(DownloadFailed):
        stranger.get(0)
    stranger.close()
    # One who can download it is served the entry (after showing its URL works).
    able = session(cache, "default", [descriptor(server, root, 2, "good2", sha=True)])
    able.get(0)
    able.close()
    assert (server.bodies("s2.pt"), server.checks("s2.pt")) == (1, 3)


@pytest.fixture
def presigned(tmp_path: Path) -> Iterator[tuple[ArtifactServer, Settings, list[dict[str, Any]]]]:
    with ArtifactServer(tmp_path / "store") as store:
        save_file(mlp_state(), str(store.path("model.safetensors")))
        shards = make_shards(Path(store.root))
        descriptors = [
            {**{k: v for k, v in s.items() if k != "name"}, "url": store.url_get(s["name"])} for s in shards
        ]
        settings = Settings(
            work_dir=str(tmp_path / "work"),
            cache_dir=str(tmp_path / "cache"),
            download_backoff_s=0.01,
            host_id="test-host",
            url_allow=["127.0.0.1"],
        )
        yield store, settings, descriptors


def forge(url: str) -> str:
    """The same presigned URL with another signature (an attacker's guess)."""
    head, _, signature = url.rpartition("X-Signature=")
    return head + "X-Signature=" + ("0" if signature[0] != "0" else "1") + signature[1:]


def test_an_executor_without_a_tenant_is_refused_a_forged_url(presigned, tmp_path: Path) -> None:
    store, settings, descriptors = presigned
    model_url = store.url_get("model.safetensors")
    ex = Executor(lambda _s: None, lambda _l: None, settings=settings)
    ex.load(model_url, descriptors, TRAIN_CODE)  # tenant "default"
    ex.session.dataset.wait_prefetch()
    before = cache_listing(tmp_path)
    assert before, "the first load filled the cache"

    other = Executor(lambda _s: None, lambda _l: None, settings=settings, work_dir=str(tmp_path / "other"))
    forged = [{**d, "url": forge(d["url"])} for d in descriptors]
    with pytest.raises(DownloadFailed) as caught:
        other.load(model_url, forged, TRAIN_CODE)
    assert caught.value.code == "download_failed" and "X-Signature" not in caught.value.message
    assert other.state is ExecutorState.IDLE
    assert cache_listing(tmp_path) == before
    other.load(model_url, descriptors, TRAIN_CODE)  # its own valid URLs: served from the cache
    assert cache_listing(tmp_path) == before
    assert other.run_round(steps=2).error is None
    for executor in (ex, other):
        executor.shutdown()


# ---------------------------------------------------------------- processes and cost


def client(cache_dir: Path, tenant: str, urls: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.cache_client", str(cache_dir), str(32 << 20), tenant, *urls],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_two_processes_still_download_once_and_a_forger_gets_nothing(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    root.mkdir()
    for i in range(3):
        (root / f"s{i}.pt").write_bytes(shard_bytes(i) * 4)  # ~0.5 MB: slow enough to overlap
    cache_dir = tmp_path / "cache"
    with SigServer(root, delay_s=0.01) as server:
        urls = {sig: [server.url(f"s{i}.pt", sig) for i in range(3)] for sig in ("good", "good2", "forged")}
        procs = [client(cache_dir, "acme", urls[sig]) for sig in ("good", "good2", "forged")]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 3], outputs
    assert json.loads(outputs[2].splitlines()[-1])["error"] == "download_failed"
    assert [server.refused(f"s{i}.pt") for i in range(3)] == [1, 0, 0]  # the forger stopped at once
    for i in range(3):
        shown = server.checks(f"s{i}.pt") - server.refused(f"s{i}.pt")
        assert (server.bodies(f"s{i}.pt"), shown) == (1, 2), i  # each process checked, one downloaded
    paths = [
        {json.loads(line)["path"] for line in out.splitlines() if '"path"' in line} for out in outputs[:2]
    ]
    assert paths[0] == paths[1]


def test_the_check_costs_one_small_request_per_shard(store, tmp_path: Path) -> None:
    """A cache hit whose URL the caller has not shown yet costs one one-byte request (the check)
    and never the body again; a hit whose URL the session checked costs no request at all.
    Counted at the server, side by side in one run: what a check costs in milliseconds depends
    on the machine's load and belongs to a benchmark."""
    server, root = store
    cache = new_cache(tmp_path)
    d = descriptor(server, root, 3)
    origin = cache.check("acme", d)
    cache.acquire("acme", d, checked=origin).release()
    assert (server.checks("s3.pt"), server.bodies("s3.pt")) == (1, 1)  # the session's check, the download
    hits = 20
    made = server.total()
    for _ in range(hits):
        cache.acquire("acme", d, checked=origin).release()  # a hit, URL known
    assert server.total() == made, "a hit on an already checked URL made requests"
    for _ in range(hits):
        cache.acquire("acme", d).release()  # a hit that shows its URL first
    assert server.total() - made == hits, "a check is not exactly one request per hit"
    assert server.checks("s3.pt") == 1 + hits, f"not a one-byte check ({CHECK_RANGE}) per hit"
    assert server.bodies("s3.pt") == 1 and cache.misses == 1 and cache.hits == 2 * hits
