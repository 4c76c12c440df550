"""The sandboxed runner (DESIGN §8): tenant code in a process of its own, with no network.

- ``SandboxedRunner``: the :class:`~executor.rounds.RoundRunner` the Executor uses when tenant
  code is untrusted; one warm runner process per session; ``end_sandboxes``: every sandbox the
  process started ended (a worker process's way out);
- launch (``_launch``: bwrap, the ``unshare`` mode, which one ``auto`` picks — ``resolve_mode``,
  ``bwrap_works``), the seccomp filter (``_seccomp``: ``build_filter``);
- the protocol (``_protocol``: JSON lines of at most ``MAX_FRAME_BYTES``, ``RoundRequest``);
- enforcement from outside, since the runner is untrusted for its whole life: the sandbox's
  confinement (``_confinement``, ``_pidns``, ``_cgroup``: a cgroup with memory and process
  limits, frozen between rounds, strays killed; ``_groups``: whose group is whose, and
  reclaiming what dead workers left), the runner's process and its whole-life
  frame reader (``_process``), the trained state read by descriptor (``_result``:
  ``read_result``, a ``ResultState`` read key by key);
- the supervisor (``_supervisor``, the worker's side: start, rounds, shards, watchdog), the
  spare (``_spare``: a runner started while the worker is idle, adopted by the next session),
  and the runner (``_runner``, the child's side, run as ``python -m executor.sandbox``:
  ``__main__``).

Inside the package, bottom up: ``_seccomp``, ``_launch``, ``_protocol``, ``_result`` and
``_confinement`` import no sibling; ``_pidns`` and ``_groups`` import ``_confinement``; ``_cgroup``
imports all three;
``_process`` imports ``_protocol``; ``_supervisor`` imports all of these; ``_sandboxed`` imports
``_supervisor``; ``_runner`` imports ``_protocol`` only.
"""

from executor.sandbox._launch import SandboxConfig, bwrap_works, resolve_mode
from executor.sandbox._protocol import MAX_FRAME_BYTES, RoundRequest, checked_error, read_frame
from executor.sandbox._result import ResultState, read_result
from executor.sandbox._sandboxed import SandboxedRunner, end_sandboxes
from executor.sandbox._seccomp import AARCH64, X86_64, build_filter

__all__ = [
    "AARCH64",
    "MAX_FRAME_BYTES",
    "X86_64",
    "ResultState",
    "RoundRequest",
    "SandboxConfig",
    "SandboxedRunner",
    "build_filter",
    "bwrap_works",
    "checked_error",
    "end_sandboxes",
    "read_frame",
    "read_result",
    "resolve_mode",
]
