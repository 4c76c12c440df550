"""The spare runner: a sandboxed runner started before its session is known, adopted by the next.

A runner's start — bwrap, then ``import torch`` inside the sandbox — takes 1–4 s, and until
issue 15 every ``load_model`` waited for it (it was the critical path of the load, longer than
the download and hash of a 1 GiB model). Nothing of a session goes into the start: the
runner's ``init`` names only its directories, each round's request names the model, bundle
and file size limit, and the session's code is a worker file read every round. So a runner
can be started while the worker is idle, frozen, and handed to the next session in an
instant.

Why a spare holds against the threats of DESIGN §8:

- It never ran tenant code: started by the worker, it imported the engine and froze (its
  cgroup or pid namespace) at "ready". The tenant who gets it is its first. Every later
  safeguard (the whole-life frame reader, the freeze between rounds, the strays' kill, the
  watchdog) is the same Supervisor's, unchanged.
- Its directories are its own (``<work>/sandbox-spare``), outside every other sandbox's
  view; at adoption they are renamed to the session's (bwrap's binds follow the directory,
  not its name), after the previous session's are removed.
- Its file size limit is open at start (the model's size is not known): the runner lowers
  RLIMIT_FSIZE, soft and hard, to the round's bound before the round's tenant code runs
  (:mod:`executor.sandbox._runner`); lowering needs no privilege and the sandbox uid, without
  ``CAP_SYS_RESOURCE``, can never raise it again. Memory, processes and tmpfs sizes are the
  worker's settings, the same for every session, so the launch sets them as before.
- A reset (the tenant boundary) and a shutdown discard it with the work dir; the next is
  started after.

Only under bwrap: the ``unshare`` launch has no mount namespace, so the runner would see
its directories by their host names, which the adoption changes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from executor.fileio import remove_tree
from executor.sandbox._launch import Paths
from executor.sandbox._supervisor import Supervisor

logger = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_S = 300.0  # a spare that could not start is not tried again at every round
WAIT_POLL_S = 0.05
DISCARD_JOIN_S = 30.0


class Spare:
    """At most one spare runner: started by :meth:`replenish`, handed over by :meth:`take`."""

    def __init__(self, paths: Paths, new_supervisor: Callable[[Paths], Supervisor]) -> None:
        self.paths = paths
        self._root = os.path.dirname(paths.task)
        self._new_supervisor = new_supervisor
        self._lock = threading.Lock()
        self._supervisor: Supervisor | None = None
        self._thread: threading.Thread | None = None
        self._failed_at: float | None = None

    @property
    def state(self) -> str:
        """``none``, ``starting`` or ``ready`` (for ``status``)."""
        thread, supervisor = self._thread, self._supervisor
        if thread is None or supervisor is None:
            return "none"
        if thread.is_alive():
            return "starting"
        return "ready" if supervisor.alive else "none"

    def replenish(self) -> None:
        """Start a spare in the background unless one is there or starting (or one failed to
        start within :data:`RETRY_AFTER_FAILURE_S`)."""
        with self._lock:
            if self._thread is not None:
                return
            if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_FAILURE_S:
                return
            remove_tree(self._root, ignore_errors=True)
            # bwrap binds the model dir (a reset removes it; ModelFiles makes it the same way).
            os.makedirs(self.paths.model, mode=0o755, exist_ok=True)
            supervisor = self._supervisor = self._new_supervisor(self.paths)
            thread = self._thread = threading.Thread(
                target=self._start, args=(supervisor,), name="sandbox-spare", daemon=True
            )
        thread.start()

    def _start(self, supervisor: Supervisor) -> None:
        try:
            supervisor.launch(None, spare=True)
        except Exception as exc:  # the next session starts a runner of its own, which says why
            with self._lock:
                discarded = self._supervisor is not supervisor
                if not discarded:
                    self._failed_at = time.monotonic()
                    self._supervisor = self._thread = None
            supervisor.close()  # discard() may be closing it too: closes are serialised
            if not discarded:
                logger.warning("spare sandboxed runner did not start: %s", exc)

    def take(self, target: Paths, abort: threading.Event | None) -> Supervisor | None:
        """The spare (waiting for it when it is still starting: it began earlier than a fresh
        start would), its directories moved to ``target``'s; None when there is none, it died,
        or ``abort`` was set meanwhile (the spare is left as it is then)."""
        with self._lock:
            thread, supervisor = self._thread, self._supervisor
        if thread is None or supervisor is None:
            return None
        while thread.is_alive():
            thread.join(WAIT_POLL_S)
            if abort is not None and abort.is_set():
                return None
        with self._lock:
            if self._supervisor is not supervisor:  # discarded, or failed, meanwhile
                return None
            self._supervisor = self._thread = None
            if not supervisor.alive:
                supervisor.close()
                remove_tree(self._root, ignore_errors=True)
                return None
            # bwrap bound the directories, not their names: the runner keeps seeing them.
            session_root = os.path.dirname(target.task)
            remove_tree(session_root, ignore_errors=True)
            os.rename(self._root, session_root)
            supervisor.paths = target
        return supervisor

    def discard(self) -> None:
        """End the spare, a starting one included, and remove its directories."""
        with self._lock:
            thread, supervisor = self._thread, self._supervisor
            self._supervisor = self._thread = None
        if supervisor is not None:
            supervisor.close()  # a start in progress sees it and raises
        if thread is not None:
            thread.join(DISCARD_JOIN_S)
        remove_tree(self._root, ignore_errors=True)
