"""The sandboxed runner (DESIGN §8): launch, seccomp, protocol, supervisor and the runner itself."""

from executor.sandbox._launch import bwrap_works
from executor.sandbox._protocol import MAX_FRAME_BYTES, checked_error, read_frame
from executor.sandbox._sandboxed import Isolation
from executor.sandbox._seccomp import AARCH64, X86_64, build_filter
from executor.sandbox._supervisor import read_result

__all__ = [
    "AARCH64",
    "MAX_FRAME_BYTES",
    "X86_64",
    "Isolation",
    "build_filter",
    "bwrap_works",
    "checked_error",
    "read_frame",
    "read_result",
]
