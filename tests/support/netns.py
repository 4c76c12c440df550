"""Network namespaces for multi-host tests: one bridge on the host side, one veth per "host".

Every namespace gets its own address on a private /24, a veth pair whose host end sits on
the bridge (which holds the host side's address: Redis and the artifact server bind to it),
and a token-bucket rate limit (``tc tbf``) on both ends. :meth:`Network.link_down` pulls
the cable of one namespace (its host end goes down: the namespace keeps its address and
routes but nothing gets through) and :meth:`Network.link_up` plugs it back in.

Needs root and ``ip``/``tc``; :func:`unavailable` says why not, for a clear skip.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Namespace", "Network", "kill_tree", "unavailable"]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    probe = f"rh-probe-{secrets.token_hex(3)}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Namespace:
    name: str
    address: str  # this namespace's own address
    host_end: str  # the veth end on the host's bridge

    def argv(self, *command: str) -> list[str]:
        """``command`` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *command]


class Network:
    """A bridge with ``prefix.1`` on the host side; namespaces get ``prefix.10`` upwards."""

    def __init__(self, rate: str = "200mbit") -> None:
        tag = secrets.token_hex(2)
        self.tag = tag
        self.subnet_byte = 100 + int(tag, 16) % 150
        self.prefix = f"10.213.{self.subnet_byte}"
        self.host_address = f"{self.prefix}.1"
        self.cidr = f"{self.prefix}.0/24"
        self.bridge = f"rhbr{tag}"
        self.rate = rate
        self.namespaces: list[Namespace] = []
        self._lock = threading.Lock()  # namespaces may be added from several threads

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> Network:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        return self

    def add(self) -> Namespace:
        with self._lock:
            index = len(self.namespaces)
            ns = Namespace(f"rh-{self.tag}-{index}", f"{self.prefix}.{10 + index}", f"rh{self.tag}h{index}")
            _run("ip", "netns", "add", ns.name)
            self.namespaces.append(ns)
        inner = f"rh{self.tag}n{index}"
        _run("ip", "link", "add", ns.host_end, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", ns.name)
        _run("ip", "link", "set", ns.host_end, "master", self.bridge)
        _run("ip", "link", "set", ns.host_end, "up")
        inside = ("ip", "netns", "exec", ns.name)
        _run(*inside, "ip", "addr", "add", f"{ns.address}/24", "dev", inner)
        _run(*inside, "ip", "link", "set", inner, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        # The rate limit both ways: the namespace's egress, and the host end's (its ingress).
        tbf = ("root", "tbf", "rate", self.rate, "burst", "64kb", "latency", "200ms")
        _run(*inside, "tc", "qdisc", "add", "dev", inner, *tbf)
        _run("tc", "qdisc", "add", "dev", ns.host_end, *tbf)
        return ns

    def link_down(self, ns: Namespace) -> None:
        _run("ip", "link", "set", ns.host_end, "down")

    def link_up(self, ns: Namespace) -> None:
        _run("ip", "link", "set", ns.host_end, "up")

    def destroy(self) -> None:
        for ns in self.namespaces:
            _run("ip", "netns", "pids", ns.name, check=False)
            for pid in _run("ip", "netns", "pids", ns.name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "link", "del", ns.host_end, check=False)  # takes its peer with it
            _run("ip", "netns", "del", ns.name, check=False)
        _run("ip", "link", "del", self.bridge, check=False)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process below it (a whole worker: MainProcess, its prefork
    child, the sandbox and tenant code), all in one pass; returns the pids killed."""
    tree = _children()
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, []))
    for victim in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGSTOP)  # frozen first, so nobody reacts to the others' deaths
    for victim in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    return found
