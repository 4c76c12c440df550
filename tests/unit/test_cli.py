"""The ``roundhouse`` command line."""

from __future__ import annotations

import json
import subprocess
import sys

from tasks.cli import _mask, main


def test_settings_command_prints_effective_settings_with_secrets_masked(monkeypatch, capsys) -> None:
    from settings import get_settings

    get_settings.cache_clear()
    monkeypatch.setenv("ROUNDHOUSE_BROKER_URL", "redis://:hunter2@redis.internal:6380/1")
    monkeypatch.setenv("ROUNDHOUSE_HOST_ID", "gpu-host-7")
    try:
        assert main(["settings"]) == 0
    finally:
        get_settings.cache_clear()
    shown = json.loads(capsys.readouterr().out)
    assert shown["host_id"] == "gpu-host-7"
    assert "hunter2" not in shown["broker_url"] and shown["broker_url"].startswith(
        "redis://:***@redis.internal"
    )


def test_mask_leaves_urls_without_passwords_alone() -> None:
    assert _mask("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_unknown_command_is_a_usage_error() -> None:
    run = subprocess.run([sys.executable, "-m", "tasks.cli", "fly"], capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice" in run.stderr
