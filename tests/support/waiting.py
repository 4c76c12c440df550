"""Waiting for a condition, bounded by a deadline rather than a guess of the machine's speed."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll ``condition`` until it holds; fail, naming ``what``, once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
