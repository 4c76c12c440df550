"""The outer optimiser's step on one tensor, the same function in both aggregation paths.

DiLoCo's outer step (``orchestrator.outer``): the outer gradient is ``g = -mean``; with
momentum ``mu`` and learning rate ``lr``, ``v <- mu v + g`` and ``theta <- theta - lr (g + mu v)``
(Nesterov) or ``theta - lr v``. It is elementwise, so a shard's reducer that runs it on its
slices of ``theta``, the mean and ``v`` gets, element for element, what the star path's
orchestrator gets on the whole keys: the two paths call this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterRule:
    """The outer optimiser's settings (its state, the velocity, is kept by whoever steps)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


def outer_step(
    rule: OuterRule, value: torch.Tensor, mean: torch.Tensor, velocity: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stepped value in ``value``'s dtype, the new velocity in fp32). ``velocity`` is updated
    in place when given (one pass less over the model per term: bench.goodput "outer")."""
    avg = mean.to(torch.float32)
    velocity = -avg if velocity is None else velocity.mul_(rule.momentum).sub_(avg)
    if rule.nesterov:
        stepped = torch.add(value.to(torch.float32), avg, alpha=rule.lr)
        stepped.add_(velocity, alpha=-rule.lr * rule.momentum)
    else:
        stepped = torch.add(value.to(torch.float32), velocity, alpha=-rule.lr)
    return stepped.to(value.dtype), velocity
