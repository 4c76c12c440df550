"""The sandboxed runner (DESIGN §8): tenant code in a process of its own, with no network.

- ``SandboxedRunner``: the :class:`~executor.rounds.RoundRunner` the Executor uses when tenant
  code is untrusted; one warm runner process per session;
- launch (``_launch``: bwrap, the ``unshare`` fallback, which one ``auto`` picks —
  ``resolve_mode``, ``bwrap_works``), the seccomp filter (``_seccomp``: ``build_filter``);
- the protocol (``_protocol``: JSON lines of at most ``MAX_FRAME_BYTES``, ``RoundRequest``);
- the supervisor (``_supervisor``, the worker's side: start, drive rounds, serve shards, read the
  trained state by descriptor with ``read_result``), and the runner (``_runner``, the child's side,
  run as ``python -m executor.sandbox``).

Inside the package: ``_seccomp``, ``_launch`` and ``_protocol`` import no sibling; ``_supervisor``
imports those three; ``_sandboxed`` imports ``_supervisor``; ``_runner`` imports ``_protocol`` only.
"""

from executor.sandbox._launch import bwrap_works, resolve_mode
from executor.sandbox._protocol import MAX_FRAME_BYTES, RoundRequest, checked_error, read_frame
from executor.sandbox._sandboxed import SandboxedRunner
from executor.sandbox._seccomp import AARCH64, X86_64, build_filter
from executor.sandbox._supervisor import read_result

__all__ = [
    "AARCH64",
    "MAX_FRAME_BYTES",
    "X86_64",
    "RoundRequest",
    "SandboxedRunner",
    "build_filter",
    "bwrap_works",
    "checked_error",
    "read_frame",
    "read_result",
    "resolve_mode",
]
