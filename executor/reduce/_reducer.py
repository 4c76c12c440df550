"""One shard's reduction: the hosts' slices summed in sorted host order, the outer step, the
sync delta's slices and the state they make (docs/SHARDED.md).

The sum is taken in fp32 in the order of the contributors' sorted host ids, whoever reduces
(so a redone reduce gives the same bits), then divided by their count, as the star path's
``RunningMean`` does; the outer step is ``outer_step``, the star path's own; the sync slice is
``cast(stepped - theta)`` and the result ``apply_rule(theta, sync)``, as ``make_sync_delta``
makes them. A key that no contributor shipped is not stepped (its velocity kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from executor.delta import apply_rule
from executor.reduce._outer import OuterRule, outer_step


@dataclass(frozen=True)
class ReducedShard:
    """A shard's outcome: the sync delta's slices (``sync_dtype``), what every host holds after
    applying them (``result``), and the optimiser's velocity for the shard (fp32)."""

    sync: dict[str, torch.Tensor]
    result: dict[str, torch.Tensor]
    velocity: dict[str, torch.Tensor]


def reduce_shard(
    rule: OuterRule,
    theta: Mapping[str, torch.Tensor],
    deltas: Sequence[Mapping[str, torch.Tensor]],
    velocity: Mapping[str, torch.Tensor] | None,
    sync_dtype: torch.dtype,
) -> ReducedShard:
    """``theta``: the shard's slices of the global model (key -> 1-D); ``deltas``: each
    contributor's slices, **in sorted host order**; ``velocity``: the shard's state from the
    last round (None: the first)."""
    if not deltas:
        raise ValueError("a shard is reduced from at least one delta")
    kept = dict(velocity or {})
    sync: dict[str, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for key in sorted(theta):
        value = theta[key]
        total: torch.Tensor | None = None
        for delta in deltas:
            part = delta.get(key)
            if part is not None:
                total = part.to(torch.float32, copy=True) if total is None else total.add_(part)
        if total is None:
            result[key] = value
            continue
        stepped, kept[key] = outer_step(rule, value, total.div_(len(deltas)), kept.get(key))
        sync[key] = (stepped.to(torch.float32) - value.to(torch.float32)).to(sync_dtype).contiguous()
        result[key] = apply_rule(value, sync[key])
    return ReducedShard(sync, result, kept)
