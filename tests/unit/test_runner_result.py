"""The runner's result write under the round's file bound (RLIMIT_FSIZE, set by the runner
before tenant code runs): the kernel's EFBIG becomes a clear ``user_code_error``."""

from __future__ import annotations

import errno
import subprocess
import sys

from executor.errors import UserCodeError
from executor.sandbox._runner import result_too_large

# A child with a 1 MiB file bound writes a 2 MiB trained state as the runner does.
WRITE = """
import resource, sys, torch
from executor.tensorfile import write_state
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    with open(sys.argv[1], "wb") as out:
        write_state(out, {"w": torch.zeros(512, 1024)})
except OSError as exc:
    print(exc.errno)
"""


def test_a_state_over_the_file_bound_is_a_clear_user_code_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(
        [sys.executable, "-c", WRITE, str(tmp_path / "result.safetensors")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(errno.EFBIG), out  # what the kernel says (Python ignores SIGXFSZ)
    mapped = result_too_large(OSError(errno.EFBIG, "File too large"), 1 << 20)
    assert isinstance(mapped, UserCodeError) and mapped.code == "user_code_error"
    assert "larger than this round's bound for one file, 1048576 bytes" in str(mapped)
    assert mapped.details == {"max_file_bytes": 1 << 20}


def test_other_write_errors_pass_through() -> None:
    other = OSError(errno.ENOSPC, "No space left on device")
    assert result_too_large(other, 1 << 20) is other
