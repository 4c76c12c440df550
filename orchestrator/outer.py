"""The outer step of DiLoCo: the next global model from the current one and the hosts' mean delta.

Each worker trains from the same global model θ and returns ``Δ_i = θ_i − θ`` (its trained
delta). The outer gradient is ``g = −mean(Δ_i)``; with momentum ``μ`` and learning rate ``η``:
``v ← μ v + g`` and ``θ ← θ − η (g + μ v)`` (Nesterov) or ``θ − η v`` (plain). ``η = 1, μ = 0``
is plain averaging of the workers' models. Only floating tensors move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.reduce import OuterRule, outer_step


def mean_delta(deltas: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The elementwise mean (fp32) of deltas held at once; a key a delta lacks counts as zero.
    (The orchestrator folds them as they arrive instead: :class:`orchestrator.aggregate.RunningMean`.)"""
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
        """The next global state from the current one and the averaged delta (the rule shared
        with the sharded round's reducers: ``executor.reduce.outer_step``)."""
        rule = OuterRule(self.lr, self.momentum, self.nesterov)
        new: dict[str, torch.Tensor] = {}
        for key, value in params.items():
            if key not in avg_delta or not value.dtype.is_floating_point:
                new[key] = value
                continue
            new[key], self.velocity[key] = outer_step(rule, value, avg_delta[key], self.velocity.get(key))
        return new

    def eager_gain(self) -> float:
        """What the next step multiplies the mean delta by: in an overlapped round a host steps
        ahead alone with its own delta in the mean's place (docs/OVERLAP.md)."""
        return self.lr * (1 + self.momentum) if self.nesterov else self.lr

    def eager_correction(self) -> dict[str, torch.Tensor]:
        """The rest of the next step, the same for every host: ``-lr mu^2 v`` (Nesterov) or
        ``-lr mu v`` (plain), in float16 (what a host adds to its working copy); {} when zero."""
        scale = -self.lr * self.momentum * (self.momentum if self.nesterov else 1.0)
        if not scale or not self.velocity:
            return {}
        return {key: (value * scale).to(torch.float16) for key, value in sorted(self.velocity.items())}

    def settings(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov}
