"""A reference DiLoCo-style orchestrator on top of :class:`tasks.client.RoundClient`.

One training session over several workers:

1. ``load_model`` on every worker (the global model, the shards, the code);
2. per round: ``run_round`` on every worker with a URL to PUT its trained delta to;
3. the completed workers' deltas are averaged and an outer step (SGD, Nesterov) gives
   the next global model; a worker that failed or was stopped is left out of the mean;
4. the fp16 sync delta from the old to the new global model is built with
   :func:`executor.delta.make_sync_delta`, and the exact state every worker will hold
   (``.result``) is published as the full-download fallback;
5. ``apply_delta`` everywhere: the workers that took part apply the delta (bit-exact,
   hash-checked); those left out are re-synced by full download; every worker must then
   report the orchestrator's hash.

The outer step: each worker trains from the same global model θ and returns
``Δ_i = θ_i − θ`` (its trained delta). The outer gradient is ``g = −mean(Δ_i)``; with
momentum ``μ`` and learning rate ``η``: ``v ← μ v + g`` and ``θ ← θ − η (g + μ v)``
(Nesterov) or ``θ − η v`` (plain). ``η = 1, μ = 0`` is plain averaging of the workers'
models. Only floating tensors move.

Artifacts live in an :class:`ArtifactStore` and workers reach them by URL only: either
:class:`orchestrator.artifacts.ArtifactServer` (the orchestrator serves a directory
itself, with signed URLs) or :class:`orchestrator.s3.S3Store` (an S3-compatible object
store such as MinIO, with presigned URLs).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from executor.delta import SyncFeedback, max_delta_bytes, read_delta, state_hash, write_delta
from tasks.client import RoundClient

logger = logging.getLogger(__name__)


class ArtifactStore(Protocol):
    """Where the orchestrator keeps artifacts; workers only ever see its URLs."""

    def url_get(self, name: str, expires_s: float = ...) -> str: ...

    def url_put(self, name: str, expires_s: float = ...) -> str: ...

    def publish(self, name: str, source: str | os.PathLike[str]) -> str:
        """Store a local file under ``name``; returns a GET URL for workers."""
        ...

    def fetch(self, name: str, dest: str | os.PathLike[str]) -> None:
        """Copy what is stored under ``name`` (a worker's upload) to a local file."""
        ...


def mean_delta(deltas: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The elementwise mean (fp32) of the workers' deltas; a key a delta lacks counts as zero."""
    if not deltas:
        raise ValueError("no deltas to average")
    keys = sorted(set().union(*deltas))
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        total: torch.Tensor | None = None
        for delta in deltas:
            if key in delta:
                value = delta[key].to(torch.float32)
                total = value.clone() if total is None else total.add_(value)
        assert total is not None
        out[key] = total.div_(len(deltas))
    return out


@dataclass
class OuterOptimizer:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    velocity: dict[str, torch.Tensor] = field(default_factory=dict)

    def step(
        self, params: Mapping[str, torch.Tensor], avg_delta: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The next global state from the current one and the averaged delta."""
        new: dict[str, torch.Tensor] = {}
        for key, value in params.items():
            if key not in avg_delta or not value.dtype.is_floating_point:
                new[key] = value
                continue
            grad = -avg_delta[key].to(torch.float32)
            velocity = self.velocity.get(key)
            velocity = grad.clone() if velocity is None else velocity.mul_(self.momentum).add_(grad)
            self.velocity[key] = velocity
            update = grad + self.momentum * velocity if self.nesterov else velocity
            new[key] = (value.to(torch.float32) - self.lr * update).to(value.dtype)
        return new


@dataclass
class RoundSummary:
    round_num: int
    losses: dict[str, float]
    included: list[str]
    excluded: dict[str, str]  # host -> why
    via: dict[str, str]  # host -> "delta" | "full"
    model_hash: str
    seconds: float

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses.values()) / len(self.losses) if self.losses else None


@dataclass
class Session:
    hosts: list[str]
    shards: list[dict[str, Any]]
    code: str
    params: dict[str, Any] = field(default_factory=dict)
    steps: int = 20
    batch_size: int = 32
    tenant: str = "default"
    delta_dtype: str = "float16"
    sync_delta_dtype: str = "float16"  # or "int8" / "int4": quantised, with error feedback
    round_timeout_s: float = 600.0


class Orchestrator:
    def __init__(
        self,
        client: RoundClient,
        store: ArtifactStore,
        model: Mapping[str, torch.Tensor],
        session: Session,
        *,
        outer: OuterOptimizer | None = None,
        on_round_start: Callable[[int, dict[str, str]], None] | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.session = session
        self.outer = outer or OuterOptimizer()
        self.sync_feedback = SyncFeedback(session.sync_delta_dtype)
        self.global_state = {k: v.detach().cpu().contiguous() for k, v in model.items()}
        self.global_hash = state_hash(self.global_state)
        self.history: list[RoundSummary] = []
        self._on_round_start = on_round_start
        self._scratch = tempfile.mkdtemp(prefix="orchestrator-")
        self._model_name = "model/global-0.safetensors"
        save_file(self.global_state, os.path.join(self._scratch, "global.safetensors"))
        self.store.publish(self._model_name, os.path.join(self._scratch, "global.safetensors"))

    def load(self) -> None:
        session = self.session
        pending = {
            host: self.client.load_model(
                host,
                self.store.url_get(self._model_name),
                session.shards,
                session.code,
                batch_size=session.batch_size,
                params=session.params,
                initial_shard_index=index,
                tenant=session.tenant,
            )
            for index, host in enumerate(session.hosts)
        }
        for host, result in pending.items():
            loaded = result.get(timeout=session.round_timeout_s)
            if loaded["model_hash"] != self.global_hash:
                raise RuntimeError(f"{host} loaded {loaded['model_hash']}, expected {self.global_hash}")

    def run(self, rounds: int) -> list[RoundSummary]:
        for round_num in range(rounds):
            self.history.append(self.round(round_num, rounds))
        return self.history

    def round(self, round_num: int, total_rounds: int) -> RoundSummary:
        started = time.monotonic()
        session = self.session
        pending = {
            host: self.client.run_round(
                host,
                steps=session.steps,
                round_num=round_num,
                total_rounds=total_rounds,
                step_offset=round_num * session.steps,
                delta_url=self.store.url_put(self._delta_name(round_num, host)),
                delta_dtype=session.delta_dtype,
            )
            for host in session.hosts
        }
        if self._on_round_start is not None:
            self._on_round_start(round_num, {host: result.id for host, result in pending.items()})
        deltas, losses, excluded = self._collect(round_num, pending)
        if deltas:
            new_state = self.outer.step(self.global_state, mean_delta(deltas))
        else:
            new_state = dict(self.global_state)  # nobody finished: the model stays as it was
        via = self._sync(round_num, new_state, excluded)
        summary = RoundSummary(
            round_num, losses, sorted(set(session.hosts) - set(excluded)), excluded, via, self.global_hash,
            time.monotonic() - started,
        )  # fmt: skip
        logger.info("round %d: mean loss %s, excluded %s", round_num, summary.mean_loss, excluded)
        return summary

    def _delta_name(self, round_num: int, host: str) -> str:
        return f"deltas/round-{round_num}/{host}.safetensors.zst"

    def _collect(
        self, round_num: int, pending: Mapping[str, Any]
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float], dict[str, str]]:
        deltas: list[dict[str, torch.Tensor]] = []
        losses: dict[str, float] = {}
        excluded: dict[str, str] = {}
        for host, async_result in pending.items():
            try:
                result = async_result.get(timeout=self.session.round_timeout_s)
            except Exception as exc:  # the task itself failed: not averaged in
                excluded[host] = f"task failed: {type(exc).__name__}: {exc}"
                continue
            if result.get("status") != "completed" or not result.get("delta"):
                error = result.get("error") or {}
                excluded[host] = (
                    f"{result.get('status')}: {error.get('code', '')} {error.get('message', '')}".strip()
                )
                continue
            local = os.path.join(self._scratch, f"delta-{host}.zst")
            try:
                self.store.fetch(self._delta_name(round_num, host), local)
                # A worker's delta is untrusted: it decodes to no more than the model allows.
                delta = read_delta(local, max_bytes=max_delta_bytes(self.global_state))
            except Exception as exc:
                excluded[host] = f"delta unreadable: {type(exc).__name__}: {exc}"
                continue
            finally:
                if os.path.exists(local):
                    os.unlink(local)
            if state_hash(delta) != result["delta"]["hash"]:
                excluded[host] = "delta does not match its reported hash"
                continue
            deltas.append(delta)
            report = result.get("report") or {}
            loss = report.get("final_loss", report.get("loss"))
            if isinstance(loss, (int, float)):
                losses[host] = float(loss)
        return deltas, losses, excluded

    def _sync(
        self, round_num: int, new_state: dict[str, torch.Tensor], excluded: Mapping[str, str]
    ) -> dict[str, str]:
        sync = self.sync_feedback.build(self.global_state, new_state)
        delta_name = f"sync/round-{round_num}.safetensors.zst"
        model_name = f"model/global-{round_num + 1}.safetensors"
        delta_file = os.path.join(self._scratch, "sync.zst")
        model_file = os.path.join(self._scratch, "global.safetensors")
        write_delta(sync.delta, delta_file)
        save_file(sync.result, model_file)
        self.store.publish(delta_name, delta_file)
        self.store.publish(model_name, model_file)
        pending = {}
        for host in self.session.hosts:
            # A worker left out of the mean is re-synced by a full download.
            delta_url = None if host in excluded else self.store.url_get(delta_name)
            pending[host] = self.client.apply_delta(
                host,
                self.store.url_get(model_name),
                delta_url=delta_url,
                base_hash=sync.base_hash,
                result_hash=sync.result_hash,
            )
        via: dict[str, str] = {}
        for host, result in pending.items():
            applied = result.get(timeout=self.session.round_timeout_s)
            if applied["model_hash"] != sync.result_hash:
                raise RuntimeError(
                    f"{host} holds {applied['model_hash']} after the sync, not {sync.result_hash}"
                )
            via[host] = applied["via"]
        self.global_state, self.global_hash, self._model_name = sync.result, sync.result_hash, model_name
        return via

    def statuses(self) -> dict[str, dict[str, Any]]:
        return {host: self.client.status(host).get(timeout=60) for host in self.session.hosts}

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._scratch, ignore_errors=True)


def pick_hosts(client: RoundClient, count: int, *, wait_s: float = 60.0) -> list[str]:
    """``count`` idle live workers from the heartbeat registry (waiting for them to appear)."""
    deadline = time.monotonic() + wait_s
    while True:
        idle = [beat["host_id"] for beat in client.hosts(idle_only=True)]
        if len(idle) >= count or time.monotonic() > deadline:
            if len(idle) < count:
                raise RuntimeError(f"wanted {count} idle workers, found {len(idle)}: {idle}")
            return sorted(idle)[:count]
        time.sleep(0.5)
