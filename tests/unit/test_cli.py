"""The ``roundhouse`` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tasks.cli import main, mask_password


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
    assert mask_password("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_unknown_command_is_a_usage_error() -> None:
    run = subprocess.run([sys.executable, "-m", "tasks.cli", "fly"], capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_worker_command_pins_the_gpu_and_names_node_and_queue(monkeypatch) -> None:
    from tasks.cli import worker_command

    monkeypatch.delenv("ROUNDHOUSE_HOST_ID", raising=False)
    argv, env = worker_command(3, None, ["--loglevel=INFO"])
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["ROUNDHOUSE_GPU"] == "3"
    host = env["ROUNDHOUSE_HOST_ID"]
    assert host.endswith("-gpu3")
    assert argv[argv.index("-Q") + 1] == f"roundhouse.{host}"
    assert argv[argv.index("-n") + 1] == "gpu3@%h"
    assert argv[argv.index("-P") + 1] == "prefork" and argv[argv.index("-c") + 1] == "1" and "-E" in argv
    assert argv[-1] == "--loglevel=INFO"
    argv, env = worker_command(None, "edge-7", [])
    assert env["ROUNDHOUSE_HOST_ID"] == "edge-7"
    # No GPU given: CUDA_VISIBLE_DEVICES stays as the caller set it.
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_events_need_redis_even_with_another_broker() -> None:
    import pytest

    from settings import Settings

    with pytest.raises(ValueError, match="ROUNDHOUSE_EVENTS_URL"):
        _ = Settings(broker_url="amqp://guest@localhost//").redis_events_url
    assert (
        Settings(broker_url="amqp://x", events_url="redis://r:6379/2").redis_events_url == "redis://r:6379/2"
    )
