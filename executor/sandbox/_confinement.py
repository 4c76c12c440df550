"""What every kind of sandbox confinement offers the supervisor (:mod:`executor.sandbox._cgroup`
makes one): its processes found, stopped and killed from outside the sandbox.

Tenant code shares the runner's interpreter, so anything the runner did for the worker (killing
strays at round end, counting bytes) could be forged or switched off (DESIGN §8). A
:class:`Confinement` does it from the worker's side instead; its kinds are ``cgroup2``,
``cgroup1`` (:mod:`executor.sandbox._cgroup`) and ``pidns`` (:mod:`executor.sandbox._pidns`).
The shared rule for killing is here, in :meth:`Confinement.kill`, on top of each kind's
``pids``, ``freeze`` and ``thaw``; so are the small /proc and control-file helpers they share.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Collection

from executor.errors import SandboxRunnerError

logger = logging.getLogger(__name__)

WAIT_S = 5.0  # freezing, emptying a group, a pid namespace appearing
SETTLE_S = 2.0  # killed processes leaving (they run nothing meanwhile: SIGKILL is pending)
SH = "/bin/sh"  # launches and helpers have an empty environment: absolute paths only
DEAD = ("Z", "X", None)  # process states (None: gone) that never run again


def read(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


def write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)  # one write(2), so its error is the kernel's answer
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` with a backoff from 50 µs to 5 ms; False if it is still false after ``timeout_s``."""
    deadline, pause = time.monotonic() + timeout_s, 50e-6
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    return True


def proc_stat(path: str) -> tuple[str, int] | None:
    """(state, ppid) from a ``/proc/.../stat`` file; None once the task is gone."""
    try:
        text = read(path)
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def proc_state(pid: int) -> str | None:
    stat = proc_stat(f"/proc/{pid}/stat")
    return stat[0] if stat else None


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot); None once it is gone or a zombie."""
    try:
        text = read(f"/proc/{pid}/stat")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] in DEAD else int(fields[19])


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def stop_threads(pids: Collection[int]) -> None:
    """SIGSTOP every thread of ``pids`` (tgkill): a signal sent to a process wakes one of its
    threads, and the others hear of the stop only once that one handles it."""
    tgkill = getattr(_libc(), "tgkill", None)  # glibc 2.30+
    for pid in pids:
        if tgkill is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            continue
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                tgkill(pid, int(tid), signal.SIGSTOP)


def sigkill(pids: Collection[int]) -> Collection[int]:
    """SIGKILL each; a process that returned from kill(2) never runs another user-space instruction."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def with_ancestors(keep: Collection[int], members: set[int]) -> set[int]:
    """``keep`` and its ancestors inside the sandbox (bwrap, unshare, a namespace's init)."""
    spared: set[int] = set()
    for pid in keep:
        while pid in members and pid not in spared:
            spared.add(pid)
            stat = proc_stat(f"/proc/{pid}/stat")
            if stat is None:
                break
            pid = stat[1]
    return spared | set(keep)


class Confinement:
    """One sandbox's processes, limited, seen, stopped and killed from outside. Thread-safe.

    Use: ``confine(...)``; launch ``[*c.launch_prefix(), *argv]`` (env may be empty);
    ``c.started(popen.pid)``; per round ``c.kill(keep={runner})``; at the end ``c.close()``.
    """

    kind = ""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._closed = False
        self._frozen = False

    def launch_prefix(self) -> list[str]:
        """argv to put before the launch command so that it joins the sandbox before it execs."""
        return []

    def started(self, pid: int) -> None:
        """The launched process, by the host pid ``Popen`` returned (pidns finds its namespace)."""

    def pids(self) -> set[int]:
        """Host pids of every live process of the sandbox now."""
        raise NotImplementedError

    # Every operation on a closed confinement is a no-op: close() removed what it would act on,
    # and two threads may end one sandbox at once (a load called off while the spare's own start
    # fails; a round's watchdog and a reset). Each runs under the confinement's lock.

    def freeze(self) -> None:
        """Returns once nothing in the sandbox runs; ``SandboxRunnerError`` (and thawed) past the timeout."""
        with self._lock:
            if not self._closed:
                self._freeze()

    def thaw(self) -> None:
        """Let the sandbox run again."""
        with self._lock:
            if not self._closed:
                self._thaw()

    def _freeze(self) -> None:
        raise NotImplementedError

    def _thaw(self) -> None:
        raise NotImplementedError

    def memory_bytes(self) -> int | None:
        """Memory the sandbox is charged for now, shared memory and tmpfs included; None for pidns."""
        return None

    def close(self) -> None:
        """Kill everything and remove the group(s); idempotent, never raises; what comes after it
        (freeze, thaw, kill) does nothing."""
        raise NotImplementedError

    def kill(self, keep: Collection[int] = ()) -> int:
        """SIGKILL every process of the sandbox but ``keep`` (host pids) and their ancestors inside
        it (bwrap, unshare, the namespace's init: killing one would end ``keep`` too); returns how
        many were killed. The sandbox is left frozen if it was, else thawed.

        The sandbox is frozen first, so that a fork bomb cannot fork while it is being killed (if
        it cannot be frozen, kill passes repeat until no new process appears). A process killed
        while frozen dies at once under cgroup2 and pidns (SIGKILL ends a stopped process), but
        under the v1 freezer only when thawed: if it killed any, a frozen cgroup1 sandbox is thawed
        until they are gone, every thread of ``keep`` and of its ancestors held by a SIGSTOP sent
        while frozen, then frozen again and continued (``_release``): ``keep`` runs nothing
        meanwhile. Either way, once this returns no process but ``keep`` runs another user-space
        instruction: each had a SIGKILL pending before it could run again. It waits up to
        ``SETTLE_S`` for them to be gone (zombies count as gone), so ``pids()`` is clean at once.
        """
        with self._lock:
            if self._closed:
                return 0
            was_frozen = self._frozen
            try:
                if not was_frozen:
                    self.freeze()
            except SandboxRunnerError as exc:
                logger.warning("killing without freezing: %s", exc)
            killed: set[int] = set()
            spared: set[int] = set()
            try:
                spared = with_ancestors(keep, self.pids())

                def no_new_target() -> bool:
                    targets = self.pids() - spared - killed
                    killed.update(sigkill(targets))
                    return not targets

                converged = wait_until(no_new_target, self.timeout_s)
            finally:
                if was_frozen and self._frozen:
                    self._release(killed, spared)
                else:
                    self.thaw()
            if not converged:
                raise SandboxRunnerError(
                    f"{self.kind} sandbox kept forking for {self.timeout_s} s under kill"
                )
            if not wait_until(lambda: not self._alive(killed), SETTLE_S):
                logger.warning("%d killed sandbox process(es) still exiting", len(self._alive(killed)))
            return len(killed)

    def _alive(self, pids: set[int]) -> set[int]:
        return pids & self.pids()

    def _release(self, killed: set[int], spared: set[int]) -> None:
        """Let processes killed while frozen die, the sandbox (``spared`` above all) staying frozen."""
