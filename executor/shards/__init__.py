"""The persistent, bounded, cross-process shard cache (DESIGN §7) and one session's dataset.

``ShardCache`` (entries keyed by tenant and shard id, a ledger that counts bytes in flight,
file locks across processes), ``ShardDescriptor`` (what ``dataset_shards`` items parse
into) and ``check_tenant``, ``ShardSession`` (pins, one-ahead prefetch, one decoded shard
in memory) and ``load_shard_file`` (decoding, shared with the sandboxed runner).

Inside, data flows down: ``_session`` (one session's dataset) → ``_cache`` (entries,
pins, downloads) → ``_ledger`` (space accounting and the ``flock`` locks) → ``_decode``
(zstd streams, shard files) → ``_descriptor`` (descriptors, tenant names).
"""

from executor.shards._cache import ShardCache
from executor.shards._decode import load_shard_file
from executor.shards._descriptor import ShardDescriptor, check_tenant
from executor.shards._session import ShardSession

__all__ = ["ShardCache", "ShardDescriptor", "ShardSession", "check_tenant", "load_shard_file"]
