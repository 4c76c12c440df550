"""The sandboxed :class:`~executor.rounds.RoundRunner`, for the loaded session.

Owns the session's sandbox directories (``<work>/sandbox/task``, writable by the
sandbox uid; ``<work>/sandbox/ro``, the worker's) and the warm :class:`Supervisor` of the
runner process: started at ``load_model``, reused by every round, torn down at the next
load, a reset, a crash, or a stop that needed a kill (the next round then starts a fresh one).
Where it can, it keeps a spare runner started ahead (:mod:`executor.sandbox._spare`), which
each of those starts adopts instead of waiting for an interpreter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from executor.errors import InvalidRequest
from executor.fileio import remove_tree, temp_path_for
from executor.rounds import RoundOutcome, RoundSession, RoundSpec
from executor.sandbox._cgroup import support
from executor.sandbox._groups import reclaim
from executor.sandbox._launch import Paths, SandboxConfig, resolve_mode
from executor.sandbox._protocol import RoundRequest
from executor.sandbox._result import result_header_limit, result_limit
from executor.sandbox._spare import Spare
from executor.sandbox._supervisor import Supervisor
from executor.workdir import SessionDir

logger = logging.getLogger(__name__)


class SandboxedRunner:
    """Tenant code in the sandboxed runner process, one warm process per session."""

    def __init__(
        self,
        mode: str,
        config: SandboxConfig,
        work_dir: str,
        model_dir: str,
        *,
        host_id: str,
        max_script_bytes: int,
        emit_log: Callable[[str], None],
        emit_stats: Callable[[dict[str, Any]], None],
    ) -> None:
        self.mode = mode
        self.config = config
        dirs = SessionDir(work_dir)
        root = dirs.sandbox
        self.paths = Paths(
            task=os.path.join(root, "task"),
            ro=os.path.join(root, "ro"),
            model=model_dir,
            bwrap=mode == "bwrap",
        )
        self._host_id = host_id
        self._max_script_bytes = max_script_bytes
        self._emit_log = emit_log
        self._emit_stats = emit_stats
        spare_root = dirs.sandbox_spare
        self._spare = Spare(
            Paths(os.path.join(spare_root, "task"), os.path.join(spare_root, "ro"), model_dir, bwrap=True),
            self._supervisor_for,
        )
        self._session: RoundSession | None = None
        self._supervisor: Supervisor | None = None
        # What a runner started by ``prepare`` was started with: (code, model path, file limit).
        self._prepared: tuple[str, str, int] | None = None
        self._lock = threading.Lock()
        _LIVE.add(self)

    @classmethod
    def start(
        cls,
        config: SandboxConfig,
        work_dir: str,
        model_dir: str,
        *,
        host_id: str,
        max_script_bytes: int,
        emit_log: Callable[[str], None],
        emit_stats: Callable[[dict[str, Any]], None],
    ) -> SandboxedRunner:
        """The runner of ``config.mode`` (``auto``: the best launch this host has), probed with
        the very launch rounds will use; ``SandboxUnavailable`` when nothing here can isolate
        tenant code."""
        mode = resolve_mode(config.mode, config.uid)
        os.chmod(work_dir, 0o711)  # the sandbox uid may pass through, not list or read
        runner = cls(
            mode,
            config,
            work_dir,
            model_dir,
            host_id=host_id,
            max_script_bytes=max_script_bytes,
            emit_log=emit_log,
            emit_stats=emit_stats,
        )
        # What dead workers of this host left (frozen sandboxes hold memory, maybe a CUDA context).
        reclaim(host_id)
        runner._supervisor_for(runner.paths).probe()  # the very launch rounds will use, or a refusal now
        return runner

    def _supervisor_for(self, paths: Paths) -> Supervisor:
        return Supervisor(
            self.mode,
            self.config,
            paths,
            host_id=self._host_id,
            cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
            emit_log=self._emit_log,
            emit_stats=self._emit_stats,
            serve_shard=self._serve_shard,
        )

    def prepare(
        self, code: str, model_path: str, model_bytes: int, *, abort: threading.Event | None = None
    ) -> None:
        """Start the next session's runner now (``load_model`` does while the model arrives:
        ``import torch`` and the CUDA context take seconds); the current one ends first. The
        runner reads nothing of the model before its first round, and ``/model`` is a bind of
        the model dir, where the new file appears by ``os.replace``."""
        self.close()
        limit = self._file_limit(model_bytes)
        spare = self._take_spare(abort)
        with self._lock:
            if abort is not None and abort.is_set():
                if spare is not None:
                    spare.close()
                return  # called off before it began: close() may already have run
            supervisor = self._supervisor = spare or self._supervisor_for(self.paths)
            self._prepared = (code, model_path, limit)
        if spare is not None:
            spare.assign(code, limit)
            return
        # Outside the lock: close() from another thread kills the runner while it starts.
        supervisor.start(code, limit)

    def _take_spare(self, abort: threading.Event | None) -> Supervisor | None:
        if not self._spare_enabled:
            return None
        return self._spare.take(self.paths, abort)

    @property
    def _spare_enabled(self) -> bool:
        return self.config.spare and self.mode == "bwrap"

    def replenish(self) -> None:
        """Start a spare runner for the next session, unless one is there (or disabled)."""
        if self._spare_enabled:
            self._spare.replenish()

    def open(self, session: RoundSession, *, warm: bool) -> None:
        """A fresh runner for ``session`` (the previous one, if any, is ended first), or the one
        ``prepare`` started for it; warm: now, so torch and CUDA load at ``load_model`` and not
        in round 1; else with the first round."""
        with self._lock:
            supervisor, prepared, self._prepared = self._supervisor, self._prepared, None
        key = (session.code, session.model_path, self._file_limit(os.path.getsize(session.model_path)))
        adopt = supervisor is not None and supervisor.alive and prepared == key
        if not adopt:
            self.close()
        self._session = session
        if warm:
            self._ensure()

    def _file_limit(self, model_bytes: int) -> int:
        limit = result_limit(model_bytes)
        if self.config.disk_bytes:
            limit = min(limit, self.config.disk_bytes)  # no single file beyond the dir's quota
        return limit

    def _ensure(self, stop: threading.Event | None = None) -> Supervisor:
        session = self._session
        if session is None:
            raise InvalidRequest("no model is loaded: send load_model first")
        with self._lock:
            if self._supervisor is not None and self._supervisor.alive:
                return self._supervisor
            if self._supervisor is not None:
                self._supervisor.close()
                self._supervisor = None
            limit = self._file_limit(os.path.getsize(session.model_path))
            spare = self._take_spare(stop)
            if spare is not None:
                spare.assign(session.code, limit)
                self._supervisor = spare
                return spare
            remove_tree(self.paths.task, ignore_errors=True)
            supervisor = self._supervisor_for(self.paths)
            supervisor.start(session.code, limit)
            self._supervisor = supervisor
            return supervisor

    def run_round(self, spec: RoundSpec, stop: threading.Event) -> RoundOutcome:
        session = self._session
        if session is None:
            raise InvalidRequest("no model is loaded: send load_model first")
        supervisor = self._ensure(stop)
        start = session.start_path  # the working copy of an overlapped session, else the model
        size = os.path.getsize(start)
        request = RoundRequest(
            round_id=uuid.uuid4().hex[:16],
            spec=spec,
            params=session.params,
            batch_size=session.batch_size,
            num_shards=session.dataset.num_shards,
            preprocessor_config=dict(session.preprocessor_config),
            max_script_bytes=self._max_script_bytes,
            max_file_bytes=self._file_limit(size),
            model_path=self.paths.inside(start),
            bundle_root=self.paths.inside(session.bundle_root) if session.bundle_root else None,
        )
        header_limit = result_header_limit(start)
        return supervisor.run_round(request, stop, result_limit(size), header_limit)

    def _serve_shard(self, index: int) -> str:
        """Pin the shard in the cache and make it readable at ``/ro/shards`` (never writable)."""
        session = self._session
        if session is None:
            raise InvalidRequest("no model is loaded")
        source = session.dataset.path(index)
        shards = os.path.join(self.paths.ro, "shards")
        target = os.path.join(shards, os.path.basename(source))
        if not _same_file(source, target):
            tmp = temp_path_for(target)
            os.unlink(tmp)
            try:
                os.link(source, tmp)
            except OSError:  # another filesystem: a copy instead of a link
                shutil.copyfile(source, tmp)
            # Readable by the sandbox uid, writable by nobody (a link shares the cache entry's
            # inode; the cache itself only reads and unlinks its entries).
            os.chmod(tmp, 0o444)
            os.replace(tmp, target)
        keep = {os.path.basename(target)} | {
            os.path.basename(session.dataset.cached_path(i)) for i in session.dataset.pinned_indexes()
        }
        for name in os.listdir(shards):
            if name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shards, name))
        return self.paths.inside(target)

    def describe(self) -> dict[str, Any]:
        supervisor = self._supervisor
        return {
            "mode": self.mode,
            "uid": self.config.uid,
            # What confines the running sandbox; before one runs, what this host would give it.
            "confinement": supervisor.confinement
            if supervisor is not None
            else support(self.config.confinement),
            "spare": self._spare.state if self._spare_enabled else "off",
        }

    def interrupt(self) -> None:
        # The runner interrupts tenant code on each stop; the supervisor's watchdog kills the
        # sandbox once the stop is older than the grace period.
        supervisor = self._supervisor
        if supervisor is not None:
            supervisor.request_stop()

    def close(self, *, spare: bool = False) -> None:
        with self._lock:
            if self._supervisor is not None:
                self._supervisor.close()
                self._supervisor = None
            self._prepared = None
        self._session = None
        remove_tree(os.path.dirname(self.paths.task), ignore_errors=True)
        if spare:
            self._spare.discard()


_LIVE: weakref.WeakSet[SandboxedRunner] = weakref.WeakSet()  # this process's, for end_sandboxes


def end_sandboxes() -> None:
    """End every sandbox this process's runners started (the sessions' runners and the spares)
    and remove their confinements, keeping the sessions' files for a replacement process: what a
    worker process does on its way out, so that no sandbox outlives it frozen. Never raises."""
    for runner in list(_LIVE):
        try:
            runner.close(spare=True)
        except Exception as exc:  # on the way out: the other runners are still ended
            logger.warning("a sandbox was not ended: %s", exc)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
