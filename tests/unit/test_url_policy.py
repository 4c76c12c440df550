"""The URL policy and the byte caps of executor.transfer (DESIGN §11, data plane), against
real HTTP servers on loopback addresses, real files and links, real sockets.

Every test builds its own settings (the session's ``ROUNDHOUSE_URL_ALLOW`` does not apply
here). The only fake is DNS: no DNS server can run here, so a test that needs a name
injects a resolver; what it answers is then connected to for real.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from executor.configs import transfer_config
from executor.errors import BadArtifact, DownloadFailed, InvalidRequest, UploadFailed
from executor.fileio import MIB
from executor.transfer import TransferConfig, fetch, partial_paths, remote_size, upload
from settings import Settings
from tests.support.http_server import FaultServer

SECRET = "X-Amz-Signature=secret-token"
DATA = os.urandom(3 * MIB + 17)


def config(*, allow: Sequence[str] = (), roots: Sequence[Path] = (), **settings: Any) -> TransferConfig:
    base: dict[str, Any] = dict(download_retries=3, download_backoff_s=0.01, read_timeout_s=20.0)
    base.update(settings)
    return transfer_config(Settings(url_allow=list(allow), file_roots=[str(root) for root in roots], **base))


class FakeDNS:
    """Answers for test names, in turn per name (the last one repeats); the rest: the system's."""

    def __init__(self, **answers: list[list[str]]) -> None:
        self.answers = {name.replace("_", "-") + ".test": list(turns) for name, turns in answers.items()}
        self.calls: list[str] = []

    def __call__(self, host: str, port: int) -> list[tuple[Any, ...]]:
        self.calls.append(host)
        turns = self.answers.get(host)
        if turns is None:
            return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        addresses = turns.pop(0) if len(turns) > 1 else turns[0]
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, port, 0, 0))
            if ":" in a
            else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
            for a in addresses
        ]


def resolving(base: TransferConfig, dns: FakeDNS) -> TransferConfig:
    return dataclasses.replace(base, policy=dataclasses.replace(base.policy, resolver=dns))


def in_thread(fn: Any) -> Any:
    """Run ``fn`` on a fresh thread (so on a fresh connection: sessions are per thread)."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(("ok", fn()))
        except BaseException as exc:
            outcome.append(("raised", exc))

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


def nothing_written(dest: Path) -> None:
    assert not dest.exists()
    for path in partial_paths(str(dest)):
        assert not os.path.exists(path), path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "served"
    path.mkdir()
    (path / "blob.bin").write_bytes(DATA)
    return path


@pytest.fixture
def server(root: Path) -> Iterator[FaultServer]:
    with FaultServer(root) as srv:
        yield srv


@pytest.fixture
def inside(tmp_path: Path) -> Iterator[FaultServer]:
    """An "internal" server on 127.0.0.2, which the tests never allow: what an attacker aims at."""
    secret_root = tmp_path / "internal"
    secret_root.mkdir()
    (secret_root / "secret.json").write_text('{"AccessKeyId": "stolen"}')
    with FaultServer(secret_root, host="127.0.0.2") as srv:
        yield srv


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


# ----------------------------------------------------------------- the deny list


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("169.254.1.1", "link_local"),
        ("fe80::1", "link_local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("169.254.169.254", "cloud_metadata"),
        ("fd00:ec2::254", "cloud_metadata"),
        ("100.100.100.200", "cloud_metadata"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "cloud_metadata"),
        ("::ffff:0.0.0.0", "unspecified"),
        # IPv6 forms that embed an IPv4 address a translator, relay or tunnel delivers to.
        ("::127.0.0.1", "loopback"),  # IPv4-compatible
        ("::169.254.169.254", "cloud_metadata"),
        ("64:ff9b::127.0.0.1", "loopback"),  # NAT64, well-known prefix
        ("64:ff9b::a9fe:a9fe", "cloud_metadata"),
        ("64:ff9b::", "unspecified"),
        ("64:ff9b:1::7f00:1", "loopback"),  # NAT64, local-use prefix as /96
        ("64:ff9b:1:7f00:0:100::", "loopback"),  # ... as /48 (bits 64-71 skipped)
        ("64:ff9b:1:a9:fe:a9fe::", "cloud_metadata"),  # ... as /56
        ("2002:7f00:1::1", "loopback"),  # 6to4
        ("2002:a9fe:a9fe:1::1", "cloud_metadata"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),  # Teredo: the client, obfuscated
        ("2001:0:a9fe:a9fe::", "cloud_metadata"),  # Teredo: the server
        ("2001:db8::5efe:7f00:1", "loopback"),  # ISATAP interface id
        ("2001:db8::200:5efe:a9fe:a9fe", "cloud_metadata"),
        ("64:ff9b::93.184.216.34", None),  # what NAT64 is for: public IPv4 from IPv6
        ("64:ff9b:1::5db8:d822", None),
        ("2002:5db8:d822::1", None),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", None),  # RFC 4380's example: public both ends
        ("2001:db8::5efe:5db8:d822", None),
        ("93.184.216.34", None),
        ("10.1.2.3", None),  # private networks are where object stores live: not denied
        ("2001:db8::1", None),
    ],
)
def test_each_denied_class(address: str, rule: str | None) -> None:
    refused = config().policy.refusal("files.example", address)
    assert (refused[0] if refused else None) == rule


def _own_global_address() -> str | None:
    ip = shutil.which("ip")
    if ip is None:
        return None
    links = json.loads(subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, check=True).stdout)
    for link in links:
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and info.get("scope") == "global":
                return str(info["local"])
    return None


def test_this_hosts_own_addresses_are_denied(root: Path, out: Path) -> None:
    own = _own_global_address()
    if own is None:
        pytest.skip("this host has no global IPv4 address")
    assert config().policy.refusal("files.example", own) == ("own_address", "this host's own address")
    with FaultServer(root, host=own) as srv:
        with pytest.raises(DownloadFailed) as info:
            fetch(srv.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"]))
        assert info.value.details["rule"] == "own_address"
        assert srv.requests == []
        assert fetch(srv.url("blob.bin"), str(out / "f"), config=config(allow=[own])).bytes == len(DATA)


def test_loopback_is_refused_at_connect(server: FaultServer, out: Path) -> None:
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("blob.bin", SECRET), str(out / "f"), config=config())
    error = info.value
    assert error.code == "download_failed" and error.details["rule"] == "loopback"
    assert error.details["attempts"] == 1  # a refusal is not retried
    assert "secret" not in str(error) and server.url("blob.bin") in str(error)
    assert server.requests == []
    nothing_written(out / "f")


def test_a_kept_alive_connection_is_checked_again(server: FaultServer, out: Path) -> None:
    fetch(server.url("blob.bin"), str(out / "a"), config=config(allow=["127.0.0.1"]))
    with pytest.raises(DownloadFailed) as info:  # same thread, same pool: the socket is reused
        fetch(server.url("blob.bin"), str(out / "b"), config=config())
    assert info.value.details["rule"] == "loopback"
    assert len(server.requests) == 1


# ------------------------------------------------------------------ the allow list


def test_allow_by_host_name(server: FaultServer, out: Path) -> None:
    dns = FakeDNS(artifacts=[["127.0.0.1"]])
    url = f"http://artifacts.test:{server.base_url.rsplit(':', 1)[1]}/blob.bin"
    fetched = fetch(url, str(out / "f"), config=resolving(config(allow=["Artifacts.test."]), dns))
    assert fetched.bytes == len(DATA) and server.requests[0].header("Host") == url.split("/")[2]
    with pytest.raises(DownloadFailed):  # another name for the same address is not opened
        in_thread(lambda: fetch(url, str(out / "g"), config=resolving(config(allow=["other.test"]), dns)))


def test_allow_by_network(server: FaultServer, inside: FaultServer, out: Path) -> None:
    wide = config(allow=["127.0.0.0/8"])
    assert fetch(server.url("blob.bin"), str(out / "a"), config=wide).bytes == len(DATA)
    assert fetch(inside.url("secret.json"), str(out / "b"), config=wide).bytes > 0
    with pytest.raises(DownloadFailed):  # one address opens that address only
        fetch(inside.url("secret.json"), str(out / "c"), config=config(allow=["127.0.0.1"]))
    with pytest.raises(ValueError):
        config(allow=["http://127.0.0.1/"])


def test_ipv4_mapped_ipv6_is_checked_as_ipv4(server: FaultServer, out: Path) -> None:
    port = server.base_url.rsplit(":", 1)[1]
    url = f"http://mapped.test:{port}/blob.bin"
    with pytest.raises(DownloadFailed) as info:
        fetch(url, str(out / "a"), config=resolving(config(), FakeDNS(mapped=[["::ffff:127.0.0.1"]])))
    assert info.value.details["rule"] == "loopback" and server.requests == []
    # Allowed as 127.0.0.1, whichever way it is written, and connected to as resolved.
    for allow in ("127.0.0.1", "::ffff:127.0.0.1"):
        mapped = resolving(config(allow=[allow]), FakeDNS(mapped=[["::ffff:127.0.0.1"]]))
        got = in_thread(lambda mapped=mapped: fetch(url, str(out / "b"), config=mapped))
        assert got.bytes == len(DATA)
    with pytest.raises(DownloadFailed) as info:  # written as a literal, too
        fetch(f"http://[::ffff:127.0.0.1]:{port}/blob.bin", str(out / "c"), config=config())
    assert info.value.details["rule"] == "loopback"


def test_ipv6_embedding_a_denied_ipv4_is_refused_at_connect(server: FaultServer, out: Path) -> None:
    """A NAT64 gateway or a 6to4/Teredo relay would carry these to 127.0.0.1: each is refused
    before any connection, as a literal or as a name's answer, naming what it embeds."""
    port = server.base_url.rsplit(":", 1)[1]
    for literal in ("64:ff9b::7f00:1", "64:ff9b:1::7f00:1", "2002:7f00:1::", "::127.0.0.1"):
        with pytest.raises(DownloadFailed) as info:
            fetch(f"http://[{literal}]:{port}/blob.bin", str(out / "a"), config=config())
        assert info.value.details["rule"] == "loopback", (literal, info.value.details)
        assert "127.0.0.1" in str(info.value) and "embedded" in str(info.value)
    dns = FakeDNS(nat64=[["64:ff9b::a9fe:a9fe"]])
    with pytest.raises(DownloadFailed) as info:
        fetch(f"http://nat64.test:{port}/blob.bin", str(out / "b"), config=resolving(config(), dns))
    assert info.value.details["rule"] == "cloud_metadata" and server.requests == []
    nothing_written(out / "a")
    # Opened by the embedded address, as an IPv4-mapped one is; or by the IPv6 network itself.
    for allow in ("127.0.0.1", "64:ff9b::/96"):
        assert config(allow=[allow]).policy.refusal("h.example", "64:ff9b::7f00:1") is None


# ------------------------------------------------------------------ DNS rebinding


@pytest.fixture
def twin(server: FaultServer, tmp_path: Path) -> Iterator[FaultServer]:
    """An "internal" server on 127.0.0.2 at the very port of ``server``: where a name that
    rebinds from 127.0.0.1 to 127.0.0.2 leads."""
    internal = tmp_path / "twin"
    internal.mkdir()
    (internal / "blob.bin").write_bytes(b"internal secret")
    with FaultServer(internal, host="127.0.0.2", port=int(server.base_url.rsplit(":", 1)[1])) as srv:
        yield srv


def test_dns_rebinding_is_refused_at_connect(server: FaultServer, twin: FaultServer, out: Path) -> None:
    """The name answers an allowed address first, a denied one the next time: each connection
    connects to the address its own lookup answered, checked, so the second one is refused."""
    url = f"http://rebind.test:{server.base_url.rsplit(':', 1)[1]}/blob.bin"
    # Where the second answer leads when the network is open: the internal server.
    loose = resolving(config(allow=["127.0.0.0/8"]), FakeDNS(rebind=[["127.0.0.1"], ["127.0.0.2"]]))
    assert in_thread(lambda: remote_size(url, config=loose)) == len(DATA)
    in_thread(lambda: fetch(url, str(out / "leaked"), config=loose))
    assert (out / "leaked").read_bytes() == b"internal secret"
    # Only 127.0.0.1 allowed: the first connection is made, the rebound one refused.
    dns = FakeDNS(rebind=[["127.0.0.1"], ["127.0.0.2"]])
    rebinding = resolving(config(allow=["127.0.0.1"]), dns)
    assert in_thread(lambda: remote_size(url, config=rebinding)) == len(DATA)
    with pytest.raises(DownloadFailed) as info:
        in_thread(lambda: fetch(url, str(out / "f"), config=rebinding))
    assert info.value.details["rule"] == "loopback" and "127.0.0.2" in str(info.value)
    assert dns.calls == ["rebind.test", "rebind.test"]  # one lookup per connection, no other
    assert len(twin.requests) == 1 and len(server.requests) == 2  # the control's, only
    nothing_written(out / "f")


def test_a_name_with_any_denied_address_is_refused(server: FaultServer, twin: FaultServer, out: Path) -> None:
    dns = FakeDNS(mixed=[["127.0.0.1", "127.0.0.2"]])
    url = f"http://mixed.test:{server.base_url.rsplit(':', 1)[1]}/blob.bin"
    with pytest.raises(DownloadFailed) as info:
        fetch(url, str(out / "f"), config=resolving(config(allow=["127.0.0.1"]), dns))
    assert info.value.details["rule"] == "loopback"
    assert server.requests == [] and twin.requests == []


# ---------------------------------------------------------------------- redirects


def test_redirect_to_a_denied_address(server: FaultServer, inside: FaultServer, out: Path) -> None:
    server.add_fault("blob.bin", "redirect", times=2, location=inside.url("secret.json", SECRET))
    # Where the redirect leads when the network is open: the internal server's secret.
    fetch(server.url("blob.bin"), str(out / "leaked"), config=config(allow=["127.0.0.0/8"]))
    assert b"stolen" in (out / "leaked").read_bytes()
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"]))
    message = str(info.value)
    assert info.value.details["rule"] == "loopback"
    assert inside.url("secret.json") in message and "secret-token" not in message
    assert len(inside.requests) == 1 and server.count("blob.bin") == 2  # the control's, only
    nothing_written(out / "f")


def test_redirect_to_the_metadata_address(server: FaultServer, out: Path) -> None:
    server.add_fault("blob.bin", "redirect", location="http://169.254.169.254/latest/meta-data/iam/x")
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"]))
    assert info.value.details["rule"] == "cloud_metadata"
    nothing_written(out / "f")


def test_redirects_are_followed_a_few_hops(server: FaultServer, out: Path) -> None:
    for hop in range(5):
        server.add_fault(f"r{hop}", "redirect", location=f"/r{hop + 1}" if hop < 4 else "/blob.bin")
    got = fetch(server.url("r0"), str(out / "f"), config=config(allow=["127.0.0.1"]))
    assert got.bytes == len(DATA) and (out / "f").read_bytes() == DATA


def test_too_many_redirects(server: FaultServer, out: Path) -> None:
    for hop in range(7):
        server.add_fault(f"r{hop}", "redirect", code=307, location=f"/r{hop + 1}")
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("r0"), str(out / "f"), config=config(allow=["127.0.0.1"]))
    assert "more than 5 redirects" in str(info.value) and info.value.details["attempts"] == 1
    assert len(server.requests) == 6


def test_redirect_loop(server: FaultServer, out: Path) -> None:
    server.add_fault("a", "redirect", times=-1, location="/b?sig=1")
    server.add_fault("b", "redirect", times=-1, location=server.url("a", SECRET))
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("a", SECRET), str(out / "f"), config=config(allow=["127.0.0.1"]))
    assert "redirect loop" in str(info.value) and "secret" not in str(info.value)
    assert [r.path for r in server.requests] == ["a", "b"]  # and not retried


def test_redirect_to_a_file_url_is_refused(server: FaultServer, root: Path, out: Path) -> None:
    server.add_fault("blob.bin", "redirect", location=(root / "blob.bin").as_uri())
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"], roots=[root]))
    assert "redirect" in str(info.value)
    nothing_written(out / "f")


# -------------------------------------------------------------------------- PUT


def test_put_to_a_denied_address(inside: FaultServer, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    source.write_bytes(DATA)
    with pytest.raises(UploadFailed) as info:
        upload(str(source), inside.url("up/delta.bin", SECRET), config=config(allow=["127.0.0.1"]))
    assert info.value.code == "download_failed" and info.value.details["rule"] == "loopback"
    assert inside.requests == [] and not (Path(inside.root) / "up").exists()


def test_put_redirects(server: FaultServer, inside: FaultServer, root: Path, tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    source.write_bytes(DATA)
    allowed = config(allow=["127.0.0.1"])
    server.add_fault("up/a.bin", "redirect", method="PUT", code=307, location="/up/b.bin")
    assert upload(str(source), server.url("up/a.bin"), config=allowed) == len(DATA)
    assert (root / "up" / "b.bin").read_bytes() == DATA  # the body sent again to the new place
    server.add_fault("up/c.bin", "redirect", method="PUT", code=307, location=inside.url("stolen.bin"))
    with pytest.raises(UploadFailed) as info:
        upload(str(source), server.url("up/c.bin"), config=allowed)
    assert info.value.details["rule"] == "loopback" and inside.requests == []


# ------------------------------------------------------------------------ file://


def test_file_urls_only_under_a_root(tmp_path: Path, root: Path, out: Path) -> None:
    (root / "deep" / "er").mkdir(parents=True)
    (root / "deep" / "er" / "x.bin").write_bytes(b"inside")
    rooted = config(roots=[root])
    assert fetch((root / "deep" / "er" / "x.bin").as_uri(), str(out / "x"), config=rooted).bytes == 6
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"private")
    refused = [
        outside.as_uri(),
        f"{root.as_uri()}/../outside.bin",
        f"{root.as_uri()}/./blob.bin",
        "file:///proc/self/environ",
        "file:///etc/passwd",
        f"file://otherhost{root}/blob.bin",
        str(root / "blob.bin"),  # a plain path is not a URL
        "blob.bin",
        "ftp://example.com/blob.bin",
    ]
    for url in refused:
        with pytest.raises(InvalidRequest) as info:
            fetch(url, str(out / "f"), config=rooted)
        assert info.value.code == "invalid_request", url
        with pytest.raises(InvalidRequest):
            remote_size(url, config=rooted)
    with pytest.raises(InvalidRequest) as info:  # no roots: no file:// at all
        fetch((root / "blob.bin").as_uri(), str(out / "f"), config=config())
    assert "ROUNDHOUSE_FILE_ROOTS" in str(info.value)
    nothing_written(out / "f")


def test_symlinks_out_of_the_root_are_not_followed(tmp_path: Path, root: Path, out: Path) -> None:
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir()
    (secret_dir / "key").write_text("root-only")
    os.symlink(secret_dir / "key", root / "key-link")
    os.symlink(secret_dir, root / "dir-link")
    os.symlink(root / "blob.bin", root / "inner-link")  # even one that stays inside
    rooted = config(roots=[root])
    for name in ("key-link", "dir-link/key", "inner-link"):
        with pytest.raises(InvalidRequest) as info:
            fetch(f"{root.as_uri()}/{name}", str(out / "f"), config=rooted)
        assert info.value.details["rule"] == "file_link", name
    nothing_written(out / "f")


def test_a_fifo_under_the_root_is_refused_without_blocking(root: Path, out: Path) -> None:
    os.mkfifo(root / "pipe")
    with pytest.raises(InvalidRequest) as info:
        fetch((root / "pipe").as_uri(), str(out / "f"), config=config(roots=[root]))
    assert info.value.details["rule"] == "file_type"


def test_uploads_stay_under_the_root(tmp_path: Path) -> None:
    source = tmp_path / "delta.bin"
    source.write_bytes(b"delta")
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    (elsewhere / "victim").write_text("keep me")
    rooted = config(roots=[shared])
    assert upload(str(source), (shared / "a" / "b" / "d.bin").as_uri(), config=rooted) == 5
    for url in (
        (elsewhere / "d.bin").as_uri(),
        str(shared / "d.bin"),  # a plain path
        f"{shared.as_uri()}/../elsewhere/d.bin",
    ):
        with pytest.raises(InvalidRequest):
            upload(str(source), url, config=rooted)
    os.symlink(elsewhere, shared / "out")
    with pytest.raises(InvalidRequest):
        upload(str(source), f"{shared.as_uri()}/out/d.bin", config=rooted)
    # A link where the file goes is replaced, never written through.
    os.symlink(elsewhere / "victim", shared / "victim")
    upload(str(source), (shared / "victim").as_uri(), config=rooted)
    assert (elsewhere / "victim").read_text() == "keep me" and (shared / "victim").read_bytes() == b"delta"
    assert sorted(os.listdir(elsewhere)) == ["victim"]


# ---------------------------------------------------------------- the environment


def test_proxy_variables_and_netrc_are_ignored(
    server: FaultServer, tmp_path: Path, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as dead:  # a port nothing listens on
        dead.bind(("127.0.0.1", 0))
        dead_proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login alice password hunter2\n")
    netrc.chmod(0o600)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, dead_proxy)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".netrc").write_text(netrc.read_text())
    got = in_thread(lambda: fetch(server.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"])))
    assert got.bytes == len(DATA)
    (request,) = server.requests
    assert request.header("Authorization") is None and request.target == "/blob.bin"


def test_a_configured_proxy_is_used(root: Path, out: Path) -> None:
    with FaultServer(root) as proxy:  # answers absolute-form requests from its own root
        dns = FakeDNS(files=[["93.184.216.34"]], metadata=[["169.254.169.254"]])
        proxied = resolving(config(http_proxy=proxy.base_url), dns)  # loopback not allowed
        got = in_thread(lambda: fetch("http://files.test:8080/blob.bin", str(out / "f"), config=proxied))
        assert got.bytes == len(DATA)
        assert proxy.requests[0].target == "http://files.test:8080/blob.bin"
        with pytest.raises(DownloadFailed) as info:  # the name as resolved here is still checked
            in_thread(lambda: fetch("http://metadata.test/latest", str(out / "g"), config=proxied))
        assert info.value.details["rule"] == "cloud_metadata" and len(proxy.requests) == 1


# ----------------------------------------------------------------------- byte caps


def test_endless_chunked_body_is_stopped_at_the_cap(server: FaultServer, out: Path) -> None:
    server.add_fault("endless", "endless", times=-1)
    allowed = config(allow=["127.0.0.1"])
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("endless", SECRET), str(out / "f"), config=allowed, max_bytes=2 * MIB)
    assert info.value.details["rule"] == "max_bytes" and info.value.details["cap"] == 2 * MIB
    assert "secret" not in str(info.value) and str(2 * MIB) in str(info.value)
    nothing_written(out / "f")
    # No cap and no size from the caller: the unknown-length default applies.
    with pytest.raises(DownloadFailed) as info:
        fetch(
            server.url("endless"),
            str(out / "f"),
            config=config(allow=["127.0.0.1"], max_unknown_download_mb=1),
        )
    assert "ROUNDHOUSE_MAX_UNKNOWN_DOWNLOAD_MB" in str(info.value) and info.value.details["cap"] == MIB
    nothing_written(out / "f")
    deadline = time.monotonic() + 10  # and the server's endless writes ended: the client hung up
    while any(r.ended is None for r in server.requests) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(r.ended is not None for r in server.requests)


def test_a_chunked_body_within_the_cap(server: FaultServer, out: Path) -> None:
    server.add_fault("blob.bin", "chunked", times=2)
    allowed = config(allow=["127.0.0.1"], max_unknown_download_mb=4)
    assert fetch(server.url("blob.bin"), str(out / "f"), config=allowed).bytes == len(DATA)
    with pytest.raises(DownloadFailed):
        fetch(server.url("blob.bin"), str(out / "g"), config=allowed, max_bytes=len(DATA) - 1)
    nothing_written(out / "g")


def test_content_length_over_the_cap_is_refused_before_writing(server: FaultServer, out: Path) -> None:
    # Headers, then nothing: a client that read the body would wait for the read timeout.
    server.add_fault("blob.bin", "stall", after_bytes=0)
    started = time.monotonic()
    try:
        with pytest.raises(DownloadFailed) as info:
            fetch(server.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"]), max_bytes=MIB)
    finally:
        server.release_stalls()
    assert time.monotonic() - started < 5
    assert f"announces {len(DATA)} bytes" in str(info.value) and info.value.details["cap"] == MIB
    nothing_written(out / "f")


def test_a_declared_size_over_the_cap_makes_no_request(server: FaultServer, out: Path) -> None:
    with pytest.raises(DownloadFailed):
        fetch(
            server.url("blob.bin"),
            str(out / "f"),
            config=config(allow=["127.0.0.1"]),
            size=2 * MIB,
            max_bytes=MIB,
        )
    assert server.requests == []


def test_the_cap_in_a_ranged_download_and_on_resume(server: FaultServer, out: Path) -> None:
    split = config(
        allow=["127.0.0.1"], parallel_min_bytes=MIB, parallel_below_bytes_s=0, download_buffer_bytes=64 * 1024
    )
    with pytest.raises(DownloadFailed):
        fetch(server.url("blob.bin"), str(out / "f"), config=split, max_bytes=MIB)
    assert server.count("blob.bin") == 1  # refused on the first answer, before any segment
    nothing_written(out / "f")
    # A partial download of the whole file, then a caller with a smaller cap: refused as it resumes.
    server.add_fault("blob.bin", "reset", after_bytes=MIB, delay_s=0.2)
    one = config(allow=["127.0.0.1"], download_retries=1, download_buffer_bytes=64 * 1024)
    with pytest.raises(DownloadFailed):
        fetch(server.url("blob.bin"), str(out / "f"), config=one)
    assert os.path.getsize(partial_paths(str(out / "f"))[0]) == MIB
    requests_before = len(server.requests)
    with pytest.raises(DownloadFailed) as info:
        fetch(server.url("blob.bin"), str(out / "f"), config=one, max_bytes=2 * MIB)
    assert info.value.details["rule"] == "max_bytes" and len(server.requests) == requests_before
    nothing_written(out / "f")


def test_the_cap_on_a_local_copy(root: Path, out: Path) -> None:
    with pytest.raises(DownloadFailed) as info:
        fetch((root / "blob.bin").as_uri(), str(out / "f"), config=config(roots=[root]), max_bytes=MIB)
    assert "the file holds" in str(info.value)
    nothing_written(out / "f")


# ---------------------------------------------------------------------- head check


class HeadCheck:
    def __init__(self, good: bool = True) -> None:
        self.good = good
        self.seen: list[bytes] = []

    def __call__(self, first: bytes) -> None:
        self.seen.append(first)
        if not self.good:
            raise BadArtifact("header promises more than the cap")


def test_a_head_check_refuses_before_the_rest(server: FaultServer, out: Path) -> None:
    server.add_fault("blob.bin", "stall", after_bytes=MIB)  # the rest would never come
    check = HeadCheck(good=False)
    try:
        with pytest.raises(BadArtifact):
            fetch(
                server.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"]), head=(16, check)
            )
    finally:
        server.release_stalls()
    assert check.seen == [DATA[:16]]
    nothing_written(out / "f")


def test_a_head_check_that_passes(server: FaultServer, root: Path, out: Path) -> None:
    check = HeadCheck()
    fetch(server.url("blob.bin"), str(out / "f"), config=config(allow=["127.0.0.1"]), head=(100, check))
    assert check.seen == [DATA[:100]] and (out / "f").read_bytes() == DATA
    (root / "short.bin").write_bytes(b"tiny")
    short = HeadCheck()
    fetch(server.url("short.bin"), str(out / "s"), config=config(allow=["127.0.0.1"]), head=(100, short))
    assert short.seen == [b"tiny"]  # a body shorter than the head: checked at its end
    local = HeadCheck()
    fetch((root / "blob.bin").as_uri(), str(out / "l"), config=config(roots=[root]), head=(8, local))
    assert local.seen == [DATA[:8]]


def test_a_head_check_in_a_ranged_download(server: FaultServer, out: Path) -> None:
    split = config(
        allow=["127.0.0.1"], parallel_min_bytes=MIB, parallel_below_bytes_s=0, download_buffer_bytes=64 * 1024
    )
    check = HeadCheck()
    got = fetch(server.url("blob.bin"), str(out / "f"), config=split, head=(200_000, check))
    assert got.connections > 1 and check.seen == [DATA[:200_000]]
    # Refused: the head is read before the segments start, so no range was asked for.
    bad = HeadCheck(good=False)
    before = len(server.requests)
    with pytest.raises(BadArtifact):
        fetch(server.url("blob.bin"), str(out / "g"), config=split, head=(200_000, bad))
    assert len(server.requests) == before + 1
    nothing_written(out / "g")


def test_a_head_check_on_resume(server: FaultServer, out: Path) -> None:
    server.add_fault("blob.bin", "reset", after_bytes=MIB, delay_s=0.2)
    one = config(allow=["127.0.0.1"], download_retries=1, download_buffer_bytes=64 * 1024)
    with pytest.raises(DownloadFailed):
        fetch(server.url("blob.bin"), str(out / "f"), config=one)
    bad = HeadCheck(good=False)
    with pytest.raises(BadArtifact):
        fetch(server.url("blob.bin"), str(out / "f"), config=one, head=(64, bad))
    assert bad.seen == [DATA[:64]]
    nothing_written(out / "f")
