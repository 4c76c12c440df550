"""Every path of a work dir, named here and nowhere else.

```
<ROUNDHOUSE_WORK_DIR>/
  <host_id>/session/              a worker's session dir (session_dir); a library caller's
                                  Executor takes a fresh <WORK_DIR>/task-XXXX/ instead
    session.json                  the manifest a replacement process resumes from
    model/                        model.safetensors and bundle/ (the sandbox's /model)
    incoming/                     downloads in progress (resumable .partial files)
    incoming/staging/             a model or bundle checked here before it replaces model/'s
    deltas/round-N.safetensors.zst  a round's delta when no upload URL was given
    deltas/round-N.safetensors      an overlapped round's, plain until its upload frames it
    delta-residual.safetensors    error feedback of quantised deltas
    reduce/                       a sharded round's scratch, and what it keeps for a later step
                                  (kept-<delta|state|velocity>-<shard>-<hex>.zst, named by hash)
    results/<task id>.json        the tasks' recorded results (redelivery: tasks/rounds.py)
    sandbox/, sandbox-spare/      the sandboxed runner's and the spare's (inside: ro/, task/;
                                  executor.sandbox lays those out)
    private-shards/               the shards without a shared cache (shard_cache_max_mb <= 0)
    model-offload/                accelerate's disk offload of the in-thread runner
  <host_id>/replay/               the control plane's nonce ledger (tasks/trust/replay.py)
```

Why one module: the layout was spelled in seven, and a directory one of them removes (a
reset, a leftover sweep) must be the one the others write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MANIFEST_NAME = "session.json"
MODEL_DIRNAME = "model"
RESIDUAL_NAME = "delta-residual.safetensors"


def session_dir(work_dir: str, host_id: str) -> str:
    """A worker's session dir: the same path for every process of the worker (a replacement
    child resumes what the last one left)."""
    return os.path.join(work_dir, host_id, "session")


def replay_dir(work_dir: str, host_id: str) -> str:
    """A worker's replay ledger: beside its session, not in it (a reset keeps the ledger)."""
    return os.path.join(work_dir, host_id, "replay")


@dataclass(frozen=True)
class SessionDir:
    """The paths of one session dir (``root``); nothing is created here."""

    root: str

    def _in(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def manifest(self) -> str:
        return self._in(MANIFEST_NAME)

    @property
    def model(self) -> str:
        return self._in(MODEL_DIRNAME)

    @property
    def incoming(self) -> str:
        return self._in("incoming")

    @property
    def staging(self) -> str:
        return self._in("incoming", "staging")

    @property
    def deltas(self) -> str:
        return self._in("deltas")

    @property
    def residual(self) -> str:
        return self._in(RESIDUAL_NAME)

    @property
    def results(self) -> str:
        return self._in("results")

    @property
    def sandbox(self) -> str:
        return self._in("sandbox")

    @property
    def sandbox_spare(self) -> str:
        return self._in("sandbox-spare")

    @property
    def private_shards(self) -> str:
        return self._in("private-shards")

    @property
    def model_offload(self) -> str:
        return self._in("model-offload")

    @property
    def reduce(self) -> str:
        return self._in("reduce")

    def kept(self, kind: str, shard: int, digest: str) -> str:
        """A sharded round's file kept for a later step (``kind``: delta, state, velocity), named
        by its hash's hex digest (the caller checks that it is one: never a path)."""
        return os.path.join(self.reduce, f"kept-{kind}-{shard}-{digest}.zst")

    def round_delta(self, round_num: int, *, compressed: bool = True) -> str:
        return os.path.join(self.deltas, f"round-{round_num}.safetensors" + (".zst" if compressed else ""))

    def result(self, task_id: str) -> str:
        """A task's recorded result (a task id is the client's: no separator survives)."""
        return os.path.join(self.results, task_id.replace("/", "_") + ".json")
