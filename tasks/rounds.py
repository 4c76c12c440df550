"""The tasks of DESIGN §3, thin: validate, hand to the child's Executor, return JSON.

Idempotent under redelivery (``task_acks_late``): a task that already finished in
this work dir returns its recorded result instead of running again, and
``apply_delta`` whose result hash is already in place applies nothing.

The functions here are plain; :func:`register` puts them on the app under their
contract names (``tasks.app`` calls it), so that this module never imports the app.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from typing import Any

from celery import Celery, Task

from executor.fileio import atomic_write_json
from executor.workdir import SessionDir
from settings import Settings
from tasks.names import APPLY_DELTA, LOAD_MODEL, REDUCE_SHARD, RESET, RUN_ROUND, STATUS
from tasks.overlap import SyncInbox
from tasks.runtime import runtime


class RoundTask(Task):
    """Base of the tasks. Acknowledged when they end; a task whose child died (the kernel's
    OOM killer, a segfault in a CUDA library) runs once more on the replacement child, then
    fails with ``WorkerLostError`` instead of looping. No other retries: the orchestrator
    decides what to do with a failed task. ``max_retries`` comes from the settings, in
    :func:`register`."""

    typing = True
    # The MainProcess's request: on a signed worker it hands the child the verified body
    # without its envelope, and retries a lost child's task by redelivering the signed message.
    Request = "tasks.trust.gate:GatedRequest"
    acks_late = True
    reject_on_worker_lost = True
    retry_on_worker_lost = True
    default_retry_delay = 1


def _memo_path(task_id: str) -> str:
    dirs = SessionDir(runtime().executor.work_dir)
    os.makedirs(dirs.results, exist_ok=True)
    return dirs.result(task_id)


def _recall(task_id: str) -> dict[str, Any] | None:
    try:
        with open(_memo_path(task_id), encoding="utf-8") as file:
            value: dict[str, Any] = json.load(file)
            return value
    except (FileNotFoundError, ValueError):
        return None


def _remember(task_id: str, result: dict[str, Any]) -> dict[str, Any]:
    atomic_write_json(_memo_path(task_id), result)
    return result


def load_model(
    self: Task,
    model_url: str,
    dataset_shards: list[Any],
    code: str,
    batch_size: int = 32,
    params: dict[str, Any] | None = None,
    initial_shard_index: int = 0,
    tenant: str = "default",
    hash_scheme: str = "sha256",
) -> dict[str, Any]:
    rt = runtime()
    task_id = self.request.id
    with rt.task(task_id, "load_model"):
        if (done := _recall(task_id)) is not None and rt.executor.state.value != "idle":
            return done
        result = rt.executor.load(
            model_url,
            dataset_shards,
            code,
            batch_size,
            params,
            initial_shard_index,
            tenant=tenant,
            hash_scheme=hash_scheme,
        )
        return _remember(task_id, result.to_json())


def run_round(
    self: Task,
    steps: int = 100,
    round_num: int = 0,
    total_rounds: int = 1,
    mode: str = "training",
    step_offset: int = 0,
    delta_url: str | None = None,
    delta_dtype: str = "float16",
    overlap: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rt = runtime()
    task_id = self.request.id
    with rt.task(task_id, "run_round", round_num) as current:
        if (done := _recall(task_id)) is not None:
            return done  # redelivered after it finished: the round is not run twice
        # One request, checked before the round trains (a refused delta URL writes nothing).
        request = rt.executor.round_request(
            steps, round_num, total_rounds, mode, step_offset, delta_url=delta_url, delta_dtype=delta_dtype,
            overlap=overlap,
        )  # fmt: skip
        started = time.monotonic()
        rt.executor.start(request)
        spec = request.overlap
        inbox = rt.sync_inbox(spec.sync_id, current) if spec is not None and spec.sync_id else None
        try:
            rt.wait_round(current)
            if spec is not None and inbox is not None:
                # A completed round's delta pass waits for its sync first: the next W is built on it.
                rt.executor.overlapped.overlap.gate = partial(inbox.wait, spec.sync_wait_s)
            result = rt.executor.finish_round().to_json()
            if spec is not None:
                result["overlap"] = _end_overlapped(
                    rt, spec.sync_wait_s, inbox, result["status"] == "completed"
                )
        finally:
            if inbox is not None:
                inbox.close()
        rt.metrics.round_done(result["status"], time.monotonic() - started)
        return _remember(task_id, result)


def _end_overlapped(rt: Any, sync_wait_s: float, inbox: SyncInbox | None, completed: bool) -> dict[str, Any]:
    """An overlapped round's end, reported: the wait for its sync (idle time) and the working
    copy the next round starts from (both made in its delta's pass), and its delta handed to an
    upload beside the next round. A round that did not complete waited for nothing: its host is
    re-synced by the orchestrator."""
    keeper = rt.executor.overlapped
    ended = keeper.end_overlapped_round()
    # The delta's hash, frame and PUT run beside the next round; their end is in the heartbeat.
    upload_wait_s = keeper.overlap.hand_off(on_done=rt.beat)
    synced = inbox is None or inbox.outcome is not None
    out: dict[str, Any] = {
        "global_hash": rt.executor.session.model_hash if rt.executor.session else None,
        "rebased": ended.rebased,
        "sync_wait_s": round(ended.sync_wait_s, 6),
        "rebase_s": round(ended.rebase_s, 6),
        "upload_wait_s": round(upload_wait_s, 6),
        "sync": inbox.outcome if inbox is not None else None,
    }
    if inbox is not None and completed and not synced:
        out["sync_error"] = inbox.error or f"no sync order within {sync_wait_s:g} s"
    return out


def apply_delta(
    self: Task,
    model_url: str,
    delta_url: str | None = None,
    base_hash: str | None = None,
    result_hash: str | None = None,
    params: dict[str, Any] | None = None,
    dataset_shards: list[Any] | None = None,
) -> dict[str, Any]:
    rt = runtime()
    with rt.task(self.request.id, "apply_delta"):
        outcome = rt.executor.update_model(
            model_url,
            params,
            dataset_shards,
            delta_url=delta_url,
            base_hash=base_hash,
            result_hash=result_hash,
        )
        return outcome.to_json()


def reduce_shard(
    self: Task,
    shard: int,
    count: int,
    base_hash: str,
    contributions: list[dict[str, Any]],
    sync_url: str,
    state_url: str | None = None,  # with velocity_url: PUT now; neither: deferred to the apply
    velocity_url: str | None = None,
    velocity: dict[str, Any] | None = None,
    outer: dict[str, Any] | None = None,
    sync_dtype: str = "float16",
    align: int = 4096,
) -> dict[str, Any]:
    """One shard of a sharded round, reduced between rounds (docs/SHARDED.md). Its objects are
    immutable and its outcome deterministic: a redelivered one returns its recorded result."""
    rt = runtime()
    task_id = self.request.id
    with rt.task(task_id, "reduce_shard"):
        if (done := _recall(task_id)) is not None:
            return done
        result = rt.executor.reduce_shard(
            shard=shard, count=count, base_hash=base_hash, contributions=contributions, sync_url=sync_url,
            state_url=state_url, velocity_url=velocity_url, velocity=velocity, outer=outer,
            sync_dtype=sync_dtype, align=align,
        )  # fmt: skip
        return _remember(task_id, result)


def reset(self: Task, tenant: str | None = None) -> dict[str, Any]:
    rt = runtime()
    with rt.task(self.request.id, "reset"):
        try:
            return {"wiped_bytes": rt.executor.reset(tenant=tenant)}
        finally:
            # The tenant boundary: the next tenant replays none of the last one's events.
            rt.events.cut()


def status(self: Task) -> dict[str, Any]:
    return runtime().status()


def register(app: Celery, settings: Settings) -> None:
    """Put the tasks on ``app`` under their contract names (DESIGN §3)."""
    for name, run in (
        (LOAD_MODEL, load_model),
        (RUN_ROUND, run_round),
        (APPLY_DELTA, apply_delta),
        (REDUCE_SHARD, reduce_shard),
        (RESET, reset),
        (STATUS, status),
    ):
        app.task(run, name=name, bind=True, base=RoundTask, max_retries=settings.worker_lost_retries)
