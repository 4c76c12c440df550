"""The persistent, bounded, cross-process shard cache (DESIGN §7) and one session's dataset.

``ShardCache`` (entries of each tenant, a ledger that counts bytes in flight, file locks
across processes, a byte cap per shard), ``Origin`` (what the check of a caller's URL
showed: an entry not addressed by its content is served only to a caller whose own URL
names the same object), ``ShardDescriptor`` (what ``dataset_shards`` items parse into)
and ``check_tenant``, ``ShardSession`` (pins, one-ahead prefetch, one decoded shard in
memory, each URL checked once) and ``load_shard_file`` (decoding, shared with the
sandboxed runner). The tenant ``"default"`` is no tenant: nothing is served to it on a
hash alone (see ``_access``).

Inside, data flows down: ``_session`` (one session's dataset) → ``_cache`` (entries,
pins, downloads, caps) → ``_access`` (who may be served an entry, and its name) →
``_ledger`` (space accounting and the ``flock`` locks) → ``_decode`` (zstd streams,
shard files) → ``_descriptor`` (descriptors, tenant names).
"""

from executor.shards._access import Origin
from executor.shards._cache import CacheLimits, ShardCache
from executor.shards._decode import load_shard_file
from executor.shards._descriptor import ShardDescriptor, check_tenant
from executor.shards._session import ShardSession

__all__ = [
    "CacheLimits",
    "Origin",
    "ShardCache",
    "ShardDescriptor",
    "ShardSession",
    "check_tenant",
    "load_shard_file",
]
