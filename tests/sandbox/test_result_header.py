"""A tenant's result file is parsed outside the sandbox's limits, so its header is bounded by
the model's before a byte of it is parsed (issue 25 item 10), through the real sandbox.

The tenant swaps the runner's writer for one that writes a valid safetensors header of
hundreds of thousands of empty tensors (zero data bytes, far under the file limit). Parsing
it used to cost the worker +1.2 GB and 16.6 s of CPU for 1.2 M entries, outside the
sandbox's cgroup; now the result is refused unread and the runner serves the next round.
"""

from __future__ import annotations

import time

import pytest

from executor.results import RoundStatus

pytestmark = [pytest.mark.needs_sandbox, pytest.mark.timeout(300)]

ENTRIES = 400_000  # ~24 MB of header: a tenth of the mlp model's result limit, 500x its header
EMPTY_TENSORS = f"""
import executor.sandbox._runner as runner
def empty_tensors(out, state):
    import struct  # the round's namespace is cleared before the runner writes the result
    body = b",".join(b'"k%d":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' % i for i in range({ENTRIES}))
    header = b"{{" + body + b"}}"
    header += b" " * (-len(header) % 8)
    out.write(struct.pack("<Q", len(header)) + header)
runner.write_state = empty_tensors
save_model({{name: value for name, value in load_model(model_path).items()}})
"""


def test_a_result_header_beyond_the_models_is_refused_unparsed(world) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = world.attack(EMPTY_TENSORS)
    elapsed = time.monotonic() - started
    assert result.status is RoundStatus.FAILED, result
    assert result.error.code == "sandbox_protocol_error", result.error
    assert "header" in result.error.message and "bound" in result.error.message, result.error.message
    assert elapsed < 30, elapsed
    world.healthy()
