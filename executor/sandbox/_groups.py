"""The cgroup tree as the sandboxes use it: where each hierarchy is, group names that say whose
they are, and the housekeeping of groups (made fresh, drained, removed, reclaimed).

Every sandbox group lies in a ``roundhouse`` group of its hierarchy (:data:`GROUP_DIR`).
A group's name ends in its owner (:func:`owned_name`): the worker's host id (hashed), and the
process that made it by pid namespace, pid and start time. A group is reclaimed (emptied and
removed) only when its owner is provably gone: in this process's pid namespace, no process with
that pid and start time lives. A group made in another pid namespace (another container sharing
the cgroup tree) is never judged by its pid, which means nothing here; :func:`reclaim`, as a
worker starts, also ends those of its own host id (one worker per host id at a time).

Group trees are walked with ``os.walk``: only the worker makes groups (their directories are
root's, and tenant code runs as a uid of its own with no capabilities), so their depth is the
worker's, never a tenant's (DESIGN §10's rule is for trees a tenant shapes).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from executor.errors import SandboxRunnerError, SandboxUnavailable
from executor.sandbox._confinement import WAIT_S, read, sigkill, start_time, wait_until, write

logger = logging.getLogger(__name__)

V1_CONTROLLERS = ("freezer", "memory", "pids")  # the freezer first: a stale group's processes die thawed
GROUP_DIR = "roundhouse"
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


@dataclass(frozen=True)
class Hierarchy:
    mount: str  # where it is mounted: its root, as far as this process can see
    own: str  # this process's group in it


def find_hierarchies(
    cgroup_text: str | None = None, mountinfo_text: str | None = None
) -> dict[str, Hierarchy]:
    """``"cgroup2"`` and each v1 controller this process is in, mapped to its mount and own group."""
    own: dict[str, str] = {}
    for line in (cgroup_text if cgroup_text is not None else read("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for key in controllers.split(",") if controllers else ["cgroup2"]:
            own[key] = path
    found: dict[str, Hierarchy] = {}
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
            found[key] = Hierarchy(mount, group)
    return found


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def enable(group: str, controllers: Sequence[str]) -> None:
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


def drain(groups: Sequence[str], timeout_s: float) -> bool:
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


def rmdirs(groups: Sequence[str], timeout_s: float) -> None:
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


def new_group(base: str, name: str, controllers: Sequence[str], timeout_s: float) -> str:
    """``base/roundhouse/name``, fresh: a stale group of that name (a crashed worker's) is
    emptied and removed first."""
    parent = os.path.join(base, GROUP_DIR)
    with contextlib.suppress(FileExistsError):
        os.mkdir(parent, 0o755)
    enable(parent, controllers)
    _reclaim_orphans(parent, timeout_s)
    group = os.path.join(parent, name)
    if os.path.isdir(group):
        logger.warning("removing the stale sandbox group %s", group)
        if not drain([group], timeout_s):
            raise SandboxUnavailable(f"the stale sandbox group {group} cannot be emptied")
        rmdirs([group], timeout_s)
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
            if drain([group], timeout_s):
                rmdirs([group], timeout_s)
        except (OSError, SandboxRunnerError) as exc:  # the next reclaim tries again
            logger.warning("sandbox group %s not removed: %s", group, exc)


def reclaim(host_id: str, timeout_s: float = WAIT_S) -> None:
    """As a worker of ``host_id`` starts: end the sandboxes dead workers left, in every
    ``roundhouse`` group of each hierarchy this process could make groups in — those whose owner
    is provably gone, and those of ``host_id`` made in another pid namespace. A frozen sandbox
    whose worker died stays frozen until then (cgroup v1 holds even a SIGKILL)."""
    try:
        hierarchies = find_hierarchies()
    except OSError:
        return
    for key in (*V1_CONTROLLERS, "cgroup2"):  # the freezer first: the processes die thawed
        hierarchy = hierarchies.get(key)
        for base in dict.fromkeys((hierarchy.own, hierarchy.mount)) if hierarchy else ():
            _reclaim_orphans(os.path.join(base, GROUP_DIR), timeout_s, host_id)
