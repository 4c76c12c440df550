"""What the whole test session shares, and every process it starts (workers inherit it).

The URL policy (DESIGN §11) refuses loopback addresses by default, and every server of
the suite listens on loopback (``FaultServer``, nginx, the orchestrator's
``ArtifactServer``), so the session opens loopback, as an operator would with
``ROUNDHOUSE_URL_ALLOW``. ``file://`` stays closed: a test that reads or writes local URLs
names its own roots (``Settings(file_roots=...)``). The tests of the policy itself build
their settings explicitly and so are not affected.
"""

from __future__ import annotations

import os

# Set at import, before any test module reads Settings or starts a worker.
os.environ["ROUNDHOUSE_URL_ALLOW"] = "127.0.0.1,::1"
os.environ.pop("ROUNDHOUSE_FILE_ROOTS", None)
