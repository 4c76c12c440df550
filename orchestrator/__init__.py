"""The reference orchestrator: DiLoCo outer loop, sync-delta publication, artifact serving, the demo.

It drives workers through :class:`tasks.client.RoundClient`; of the engine it uses the delta
format and the streaming file helpers (``executor.delta``, ``executor.fileio``,
``executor.tensorfile``), and ``engine_demo`` the ``Executor`` itself. Modules, each importing
only those listed before it (and ``tasks.client``, ``tasks.names``, ``tasks.overlap``,
``tasks.embedded_redis``, ``tasks.trust.keys``, ``executor``, ``settings``; ``cli`` also
``tasks.cli``):

- ``artifacts``: a directory over HTTP with HMAC-signed, expiring URLs (``ArtifactServer``)
- ``s3``: an S3-compatible store reached by SigV4 presigned URLs (``S3Store``)
- ``local``: the embedded Redis and local worker processes (the demo; the tests reuse them)
- ``checkpoint``: the state directory a restarted orchestrator resumes from
- ``collect``: waiting for the workers, with deadlines: how a round or a sync ends
- ``membership``: who trains, from the workers' heartbeats, elastic at round boundaries
- ``aggregate``: a round's trained deltas folded into one running sum as they arrive
- ``elastic``: joins at round boundaries and the sync that follows a round
- ``phases``: where a round's wall time goes, phase by phase (``PhaseClock``)
- ``outer``: the outer step (``OuterOptimizer``: SGD with Nesterov momentum on the mean delta)
- ``records``: what a session trains (``Session``) and what each round did (``RoundSummary``)
- ``overlap``: overlapped rounds: the next round trains while the last one's sync is built,
  published and ordered on the hosts (docs/OVERLAP.md)
- ``fallback``: the star path as a sharded round's fallback (the round folded from the hosts' shards),
  and one shard's state and velocity made again when its reducer's deferred store was not confirmed
- ``sharded_state``: the global model as the store holds it in a sharded session (``ShardedState``)
  and its reducers' deferred store, confirmed or restored
- ``sharded``: sharded rounds: the hosts reduce each round among themselves, no tensor byte
  through the orchestrator (docs/SHARDED.md)
- ``diloco``: the ``ArtifactStore`` protocol and the ``Orchestrator`` (the sequential round)
- ``progress``: what ``roundhouse train`` and ``demo`` show (live progress, the loss)
- ``train``: ``roundhouse train``, DiLoCo training of a user's own model
- ``demo``: ``roundhouse demo``; ``engine_demo``: the engine alone, without Celery
- ``cli``: the ``roundhouse`` command: ``train`` and ``demo`` here, every other subcommand
  ``tasks.cli``'s (the entry point stands on top, so that ``tasks`` never imports this package)
"""
