"""The session: what ``load_model`` establishes and every later round and sync reuses.

The facade (:class:`executor.core.Executor`) parses each request once into a typed value
and hands it to the :class:`SessionKeeper`, which owns the rest:

- ``_working``: an overlapped session's working copy (``WorkingCopy``), the file its rounds
  start from, and the one pass that writes a round's delta and the next working copy;
- ``_overlap``: the rest of an overlapped session's side: ``run_round``'s ``OverlapSpec``,
  the round's start and end, and its delta's upload beside the next round;
- ``_requests``: ``LoadRequest``, ``RoundRequest``, ``SyncRequest``, each checked once where
  it enters; ``QuantConfig`` (how a quantised delta is cut);
- ``_model``: the model file in the work dir (``ModelFiles``): fetched, hashed as it lands,
  checked and swapped in atomically; the sync's delta path and its full-download fallback;
- ``_state``: the loaded ``Session``;
- ``_manifest``: ``session.json`` (``Manifest``), what a replacement process resumes from;
- ``_loading``: the load pipeline (model, first shard and runner start at once);
- ``_shipping``: a round's trained delta written and uploaded;
- ``_assembling``: a sharded round's sync: its N shards applied, each checked, or the model
  assembled from the round's state shards;
- ``_reducing``: ``reduce_shard``, one shard of a sharded round reduced on this host
  (``ReduceRequest``, checked once where it enters);
- ``_keeper``: ``SessionKeeper`` and its ``SessionConfig``.

Inside the package each module imports only those above it in this list.
"""

from executor.session._keeper import SessionConfig, SessionKeeper
from executor.session._manifest import Manifest, drop_manifest, read_manifest
from executor.session._model import InstalledModel, ModelFiles, ModelLimits, model_fingerprint
from executor.session._overlap import NotInSync, Overlap, OverlapSpec
from executor.session._reducing import ReduceRequest, reduce_on_host
from executor.session._requests import LoadRequest, QuantConfig, RoundRequest, SyncRequest
from executor.session._state import Session
from executor.session._working import WorkingCopy

__all__ = [
    "InstalledModel",
    "LoadRequest",
    "Manifest",
    "ModelFiles",
    "ModelLimits",
    "NotInSync",
    "Overlap",
    "OverlapSpec",
    "QuantConfig",
    "ReduceRequest",
    "RoundRequest",
    "Session",
    "SessionConfig",
    "SessionKeeper",
    "SyncRequest",
    "WorkingCopy",
    "drop_manifest",
    "model_fingerprint",
    "read_manifest",
    "reduce_on_host",
]
