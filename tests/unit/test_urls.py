"""executor.urls: a URL that redacts itself (DESIGN §10), alone and through executor.transfer.

A presigned URL's query string is a credential: whatever shows a :class:`Url` (str, repr,
format, %-format, a log line, an error of the transfer layer, its JSON, its pickle) must
show no query, fragment or userinfo; only ``reveal()`` gives the raw form.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.configs import transfer_config
from executor.errors import DownloadFailed, InvalidRequest, RoundhouseError, UploadFailed
from executor.transfer import fetch, partial_paths, remote_size, upload
from executor.urls import Url, redact_url
from settings import Settings
from tests.support.http_server import FaultServer

SECRETS = ("s3cr3t-signature", "AKIAEXAMPLE", "hunter2", "frag-token")
RAW = (
    "https://alice:hunter2@Bucket.s3.example.com:8443/a/b.bin"
    "?X-Amz-Signature=s3cr3t-signature&X-Amz-Credential=AKIAEXAMPLE#frag-token"
)
SHOWN = "https://bucket.s3.example.com:8443/a/b.bin"
QUERY = "X-Amz-Signature=s3cr3t-signature&X-Amz-Credential=AKIAEXAMPLE"
FAST = transfer_config(
    Settings(
        download_retries=2, download_backoff_s=0.01, read_timeout_s=20.0, download_buffer_bytes=64 * 1024
    )
)


def _clean(text: str) -> bool:
    return not any(secret in text for secret in (*SECRETS, "X-Amz", "alice"))


# ------------------------------------------------------------------- the value


def test_every_rendering_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    url = Url(RAW)
    shown = [
        str(url),
        repr(url),
        format(url),
        format(url, ">60"),
        f"{url}",
        f"{url!r}",
        f"{url!s}",
        "%s" % url,  # noqa: UP031 - the %-format is what is tested
        "%r" % url,  # noqa: UP031
        "{}".format(url),  # noqa: UP032
        json.dumps({"url": url}, default=str),
        str([url]),
        str({"url": url}),
    ]
    assert all(_clean(text) for text in shown), shown
    assert str(url) == SHOWN and repr(url) == f"Url({SHOWN!r})"
    with caplog.at_level(logging.DEBUG, logger="test_urls"):
        logging.getLogger("test_urls").info("fetching %s (%r)", url, url)
        logging.getLogger("test_urls").info(url)
    assert [_clean(record.getMessage()) for record in caplog.records] == [True, True]
    assert SHOWN in caplog.text and _clean(caplog.text)


def test_the_raw_form_comes_only_through_reveal() -> None:
    url = Url(RAW)
    assert url.reveal() == RAW
    assert not isinstance(url, str)  # a Url handed to requests or open is a type error
    assert (url.scheme, url.host, url.port) == ("https", "bucket.s3.example.com", 8443)
    with pytest.raises(TypeError):
        json.dumps(url)  # no accidental serialisation, raw or not
    with pytest.raises(AttributeError):
        url._raw = "http://elsewhere/"


def test_a_value_equal_by_its_raw_form() -> None:
    url = Url(RAW)
    assert Url.of(url) is url and Url.of(RAW) == url
    assert hash(Url(RAW)) == hash(url)
    resigned = Url(RAW.replace("s3cr3t-signature", "another"))
    assert resigned != url and str(resigned) == str(url)  # two credentials, one rendering
    assert url != RAW and url != SHOWN  # never equal to a str
    assert len({url, Url(RAW), resigned}) == 2
    with pytest.raises(TypeError):
        Url(url)


def test_it_pickles_whole() -> None:
    url = Url(RAW)
    clone = pickle.loads(pickle.dumps(url))
    assert clone == url and clone.reveal() == RAW and str(clone) == SHOWN


def test_redact_url_takes_a_str_or_a_url() -> None:
    assert redact_url(RAW) == SHOWN == redact_url(Url(RAW))
    assert redact_url("http://[::1]:9000/x?y=1#z") == "http://[::1]:9000/x"
    assert redact_url("file:///data/x.bin?sig=1") == "file:///data/x.bin"
    assert redact_url("http:///x.bin?sig=1") == "http:///x.bin"  # no host, still a URL
    assert str(Url("/data/a?b.bin")) == "/data/a?b.bin"  # a plain path is no URL: '?' is a name


def test_the_client_shows_a_url_value_as_its_redacted_str() -> None:
    from tasks.client import redacted

    assert redacted({"delta_url": Url(RAW), "shards": [RAW, {"url": Url(RAW)}]}) == {
        "delta_url": SHOWN,
        "shards": [SHOWN, {"url": SHOWN}],
    }


# --------------------------------------------------------- through the transfer layer


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "served"
    path.mkdir()
    (path / "blob.bin").write_bytes(b"x" * (1024 * 1024))
    return path


@pytest.fixture
def server(root: Path) -> Iterator[FaultServer]:
    with FaultServer(root) as srv:
        yield srv


def _assert_redacted(exc: RoundhouseError) -> None:
    texts = [str(exc), repr(exc), exc.message, json.dumps(exc.to_json()), json.dumps(exc.details)]
    texts += [str(arg) for arg in exc.args]
    assert all(_clean(text) for text in texts), texts
    assert "127.0.0.1" in str(exc)
    # Errors carry the redacted str, never the value: a pickle (Celery's) holds no credential.
    assert all(not isinstance(value, Url) for value in exc.details.values())
    assert b"s3cr3t" not in pickle.dumps(exc)


@pytest.mark.parametrize("code", [403, 404])
@pytest.mark.parametrize("as_url", [False, True])
def test_a_refused_presigned_download_names_no_credential(
    server: FaultServer, tmp_path: Path, code: int, as_url: bool
) -> None:
    if code == 403:
        server.add_fault("blob.bin", "status", code=403, times=-1)
    raw = server.url("blob.bin" if code == 403 else "missing.bin", QUERY + "#frag-token")
    with pytest.raises(DownloadFailed) as info:
        fetch(Url(raw) if as_url else raw, str(tmp_path / "f"), config=FAST)
    assert info.value.details["status"] == code
    assert info.value.details["url"] == redact_url(raw)
    _assert_redacted(info.value)
    with pytest.raises(DownloadFailed) as sized:
        remote_size(Url(raw), config=FAST)
    _assert_redacted(sized.value)


def test_a_redirect_loop_with_signed_hops_names_no_credential(server: FaultServer, tmp_path: Path) -> None:
    loop = server.url("loop.bin", QUERY)
    server.add_fault("loop.bin", "redirect", times=-1, location=loop)
    with pytest.raises(DownloadFailed) as info:
        fetch(loop, str(tmp_path / "f"), config=FAST)
    assert "redirect loop" in str(info.value)
    _assert_redacted(info.value)


def test_a_refused_presigned_upload_names_no_credential(server: FaultServer, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    source.write_bytes(b"abc")
    server.add_fault("d.bin", "status", code=403, method="PUT")
    with pytest.raises(UploadFailed) as info:
        upload(str(source), Url(server.url("d.bin", QUERY)), config=FAST)
    _assert_redacted(info.value)


@pytest.mark.parametrize(
    "raw",
    [
        "ftp://alice:hunter2@files.example/x?X-Amz-Signature=s3cr3t-signature",
        "file:///nowhere/x.bin?X-Amz-Signature=s3cr3t-signature#frag-token",
        "http:///x?X-Amz-Signature=s3cr3t-signature",
    ],
)
def test_a_url_the_policy_refuses_is_named_redacted(raw: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as info:
        fetch(raw, str(tmp_path / "f"), config=FAST)
    texts = [str(info.value), json.dumps(info.value.to_json())]
    assert all(_clean(text) for text in texts), texts


def test_a_logged_download_shows_no_signature(
    server: FaultServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A retried attempt (the transfer's warning), urllib3's request lines at DEBUG, the sidecar.
    server.add_fault("blob.bin", "status", code=503)
    dest = tmp_path / "f"
    with caplog.at_level(logging.DEBUG):
        fetch(Url(server.url("blob.bin", QUERY)), str(dest), config=FAST)
    assert dest.read_bytes() == b"x" * (1024 * 1024)
    messages = [record.getMessage() for record in caplog.records]
    requested = [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")]
    assert any("/blob.bin" in message for message in requested), messages  # urllib3 did log
    assert any("attempt 1/2" in message for message in messages), messages
    assert all(_clean(message) for message in messages), messages
    assert _clean(caplog.text)


def test_the_resume_sidecar_holds_the_redacted_url(server: FaultServer, tmp_path: Path) -> None:
    server.add_fault("blob.bin", "reset", times=-1, after_bytes=256 * 1024, delay_s=0.1)
    dest = tmp_path / "f"
    with pytest.raises(DownloadFailed):
        fetch(server.url("blob.bin", QUERY), str(dest), config=FAST)
    sidecar = Path(partial_paths(str(dest))[1]).read_text()
    assert _clean(sidecar) and json.loads(sidecar)["url"] == server.url("blob.bin")
    server.clear_faults()
    # Re-presigned: the same object under another signature resumes what was left.
    result = fetch(Url(server.url("blob.bin", "X-Amz-Signature=other")), str(dest), config=FAST)
    assert result.resumed_bytes > 0 and dest.stat().st_size == 1024 * 1024
