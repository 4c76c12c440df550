"""executor.transfer against a real HTTP server with injected faults, real files, real sockets."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.configs import transfer_config
from executor.errors import DownloadFailed, HashMismatch, InvalidRequest, Stopped, UploadFailed
from executor.fileio import MIB
from executor.stopping import StopSignal
from executor.transfer import (
    FetchResult,
    TransferConfig,
    fetch,
    partial_paths,
    redact_url,
    upload,
)
from executor.transfer._ranged import RECORD_EVERY_BYTES
from settings.config import Settings
from tests.support.http_server import FaultServer

SECRET_QUERY = "X-Amz-Signature=secret-token&X-Amz-Credential=AKIAEXAMPLE"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Small buffers so that a few MiB make many reads; tiny backoff so retries are quick.
FAST_SETTINGS = dict(
    download_retries=3, download_backoff_s=0.01, read_timeout_s=20.0, download_buffer_bytes=64 * 1024
)
FAST = transfer_config(Settings(**FAST_SETTINGS))
# A stop that reached a stalled transfer ends it in milliseconds; one that did not would wait
# for the read timeout (20 s or 60 s below) or the backoff (30 s). The bound sits well between,
# generous for a loaded 2-core CI machine.
STOP_BOUND_S = 8.0


def _rooted(*roots: Path) -> TransferConfig:
    """FAST, with file:// URLs allowed under ``roots``."""
    return transfer_config(Settings(**FAST_SETTINGS, file_roots=[str(root) for root in roots]))


def _write_random(path: Path, size_bytes: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        remaining = size_bytes
        while remaining:
            chunk = os.urandom(min(remaining, 8 * MIB))
            fh.write(chunk)
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def _sha256(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "served"
    path.mkdir()
    return path


@pytest.fixture
def server(root: Path) -> Iterator[FaultServer]:
    with FaultServer(root) as srv:
        yield srv


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def blob(root: Path) -> tuple[str, str]:
    """A 4 MiB random file on the server: (relpath, sha256)."""
    return "blob.bin", _write_random(root / "blob.bin", 4 * MIB)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An ~80 MB random file, shared by the parallel tests of this module."""
    directory = tmp_path_factory.mktemp("big")
    path = directory / "big.bin"
    return path, _write_random(path, 80 * 1000 * 1000 + 12345)


def _no_leftovers(dest: Path) -> None:
    partial, sidecar = partial_paths(str(dest))
    assert not os.path.exists(partial)
    assert not os.path.exists(sidecar)


# ------------------------------------------------------------------------- basics


def test_plain_download(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    seen: list[tuple[int, int | None]] = []
    dest = out / "sub" / "blob.bin"
    result = fetch(
        server.url(relpath, SECRET_QUERY),
        str(dest),
        config=FAST,
        sha256=digest,
        size=4 * MIB,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert isinstance(result, FetchResult)
    assert (result.bytes, result.resumed_bytes, result.connections, result.sha256) == (4 * MIB, 0, 1, digest)
    assert _sha256(dest) == digest
    _no_leftovers(dest)
    assert seen[-1] == (4 * MIB, 4 * MIB)
    assert json.loads(json.dumps(result.to_json()))["bytes"] == 4 * MIB
    (record,) = server.requests
    assert record.range_header is None and record.status == 200


def test_plain_body_is_read_into_the_reused_buffer(
    server: FaultServer, blob: tuple[str, str], out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # urllib3's read1 allocates a fresh bytes object per read (the slow path bench.download
    # measured); a plain Content-Length body must never go through it.
    import urllib3

    def refuse(*_args: object, **_kwargs: object) -> bytes:
        raise AssertionError("read1 used for a plain body")

    monkeypatch.setattr(urllib3.response.HTTPResponse, "read1", refuse)
    relpath, digest = blob
    server.add_fault(relpath, "reset", after_bytes=MIB, delay_s=0.2)  # the resumed 206 body too
    result = fetch(server.url(relpath), str(out / "blob.bin"), config=FAST, sha256=digest)
    assert result.sha256 == digest and [r.status for r in server.requests] == [200, 206]


def test_5xx_then_success(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    server.add_fault(relpath, "status", code=503, times=2)
    fetch(server.url(relpath), str(out / "f"), config=FAST, sha256=digest)
    assert [r.status for r in server.requests] == [503, 503, 200]


def test_reset_mid_body_resumes_with_range(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    server.add_fault(relpath, "reset", after_bytes=2 * MIB, delay_s=0.2)
    result = fetch(server.url(relpath), str(out / "f"), config=FAST, sha256=digest)
    first, second = server.requests
    assert first.range_header is None
    assert second.range_start() == 2 * MIB, second
    assert second.status == 206
    assert result.resumed_bytes == 0  # resumed within this call, not from an earlier one
    assert _sha256(out / "f") == digest


def test_truncated_body_recovered(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    server.add_fault(relpath, "truncate", after_bytes=1 * MIB)
    fetch(server.url(relpath), str(out / "f"), config=FAST, sha256=digest)
    assert [r.range_start() for r in server.requests] == [None, 1 * MIB]


def test_wrong_length_recovered(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    server.add_fault(relpath, "wrong_length", length=5 * MIB)
    fetch(server.url(relpath), str(out / "f"), config=FAST, sha256=digest)
    assert _sha256(out / "f") == digest


def test_slow_body_completes(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    server.add_fault(relpath, "slow", chunk_bytes=512 * 1024, delay_s=0.01)
    fetch(server.url(relpath), str(out / "f"), config=FAST, sha256=digest)
    assert server.count(relpath) == 1


def test_range_ignored_restarts_from_zero(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    server.add_fault(relpath, "reset", after_bytes=1 * MIB, delay_s=0.2)
    server.add_fault(relpath, "ignore_range")
    fetch(server.url(relpath), str(out / "f"), config=FAST, sha256=digest)
    _, second = server.requests
    assert second.range_start() == 1 * MIB and second.status == 200
    assert os.path.getsize(out / "f") == 4 * MIB
    assert _sha256(out / "f") == digest


# ------------------------------------------------------------------------ failures


@pytest.mark.parametrize("code", [404, 403])
def test_client_errors_are_final_and_redacted(
    server: FaultServer, blob: tuple[str, str], out: Path, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    relpath, _ = blob
    url = server.url(relpath if code == 403 else "missing.bin", SECRET_QUERY)
    if code == 403:
        server.add_fault(relpath, "status", code=403)
    with caplog.at_level(logging.DEBUG), pytest.raises(DownloadFailed) as info:
        fetch(url, str(out / "f"), config=FAST)
    exc = info.value
    assert exc.code == "download_failed"
    assert "127.0.0.1" in str(exc) and "secret" not in str(exc) and "X-Amz" not in str(exc)
    assert exc.details["status"] == code and exc.details["attempts"] == 1
    assert "secret" not in json.dumps(exc.to_json())
    assert exc.__cause__ is None and exc.__suppress_context__
    clone = pickle.loads(pickle.dumps(exc))
    assert (type(clone), clone.details) == (DownloadFailed, exc.details)
    assert len(server.requests) == 1  # final at once, no retries
    assert not (out / "f").exists()
    assert all("secret" not in record.getMessage() for record in caplog.records)


def test_retries_spent_keeps_partial_for_a_later_resume(
    server: FaultServer, root: Path, out: Path, caplog: pytest.LogCaptureFixture
) -> None:
    digest = _write_random(root / "f.bin", 8 * MIB)
    server.add_fault("f.bin", "reset", times=-1, after_bytes=1 * MIB, delay_s=0.1)
    dest = out / "f.bin"
    with caplog.at_level(logging.DEBUG), pytest.raises(DownloadFailed) as info:
        fetch(server.url("f.bin", SECRET_QUERY), str(dest), config=FAST)
    assert info.value.details["attempts"] == 3 and "secret" not in str(info.value)
    assert all("secret" not in record.getMessage() for record in caplog.records)
    assert any("attempt 1/3" in record.getMessage() for record in caplog.records)
    assert not dest.exists()
    partial, sidecar = partial_paths(str(dest))
    assert os.path.getsize(partial) == 3 * MIB  # 1 MiB from each attempt, all kept
    assert "secret" not in Path(sidecar).read_text()

    server.clear_faults()
    result = fetch(
        server.url("f.bin", "X-Amz-Signature=another-token"), str(dest), config=FAST, sha256=digest
    )
    assert result.resumed_bytes == 3 * MIB
    assert server.requests[-1].range_start() == 3 * MIB
    _no_leftovers(dest)


def test_5xx_forever_fails(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, _ = blob
    server.add_fault(relpath, "status", code=500, times=-1)
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url(relpath), str(out / "f"), config=FAST)
    assert info.value.details["status"] == 500
    assert server.count(relpath) == 3
    assert not (out / "f").exists()


def test_sha256_mismatch_removes_everything(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, _ = blob
    with pytest.raises(HashMismatch) as info:
        fetch(server.url(relpath), str(out / "f"), config=FAST, sha256="0" * 64)
    assert info.value.code == "hash_mismatch"
    assert info.value.details["expected"] == "0" * 64
    assert not (out / "f").exists()
    _no_leftovers(out / "f")


@pytest.mark.parametrize("fault", [None, "reset", "ignore_range"])
def test_one_stream_sha256_is_computed_while_the_file_is_written(
    server: FaultServer, blob: tuple[str, str], out: Path, monkeypatch: pytest.MonkeyPatch, fault: str | None
) -> None:
    # No second pass over the finished file: the hash follows the writer (transfer._follower),
    # also across a Range resume and across a restart from zero (a server ignoring Range).
    import executor.transfer._local as local_module

    def second_pass(*_args: object, **_kwargs: object) -> str:
        raise AssertionError("the file was hashed again after the download")

    monkeypatch.setattr(local_module, "hash_file", second_pass)
    relpath, digest = blob
    if fault is not None:
        server.add_fault(relpath, "reset", after_bytes=MIB, delay_s=0.2)
    if fault == "ignore_range":
        server.add_fault(relpath, "ignore_range")
    result = fetch(server.url(relpath), str(out / "f"), config=FAST, sha256=digest)
    assert result.sha256 == digest and _sha256(out / "f") == digest
    assert len(server.requests) == (1 if fault is None else 2)


def test_hash_follower_sees_a_truncated_and_rewritten_file(tmp_path: Path) -> None:
    from executor.transfer._cancel import Cancel
    from executor.transfer._follower import HashFollower

    path = tmp_path / "f"
    path.write_bytes(b"")
    old, new = os.urandom(3 * MIB), os.urandom(2 * MIB)
    follower = HashFollower(str(path))
    try:
        with open(path, "r+b") as file:
            file.write(old)
            file.flush()
            follower.add(len(old))
            time.sleep(0.05)  # not for correctness: the follower has likely read some old bytes
            file.truncate(0)
            follower.mark(0)
            file.seek(0)
            file.write(new)
            file.flush()
            follower.add(len(new))
        with Cancel(None, "test") as cancel:
            assert follower.result(len(new), cancel) == hashlib.sha256(new).hexdigest()
            assert follower.result(len(new) + 1, cancel) is None  # not every byte was seen
    finally:
        follower.close()


def test_size_mismatch_fails(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, _ = blob
    with pytest.raises(DownloadFailed):
        fetch(server.url(relpath), str(out / "f"), config=FAST, size=4 * MIB + 1)
    assert not (out / "f").exists()


def test_unsupported_scheme(out: Path) -> None:
    with pytest.raises(InvalidRequest):
        fetch("ftp://example.com/x?token=1", str(out / "f"), config=FAST)


# ------------------------------------------------------------------------ parallel


def _parallel_config(connections: int) -> TransferConfig:
    return transfer_config(
        Settings(
            download_retries=3,
            download_backoff_s=0.01,
            read_timeout_s=20.0,
            download_buffer_bytes=1 * MIB,
            parallel_min_bytes=1 * MIB,
            parallel_connections=connections,
            parallel_below_bytes_s=0,  # always split: these tests are about the split itself
        )
    )


def test_parallel_ranged_download_is_byte_identical(
    tmp_path: Path, big_file: tuple[Path, str], out: Path
) -> None:
    path, digest = big_file
    calls: list[tuple[int, int | None]] = []
    lock = threading.Lock()

    def progress(done: int, total: int | None) -> None:
        with lock:
            calls.append((done, total))

    with FaultServer(path.parent) as srv:
        result = fetch(srv.url(path.name), str(out / "big"), config=_parallel_config(8), progress=progress)
        ranged = [r for r in srv.requests if r.range_header is not None]
    size = path.stat().st_size
    assert result.connections == 8 and result.bytes == size
    assert len(ranged) >= 7, ranged
    assert all(r.status == 206 for r in ranged)
    assert _sha256(out / "big") == digest
    assert calls[-1] == (size, size)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))
    _no_leftovers(out / "big")


@pytest.mark.parametrize("fast", [True, False])
def test_first_connection_probe_decides_the_split(
    server: FaultServer, root: Path, out: Path, fast: bool
) -> None:
    # The first connection copies its first 16 MiB (transfer._stream.PROBE_BYTES) and splits only
    # when that ran slower than parallel_below_bytes_s; either way no byte is fetched twice.
    size = 40 * MIB
    digest = _write_random(root / "q.bin", size)
    config = dataclasses.replace(_parallel_config(4), parallel_below_bytes_s=1 if fast else 10**15)
    result = fetch(server.url("q.bin"), str(out / "q"), config=config, sha256=digest)
    assert _sha256(out / "q") == digest
    if fast:
        assert result.connections == 1 and [r.range_header for r in server.requests] == [None]
    else:
        # segment 0 (10 MiB) is probed whole and ends with the first response: no range
        # request covers it again
        assert result.connections == 4
        starts = sorted(r.range_start() for r in server.requests if r.range_header)
        assert starts == [10 * MIB, 20 * MIB, 30 * MIB], starts


def test_an_origin_that_ran_slow_is_split_at_once_next_time(
    server: FaultServer, root: Path, out: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Everything is "slow" against this threshold: the first download probes the origin's one
    # stream and splits; the second, from the same origin, splits right after the head.
    config = dataclasses.replace(_parallel_config(4), parallel_below_bytes_s=10**15)
    digests = {name: _write_random(root / name, 40 * MIB) for name in ("a.bin", "b.bin")}
    probes, at_once = [], []
    for name, digest in digests.items():
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="executor.transfer"):
            result = fetch(server.url(name), str(out / name), config=config, sha256=digest)
        assert result.connections == 4 and _sha256(out / name) == digest
        probes.append(any("one stream at" in r.getMessage() for r in caplog.records))
        at_once.append(any("split at once" in r.getMessage() for r in caplog.records))
    assert probes == [True, False] and at_once == [False, True], (probes, at_once)
    # No byte fetched twice either way: segment 0 stays on the first response.
    starts = sorted(r.range_start() for r in server.requests if r.path == "b.bin" and r.range_header)
    assert starts == [10 * MIB, 20 * MIB, 30 * MIB], starts


def test_parallel_segment_fault_is_recovered(server: FaultServer, root: Path, out: Path) -> None:
    digest = _write_random(root / "p.bin", 16 * MIB)
    # Resets the first ranged request that is not segment 0, after 1 MiB of its body.
    server.add_fault("p.bin", "reset", range_start_min=1, after_bytes=1 * MIB, delay_s=0.2)
    result = fetch(server.url("p.bin"), str(out / "p"), config=_parallel_config(4), sha256=digest)
    assert result.connections == 4
    starts = sorted(r.range_start() or 0 for r in server.requests if r.range_start())
    boundaries = {4 * MIB, 8 * MIB, 12 * MIB}
    resumed = [s for s in starts if s not in boundaries]
    assert len(resumed) == 1 and resumed[0] - 1 * MIB in boundaries, starts
    assert _sha256(out / "p") == digest


def test_parallel_stops_on_a_plain_event(server: FaultServer, root: Path, out: Path) -> None:
    _write_random(root / "p.bin", 8 * MIB)
    server.add_fault("p.bin", "stall", times=-1, after_bytes=256 * 1024)
    abort = threading.Event()
    latency = _abort_latency(
        lambda: fetch(server.url("p.bin"), str(out / "p"), config=_parallel_config(4), abort=abort),
        abort,
        server,
        stalls=4,
    )
    assert latency < STOP_BOUND_S, f"stop took {latency:.3f} s"
    assert os.path.exists(partial_paths(str(out / "p"))[0])


# ---------------------------------------------------------------- crash and resume

_CHILD = """
import sys
from executor.configs import transfer_config
from executor.transfer import fetch
from settings import Settings
config = transfer_config(Settings(
    download_retries=1, read_timeout_s=60, download_buffer_bytes={buffer}, parallel_min_bytes={min_bytes},
    parallel_connections={connections}, parallel_below_bytes_s={below}))
fetch(sys.argv[1], sys.argv[2], config=config)
"""


def _spawn_fetch(
    url: str, dest: Path, *, buffer: int, min_bytes: int, connections: int, below: int = 0
) -> subprocess.Popen[bytes]:
    code = _CHILD.format(buffer=buffer, min_bytes=min_bytes, connections=connections, below=below)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, url, str(dest)], env=env, cwd=REPO_ROOT)


def _wait_until(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _kill(child: subprocess.Popen[bytes]) -> None:
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_resume_after_kill_9(server: FaultServer, root: Path, out: Path) -> None:
    digest = _write_random(root / "r.bin", 8 * MIB)
    server.add_fault("r.bin", "stall", after_bytes=3 * MIB)
    dest = out / "r.bin"
    partial, _ = partial_paths(str(dest))
    child = _spawn_fetch(
        server.url("r.bin", SECRET_QUERY), dest, buffer=MIB, min_bytes=1 << 40, connections=1
    )
    try:
        _wait_until(lambda: os.path.exists(partial) and os.path.getsize(partial) >= 3 * MIB)
    finally:
        _kill(child)
    server.release_stalls()
    result = fetch(server.url("r.bin", SECRET_QUERY), str(dest), config=FAST, sha256=digest)
    assert result.resumed_bytes == 3 * MIB
    assert server.requests[-1].range_start() == 3 * MIB
    assert _sha256(dest) == digest
    _no_leftovers(dest)


def test_kill_9_during_the_first_connection_probe_resumes(server: FaultServer, root: Path, out: Path) -> None:
    # The probe (the first 16 MiB of a would-be parallel download) runs under a one-stream
    # sidecar, so a crash there keeps its bytes; the resume carries on as one stream.
    digest = _write_random(root / "r.bin", 40 * MIB)
    server.add_fault("r.bin", "stall", after_bytes=3 * MIB)
    dest = out / "r.bin"
    partial, _ = partial_paths(str(dest))
    child = _spawn_fetch(server.url("r.bin"), dest, buffer=MIB, min_bytes=MIB, connections=4, below=10**15)
    try:
        _wait_until(lambda: os.path.exists(partial) and os.path.getsize(partial) >= 3 * MIB)
    finally:
        _kill(child)
    server.release_stalls()
    result = fetch(server.url("r.bin"), str(dest), config=FAST, sha256=digest)
    assert (result.resumed_bytes, result.connections) == (3 * MIB, 1)
    assert server.requests[-1].range_start() == 3 * MIB
    assert _sha256(dest) == digest


def test_parallel_resume_after_kill_9_is_segment_wise(server: FaultServer, root: Path, out: Path) -> None:
    size = 24 * MIB
    digest = _write_random(root / "r.bin", size)
    # Each of the two segments writes 6 MiB, of which the sidecar records at least 4 MiB.
    server.add_fault("r.bin", "stall", times=-1, after_bytes=RECORD_EVERY_BYTES + 2 * MIB)
    dest = out / "r.bin"
    _, sidecar = partial_paths(str(dest))

    def recorded() -> list[int]:
        try:
            return [seg[2] for seg in json.loads(Path(sidecar).read_text())["segments"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    child = _spawn_fetch(server.url("r.bin"), dest, buffer=MIB, min_bytes=MIB, connections=2)
    try:
        _wait_until(lambda: len(recorded()) == 2 and min(recorded()) >= RECORD_EVERY_BYTES)
    finally:
        _kill(child)
    at_kill = recorded()
    server.clear_faults()
    server.release_stalls()
    before = len(server.requests)
    result = fetch(server.url("r.bin"), str(dest), config=_parallel_config(2), sha256=digest)
    # Any sidecar write records every segment's written bytes, so each is at least 4 MiB.
    assert result.resumed_bytes == sum(at_kill) >= 2 * RECORD_EVERY_BYTES
    starts = sorted(r.range_start() or 0 for r in server.requests[before:])
    assert starts == [at_kill[0], size // 2 + at_kill[1]]
    assert result.connections == 2
    assert _sha256(dest) == digest


# --------------------------------------------------------------------------- abort


def _abort_latency(run: object, abort: threading.Event, server: FaultServer, stalls: int = 1) -> float:
    """Start ``run`` in a thread, set ``abort`` once the server stalls; seconds until Stopped."""
    errors: list[BaseException] = []
    ended: list[float] = []

    def target() -> None:
        try:
            run()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)
        ended.append(time.monotonic())

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        assert server.wait_for_stalls(stalls, timeout_s=20), "server never stalled"
        time.sleep(0.1)  # not for correctness: the client is most likely blocked in its read now
        started = time.monotonic()
        abort.set()
        thread.join(timeout=15)
        assert not thread.is_alive(), "download did not stop"
    finally:
        server.release_stalls()
    assert len(errors) == 1 and isinstance(errors[0], Stopped), errors
    assert errors[0].code == "stopped"
    return ended[0] - started


def test_stop_signal_aborts_a_stalled_read(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, _ = blob
    server.add_fault(relpath, "stall", after_bytes=1 * MIB)
    signal_ = StopSignal()
    config = transfer_config(
        Settings(
            download_retries=3, download_backoff_s=0.01, read_timeout_s=60.0, download_buffer_bytes=64 * 1024
        )
    )
    latency = _abort_latency(
        lambda: fetch(server.url(relpath), str(out / "f"), config=config, abort=signal_), signal_, server
    )
    assert latency < STOP_BOUND_S, f"stop took {latency:.3f} s"
    assert server.count(relpath) == 1  # no retry after a stop
    assert os.path.getsize(partial_paths(str(out / "f"))[0]) == 1 * MIB  # kept for a resume
    assert not signal_._callbacks  # unregistered in finally


def test_a_connection_gone_silent_is_given_up_after_the_speed_floors_window(
    server: FaultServer, blob: tuple[str, str], out: Path
) -> None:
    """No byte at all (no RST either) never reaches the speed floor; the body's read timeout
    is the floor's window, so the attempt ends after it and resumes, not after read_timeout_s."""
    relpath, digest = blob
    server.add_fault(relpath, "stall", after_bytes=1 * MIB)
    silent = dict(FAST_SETTINGS, read_timeout_s=300.0)
    floor = dict(download_low_speed_bytes_s=1024, download_low_speed_time_s=1.0)
    config = transfer_config(Settings(**silent, **floor))
    started = time.monotonic()
    try:
        fetch(server.url(relpath), str(out / "f"), config=config, sha256=digest)
    finally:
        server.release_stalls()
    took = time.monotonic() - started
    # 1 s of silence, then a resume; far from the 300 s read timeout even on a loaded machine.
    assert took < 60, f"{took:.1f} s: the silent connection was waited out"
    assert server.requests[-1].range_start() == 1 * MIB  # the retry resumed where the silence began
    assert _sha256(out / "f") == digest


def test_abort_during_backoff(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, _ = blob
    server.add_fault(relpath, "status", code=503, times=-1)
    abort = threading.Event()
    config = transfer_config(Settings(download_retries=3, download_backoff_s=30.0))
    timer = threading.Timer(0.3, abort.set)
    timer.start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        fetch(server.url(relpath), str(out / "f"), config=config, abort=abort)
    assert time.monotonic() - started < STOP_BOUND_S  # not the 30 s backoff
    assert server.count(relpath) == 1


def test_already_set_abort_makes_no_request(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    signal_ = StopSignal()
    signal_.set()
    with pytest.raises(Stopped):
        fetch(server.url(blob[0]), str(out / "f"), config=FAST, abort=signal_)
    assert server.requests == []


# ------------------------------------------------------------------- sidecar checks


def test_file_changed_on_server_starts_over(server: FaultServer, root: Path, out: Path) -> None:
    _write_random(root / "c.bin", 4 * MIB)
    server.add_fault("c.bin", "reset", after_bytes=1 * MIB, delay_s=0.2)
    dest = out / "c.bin"
    with pytest.raises(DownloadFailed):
        fetch(
            server.url("c.bin"),
            str(dest),
            config=transfer_config(Settings(download_retries=1, download_buffer_bytes=64 * 1024)),
        )
    assert os.path.getsize(partial_paths(str(dest))[0]) == 1 * MIB
    new_digest = _write_random(root / "c.bin", 3 * MIB)  # another size: another ETag
    result = fetch(server.url("c.bin"), str(dest), config=FAST, sha256=new_digest)
    last = server.requests[-1]
    assert last.range_start() == 1 * MIB and last.status == 200  # If-Range did not match
    assert result.bytes == 3 * MIB and result.resumed_bytes == 0
    assert _sha256(dest) == new_digest


def test_sidecar_of_another_url_is_not_resumed(server: FaultServer, blob: tuple[str, str], out: Path) -> None:
    relpath, digest = blob
    dest = out / "x.bin"
    partial, sidecar = partial_paths(str(dest))
    Path(partial).write_bytes(b"x" * 1000)
    Path(sidecar).write_text(
        json.dumps(
            {"v": 1, "url": server.url("other.bin"), "etag": None, "last_modified": None, "total": None}
        )
    )
    result = fetch(server.url(relpath), str(dest), config=FAST, sha256=digest)
    assert result.resumed_bytes == 0
    assert server.requests[-1].range_header is None


# ----------------------------------------------------------------------- local URLs


def test_local_sources_are_copied(root: Path, out: Path, blob: tuple[str, str]) -> None:
    relpath, digest = blob
    source = root / relpath
    result = fetch(source.as_uri(), str(out / "copy.bin"), sha256=digest, config=_rooted(root))
    assert result.connections == 0 and result.sha256 == digest
    assert _sha256(out / "copy.bin") == digest
    assert source.exists() and os.stat(source).st_nlink == 1  # neither moved nor hard-linked
    _no_leftovers(out / "copy.bin")


def test_a_plain_path_is_not_a_url(root: Path, out: Path, blob: tuple[str, str]) -> None:
    with pytest.raises(InvalidRequest) as info:
        fetch(str(root / blob[0]), str(out / "copy.bin"), config=_rooted(root))
    assert info.value.code == "invalid_request" and "file://" in str(info.value)
    assert os.listdir(out) == []


def test_local_source_missing(out: Path) -> None:
    with pytest.raises(DownloadFailed):
        fetch((out / "nope.bin").as_uri(), str(out / "f"), config=_rooted(out))


# ------------------------------------------------------------------------- upload


def test_upload_put_round_trip(server: FaultServer, root: Path, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    digest = _write_random(source, 3 * MIB + 7)
    sent = upload(str(source), server.url("deltas/d.bin", SECRET_QUERY), config=FAST)
    assert sent == 3 * MIB + 7
    assert _sha256(root / "deltas" / "d.bin") == digest
    (record,) = server.requests
    assert (record.method, record.status, record.bytes_sent) == ("PUT", 201, sent)


def test_upload_retried_after_500(server: FaultServer, root: Path, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    digest = _write_random(source, 1 * MIB)
    server.add_fault("d.bin", "status", code=500, method="PUT")
    server.add_fault("d.bin", "reset", method="PUT", after_bytes=64 * 1024)
    upload(str(source), server.url("d.bin"), config=FAST)
    assert [r.status for r in server.requests] == [500, None, 201]
    assert _sha256(root / "d.bin") == digest


def test_upload_failure_is_redacted(server: FaultServer, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    source.write_bytes(b"abc")
    server.add_fault("d.bin", "status", code=503, times=-1, method="PUT")
    with pytest.raises(UploadFailed) as info:
        upload(str(source), server.url("d.bin", SECRET_QUERY), config=FAST)
    assert info.value.code == "download_failed"
    assert "secret" not in str(info.value) and "127.0.0.1" in str(info.value)
    assert server.count("d.bin", "PUT") == 3


def test_upload_to_local_destination(tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    digest = _write_random(source, 2 * MIB)
    target = tmp_path / "shared" / "volume" / "delta.bin"
    (tmp_path / "shared").mkdir()  # the root exists; what is below it is made
    assert upload(str(source), target.as_uri(), config=_rooted(tmp_path / "shared")) == 2 * MIB
    assert _sha256(target) == digest
    assert sorted(os.listdir(target.parent)) == ["delta.bin"]  # no temp file left behind


def test_upload_to_a_plain_path_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    source.write_bytes(b"abc")
    (tmp_path / "shared").mkdir()
    with pytest.raises(InvalidRequest):
        upload(str(source), str(tmp_path / "shared" / "delta.bin"), config=_rooted(tmp_path / "shared"))
    assert os.listdir(tmp_path / "shared") == []


def test_upload_stops(server: FaultServer, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    source.write_bytes(b"abc")
    signal_ = StopSignal()
    signal_.set()
    with pytest.raises(Stopped):
        upload(str(source), server.url("d.bin"), config=FAST, abort=signal_)
    assert server.requests == []


# -------------------------------------------------------------------------- small


def test_redact_url() -> None:
    assert redact_url("https://user:pw@Bucket.s3.example.com:8443/a/b.bin?X-Amz-Signature=s#frag") == (
        "https://bucket.s3.example.com:8443/a/b.bin"
    )
    assert redact_url("http://[::1]:9000/x?y=1") == "http://[::1]:9000/x"
    assert redact_url("file:///data/x.bin") == "file:///data/x.bin"
    assert redact_url("/data/x.bin") == "/data/x.bin"


def test_config_from_settings() -> None:
    settings = Settings(download_retries=5, download_backoff_s=0.5, parallel_connections=3)
    config = transfer_config(settings)
    assert (config.retries, config.backoff_s, config.parallel_connections) == (5, 0.5, 3)
    assert config.buffer_bytes == settings.download_buffer_bytes
    with pytest.raises(ValueError):
        transfer_config(Settings(download_retries=0))


def test_remote_size(server: FaultServer, root: Path, blob: tuple[str, str]) -> None:
    from executor.transfer import remote_size

    relpath, _ = blob
    assert remote_size(server.url(relpath, SECRET_QUERY), config=FAST) == 4 * MIB
    assert server.requests[-1].range_header == "bytes=0-0"  # GET, as a presigned URL allows
    server.add_fault(relpath, "ignore_range")
    assert remote_size(server.url(relpath), config=FAST) == 4 * MIB
    (root / "empty.bin").write_bytes(b"")
    assert remote_size(server.url("empty.bin"), config=FAST) == 0
    assert remote_size((root / relpath).as_uri(), config=_rooted(root)) == 4 * MIB
    with pytest.raises(DownloadFailed):
        remote_size(server.url("missing.bin"), config=FAST)


def test_upload_stops_mid_body(server: FaultServer, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    _write_random(source, 8 * MIB)
    server.add_fault("d.bin", "stall", method="PUT", after_bytes=1 * MIB)
    signal_ = StopSignal()
    latency = _abort_latency(
        lambda: upload(str(source), server.url("d.bin"), config=FAST, abort=signal_), signal_, server
    )
    assert latency < STOP_BOUND_S, f"stop took {latency:.3f} s"
    assert server.count("d.bin", "PUT") == 1


def _sidecar(server: FaultServer, relpath: str, **fields: object) -> str:
    import requests

    headers = requests.head(server.url(relpath), timeout=10).headers
    data = {
        "v": 1,
        "url": server.url(relpath),
        "etag": headers["ETag"],
        "last_modified": headers["Last-Modified"],
    }
    return json.dumps({**data, "total": int(headers["Content-Length"]), "segments": None, **fields})


def test_complete_partial_is_confirmed_by_a_416(
    server: FaultServer, root: Path, blob: tuple[str, str], out: Path
) -> None:
    relpath, digest = blob
    dest = out / "done.bin"
    partial, sidecar = partial_paths(str(dest))
    Path(partial).write_bytes((root / relpath).read_bytes())
    Path(sidecar).write_text(_sidecar(server, relpath))
    result = fetch(server.url(relpath), str(dest), config=FAST, sha256=digest)
    assert result.resumed_bytes == 4 * MIB
    assert [(r.range_start(), r.status) for r in server.requests[1:]] == [(4 * MIB, 416)]


def test_changed_file_restarts_a_ranged_resume(server: FaultServer, root: Path, out: Path) -> None:
    _write_random(root / "g.bin", 4 * MIB)
    dest = out / "g.bin"
    partial, sidecar = partial_paths(str(dest))
    Path(partial).write_bytes(b"\0" * 4 * MIB)
    segments = [[0, 2 * MIB, MIB], [2 * MIB, 4 * MIB, MIB]]
    Path(sidecar).write_text(_sidecar(server, "g.bin", segments=segments, etag='"stale"'))
    digest = _write_random(root / "g.bin", 4 * MIB)  # same size, new content
    os.utime(root / "g.bin", ns=(1, 1))  # and another ETag
    result = fetch(server.url("g.bin"), str(dest), config=_parallel_config(2), sha256=digest)
    assert result.resumed_bytes == 0
    # A resume was attempted: at least one segment asked for its rest (the first to see the
    # new ETag cancels the other, which may not have sent its request yet).
    assert {MIB, 3 * MIB} & {r.range_start() for r in server.requests}
    assert _sha256(dest) == digest


# ------------------------------------------------------- following a split download


def test_a_split_download_in_many_segments_is_hashed_as_its_front_lands(
    server: FaultServer, root: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More segments than connections, taken in file order: the sha256 and a digest given with
    # ``follow`` follow the gapless front, so the file is not read a second time.
    import executor.transfer._local as local_module

    def second_pass(*_args: object, **_kwargs: object) -> str:
        raise AssertionError("the file was hashed again after the download")

    monkeypatch.setattr(local_module, "hash_file", second_pass)
    digest = _write_random(root / "s.bin", 12 * MIB + 12345)
    # One reset mid-segment too: the segment resumes and the front still arrives whole.
    server.add_fault("s.bin", "reset", range_start_min=5 * MIB, after_bytes=300_000, delay_s=0.1)
    result = fetch(
        server.url("s.bin"),
        str(out / "s"),
        config=dataclasses.replace(_parallel_config(3), segment_max_bytes=1 * MIB),
        sha256=digest,
        follow=hashlib.blake2b,  # any digest of the bytes in order
    )
    assert result.connections == 3 and result.sha256 == digest == _sha256(out / "s")
    assert result.followed == hashlib.blake2b((out / "s").read_bytes()).hexdigest()
    ranged = sorted(r.range_start() or 0 for r in server.requests if r.range_header)
    assert len(ranged) >= 12, ranged  # 13 segments of 1 MiB, the first on the probe's response
    _no_leftovers(out / "s")
