"""Limits a sandbox cannot lift, enforced from outside it (DESIGN §8, "the runner is untrusted").

:func:`confine` gives each sandbox a :class:`~executor.sandbox._confinement.Confinement` of the
first usable kind:

``cgroup2``
    a group ``roundhouse/<name>`` under the worker's own cgroup (else under the hierarchy's
    root), below a ``roundhouse`` group that never holds processes, so that v2's "no internal
    processes" rule lets it enable controllers. ``memory.max`` counts everything the sandbox
    charges — anonymous memory, shared memory and the tmpfs pages it touches, page cache —
    ``memory.swap.max`` 0 keeps it out of swap, ``pids.max`` bounds its tasks (threads count);
    ``cgroup.freeze`` stops it, ``cgroup.kill`` tears it down.
``cgroup1``
    the same in the v1 ``memory``, ``pids`` and ``freezer`` hierarchies: ``memory.limit_in_bytes``
    (and ``memory.memsw.limit_in_bytes`` where swap is accounted), ``pids.max``, ``freezer.state``.
``pidns``
    where no cgroup is usable: the sandbox's pid namespace (:mod:`executor.sandbox._pidns`),
    which stops and kills but limits nothing.

A cgroup sandbox's processes are in its group from their first instruction: the launch runs
behind :meth:`~executor.sandbox._confinement.Confinement.launch_prefix`, a shell that moves itself
into each group, then execs. The sandbox cannot leave: the group files are root's, and bwrap's
``--unshare-cgroup-try`` makes the group the root of its cgroup namespace. Two live sandboxes must
not share a ``name``: making a group removes a stale one of that name, processes and all.
:func:`support` says which kind this host gives, and why not a better one.

Whose group is whose, and the housekeeping of groups, is :mod:`executor.sandbox._groups`.
Inside the package: ``_confinement`` (the contract and its helpers) imports no sibling,
``_pidns`` and ``_groups`` import it, and this module imports all three.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence

from executor.errors import SandboxRunnerError, SandboxUnavailable
from executor.fileio import MIB
from executor.sandbox._confinement import (
    SETTLE_S,
    SH,
    WAIT_S,
    Confinement,
    read,
    stop_threads,
    wait_until,
    write,
)
from executor.sandbox._groups import (
    V1_CONTROLLERS,
    Hierarchy,
    drain,
    enable,
    find_hierarchies,
    new_group,
    owned_name,
    rmdirs,
)
from executor.sandbox._pidns import PidNamespace

logger = logging.getLogger(__name__)

KINDS = ("cgroup2", "cgroup1", "pidns")  # in order of preference
V2_CONTROLLERS = ("memory", "pids")
JOIN_FAILED = 97  # the prefix's exit status when it cannot join a group
_JOIN = 'for f; do [ "$f" = -- ] && break; echo 0 > "$f" || exit 97; shift; done; shift; exec "$@"'


class _Cgroup(Confinement):
    """A sandbox in one group per hierarchy; ``groups[0]`` is the one whose processes are listed."""

    def __init__(self, groups: Sequence[str], timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.groups = list(dict.fromkeys(groups))

    def launch_prefix(self) -> list[str]:
        # Writing 0 to cgroup.procs moves the writer itself (v1 and v2).
        procs = [os.path.join(group, "cgroup.procs") for group in self.groups]
        return [SH, "-c", _JOIN, "sh", *procs, "--"]

    def pids(self) -> set[int]:
        if self._closed:
            return set()
        return {int(pid) for pid in read(os.path.join(self.groups[0], "cgroup.procs")).split()}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if not drain(self.groups, self.timeout_s):
                    logger.warning("sandbox group %s still has processes", self.groups[0])
                rmdirs(self.groups, self.timeout_s)
            except Exception as exc:  # close() runs on every error path; it must not mask the error
                logger.warning("sandbox group %s not removed: %s", self.groups[0], exc)


class Cgroup2(_Cgroup):
    kind = "cgroup2"

    def _freeze(self) -> None:
        group = self.groups[0]
        write(f"{group}/cgroup.freeze", "1")
        if not wait_until(lambda: "\nfrozen 1" in "\n" + read(f"{group}/cgroup.events"), self.timeout_s):
            self.thaw()
            raise SandboxRunnerError(f"sandbox group {group} did not freeze within {self.timeout_s} s")
        self._frozen = True

    def _thaw(self) -> None:
        write(f"{self.groups[0]}/cgroup.freeze", "0")
        self._frozen = False

    def memory_bytes(self) -> int | None:
        path = f"{self.groups[0]}/memory.current"
        return int(read(path)) if os.path.exists(path) else None


class Cgroup1(_Cgroup):
    kind = "cgroup1"

    def __init__(self, freezer: str, memory: str, pids: str, timeout_s: float) -> None:
        super().__init__([freezer, memory, pids], timeout_s)
        self.freezer, self.memory = freezer, memory

    def _freeze(self) -> None:
        state = f"{self.freezer}/freezer.state"
        write(state, "FROZEN")
        # FREEZING until every task is frozen; a task in uninterruptible sleep can hold it there.
        if not wait_until(lambda: read(state).strip() == "FROZEN", self.timeout_s):
            self.thaw()
            raise SandboxRunnerError(f"sandbox group {self.freezer} did not freeze within {self.timeout_s} s")
        self._frozen = True

    def _thaw(self) -> None:
        write(f"{self.freezer}/freezer.state", "THAWED")
        self._frozen = False

    def _release(self, killed: set[int], spared: set[int]) -> None:
        # A SIGKILL sent into a frozen v1 group acts only once it is thawed, and a plain thaw let
        # the runner run unwatched meanwhile, up to SETTLE_S a pass (issue 25: tens of MiB
        # written after "complete"). A frozen task handles its pending signals before it returns
        # to user space: thawed, the killed die, and the spared, each thread sent a SIGSTOP while
        # frozen, stop. Frozen again, they get their SIGCONT, which leaves them frozen. (Moving
        # the killed out of the group instead costs an RCU grace period, ~3 ms, a process.)
        if not killed:
            return
        held = spared & self.pids()
        stop_threads(held)
        try:
            write(f"{self.freezer}/freezer.state", "THAWED")
            wait_until(lambda: not self._alive(killed), SETTLE_S)
        finally:
            try:
                self.freeze()
            finally:
                for pid in held:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)

    def memory_bytes(self) -> int | None:
        return int(read(f"{self.memory}/memory.usage_in_bytes"))


def _group_in(hierarchy: Hierarchy, make: Callable[[str], str], what: str) -> str:
    """The group ``make`` creates under the first of: this process's own group, the hierarchy's root."""
    reasons = []
    for base in dict.fromkeys((hierarchy.own, hierarchy.mount)):
        try:
            return make(base)
        except SandboxUnavailable as exc:
            reasons.append(str(exc))
        except OSError as exc:
            reasons.append(f"{base}: {exc.strerror or exc}")
    raise SandboxUnavailable(f"no {what} group can be made: {'; '.join(reasons)}")


@contextlib.contextmanager
def _set_up(confinement: _Cgroup) -> Iterator[None]:
    """Limits written and the launch prefix tried, or the group removed and the kind refused."""
    try:
        yield
        argv = [*confinement.launch_prefix(), SH, "-c", "exit 0"]
        status = subprocess.run(argv, env={}, capture_output=True, timeout=confinement.timeout_s).returncode
        if status != 0:
            raise SandboxUnavailable(f"a process cannot join {', '.join(confinement.groups)} (exit {status})")
    except BaseException as exc:
        confinement.close()
        if isinstance(exc, OSError | subprocess.SubprocessError):
            raise SandboxUnavailable(f"{confinement.kind} group not usable: {exc}") from None
        raise


def _cgroup2(
    name: str,
    memory_bytes: int,
    max_procs: int,
    timeout_s: float,
    controllers: Sequence[str] = V2_CONTROLLERS,
) -> Cgroup2:
    hierarchy = find_hierarchies().get("cgroup2")
    if hierarchy is None:
        raise SandboxUnavailable("no cgroup2 hierarchy is mounted")

    def make(base: str) -> str:
        missing = [c for c in controllers if c not in read(f"{base}/cgroup.controllers").split()]
        if missing:
            raise SandboxUnavailable(f"{base} has no {', '.join(missing)} controller")
        enable(base, controllers)
        return new_group(base, name, controllers, timeout_s)

    confinement = Cgroup2([_group_in(hierarchy, make, "cgroup2")], timeout_s)
    group = confinement.groups[0]
    with _set_up(confinement):
        if "memory" in controllers:
            write(f"{group}/memory.max", str(memory_bytes))
            if os.path.exists(f"{group}/memory.swap.max"):
                write(f"{group}/memory.swap.max", "0")
        if "pids" in controllers:
            write(f"{group}/pids.max", str(max_procs))
    return confinement


def _cgroup1(name: str, memory_bytes: int, max_procs: int, timeout_s: float) -> Cgroup1:
    hierarchies = find_hierarchies()
    missing = [c for c in V1_CONTROLLERS if c not in hierarchies]
    if missing:
        raise SandboxUnavailable(f"no cgroup v1 {', '.join(missing)} hierarchy is mounted")
    made: dict[str, str] = {}  # by mount: controllers may share a hierarchy
    try:
        for controller in V1_CONTROLLERS:
            hierarchy = hierarchies[controller]
            if hierarchy.mount not in made:
                make = functools.partial(new_group, name=name, controllers=(), timeout_s=timeout_s)
                made[hierarchy.mount] = _group_in(hierarchy, make, f"cgroup v1 {controller}")
    except BaseException:
        for group in made.values():
            with contextlib.suppress(OSError):
                os.rmdir(group)
        raise
    freezer, memory, pids = (made[hierarchies[c].mount] for c in V1_CONTROLLERS)
    confinement = Cgroup1(freezer, memory, pids, timeout_s)
    with _set_up(confinement):
        write(f"{memory}/memory.limit_in_bytes", str(memory_bytes))
        if os.path.exists(f"{memory}/memory.memsw.limit_in_bytes"):  # swap accounting is on
            write(f"{memory}/memory.memsw.limit_in_bytes", str(memory_bytes))
        write(f"{pids}/pids.max", str(max_procs))
    return confinement


def _pidns(name: str, memory_bytes: int, max_procs: int, timeout_s: float) -> PidNamespace:
    if not os.path.exists("/proc/self/ns/pid"):
        raise SandboxUnavailable("this kernel has no pid namespaces")
    return PidNamespace(timeout_s)


_MAKERS: dict[str, Callable[[str, int, int, float], Confinement]] = {
    "cgroup2": _cgroup2,
    "cgroup1": _cgroup1,
    "pidns": _pidns,
}


def confine(
    name: str,
    *,
    memory_bytes: int,
    max_procs: int,
    prefer: str = "auto",
    timeout_s: float = WAIT_S,
    host_id: str = "",
) -> Confinement:
    """A new confinement for the sandbox ``name`` (unique among this process's live sandboxes),
    of the worker ``host_id``; its group's name says so (:func:`owned_name`).

    ``prefer``: ``auto`` takes cgroup2 if usable, else cgroup1 (all of memory, pids and freezer),
    else pidns; an explicit kind that cannot be had raises ``SandboxUnavailable`` saying why.
    """
    if prefer != "auto" and prefer not in KINDS:
        raise ValueError(f"unknown confinement {prefer!r}: auto, {', '.join(KINDS)}")
    reasons = []
    for kind in KINDS if prefer == "auto" else (prefer,):
        try:
            return _MAKERS[kind](owned_name(name, host_id), memory_bytes, max_procs, timeout_s)
        except SandboxUnavailable as exc:
            reasons.append(f"{kind}: {exc.message}")
            logger.debug("confinement %s not usable: %s", kind, exc.message)
    raise SandboxUnavailable(
        f"no confinement {prefer!r} for the sandbox here ({'; '.join(reasons)})", {"prefer": prefer}
    )


def support(prefer: str = "auto") -> str:
    """What ``confine(prefer=prefer)`` would give here, and why not the better kinds, e.g.
    ``cgroup1 (cgroup2: /sys/fs/cgroup/unified has no memory, pids controller)``; found by
    making (and removing) a probe group exactly as a sandbox's."""
    reasons = []
    for kind in KINDS if prefer == "auto" else (prefer,):
        try:
            _MAKERS[kind](owned_name(f"probe-{threading.get_ident()}", ""), 64 * MIB, 64, WAIT_S).close()
        except SandboxUnavailable as exc:
            reasons.append(f"{kind}: {exc.message}")
            continue
        return f"{kind} ({'; '.join(reasons)})" if reasons else kind
    return f"none ({'; '.join(reasons)})"
