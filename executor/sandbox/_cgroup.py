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

A group's name ends in its owner (:func:`owned_name`): the worker's host id (hashed), and the
process that made it by pid namespace, pid and start time. A group is reclaimed (emptied and
removed) only when its owner is provably gone: in this process's pid namespace, no process with
that pid and start time lives. A group made in another pid namespace (another container sharing
the cgroup tree) is never judged by its pid, which means nothing here; :func:`reclaim`, as a
worker starts, also ends those of its own host id (one worker per host id at a time).

Inside the package: ``_confinement`` (the contract and its helpers) imports no sibling, ``_pidns``
imports it, and this module imports both.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from executor.errors import SandboxRunnerError, SandboxUnavailable
from executor.fileio import MIB
from executor.sandbox._confinement import (
    SETTLE_S,
    SH,
    WAIT_S,
    Confinement,
    read,
    sigkill,
    start_time,
    stop_threads,
    wait_until,
    write,
)
from executor.sandbox._pidns import PidNamespace

logger = logging.getLogger(__name__)

KINDS = ("cgroup2", "cgroup1", "pidns")  # in order of preference
V1_CONTROLLERS = ("freezer", "memory", "pids")  # the freezer first: a stale group's processes die thawed
V2_CONTROLLERS = ("memory", "pids")
GROUP_DIR = "roundhouse"
JOIN_FAILED = 97  # the prefix's exit status when it cannot join a group
_JOIN = 'for f; do [ "$f" = -- ] && break; echo 0 > "$f" || exit 97; shift; done; shift; exec "$@"'
_OWNER = re.compile(r"\.([0-9a-f]{8})-(\d+)-(\d+)-(\d+)$")  # .<host tag>-<pid ns>-<pid>-<start time>
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,62}")


def group_name(name: str) -> str:
    """``name`` as one path component: kept when already safe, else cleaned and made unique by a hash."""
    if _SAFE_NAME.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:48].lstrip('.')}-{digest}"


def owned_name(name: str, host_id: str) -> str:
    """``name`` as a group name that says whose it is: ``<name>.<host tag>-<pid ns>-<pid>-<start
    time>``, the calling process's (a pid alone may be reused, or mean another process in another
    pid namespace)."""
    pid = os.getpid()
    return f"{group_name(name)}.{_host_tag(host_id)}-{_pid_ns()}-{pid}-{start_time(pid)}"


def _host_tag(host_id: str) -> str:
    return hashlib.sha256(host_id.encode()).hexdigest()[:8]


def _pid_ns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _orphaned(entry: str, host_id: str | None) -> bool:
    """Whether the group ``entry``'s owner is provably gone (see the module's docstring);
    ``host_id``: a worker of that host id is starting."""
    match = _OWNER.search(entry)
    if match is None:
        return False
    tag, ns, pid, start = match.group(1), *(int(field) for field in match.groups()[1:])
    if ns != _pid_ns():
        return host_id is not None and tag == _host_tag(host_id)
    return start_time(pid) != start


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
                if not _drain(self.groups, self.timeout_s):
                    logger.warning("sandbox group %s still has processes", self.groups[0])
                _rmdirs(self.groups, self.timeout_s)
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


@dataclass(frozen=True)
class _Hierarchy:
    mount: str  # where it is mounted: its root, as far as this process can see
    own: str  # this process's group in it


def _hierarchies(cgroup_text: str | None = None, mountinfo_text: str | None = None) -> dict[str, _Hierarchy]:
    """``"cgroup2"`` and each v1 controller this process is in, mapped to its mount and own group."""
    own: dict[str, str] = {}
    for line in (cgroup_text if cgroup_text is not None else read("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for key in controllers.split(",") if controllers else ["cgroup2"]:
            own[key] = path
    found: dict[str, _Hierarchy] = {}
    mountinfo = mountinfo_text if mountinfo_text is not None else read("/proc/self/mountinfo")
    for line in mountinfo.splitlines():
        fields = line.split()
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        keys = ["cgroup2"] if fstype == "cgroup2" else options if fstype == "cgroup" else []
        root, mount = (_unescape(field) for field in fields[3:5])
        for key in (key for key in keys if key in own and key not in found):
            path = own[key]
            inside = path == root or path.startswith(root.rstrip("/") + "/")
            # Outside the mount's root (another cgroup namespace, a bind mount): only the mount is ours.
            group = os.path.normpath(f"{mount}/{os.path.relpath(path, root)}") if inside else mount
            found[key] = _Hierarchy(mount, group)
    return found


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _enable(group: str, controllers: Sequence[str]) -> None:
    control = f"{group}/cgroup.subtree_control"
    missing = [c for c in controllers if c not in read(control).split()]
    try:
        if missing:
            write(control, " ".join(f"+{c}" for c in missing))
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        raise SandboxUnavailable(
            f"cannot enable {', '.join(missing)} in {group}: it holds processes, and cgroup v2 gives "
            "controllers to the children of a group only while it holds none"
        ) from None


def _drain(groups: Sequence[str], timeout_s: float) -> bool:
    """Kill every process in ``groups`` and their subgroups; True once all are empty."""
    dirs = [d for group in groups if os.path.isdir(group) for d, _, _ in os.walk(group)]

    def procs() -> set[int]:
        found: set[int] = set()
        for d in dirs:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(pid) for pid in read(f"{d}/cgroup.procs").split())
        return found

    for group in groups:
        for control, value in (("cgroup.kill", "1"), ("freezer.state", "FROZEN")):
            if os.path.exists(f"{group}/{control}"):
                write(f"{group}/{control}", value)
    sigkill(procs())
    for group in groups:  # v1: a frozen process dies only when thawed
        if os.path.exists(f"{group}/freezer.state"):
            write(f"{group}/freezer.state", "THAWED")
    return wait_until(lambda: not sigkill(procs()), timeout_s)


def _rmdirs(groups: Sequence[str], timeout_s: float) -> None:
    """Remove ``groups`` and their subgroups, bottom-up (an exiting process holds one a moment)."""
    for group in groups:
        for d in [d for d, _, _ in os.walk(group, topdown=False)]:

            def removed(d: str = d) -> bool:
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    return True
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    return False
                return True

            if not wait_until(removed, timeout_s):
                raise SandboxRunnerError(f"sandbox group {d} stays busy")


def _new_group(base: str, name: str, controllers: Sequence[str], timeout_s: float) -> str:
    """``base/roundhouse/name``, fresh: a stale group of that name (a crashed worker's) is
    emptied and removed first."""
    parent = os.path.join(base, GROUP_DIR)
    with contextlib.suppress(FileExistsError):
        os.mkdir(parent, 0o755)
    _enable(parent, controllers)
    _reclaim_orphans(parent, timeout_s)
    group = os.path.join(parent, name)
    if os.path.isdir(group):
        logger.warning("removing the stale sandbox group %s", group)
        if not _drain([group], timeout_s):
            raise SandboxUnavailable(f"the stale sandbox group {group} cannot be emptied")
        _rmdirs([group], timeout_s)
    os.mkdir(group, 0o755)
    return group


def _reclaim_orphans(parent: str, timeout_s: float, host_id: str | None = None) -> None:
    """End and remove the groups under ``parent`` whose owner is gone (:func:`_orphaned`)."""
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in (entry for entry in entries if _orphaned(entry, host_id)):
        group = os.path.join(parent, entry)
        logger.warning("removing the sandbox group %s of a worker that is gone", group)
        try:
            if _drain([group], timeout_s):
                _rmdirs([group], timeout_s)
        except (OSError, SandboxRunnerError) as exc:  # the next reclaim tries again
            logger.warning("sandbox group %s not removed: %s", group, exc)


def reclaim(host_id: str, timeout_s: float = WAIT_S) -> None:
    """As a worker of ``host_id`` starts: end the sandboxes dead workers left, in every
    ``roundhouse`` group of each hierarchy this process could make groups in — those whose owner
    is provably gone, and those of ``host_id`` made in another pid namespace. A frozen sandbox
    whose worker died stays frozen until then (cgroup v1 holds even a SIGKILL)."""
    try:
        hierarchies = _hierarchies()
    except OSError:
        return
    for key in (*V1_CONTROLLERS, "cgroup2"):  # the freezer first: the processes die thawed
        hierarchy = hierarchies.get(key)
        for base in dict.fromkeys((hierarchy.own, hierarchy.mount)) if hierarchy else ():
            _reclaim_orphans(os.path.join(base, GROUP_DIR), timeout_s, host_id)


def _group_in(hierarchy: _Hierarchy, make: Callable[[str], str], what: str) -> str:
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
    hierarchy = _hierarchies().get("cgroup2")
    if hierarchy is None:
        raise SandboxUnavailable("no cgroup2 hierarchy is mounted")

    def make(base: str) -> str:
        missing = [c for c in controllers if c not in read(f"{base}/cgroup.controllers").split()]
        if missing:
            raise SandboxUnavailable(f"{base} has no {', '.join(missing)} controller")
        _enable(base, controllers)
        return _new_group(base, name, controllers, timeout_s)

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
    hierarchies = _hierarchies()
    missing = [c for c in V1_CONTROLLERS if c not in hierarchies]
    if missing:
        raise SandboxUnavailable(f"no cgroup v1 {', '.join(missing)} hierarchy is mounted")
    made: dict[str, str] = {}  # by mount: controllers may share a hierarchy
    try:
        for controller in V1_CONTROLLERS:
            hierarchy = hierarchies[controller]
            if hierarchy.mount not in made:
                make = functools.partial(_new_group, name=name, controllers=(), timeout_s=timeout_s)
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
