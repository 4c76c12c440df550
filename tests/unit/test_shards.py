"""The persistent, bounded, cross-process shard cache (DESIGN §7), against a real HTTP server.

Each acquire outside a session first checks the caller's URL with a one-byte ranged GET
(``executor.shards._access``); the tests tell those checks from downloads by their Range.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zstandard

from executor.configs import transfer_config
from executor.errors import BadArtifact, CacheTooSmall, DownloadFailed, InvalidRequest, ShardIndexError
from executor.shards import Origin, ShardCache, ShardDescriptor, ShardSession
from settings import Settings
from tests.support.http_server import FaultServer

REPO = Path(__file__).resolve().parents[2]
FAST = transfer_config(
    Settings(download_retries=3, download_backoff_s=0.01, read_timeout_s=10, url_allow=["127.0.0.1"])
)
SHARD_ELEMS = 64 * 1024  # 256 KiB of float32 per shard (plus torch's zip overhead)


def shard_bytes(index: int) -> bytes:
    g = torch.Generator().manual_seed(index)
    buffer = io.BytesIO()
    torch.save({"x": torch.randn(SHARD_ELEMS, generator=g), "index": torch.tensor(index)}, buffer)
    return buffer.getvalue()


@pytest.fixture
def served(tmp_path: Path):
    root = tmp_path / "srv"
    root.mkdir()
    for i in range(6):
        data = shard_bytes(i)
        (root / f"s{i}.pt").write_bytes(data)
        (root / f"s{i}.pt.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    with FaultServer(root) as server:
        yield server, root


def desc(
    server: FaultServer, root: Path, i: int, *, zstd: bool = False, query: str | None = None
) -> ShardDescriptor:
    name = f"s{i}.pt.zst" if zstd else f"s{i}.pt"
    return ShardDescriptor(server.url(name, query), "zstd" if zstd else "none", (root / name).stat().st_size)


def downloads(server: FaultServer, name: str) -> int:
    """GETs of ``name`` that fetched its body (not the one-byte URL checks)."""
    return sum(
        1 for r in server.requests if r.path == name and r.method == "GET" and r.range_header != "bytes=0-0"
    )


def checks(server: FaultServer, name: str) -> int:
    return sum(1 for r in server.requests if r.path == name and r.range_header == "bytes=0-0")


def cache_files_bytes(cache_dir: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(cache_dir / "tenants"):
        for name in files:
            if name.endswith(".lock"):
                continue
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


class DiskMonitor:
    """Samples the cache's bytes on disk every millisecond and keeps the peak."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir, self.peak, self._stop = cache_dir, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, cache_files_bytes(self.cache_dir))
            time.sleep(0.001)

    def __enter__(self) -> DiskMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_descriptor_parsing_and_keys() -> None:
    d = ShardDescriptor.parse("http://h/x.pt?sig=1")
    assert d.compression == "none" and d.key == "url:http://h/x.pt"
    assert ShardDescriptor.parse({"url": "http://h/x?sig=2", "id": "abc"}).key == "id:abc"
    sha = "a" * 64
    assert ShardDescriptor.parse({"url": "http://h/x", "sha256": sha.upper()}).key == "sha256:" + sha
    assert "sig" not in json.dumps(d.to_json())
    for bad in (
        {"url": ""},
        {"url": "u", "compression": "gzip"},
        {"url": "u", "size_bytes": -1},
        5,
        {"url": "u", "sha256": "zz"},
    ):
        with pytest.raises(InvalidRequest):
            ShardDescriptor.parse(bad)


def test_hit_after_miss_and_query_string_ignored(served, tmp_path: Path) -> None:
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    first = cache.acquire("t", desc(server, root, 0, query="sig=one"))
    first.release()
    again = cache.acquire("t", desc(server, root, 0, query="sig=two"))  # a re-presigned URL
    assert Path(again.path).read_bytes() == (root / "s0.pt").read_bytes()
    again.release()
    assert (downloads(server, "s0.pt"), checks(server, "s0.pt")) == (1, 2)  # each caller's URL checked
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.checks) == (1, 1, 1, 2)


def test_zstd_shard_is_decoded_and_packed_copy_removed(served, tmp_path: Path) -> None:
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    pin = cache.acquire("t", desc(server, root, 1, zstd=True))
    assert Path(pin.path).read_bytes() == (root / "s1.pt").read_bytes()
    pin.release()
    names = os.listdir(Path(pin.path).parent)
    assert sorted(n.rsplit(".", 1)[1] for n in names) == ["bin", "lock"]


def test_corrupt_zstd_is_bad_artifact_and_leaves_no_entry(served, tmp_path: Path) -> None:
    server, root = served
    (root / "bad.zst").write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(4000))
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    bad = ShardDescriptor(server.url("bad.zst"), "zstd", 4004)
    with pytest.raises(BadArtifact):
        cache.acquire("t", bad)
    assert cache_files_bytes(tmp_path / "cache") == 0
    assert cache.stats().entries == 0


def test_lru_eviction_keeps_pinned_and_respects_limit(served, tmp_path: Path) -> None:
    server, root = served
    size = (root / "s0.pt").stat().st_size
    cache = ShardCache(str(tmp_path / "cache"), int(size * 3.5), transfer_config=FAST)
    current = cache.acquire("t", desc(server, root, 0))  # stays pinned throughout
    for i in (1, 2, 3, 4):
        cache.acquire("t", desc(server, root, i)).release()
        time.sleep(0.01)  # distinct mtimes for the LRU order
    assert os.path.exists(current.path)
    stats = cache.stats()
    assert stats.used_bytes <= cache.max_bytes and stats.evictions >= 1
    left = {int(torch.load(p, weights_only=True)["index"]) for p in Path(current.path).parent.glob("*.bin")}
    assert 0 in left and 4 in left and 1 not in left
    current.release()


def test_limit_below_two_shards_is_a_clear_error(served, tmp_path: Path) -> None:
    server, root = served
    size = (root / "s0.pt").stat().st_size
    cache = ShardCache(str(tmp_path / "cache"), int(size * 1.5), transfer_config=FAST)
    pin = cache.acquire("t", desc(server, root, 0))
    with pytest.raises(CacheTooSmall) as caught:
        cache.acquire("t", desc(server, root, 1))
    assert caught.value.code == "invalid_request"
    assert "two shards" in caught.value.message
    pin.release()


def test_limit_is_respected_at_every_instant_with_two_processes(served, tmp_path: Path) -> None:
    server, root = served
    size = (root / "s0.pt").stat().st_size
    limit = int(size * 4.5)
    cache_dir = tmp_path / "cache"
    for i in range(6):
        server.add_fault(f"s{i}.pt", "slow", times=-1, chunk_bytes=64 * 1024, delay_s=0.005)
    urls = [json.dumps(desc(server, root, i).__dict__) for i in range(6)]
    with DiskMonitor(cache_dir) as monitor:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.cache_client", str(cache_dir), str(limit), "t", *order],
                cwd=REPO,
                stdout=subprocess.PIPE,
                text=True,
            )
            for order in (urls, list(reversed(urls)))
        ]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert monitor.peak <= limit, f"peak {monitor.peak} > limit {limit}"
    assert monitor.peak > 0


def test_two_processes_download_each_shard_once(served, tmp_path: Path) -> None:
    server, _root = served
    cache_dir = tmp_path / "cache"
    for i in range(4):
        server.add_fault(f"s{i}.pt", "slow", times=-1, chunk_bytes=32 * 1024, delay_s=0.01)
    urls = [server.url(f"s{i}.pt", f"sig={i}") for i in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.cache_client", str(cache_dir), str(50 << 20), "t", *urls],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    for i in range(4):
        # Each process checks its own URL once (a 1-byte ranged GET, which also gives the size
        # the descriptor left out); only one of them downloads.
        counts = (downloads(server, f"s{i}.pt"), checks(server, f"s{i}.pt"))
        assert counts == (1, 2), f"shard {i}: {counts[0]} downloads, {counts[1]} checks"
    paths = [{json.loads(line)["path"] for line in out.splitlines() if '"path"' in line} for out in outputs]
    assert paths[0] == paths[1]


def test_kill_9_mid_download_leaves_nothing_corrupt_and_resumes(served, tmp_path: Path) -> None:
    server, root = served
    cache_dir = tmp_path / "cache"
    server.add_fault("s2.pt", "slow", chunk_bytes=1 << 20)  # the URL check goes through as is
    server.add_fault("s2.pt", "stall", after_bytes=100_000)
    d = desc(server, root, 2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.cache_client",
            str(cache_dir),
            str(10 << 20),
            "t",
            json.dumps(d.__dict__),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
    )
    try:
        assert server.wait_for_stalls(1, timeout_s=60)
        deadline = time.monotonic() + 10
        while cache_files_bytes(cache_dir) < 100_000 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        server.release_stalls()
    later = ShardCache(str(cache_dir), 10 << 20, transfer_config=FAST)
    entry = later.entry_path("t", d, later.check("t", d))
    assert not os.path.exists(entry), "a partial download appeared under the final name"
    assert not list((cache_dir / "reservations").iterdir()), "the dead process's reservation was not dropped"
    assert not [n for n in os.listdir(Path(entry).parent) if n.endswith(".tmp")]
    cache = ShardCache(str(cache_dir), 10 << 20, transfer_config=FAST)
    pin = cache.acquire("t", d)
    assert Path(pin.path).read_bytes() == (root / "s2.pt").read_bytes()
    resumed = [r for r in server.requests if r.path == "s2.pt" and (r.range_start() or 0) > 0]
    assert resumed, "the second download did not resume from the partial file"
    pin.release()


def test_tenants_are_separate_and_removed_alone(served, tmp_path: Path) -> None:
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    a = cache.acquire("alice", desc(server, root, 0))
    b = cache.acquire("bob", desc(server, root, 0))
    assert a.path != b.path and downloads(server, "s0.pt") == 2
    a.release()
    b.release()
    freed = cache.remove_tenant("alice")
    assert freed == (root / "s0.pt").stat().st_size
    assert not os.path.exists(a.path) and os.path.exists(b.path)
    with pytest.raises(InvalidRequest):
        cache.acquire("../etc", desc(server, root, 0))


def _on_disk(session: ShardSession, index: int) -> bool:
    try:
        return os.path.exists(session.cached_path(index))
    except ValueError:  # its URL has not been checked yet: the prefetch has not started
        return False


def test_session_prefetch_overlaps_compute(served, tmp_path: Path) -> None:
    # While the caller "computes" on shard i (it makes no call into the session), the next
    # shard arrives on disk by itself; its get() then downloads nothing. No timing: the wait
    # for the background fetch is bounded generously and the proof is the request count.
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    for i in range(4):
        server.add_fault(f"s{i}.pt", "slow", times=-1, chunk_bytes=64 * 1024, delay_s=0.01)
    session = ShardSession(cache, "t", [desc(server, root, i) for i in range(4)], abort=threading.Event())
    for i in range(4):
        data = session.get(i)
        assert int(data["index"]) == i
        nxt = session.next_index(i)
        deadline = time.monotonic() + 60
        while not _on_disk(session, nxt):
            assert time.monotonic() < deadline, f"shard {nxt} was never prefetched"
            time.sleep(0.01)
        assert downloads(server, f"s{nxt}.pt") == 1, f"shard {nxt}: fetched before it was asked for"
    assert [downloads(server, f"s{i}.pt") for i in range(4)] == [1, 1, 1, 1]  # no get() fetched again
    session.close()


def test_session_holds_one_decoded_shard_and_checks_indexes(served, tmp_path: Path) -> None:
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    session = ShardSession(cache, "t", [desc(server, root, i) for i in range(3)], abort=threading.Event())
    first = session.get(0)
    assert session.get(0) is first
    session.get(1)
    assert session._decoded_index == 1  # the previous decoded shard was dropped
    for bad in (3, -1, "1", True):
        with pytest.raises(ShardIndexError):
            session.get(bad)  # type: ignore[arg-type]
    session.close()


def test_threads_racing_for_one_missing_shard_download_it_once(served, tmp_path: Path) -> None:
    # Regression: a reader that grabbed the entry between the downloader's exclusive and
    # shared lock used to deadlock against the downloader holding the global lock.
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    for round_index in range(3):
        i = round_index + 1
        server.add_fault(f"s{i}.pt", "slow", times=-1, chunk_bytes=64 * 1024, delay_s=0.02)
        pins: list = []
        errors: list = []

        def take(index: int, pins: list = pins, errors: list = errors) -> None:
            try:
                pins.append(cache.acquire("t", desc(server, root, index)))
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=take, args=(i,)) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "threads deadlocked on one entry"
        assert not errors and len(pins) == 6
        assert downloads(server, f"s{i}.pt") == 1
        for pin in pins:
            pin.release()


# ---------------------------------------------------------------- caps and URL checks


def no_reservations(cache_dir: Path) -> bool:
    return not list((cache_dir / "reservations").iterdir())


def test_a_shard_over_the_cap_is_refused_before_its_body(served, tmp_path: Path) -> None:
    server, root = served
    size = (root / "s0.pt").stat().st_size
    cache_dir = tmp_path / "cache"
    cache = ShardCache(str(cache_dir), 10 << 20, transfer_config=FAST, max_shard_bytes=size - 1)
    # Without size_bytes the server's answer is held to the cap; with it, the descriptor's size.
    for descriptor in (
        ShardDescriptor(server.url("s0.pt", "sig=secret")),
        desc(server, root, 0, query="sig=secret"),
    ):
        with pytest.raises(DownloadFailed) as caught:
            cache.acquire("t", descriptor)
        assert caught.value.code == "download_failed"
        message = caught.value.message
        assert "cap" in message and server.url("s0.pt") in message and "secret" not in message
    assert downloads(server, "s0.pt") == 0
    assert cache_files_bytes(cache_dir) == 0 and no_reservations(cache_dir)


def test_a_size_other_than_the_descriptors_is_refused_before_its_body(served, tmp_path: Path) -> None:
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    wrong = ShardDescriptor(server.url("s0.pt"), "none", (root / "s0.pt").stat().st_size + 1)
    with pytest.raises(DownloadFailed) as caught:
        cache.acquire("t", wrong)
    assert caught.value.details["expected"] == wrong.size_bytes
    assert downloads(server, "s0.pt") == 0 and cache.stats().entries == 0


def zstd_without_content_size(data: bytes) -> bytes:
    packer = zstandard.ZstdCompressor().compressobj()
    packed = packer.compress(data) + packer.flush()
    assert zstandard.get_frame_parameters(packed).content_size == zstandard.CONTENTSIZE_UNKNOWN
    return packed


def test_zstd_decode_never_passes_the_cap(served, tmp_path: Path) -> None:
    server, root = served
    zeros = b"\0" * (8 << 20)
    frames = {
        "recorded.zst": zstandard.ZstdCompressor().compress(zeros),  # refused from its header
        "streamed.zst": zstd_without_content_size(zeros),  # refused once the output reaches the cap
    }
    cap = 1 << 20
    cache_dir = tmp_path / "cache"
    cache = ShardCache(str(cache_dir), 64 << 20, transfer_config=FAST, max_shard_bytes=cap)
    for name, packed in frames.items():
        (root / name).write_bytes(packed)
        with DiskMonitor(cache_dir) as monitor, pytest.raises(DownloadFailed) as caught:
            cache.acquire("t", ShardDescriptor(server.url(name, "sig=x"), "zstd", len(packed)))
        assert "cap" in caught.value.message and "sig" not in caught.value.message, name
        assert monitor.peak <= len(packed) + cap, name
        assert cache_files_bytes(cache_dir) == 0 and no_reservations(cache_dir), name
    assert cache.stats().entries == 0


def test_a_frame_decoding_past_its_recorded_size_is_bad(served, tmp_path: Path) -> None:
    server, root = served
    one = zstandard.ZstdCompressor().compress(b"\1" * 4096)
    (root / "two-frames.zst").write_bytes(one + one)  # the header says 4096, the data says more
    cache_dir = tmp_path / "cache"
    cache = ShardCache(str(cache_dir), 10 << 20, transfer_config=FAST)
    with pytest.raises(BadArtifact):
        cache.acquire("t", ShardDescriptor(server.url("two-frames.zst"), "zstd", 2 * len(one)))
    assert cache_files_bytes(cache_dir) == 0 and no_reservations(cache_dir)


def test_a_session_checks_each_url_once(served, tmp_path: Path) -> None:
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    descriptors = [desc(server, root, i, query="sig=s") for i in range(3)]
    session = ShardSession(cache, "t", descriptors, abort=threading.Event())
    for _round in range(3):
        for i in range(3):
            session.get(i)
    session.wait_prefetch()
    assert [checks(server, f"s{i}.pt") for i in range(3)] == [1, 1, 1]
    assert [downloads(server, f"s{i}.pt") for i in range(3)] == [1, 1, 1]
    assert cache.stats().checks == 3
    session.close()
    again = ShardSession(cache, "t", descriptors, abort=threading.Event())
    again.get(0)  # a new session shows its URL again, then reads the entry
    assert (checks(server, "s0.pt"), downloads(server, "s0.pt")) == (2, 1)
    again.close()


def test_an_origin_names_the_entry(served, tmp_path: Path) -> None:
    server, root = served
    cache = ShardCache(str(tmp_path / "cache"), 10 << 20, transfer_config=FAST)
    d = desc(server, root, 0)
    origin = cache.check("t", d)
    assert isinstance(origin, Origin) and origin.size == d.size_bytes
    pin = cache.acquire("t", d, checked=origin)
    assert pin.origin == origin and pin.path == cache.entry_path("t", d, origin)
    assert checks(server, "s0.pt") == 1  # acquire trusted the check it was given
    other = cache.entry_path("t", d, Origin(origin.size, '"another-etag"'))
    assert other != pin.path  # a changed object is another entry, never this one
    with pytest.raises(ValueError):
        cache.entry_path("t", d)  # an entry not addressed by content has no name before its check
    pin.release()
