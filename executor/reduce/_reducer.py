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


class ShardSum:
    """The contributors' slices of one shard summed in fp32 **in the order they are added** (the
    caller adds them in sorted host order), one held at a time; then the shard's reduction."""

    def __init__(self) -> None:
        self._total: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, delta: Mapping[str, torch.Tensor]) -> None:
        for key in sorted(delta):
            total = self._total.get(key)
            if total is None:
                self._total[key] = delta[key].to(torch.float32, copy=True)
            else:
                total.add_(delta[key])  # cast element by element, as the star path's sum
        self.count += 1

    def reduce(
        self,
        rule: OuterRule,
        theta: Mapping[str, torch.Tensor],
        velocity: Mapping[str, torch.Tensor] | None,
        sync_dtype: torch.dtype,
    ) -> ReducedShard:
        """``theta``: the shard's slices of the global model (key -> 1-D); ``velocity``: the
        shard's state from the last round (None: the first). The sum is spent."""
        if not self.count:
            raise ValueError("a shard is reduced from at least one delta")
        kept = dict(velocity or {})
        sync: dict[str, torch.Tensor] = {}
        result: dict[str, torch.Tensor] = {}
        for key in sorted(theta):
            value, total = theta[key], self._total.pop(key, None)
            if total is None:
                result[key] = apply_rule(value, None)
                continue
            stepped, kept[key] = outer_step(rule, value, total.div_(self.count), kept.get(key))
            sync[key] = (stepped.to(torch.float32) - value.to(torch.float32)).to(sync_dtype).contiguous()
            result[key] = apply_rule(value, sync[key])
        self._total = {}
        return ReducedShard(sync, result, kept)


def reduce_shard(
    rule: OuterRule,
    theta: Mapping[str, torch.Tensor],
    deltas: Sequence[Mapping[str, torch.Tensor]],
    velocity: Mapping[str, torch.Tensor] | None,
    sync_dtype: torch.dtype,
) -> ReducedShard:
    """:class:`ShardSum` of ``deltas`` (**in sorted host order**), reduced."""
    total = ShardSum()
    for delta in deltas:
        total.add(delta)
    return total.reduce(rule, theta, velocity, sync_dtype)
