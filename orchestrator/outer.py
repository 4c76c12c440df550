"""The outer step of DiLoCo: average the workers' deltas, then SGD with Nesterov momentum.

Each worker trains from the same global model θ and returns ``Δ_i = θ_i − θ`` (its trained
delta). The outer gradient is ``g = −mean(Δ_i)``; with momentum ``μ`` and learning rate
``η``: ``v ← μ v + g`` and ``θ ← θ − η (g + μ v)`` (Nesterov) or ``θ − η v`` (plain).
``η = 1, μ = 0`` is plain averaging of the workers' models. Only floating tensors move;
the new θ is then handed to :func:`executor.delta.make_sync_delta`, whose ``.result`` is the
exact state every worker will hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


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
