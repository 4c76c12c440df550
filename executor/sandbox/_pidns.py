"""The ``pidns`` confinement: a sandbox held by its pid namespace, where no cgroup is usable.

Its processes are found by namespace inode (nested namespaces included), stopped by SIGSTOP —
sent from inside the namespace with ``kill(-1)``, which no fork can race — killed by SIGKILL, and
the whole namespace torn down by killing its init. Its limits, honestly: it enforces no limit of
its own (memory and process count rest on rlimits, which are per process — RLIMIT_DATA ignores
shared memory — or per uid); a stopped process resumes on a SIGCONT from anyone allowed to signal
it (its uid, outside the namespace); a process in uninterruptible sleep stops late; every pass
reads all of /proc, so its cost grows with the host's process count (~1.7 ms a round end with 85).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import signal

from executor.errors import SandboxRunnerError
from executor.sandbox._confinement import (
    DEAD,
    SH,
    Confinement,
    proc_stat,
    proc_state,
    wait_until,
)

logger = logging.getLogger(__name__)

_NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2), linux/nsfs.h
_CLONE_NEWPID = 0x20000000


def _ns_inode(pid: int) -> int:
    return int(os.readlink(f"/proc/{pid}/ns/pid")[len("pid:[") : -1])


def _nested_in(pid: int, ns: int) -> bool:
    """Whether the pid namespace of ``pid`` is ``ns`` or below it (walked up with NS_GET_PARENT)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        while os.fstat(fd).st_ino != ns:
            parent = fcntl.ioctl(fd, _NS_GET_PARENT)
            os.close(fd)
            fd = parent
        return True
    except OSError:  # EPERM past the top
        return False
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc().setns(fd, _CLONE_NEWPID) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _descends(pid: int, parents: dict[int, int], ancestors: set[int]) -> bool:
    """Whether a parent, grandparent, … of ``pid`` (by ``parents``) is in ``ancestors``."""
    seen: set[int] = set()
    while (pid := parents.get(pid, 0)) > 1 and pid not in seen:
        if pid in ancestors:
            return True
        seen.add(pid)
    return False


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (or gone): a SIGSTOP stops threads one by one."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return all(
        (stat is None or stat[0] in "TtZX")
        for stat in (proc_stat(f"/proc/{pid}/task/{t}/stat") for t in tids)
    )


class PidNamespace(Confinement):
    kind = "pidns"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self._outer = _ns_inode(os.getpid())
        self._ns: int | None = None
        self._init = 0  # the namespace's init, by host pid
        self._fds: list[int] = []  # pidfds of the namespace's init and of the launch, the namespace

    def started(self, pid: int) -> None:
        """Find the sandbox's namespace: the first descendant of ``pid`` in a namespace not ours
        (waiting for it up to the timeout; a launch that already ended leaves nothing to find)."""
        outer = _ns_inode(pid)

        def found() -> bool:
            parents: dict[int, list[int]] = {}
            for entry in filter(str.isdigit, os.listdir("/proc")):
                if (stat := proc_stat(f"/proc/{entry}/stat")) is not None:
                    parents.setdefault(stat[1], []).append(int(entry))
            queue = list(parents.get(pid, []))
            for child in queue:
                with contextlib.suppress(OSError):
                    if (ns := _ns_inode(child)) == outer:
                        queue.extend(parents.get(child, []))
                        continue
                    fds = [os.pidfd_open(child), os.pidfd_open(pid)]
                    fds.append(os.open(f"/proc/{child}/ns/pid", os.O_RDONLY | os.O_CLOEXEC))
                    if os.fstat(fds[2]).st_ino == ns:  # still the same process
                        self._ns, self._fds, self._init = ns, fds, child
                        return True
                    for fd in fds:
                        os.close(fd)
            return proc_state(pid) in DEAD

        with self._lock:
            if not wait_until(found, self.timeout_s):
                raise SandboxRunnerError(f"process {pid} made no pid namespace within {self.timeout_s} s")

    def pids(self) -> set[int]:
        if self._ns is None or self._closed:
            return set()
        verdict = {self._ns: True, self._outer: False}
        members: set[int] = set()
        unreadable: list[int] = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                ns = _ns_inode(int(entry))
            except PermissionError:
                unreadable.append(int(entry))
                continue
            except (OSError, ValueError):
                continue
            if (inside := verdict.get(ns)) is None:
                inside = verdict[ns] = _nested_in(int(entry), self._ns)
            if inside and proc_state(int(entry)) not in DEAD:
                members.add(int(entry))
        if unreadable:
            members |= self._descendants(unreadable, members)
        return members

    def _descendants(self, unreadable: list[int], members: set[int]) -> set[int]:
        """The live ``unreadable`` processes that descend from a member or from the namespace's
        init. A worker without CAP_SYS_PTRACE (a container's root, by default) may not read the
        /proc/<pid>/ns of the sandbox's uid; an orphan of a pid namespace is reparented to its
        init, so no process of the namespace escapes the ancestry. Without this the thaw missed
        the tenant's processes and left the runner stopped for good. Only here is every ppid
        read: a worker that can read every namespace never pays for it."""
        parents: dict[int, int] = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            if (stat := proc_stat(f"/proc/{entry}/stat")) is not None and stat[0] not in DEAD:
                parents[int(entry)] = stat[1]
        # The init by pid only while its pidfd says it lives: a pid of a dead init may be reused.
        ancestors = members | ({self._init} if self._init_lives() else set())
        return {
            pid
            for pid in unreadable
            if pid in parents and (pid in ancestors or _descends(pid, parents, ancestors))
        }

    def _init_lives(self) -> bool:
        try:
            signal.pidfd_send_signal(self._fds[0], 0)
            return True
        except (IndexError, OSError):  # no pidfd yet, or its process is gone
            return False

    def _freeze(self) -> None:
        """SIGSTOP the init, then every other process at once (``_signal_all``); wait until every
        thread is stopped (a SIGSTOP stops threads one by one)."""
        try:
            if self._ns is None:
                return
            signal.pidfd_send_signal(self._fds[0], signal.SIGSTOP)
        except ProcessLookupError:  # its init is gone, and with it every process of the namespace
            return
        self._signal_all("STOP")

        def settled() -> bool:
            running = [pid for pid in self.pids() if not _stopped(pid)]
            for pid in running:  # resumed by someone allowed to signal it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            return not running

        done = wait_until(settled, self.timeout_s)
        self._frozen = True
        if not done:
            self.thaw()
            raise SandboxRunnerError(f"pid namespace did not stop within {self.timeout_s} s")

    def _signal_all(self, name: str) -> None:
        """``kill(-1)`` from a helper inside the namespace: every process there but its init, in one
        step no fork can race — a scan of /proc is outrun by a process that forks and exits in a
        loop. The helper acts only once its namespace is checked: -1 outside it is the host."""
        go_read, go_write = os.pipe()
        try:
            own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(self._fds[2])  # this thread's children are born in the sandbox's namespace
                try:
                    # kill's status is ESRCH's when only the init is there: not a failure.
                    argv = [SH, "-c", f"read go || exit 3; kill -s {name} -- -1 2>/dev/null; exit 0"]
                    helper = os.posix_spawn(SH, argv, {}, file_actions=[(os.POSIX_SPAWN_DUP2, go_read, 0)])
                finally:
                    _setns(own)
            finally:
                os.close(own)
            if _ns_inode(helper) == self._ns:
                os.write(go_write, b"go\n")
        except OSError as exc:
            raise SandboxRunnerError(f"no helper in the pid namespace: {exc}") from None
        finally:
            os.close(go_read)
            os.close(go_write)
        if os.waitpid(helper, 0)[1] != 0:
            raise SandboxRunnerError(f"the pid namespace's processes cannot be sent SIG{name}")

    def _thaw(self) -> None:
        for pid in self.pids():  # members only: a pid remembered from the freeze may be reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._frozen = False

    def close(self) -> None:
        """SIGKILL the namespace's init (the kernel then kills every process in it) and the launch."""
        with self._lock:
            if self._closed:
                return
            try:
                for fd in self._fds[:2]:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                if not wait_until(lambda: not self.pids(), self.timeout_s):
                    logger.warning("pid namespace still has processes after its init was killed")
            except Exception as exc:  # close() runs on every error path; it must not mask the error
                logger.warning("pid namespace not torn down: %s", exc)
            finally:
                self._closed = True
                for fd in self._fds:
                    os.close(fd)
                self._fds = []

    def _alive(self, pids: set[int]) -> set[int]:
        return {pid for pid in pids if proc_state(pid) not in DEAD}
