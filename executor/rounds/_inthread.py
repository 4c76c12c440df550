"""Rounds of tenant code in a thread of the worker process (sandbox ``off``).

The round runs in the namespace every runner builds (:func:`session_namespace`), on the
thread that calls :meth:`InThreadRunner.run_round` — the Executor's round thread. A stop
arrives as ``StopExecution`` at the next bytecode of tenant code (see
:class:`executor.stopping.UserCodeShield`); a long native call delays it.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

from executor import placement
from executor.rounds._guard import play
from executor.rounds._namespace import RoundOutputs, RoundSpec, SessionView, session_namespace
from executor.rounds._outcome import RoundOutcome, RoundSession
from executor.stopping import UserCodeShield

logger = logging.getLogger(__name__)


class InThreadRunner:
    """The :class:`~executor.rounds.RoundRunner` that trusts tenant code with the worker's process."""

    mode = "off"

    def __init__(
        self,
        stop: threading.Event,
        *,
        host_id: str,
        offload_dir: str,
        emit_stats: Callable[[dict[str, Any]], None],
        emit_log: Callable[[str], None],
    ) -> None:
        self._shield = UserCodeShield(stop)
        self._stop = stop
        self._host_id = host_id
        self._offload_dir = offload_dir
        self._emit_stats = emit_stats
        self._emit_log = emit_log
        self._session: RoundSession | None = None

    def prepare(
        self, code: str, model_path: str, model_bytes: int, *, abort: threading.Event | None = None
    ) -> None:
        pass  # nothing starts: tenant code runs on the executor's own thread

    def open(self, session: RoundSession, *, warm: bool) -> None:
        # Nothing to warm: torch and the CUDA context live in this process already.
        self._session = session

    def replenish(self) -> None:
        pass  # nothing to start ahead

    def close(self, *, spare: bool = False) -> None:
        self._session = None

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "confinement": "none: tenant code runs in the worker (trusted)"}

    def interrupt(self) -> None:
        # Re-delivered until the round ends: tenant code may catch one StopExecution.
        self._shield.interrupt()

    def run_round(self, spec: RoundSpec, stop: threading.Event) -> RoundOutcome:
        session = self._session
        if session is None:
            raise RuntimeError("run_round before open")
        outputs = RoundOutputs()
        try:
            end = play(
                session.compiled,
                lambda: self._namespace(session, spec, outputs),
                outputs,
                self._shield,
                training=spec.training,
            )
        finally:
            gc.collect()
            placement.empty_device_cache()
        if end.error is not None:
            logger.info("tenant code failed: %s", end.error.message)
            self._emit_log(f"[ERROR] {end.error.message}")
        return RoundOutcome(end.stopped, end.error, end.trained, outputs.report, end.seconds)

    def _namespace(self, session: RoundSession, spec: RoundSpec, outputs: RoundOutputs) -> dict[str, Any]:
        view = SessionView(
            model_path=session.start_path,
            bundle_root=session.bundle_root,
            preprocessor_config=session.preprocessor_config,
            params=session.params,
            batch_size=session.batch_size,
            num_shards=session.dataset.num_shards,
            host_id=self._host_id,
            offload_dir=self._offload_dir,
        )
        return session_namespace(
            view,
            spec,
            get_shard=session.dataset.get,
            emit_stats=self._emit_stats,
            emit_log=self._emit_log,
            stop_signal=self._stop,
            outputs=outputs,
            shield=self._shield.callback,
        )
