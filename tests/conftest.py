"""What the whole test session shares, and every process it starts (workers inherit it).

The URL policy (DESIGN §11) refuses loopback addresses by default, and every server of
the suite listens on loopback (``FaultServer``, nginx, the orchestrator's
``ArtifactServer``), so the session opens loopback, as an operator would with
``ROUNDHOUSE_URL_ALLOW``. ``file://`` stays closed: a test that reads or writes local URLs
names its own roots (``Settings(file_roots=...)``). The tests of the policy itself build
their settings explicitly and so are not affected.

The session also runs signed (below): one development key directory for the whole run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

# Set at import, before any test module reads Settings or starts a worker.
os.environ["ROUNDHOUSE_URL_ALLOW"] = "127.0.0.1,::1"
os.environ.pop("ROUNDHOUSE_FILE_ROOTS", None)
# No spare runner unless a test asks for one (tests/sandbox/test_spare.py, the worker tests of
# it): the spare is a second sandboxed interpreter per executor, and the suite's counts of
# runners and their starts are of the session's runner; two cores would also pay a torch
# import per load.
os.environ["ROUNDHOUSE_SANDBOX_SPARE"] = "false"

# The signed control plane (DESIGN §11), as deployed: every worker the suite starts trusts the
# session's development orchestrator certificate and nothing else, and every client of the
# test process (RoundClient, Celery apps from Settings) signs with its key. Tests of the
# unsigned plane, or of other keys, say so in their own Settings.
from tasks.trust.keys import init_keys  # after the settings above (it builds no app)

SESSION_KEYS, _ = init_keys(tempfile.mkdtemp(prefix="roundhouse-test-keys-") + "/keys")
os.environ["ROUNDHOUSE_TRUSTED_CERTS"] = str(SESSION_KEYS.trusted)
os.environ["ROUNDHOUSE_SIGNING_KEY"] = str(SESSION_KEYS.signing_key())
os.environ["ROUNDHOUSE_SIGNING_CERT"] = str(SESSION_KEYS.signing_cert())
os.environ["ROUNDHOUSE_TLS_CA_FILE"] = str(SESSION_KEYS.ca_cert)
for _name in ("ROUNDHOUSE_KEYS_DIR", "ROUNDHOUSE_INSECURE"):
    os.environ.pop(_name, None)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of the module's own on a free port (its tests may kill and restart it:
    no other module sees it), stopped after the module."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


# The suite's rules (skips in CI, module order, measured times): tests/support/suite.py.
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.suite import (  # noqa: E402
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_collectreport,
    pytest_make_collect_report,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)

__all__ = [
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_collectreport",
    "pytest_make_collect_report",
    "pytest_runtest_logreport",
    "pytest_runtest_makereport",
    "pytest_terminal_summary",
]
