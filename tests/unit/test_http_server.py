"""The fault-injecting test server itself: ranges, validators, PUT, faults, the request log."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import urllib3

from tests.support.http_server import FaultServer
from tests.support.waiting import wait_until

DATA = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FaultServer]:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f.bin").write_bytes(DATA)
    with FaultServer(tmp_path) as srv:
        yield srv


def _get(
    server: FaultServer, headers: dict[str, str] | None = None, path: str = "dir/f.bin"
) -> requests.Response:
    return requests.get(server.url(path, "sig=x"), headers=headers or {}, timeout=10)


def test_full_get_and_head(server: FaultServer) -> None:
    response = _get(server)
    assert response.status_code == 200 and response.content == DATA
    assert response.headers["Accept-Ranges"] == "bytes"
    assert response.headers["ETag"] and response.headers["Last-Modified"]
    head = requests.head(server.url("dir/f.bin"), timeout=10)
    assert head.status_code == 200 and head.headers["Content-Length"] == str(len(DATA)) and not head.content
    # The client has every byte before the server's thread records the request's end.
    wait_until(lambda: server.requests[0].ended is not None, 10, "the server to record the GET's end")
    record = server.requests[0]
    assert (record.method, record.path, record.query, record.status) == ("GET", "dir/f.bin", "sig=x", 200)
    assert record.bytes_sent == len(DATA) and record.ended is not None
    assert server.count("dir/f.bin") == 1 and server.count("dir/f.bin", "HEAD") == 1


@pytest.mark.parametrize(
    ("header", "expected", "content_range"),
    [
        ("bytes=10-19", DATA[10:20], "bytes 10-19/16384"),
        ("bytes=16000-", DATA[16000:], "bytes 16000-16383/16384"),
        ("bytes=-100", DATA[-100:], "bytes 16284-16383/16384"),
        ("bytes=16380-99999", DATA[16380:], "bytes 16380-16383/16384"),
    ],
)
def test_ranges(server: FaultServer, header: str, expected: bytes, content_range: str) -> None:
    response = _get(server, {"Range": header})
    assert response.status_code == 206
    assert response.content == expected
    assert response.headers["Content-Range"] == content_range
    assert server.requests[0].range_header == header


def test_unsatisfiable_range_and_missing_file(server: FaultServer) -> None:
    response = _get(server, {"Range": "bytes=99999-"})
    assert response.status_code == 416 and response.headers["Content-Range"] == "bytes */16384"
    assert _get(server, path="nope.bin").status_code == 404
    assert _get(server, path="../outside").status_code == 404


def test_if_range(server: FaultServer) -> None:
    etag = _get(server).headers["ETag"]
    assert _get(server, {"Range": "bytes=5-", "If-Range": etag}).status_code == 206
    stale = _get(server, {"Range": "bytes=5-", "If-Range": '"other"'})
    assert stale.status_code == 200 and stale.content == DATA


def test_status_fault_times(server: FaultServer) -> None:
    server.add_fault("dir/f.bin", "status", code=503, times=2)
    assert [_get(server).status_code for _ in range(3)] == [503, 503, 200]
    server.add_fault("dir/f.bin", "status", code=500, times=-1)
    assert [_get(server).status_code for _ in range(3)] == [500, 500, 500]
    server.clear_faults()
    assert _get(server).status_code == 200


def test_body_faults(server: FaultServer) -> None:
    server.add_fault("dir/f.bin", "reset", after_bytes=100)
    with pytest.raises(requests.RequestException):
        _get(server)
    server.add_fault("dir/f.bin", "truncate", after_bytes=100)
    with pytest.raises(requests.RequestException):  # IncompleteRead
        _get(server)
    server.add_fault("dir/f.bin", "wrong_length", length=50)
    assert _get(server).content == DATA[:50]
    server.add_fault("dir/f.bin", "ignore_range")
    ignored = _get(server, {"Range": "bytes=5-"})
    assert ignored.status_code == 200 and ignored.content == DATA
    server.add_fault("dir/f.bin", "slow", chunk_bytes=4096, delay_s=0.01)
    assert _get(server).content == DATA


def test_range_start_min_selects_requests(server: FaultServer) -> None:
    server.add_fault("dir/f.bin", "status", code=500, range_start_min=100)
    assert _get(server).status_code == 200
    assert _get(server, {"Range": "bytes=10-"}).status_code == 206
    assert _get(server, {"Range": "bytes=200-"}).status_code == 500
    assert _get(server, {"Range": "bytes=200-"}).status_code == 206


def test_stall_until_released(server: FaultServer) -> None:
    server.add_fault("dir/f.bin", "stall", after_bytes=10)
    response = requests.get(server.url("dir/f.bin"), stream=True, timeout=10)
    assert response.raw.read(10) == DATA[:10]
    assert server.wait_for_stalls(1, timeout_s=5)
    assert server.requests[0].ended is None  # still in flight
    server.release_stalls()
    # The server closed after 10 of the promised bytes: urllib3 reports a short body.
    with pytest.raises(urllib3.exceptions.ProtocolError, match="IncompleteRead"):
        response.raw.read(100)
    response.close()


def test_put_is_atomic_and_faults_apply(server: FaultServer, tmp_path: Path) -> None:
    assert requests.put(server.url("up/new.bin"), data=b"hello", timeout=10).status_code == 201
    assert requests.put(server.url("up/new.bin"), data=b"again", timeout=10).status_code == 204
    assert (tmp_path / "up" / "new.bin").read_bytes() == b"again"
    server.add_fault("up/new.bin", "status", code=500, method="PUT")
    assert requests.put(server.url("up/new.bin"), data=b"x", timeout=10).status_code == 500
    server.add_fault("up/new.bin", "reset", method="PUT")
    with pytest.raises(requests.ConnectionError):
        requests.put(server.url("up/new.bin"), data=b"x" * 1_000_000, timeout=10)
    assert (tmp_path / "up" / "new.bin").read_bytes() == b"again"
    assert sorted(os.listdir(tmp_path / "up")) == ["new.bin"]
    assert [r.status for r in server.requests] == [201, 204, 500, None]
