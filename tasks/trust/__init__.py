"""The signed control plane (DESIGN §11): only the orchestrator commands a worker.

Tasks, control commands and stop requests are signed with the orchestrator's key (Flower's
for control commands only) and carry an envelope that binds what Celery leaves in headers;
a worker trusts exactly the certificates it is given, and its gate, on the MainProcess,
admits nothing else. Modules, each importing only those listed before it (and, of the rest
of ``tasks``, ``names``; the gate also ``events``):

- ``replay``: the replay guard's memory of the signed messages a worker admitted (a ledger on
  its own disk, a copy in Redis)
- ``keys``: development keys (``roundhouse keys init DIR``): a CA, signing pairs, the trust
  store, a Redis TLS certificate, one directory per role with only what that role needs
- ``signing``: Celery's ``auth`` wire format, ``Signer`` / ``Verifier``, the envelopes a
  signed body binds, signed stop tokens
- ``signed_app``: ``SignedCelery``, the app that signs what it sends (tasks, control
  commands) and carries the Settings its bootsteps read (``app_settings``)
- ``gate``: the worker's gate, a consumer bootstep on the MainProcess that admits only
  verified, bound, unexpired, not-yet-finished messages, and the start-up policy
- ``acl``: the Redis ACL users of a deployment (``python -m tasks.trust.acl``)
"""
