"""The load pipeline of ``load_model``: the model download, the first shard and the sandboxed
runner's start, all at once, with the model hashed while its bytes land.

A load used to be strictly serial: fetch the model, read it back to hash it, stage the first
shard, then start the runner (``import torch`` and the CUDA context: 1.2 s on a 2-core VM,
~4 s on an H200). What a user waits for is the longest of these instead::

    main thread    model GET ──────────────▶ canonical file ─┐
      follower       └ state hash just behind the writer ────┤ (or the hash of the file, when
                                                             │  its tensors are out of key order)
    load-shard     first shard: reserve, GET, decode ────────┤
    load-runner    (once the model's safetensors header is   │
                   in: its size sets the runner's limits)    │
                   start the sandboxed runner ───────────────┴▶ install (os.replace) → session

The rules of a load hold as before: nothing of the current session changes before the new
model and shard are both complete and checked (a bad model or shard leaves the old model
file, its dataset and its manifest as they were; only its warm runner, replaced at the
start, is started again at its next round); a stop, or a failure of any one part, calls off
the others (a private stop signal, linked to the executor's, aborts both downloads and
kills a runner that is starting) and every thread is joined before ``load`` returns or
raises; every error keeps its code.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from executor import artifacts
from executor.errors import BadArtifact, CleanupFailed, RoundhouseError, Stopped
from executor.rounds import RoundRunner
from executor.session._manifest import drop_manifest
from executor.session._model import InstalledModel, ModelFiles
from executor.session._requests import LoadRequest
from executor.session._state import Session
from executor.shards import ShardSession
from executor.stopping import DoneThread, StopSignal, on_stop
from executor.tensorfile import header_length, parse_header

logger = logging.getLogger(__name__)

JOIN_POLL_S = 0.05


@dataclass(frozen=True)
class Staged:
    """What a load put in place: the installed model, the new dataset and its staged shard."""

    model: InstalledModel
    dataset: ShardSession
    staged_shard: int | None
    artifact: artifacts.ModelArtifact


def safetensors_bytes(head: bytes) -> int | None:
    """The size of the safetensors file whose first bytes are ``head``, when its header lies
    within them (None for anything else: a zip, a pickle, a header longer than ``head``)."""
    if head[8:9] != b"{":
        return None
    try:
        length = header_length(head[:8])
        if 8 + length > len(head):
            return None
        header = parse_header(head[8 : 8 + length], None)
    except BadArtifact:
        return None
    return header.data_offset + header.data_bytes


class _Helpers:
    """The load's helper threads: started on demand, joined before the load ends."""

    def __init__(self, join_timeout_s: float) -> None:
        self._join_timeout_s = join_timeout_s
        self._threads: list[tuple[DoneThread, list[BaseException]]] = []
        self._lock = threading.Lock()
        self.began = time.monotonic()  # the load's start: every time the load logs counts from it
        self.ended: dict[str, float] = {}  # a helper's name: seconds from the load's start to its end

    def start(self, name: str, work: Callable[[], object]) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # handed to the load's own thread in join()
                errors.append(exc)
            finally:
                self.ended[name] = time.monotonic() - self.began

        thread = DoneThread(run, name)
        with self._lock:
            self._threads.append((thread, errors))
        thread.start()

    def join(self, abort: threading.Event, on_abort: Callable[[], None]) -> dict[str, BaseException]:
        """Wait for every helper; their errors by thread name. ``on_abort`` runs (once, on this
        thread) when ``abort`` is set meanwhile. ``CleanupFailed`` when a helper does not end
        within the join timeout after that (it must not outlive the load unseen)."""
        with self._lock:
            threads = list(self._threads)
        called = False
        deadline: float | None = None
        for thread, _ in threads:
            while not thread.wait(JOIN_POLL_S):
                if abort.is_set() and not called:
                    called = True
                    on_abort()
                if abort.is_set():
                    deadline = deadline or time.monotonic() + self._join_timeout_s
                    if time.monotonic() > deadline:
                        raise CleanupFailed(f"load helper thread {thread.name} did not end")
        return {thread.name: errors[0] for thread, errors in threads if errors}


class LoadPipeline:
    """One ``load_model`` (a fresh pipeline per load)."""

    def __init__(
        self,
        models: ModelFiles,
        runner: RoundRunner,
        stop: StopSignal,
        *,
        stage_first_shard: bool,
        join_timeout_s: float,
    ) -> None:
        self._models = models
        self._runner = runner
        self._stop = stop
        self._stage_first_shard = stage_first_shard
        self._join_timeout_s = join_timeout_s
        # Set by a stop (the executor's signal) or by a failure of any part.
        self._abort = StopSignal()
        self._helpers = _Helpers(join_timeout_s)
        self._runner_started = False
        self._fetched_s = 0.0

    def run(self, request: LoadRequest, *, dataset: ShardSession, previous: Session | None) -> Staged:
        """Fetch, hash and install the model with the first shard staged and the runner
        started beside it; on any failure ``previous`` stays the session, its runner reopened
        cold (started again by its next round)."""
        unlink = on_stop(self._stop, self._abort.set)
        if previous is not None:
            previous.dataset.close(timeout_s=self._join_timeout_s)  # its pins free the cache for ours
        staged = request.staged_shard if self._stage_first_shard else None
        if staged is not None:
            index = staged
            self._helpers.start("load-shard", lambda: dataset.stage(index, abort=self._abort, prefetch=False))
        try:
            model, artifact = self._model(request)
        except BaseException:
            self._call_off(previous)
            dataset.close(timeout_s=self._join_timeout_s)
            raise
        finally:
            unlink()
        if staged is not None:
            dataset.prefetch_after(staged)
        # Where a load's time went, for whoever profiles time to ready (bench.load, a slow host).
        helpers = ", ".join(f"{name} done {at:.2f} s" for name, at in sorted(self._helpers.ended.items()))
        logger.info(
            "load_model: model fetched and hashed %.2f s, installed %.2f s; %s",
            self._fetched_s,
            time.monotonic() - self._helpers.began,
            helpers or "no helper",
        )
        return Staged(model, dataset, staged, artifact)

    def _model(self, request: LoadRequest) -> tuple[InstalledModel, artifacts.ModelArtifact]:
        with self._models.staging() as staging:
            artifact, model_hash = self._models.fetch_hashed(
                request.model_url,
                "model",
                staging,
                scheme=request.hash_scheme,
                abort=self._abort,
                on_head=lambda head: self._start_runner(request.code, head),
            )
            self._fetched_s = time.monotonic() - self._helpers.began
            self._join_helpers()
            # A crash from here on must not rehydrate the old session onto the new model.
            drop_manifest(self._models.work_dir)
            return self._models.install(artifact, model_hash), artifact

    def _start_runner(self, code: str, head: bytes) -> None:
        """Once the model's header is in: start the runner that ``open`` will adopt."""
        model_bytes = safetensors_bytes(head)
        if model_bytes is None or self._abort.is_set():
            return  # not safetensors (converted later: its size is not known yet)
        model_path = self._models.model_path
        self._runner_started = True
        self._helpers.start(
            "load-runner",
            lambda: self._runner.prepare(code, model_path, model_bytes, abort=self._abort),
        )

    def _join_helpers(self) -> None:
        """Wait for the shard and the runner; a failed shard fails the load (its code kept), a
        runner that could not start is started again by ``open`` (which reports why)."""
        errors = self._helpers.join(self._abort, self._runner.close)
        if self._abort.is_set():
            raise Stopped("load_model stopped")
        runner_error = errors.pop("load-runner", None)
        if runner_error is not None:
            logger.info("the runner started beside the download did not come up: %s", runner_error)
        shard_error = errors.pop("load-shard", None)
        if shard_error is not None:
            raise shard_error

    def _call_off(self, previous: Session | None) -> None:
        """Stop every part still running, join them, and give ``previous`` back its runner."""
        self._abort.set()
        if self._runner_started:
            self._runner.close()  # kills a runner that is starting; prepare() sees the abort
        try:
            errors = self._helpers.join(self._abort, self._runner.close)
        finally:
            if self._runner_started:
                self._runner.close()
                if previous is not None:
                    self._runner.open(previous, warm=False)
        for name, exc in errors.items():
            if not isinstance(exc, Stopped | RoundhouseError):
                logger.warning("%s failed while the load was called off", name, exc_info=exc)
