"""Settings are read once from the environment; the Celery config built from them."""

from __future__ import annotations

import pytest

from settings import Settings, celery_config


def test_environment_prefix_and_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDHOUSE_SHARD_CACHE_MAX_MB", "128")
    monkeypatch.setenv("ROUNDHOUSE_SANDBOX", "off")
    monkeypatch.setenv("ROUNDHOUSE_HOST_ID", "gpu-box-1")
    settings = Settings()
    assert settings.shard_cache_max_bytes == 128 * 1024 * 1024
    assert settings.sandbox == "off" and settings.queue == "roundhouse.gpu-box-1"
    monkeypatch.setenv("ROUNDHOUSE_SANDBOX", "maybe")
    with pytest.raises(ValueError):
        Settings()


def test_celery_config_is_json_only_one_at_a_time_and_long_visibility() -> None:
    config = celery_config(Settings(broker_url="redis://r:6379/0", visibility_timeout_s=86400 * 3))
    assert config["accept_content"] == ["json"] and config["result_accept_content"] == ["json"]
    assert config["task_serializer"] == config["result_serializer"] == "json"
    assert config["worker_prefetch_multiplier"] == 1 and config["worker_disable_prefetch"] is True
    assert config["broker_transport_options"]["visibility_timeout"] == 86400 * 3
    assert config["result_backend_transport_options"]["visibility_timeout"] == 86400 * 3
    assert config["worker_max_tasks_per_child"] is None and config["worker_max_memory_per_child"] is None
    assert config["task_time_limit"] is None and config["task_acks_late"] is True
    assert config["task_track_started"] and config["worker_send_task_events"]
    assert config["result_backend"] == "redis://r:6379/0"  # the broker, unless set
    other = celery_config(Settings(broker_url="amqp://guest@mq//", result_backend="redis://r/1"))
    assert other["worker_disable_prefetch"] is False and other["result_backend"] == "redis://r/1"


def test_task_names_are_the_contract() -> None:
    from tasks.app import app
    from tasks.names import TASK_NAMES

    assert set(TASK_NAMES) <= set(app.tasks)
