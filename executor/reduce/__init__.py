"""The sharded round (issue 29, docs/SHARDED.md): no tensor byte through the orchestrator.

Each host writes its trained delta as N shard objects over a fixed partition of the model's
floating elements, host ``i`` reduces shard ``i`` (the contributors' slices summed in sorted
host order, the outer step on its slices) and every host applies the N sync shards.

Inside, data flows down: ``_reducer`` (one shard's reduction) and ``_shardfile`` (a delta's
shard files, written and read back against the partition) → ``_partition`` (the partition: N
runs of key slices, cut on block boundaries) and ``_outer`` (the outer optimiser's step on one
tensor, shared with the star path's ``orchestrator.outer``).
"""

from executor.reduce._outer import OuterRule, outer_step
from executor.reduce._partition import (
    MAX_SHARDS,
    SHARD_ALIGN,
    Partition,
    Slice,
    align_for,
    flat_slice,
    floating_keys,
    model_partition,
    partition,
)
from executor.reduce._reducer import ReducedShard, ShardSum, reduce_shard
from executor.reduce._shardfile import read_delta_shard, read_slice, shard_bound, write_delta_shards

__all__ = [
    "MAX_SHARDS",
    "SHARD_ALIGN",
    "OuterRule",
    "Partition",
    "ReducedShard",
    "ShardSum",
    "Slice",
    "align_for",
    "flat_slice",
    "floating_keys",
    "model_partition",
    "outer_step",
    "partition",
    "read_delta_shard",
    "read_slice",
    "reduce_shard",
    "shard_bound",
    "write_delta_shards",
]
