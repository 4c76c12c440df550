"""The reference orchestrator: DiLoCo outer loop, sync-delta publication, artifact serving, the demo.

It drives workers through :class:`tasks.client.RoundClient` only. Modules, each importing
only those listed before it (and ``tasks.client``, ``tasks.names``, ``executor``, ``settings``):

- ``artifacts``: a directory over HTTP with HMAC-signed, expiring URLs (``ArtifactServer``)
- ``s3``: an S3-compatible store reached by SigV4 presigned URLs (``S3Store``)
- ``local``: the embedded Redis and local worker processes (the demo; the tests reuse them)
- ``diloco``: the ``ArtifactStore`` protocol, the outer step and the ``Orchestrator``
- ``demo``: ``roundhouse demo``; ``engine_demo``: the engine alone, without Celery
"""
