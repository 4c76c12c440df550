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
    # The unsigned control plane (the session's keys cleared); the signed one: tests/unit/test_signing.py.
    unsigned = {"trusted_certs": None, "signing_key": None, "signing_cert": None}
    config = celery_config(
        Settings(broker_url="redis://r:6379/0", visibility_timeout_s=86400 * 3, **unsigned)
    )
    assert config["accept_content"] == ["json"] and config["result_accept_content"] == ["json"]
    assert config["task_serializer"] == config["result_serializer"] == "json"
    assert config["worker_prefetch_multiplier"] == 1 and config["worker_disable_prefetch"] is True
    assert config["broker_transport_options"]["visibility_timeout"] == 86400 * 3
    assert config["result_backend_transport_options"]["visibility_timeout"] == 86400 * 3
    assert config["worker_max_tasks_per_child"] is None and config["worker_max_memory_per_child"] is None
    assert config["task_time_limit"] is None and config["task_acks_late"] is True
    assert config["task_track_started"] is True and config["worker_send_task_events"] is True
    assert config["result_backend"] == "redis://r:6379/0"  # the broker, unless set
    other = celery_config(Settings(broker_url="amqp://guest@mq//", result_backend="redis://r/1"))
    assert other["worker_disable_prefetch"] is False and other["result_backend"] == "redis://r/1"


def test_task_names_are_the_contract() -> None:
    from tasks.app import app
    from tasks.names import TASK_NAMES

    assert set(TASK_NAMES) <= set(app.tasks)


def test_each_worker_gets_a_sandbox_uid_of_its_own() -> None:
    # RLIMIT_NPROC counts per uid: two GPUs' tenants sharing one uid could starve each other.
    gpu0, gpu1 = Settings(host_id="box", gpu=0), Settings(host_id="box", gpu=1)
    assert gpu0.sandbox_ids == (61000, 61000) and gpu1.sandbox_ids == (61001, 61001)
    by_host = {Settings(host_id=f"cpu-{n}").sandbox_ids[0] for n in range(5)}
    assert len(by_host) == 5 and all(61100 <= uid < 62000 for uid in by_host)
    assert Settings(sandbox_uid=65534, sandbox_gid=65533).sandbox_ids == (65534, 65533)
    assert Settings(gpu=3, sandbox_uid_base=200000).sandbox_ids[0] == 200003
