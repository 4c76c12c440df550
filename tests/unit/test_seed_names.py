"""A caller of the seed imports its names from ``executor`` (DESIGN §9): every public name the
seed's ``executor.py`` defined (its classes and module constants), from the package itself,
without torch where the seed's caller only wants an exception name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from settings import Settings

# What the seed's executor.py defines at module level without a leading underscore.
SEED_CLASSES = ("Executor", "StopExecution", "DownloadAborted")
SEED_CONSTANTS = {
    "DOWNLOAD_RETRIES": 3,
    "DOWNLOAD_RETRY_BACKOFF": 2.0,
    "DOWNLOAD_CHUNK_SIZE": 4 * 1024 * 1024,
    "STOP_JOIN_TIMEOUT": 30,
    "MAX_IPC_FRAME": 1024 * 1024,
}


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_seeds_exception_names_import_from_the_package_without_torch() -> None:
    # A fresh interpreter: this one has imported torch long ago.
    done = run(
        "import sys\n"
        "from executor import CleanupFailed, DownloadAborted, StopExecution, Stopped\n"
        "assert issubclass(DownloadAborted, Stopped) and issubclass(CleanupFailed, RuntimeError)\n"
        "assert 'torch' not in sys.modules, 'importing an exception name imported torch'\n"
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", [*SEED_CLASSES, "CleanupFailed", *SEED_CONSTANTS])
def test_every_public_seed_name_imports_from_executor(name: str) -> None:
    done = run(f"from executor import {name}")
    assert done.returncode == 0, done.stderr
    import executor

    assert name in executor.__all__


def test_the_seeds_constants_are_the_defaults_that_replaced_them() -> None:
    import executor

    for name, seed_value in SEED_CONSTANTS.items():
        assert getattr(executor, name) == seed_value, name
    # The numbers the engine runs with unless an operator sets them.
    fields = Settings.model_fields
    assert fields["download_retries"].default == executor.DOWNLOAD_RETRIES
    assert fields["download_buffer_bytes"].default == executor.DOWNLOAD_CHUNK_SIZE
    with pytest.raises(AttributeError):
        executor.NOT_A_SEED_NAME  # noqa: B018
