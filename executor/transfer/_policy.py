"""The URL policy (DESIGN §11, data plane): what a URL in a task may name, in one place.

A URL comes from whoever can enqueue a task or serve a redirect, so it is checked before
anything is fetched or written, and again at every connection:

- Schemes: ``http`` and ``https``; ``file://`` only below one of the operator's file roots
  (``ROUNDHOUSE_FILE_ROOTS``). A plain filesystem path is not a URL.
- ``file://``: ``.`` and ``..`` are refused, and the path is opened one component at a time,
  each relative to the directory descriptor before it, with ``O_NOFOLLOW``
  (:class:`FilePath`). So no symbolic link below a root is followed (not even one that
  points back inside it), and a directory renamed during the walk cannot move it out of
  the root. Only regular files are read. Why not ``openat2(RESOLVE_BENEATH)``: Python has no
  binding for it, a ctypes syscall is per-architecture and refused by some seccomp
  profiles and kernels before 5.6, and refusing every link leaves nothing to resolve.
- Addresses: a connection resolves its host once, checks every address the resolver gave
  (:meth:`UrlPolicy.addresses`) and connects only to those very addresses, so a name that
  answers differently the next time (DNS rebinding) is checked again then, never trusted
  from an earlier answer. A name any of whose addresses is refused is refused whole.
  Refused: loopback, link-local, unspecified, the cloud metadata addresses, and this host's
  own addresses as the kernel lists them; and every IPv6 address that embeds an IPv4 one which
  a translator, relay or tunnel may deliver to (:func:`embedded_ipv4`: IPv4-mapped,
  IPv4-compatible, NAT64 64:ff9b::/96 and 64:ff9b:1::/48, 6to4, Teredo, ISATAP) is refused
  when what it embeds is.
  ``ROUNDHOUSE_URL_ALLOW`` opens host names (matched against the URL's host) and networks.
- Proxies: none from the environment; ``ROUNDHOUSE_HTTP_PROXY`` when set. A proxy resolves
  the name itself, so through one the URL's host is checked as this machine resolves it.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from urllib3.util.connection import allowed_gai_family

from executor.errors import InvalidRequest
from executor.urls import Url

logger = logging.getLogger("executor.transfer")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# socket.getaddrinfo's answer: (family, type, proto, canonname, sockaddr).
AddrInfo = tuple[Any, Any, int, str, tuple[Any, ...]]
Resolver = Callable[[str, int], Sequence[AddrInfo]]


def _networks(*texts: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(text) for text in texts)


# (rule, what it is, networks); the first rule holding an address names the refusal.
# Metadata before link-local: 169.254.169.254 is both, and the narrower name says more.
DENIED: tuple[tuple[str, str, tuple[IPNetwork, ...]], ...] = (
    (
        "cloud_metadata",
        "a cloud metadata address",
        # AWS, GCP, Azure, OpenStack; AWS over IPv6; Alibaba.
        _networks("169.254.169.254/32", "fd00:ec2::254/128", "100.100.100.200/32"),
    ),
    ("loopback", "a loopback address", _networks("127.0.0.0/8", "::1/128")),
    ("link_local", "a link-local address", _networks("169.254.0.0/16", "fe80::/10")),
    # Linux connects 0.0.0.0 (and the rest of 0/8 it accepts) to this host.
    ("unspecified", "an unspecified address", _networks("0.0.0.0/8", "::/128")),
)
OWN_ADDRESS = ("own_address", "this host's own address")
_IPV4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: prefixes of /48 to /96 inside
_ISATAP_IDS = (0x00005EFE, 0x02005EFE)  # RFC 5214: the interface id's upper half, any /64


class AddressDenied(Exception):
    """A connection the policy refuses: ``rule`` names why. Raised at connect time and
    turned into the caller's DownloadFailed / UploadFailed, never retried."""

    def __init__(self, host: str, address: str, rule: str, what: str, url: str | None = None) -> None:
        super().__init__(host, address, rule, what, url)
        self.host, self.address, self.rule, self.what, self.url = host, address, rule, what, url

    def __str__(self) -> str:
        name = self.address if self.host == self.address else f"{self.host} ({self.address})"
        hop = f" (redirected to {self.url})" if self.url else ""
        return f"connection to {name}{hop} refused: {self.what}; ROUNDHOUSE_URL_ALLOW can open it"


def plain_address(text: str) -> IPAddress:
    """The address an IPv4-mapped IPv6 address stands for, else the address itself."""
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _nat64_local(value: int) -> list[int]:
    """What an address in 64:ff9b:1::/48 embeds under each RFC 6052 prefix length it can have
    (/48, /56, /64: the suffix after the IPv4 bits is zero; /96: always), bits 64-71 skipped.
    A zero candidate counts only when no other is left: the zero suffix of a /48 address
    read as /96 is not a request for 0.0.0.0."""
    bits = f"{value:0128b}"
    packed = bits[:64] + bits[72:]  # 120 bits
    found = [int(packed[n : n + 32], 2) for n in (48, 56, 64) if not packed[n + 32 :].strip("0")]
    found.append(int(bits[96:], 2))
    return [ip for ip in found if ip] or [0]


def embedded_ipv4(address: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """Every IPv4 address an IPv6 ``address`` may lead to, through whatever on the path
    translates or tunnels it (a NAT64 gateway, a 6to4 or Teredo relay, an ISATAP router).

    The forms are matched by prefix whether or not this network runs such a translator: a
    deny list cannot know what a path holds. Inside 64:ff9b:1::/48 an operator picks the
    prefix length, so each of RFC 6052's lengths from /48 that fits the address counts.
    """
    if not isinstance(address, ipaddress.IPv6Address):
        return ()
    value = int(address)
    found: list[int] = []
    if address in _IPV4_MAPPED or address in _IPV4_COMPATIBLE or address in _NAT64_WELL_KNOWN:
        found.append(value & 0xFFFFFFFF)
    if address in _NAT64_LOCAL:
        found.extend(_nat64_local(value))
    if address.sixtofour is not None:
        found.append(int(address.sixtofour))
    if address.teredo is not None:
        found.extend(int(ip) for ip in address.teredo)  # the relay (server) and the client
    if (value >> 32) & 0xFFFFFFFF in _ISATAP_IDS:
        found.append(value & 0xFFFFFFFF)
    return tuple(ipaddress.IPv4Address(ip) for ip in dict.fromkeys(found))


def _plain_network(network: IPNetwork) -> IPNetwork:
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_IPV4_MAPPED):
        mapped = network.network_address.ipv4_mapped
        assert mapped is not None
        return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
    return network


def _host_key(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


# ------------------------------------------------------------- this host's addresses


def _fib_local(text: str) -> set[IPNetwork]:
    """The LOCAL entries of /proc/net/fib_trie: ``|-- 127.0.0.0`` then ``/8 host LOCAL``."""
    found: set[IPNetwork] = set()
    prefix = None
    for line in text.splitlines():
        item = line.strip()
        if item.startswith("|--"):
            prefix = item[3:].strip()
        elif item.startswith("/") and prefix is not None and item.split()[-1] == "LOCAL":
            found.add(ipaddress.ip_network(prefix + item.split()[0], strict=False))
    return found


def _inet6(text: str) -> set[IPNetwork]:
    """The addresses of /proc/net/if_inet6: 32 hex digits first on each line."""
    found: set[IPNetwork] = set()
    for line in text.splitlines():
        fields = line.split()
        if fields and len(fields[0]) == 32:
            found.add(ipaddress.IPv6Network((int(fields[0], 16), 128)))
    return found


def read_own_networks() -> frozenset[IPNetwork]:
    """This host's addresses as the kernel lists them (no subprocess, no netlink)."""
    found: set[IPNetwork] = set()
    for path, parse in (("/proc/net/fib_trie", _fib_local), ("/proc/net/if_inet6", _inet6)):
        with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as file:
            found |= parse(file.read())
    if not found:  # no procfs: the addresses this host's name resolves to, the next best
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(socket.gethostname(), None):
                found.add(ipaddress.ip_network(plain_address(str(info[4][0]))))
    return frozenset(_plain_network(network) for network in found)


class _OwnNetworks:
    """:func:`read_own_networks`, re-read at most every ``ttl_s`` (addresses rarely change;
    a check runs at every connection)."""

    def __init__(self, ttl_s: float = 30.0) -> None:
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._networks: frozenset[IPNetwork] = frozenset()
        self._read_at = -ttl_s

    def __call__(self) -> frozenset[IPNetwork]:
        with self._lock:
            if time.monotonic() - self._read_at >= self._ttl_s:
                self._networks = read_own_networks()
                self._read_at = time.monotonic()
            return self._networks


own_networks = _OwnNetworks()


def system_resolver(host: str, port: int) -> Sequence[AddrInfo]:
    # The families urllib3 itself would ask for (no IPv6 where the host cannot use it).
    return socket.getaddrinfo(host, port, allowed_gai_family(), socket.SOCK_STREAM)


# ------------------------------------------------------------------------ files


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class FilePath:
    """A ``file://`` URL the policy accepted: ``names`` below the directory ``root``."""

    url: Url
    root: str
    names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.names[-1]

    def open_read(self) -> int:
        """A descriptor of the regular file, opened without following any link below the root."""
        parent = self.open_parent(create=False)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
            fd = self._below(parent, self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        finally:
            os.close(parent)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InvalidRequest(
                f"{self.url} is not a regular file", {"url": str(self.url), "rule": "file_type"}
            )
        os.set_blocking(fd, True)
        return fd

    def open_parent(self, *, create: bool) -> int:
        """A descriptor of the directory that holds the file; ``create`` makes missing ones."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's own path
        try:
            for name in self.names[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                below = self._below(fd, name, _DIR_FLAGS)
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _below(self, dir_fd: int, name: str, flags: int) -> int:
        try:
            return os.open(name, flags, dir_fd=dir_fd)
        except OSError as exc:
            # O_NOFOLLOW answers ELOOP for a link, ENOTDIR with O_DIRECTORY: say which it was.
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                with contextlib.suppress(OSError):
                    if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        raise InvalidRequest(
                            f"{self.url} goes through a symbolic link below its file root; "
                            "links are not followed there",
                            {"url": str(self.url), "rule": "file_link"},
                        ) from None
            raise


def _denied(ip: IPAddress) -> tuple[str, str] | None:
    for rule, what, networks in DENIED:
        if any(ip in network for network in networks):
            return rule, what
    if any(ip in network for network in own_networks()):
        return OWN_ADDRESS
    return None


# ----------------------------------------------------------------------- policy


@dataclass(frozen=True)
class UrlPolicy:
    """What URLs may name; built from Settings by ``executor.configs.transfer_config``.

    ``resolver`` is ``socket.getaddrinfo`` but for tests, which inject one because no DNS
    server can run there.
    """

    file_roots: tuple[str, ...] = ()
    allow_hosts: frozenset[str] = frozenset()
    allow_networks: tuple[IPNetwork, ...] = ()
    proxy: str | None = None
    resolver: Resolver = system_resolver

    @classmethod
    def build(cls, file_roots: Iterable[str], allow: Iterable[str], proxy: str | None) -> UrlPolicy:
        hosts, networks = set(), []
        for entry in (item.strip() for item in allow):
            if not entry:
                continue
            if "://" in entry:
                raise ValueError(f"url_allow takes host names, addresses or networks, not URLs: {entry!r}")
            try:
                networks.append(_plain_network(ipaddress.ip_network(entry.strip("[]"), strict=False)))
            except ValueError:
                if "/" in entry:
                    raise ValueError(f"url_allow: {entry!r} is not a network") from None
                hosts.add(_host_key(entry))
        roots = tuple(os.path.normpath(os.path.abspath(root)) for root in file_roots if root.strip())
        return cls(roots, frozenset(hosts), tuple(networks), proxy or None)

    @property
    def proxies(self) -> dict[str, str]:
        return {"http": self.proxy, "https": self.proxy} if self.proxy else {}

    # ---------------------------------------------------------------- URLs

    def target(self, url: str | Url) -> Url | FilePath:
        """The HTTP(S) URL itself, or the :class:`FilePath` of a ``file://`` URL under a root.

        ``InvalidRequest`` for anything else: another scheme, a plain path, a ``file://`` URL
        outside the roots or with ``.``/``..`` in it.
        """
        url = Url.of(url)
        parts = urlsplit(url.reveal())  # the path of a file:// URL is read raw, and checked
        scheme = parts.scheme.lower()
        if scheme in ("http", "https"):
            if not parts.hostname:
                raise InvalidRequest(f"URL without a host: {url}", {"rule": "scheme"})
            return url
        if scheme == "file":
            return self._file(url, unquote(parts.path), parts.netloc)
        if not scheme or "://" not in url.reveal():
            raise InvalidRequest(
                f"not a URL: {url} (a local file is named by a file:// URL under ROUNDHOUSE_FILE_ROOTS)",
                {"url": str(url), "rule": "scheme"},
            )
        raise InvalidRequest(
            f"unsupported URL scheme {scheme!r}: {url} (http, https, or file:// under ROUNDHOUSE_FILE_ROOTS)",
            {"url": str(url), "rule": "scheme"},
        )

    def _file(self, url: Url, path: str, netloc: str) -> FilePath:
        safe_url = str(url)
        if netloc not in ("", "localhost"):
            message = f"file URL with a remote host: {safe_url}"
            raise InvalidRequest(message, {"url": safe_url, "rule": "file_path"})
        names = [name for name in path.split("/") if name]
        if not path.startswith("/") or "\x00" in path or any(name in (".", "..") for name in names):
            message = f"file URL with a relative path, '.' or '..': {safe_url}"
            raise InvalidRequest(message, {"url": safe_url, "rule": "file_path"})
        for root in self.file_roots:
            root_names = [name for name in root.split("/") if name]
            if len(names) > len(root_names) and names[: len(root_names)] == root_names:
                return FilePath(url, root, tuple(names[len(root_names) :]))
        why = "is not under ROUNDHOUSE_FILE_ROOTS" if self.file_roots else "refused: no ROUNDHOUSE_FILE_ROOTS"
        raise InvalidRequest(f"{safe_url} {why}", {"url": safe_url, "rule": "file_roots"})

    # ------------------------------------------------------------ addresses

    def refusal(self, host: str, address: str) -> tuple[str, str] | None:
        """``(rule, what)`` refusing a connection to ``address`` for a URL naming ``host``."""
        if _host_key(host) in self.allow_hosts:
            return None
        ip = plain_address(address)
        if any(ip in network for network in self.allow_networks):
            return None
        refused = _denied(ip)
        if refused is not None:
            return refused
        # An IPv4 address embedded in an IPv6 one is checked as itself, unless it is opened.
        for inner in embedded_ipv4(ip):
            if any(inner in network for network in self.allow_networks):
                continue
            refused = _denied(inner)
            if refused is not None:
                rule, what = refused
                return rule, f"{what} ({inner}) embedded in an IPv6 address"
        return None

    def check(self, host: str, address: str) -> None:
        refused = self.refusal(host, address)
        if refused is not None:
            raise AddressDenied(_host_key(host), address.split("%", 1)[0], *refused)

    def addresses(self, host: str, port: int) -> list[str]:
        """Resolve ``host`` once and check every answer: the addresses to connect to, in order.

        Raises ``socket.gaierror`` when it does not resolve, :class:`AddressDenied` when any
        answer is refused.
        """
        found = list(dict.fromkeys(str(info[4][0]) for info in self.resolver(host.strip("[]"), port)))
        if not found:
            raise socket.gaierror(socket.EAI_NONAME, f"{host} has no address")
        for address in found:
            self.check(host, address)
        return found

    def check_proxied(self, url: Url) -> None:
        """Through a proxy (which resolves the name itself): the host as resolved here, when it is."""
        host = url.host
        # Not resolvable here: the operator's proxy is the gate.
        with contextlib.suppress(socket.gaierror, UnicodeError):
            self.addresses(host, 0)
