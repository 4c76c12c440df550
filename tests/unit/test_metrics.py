"""The worker's metrics endpoint shows tenant activity, so it is kept close (docs/SECURITY.md):
on loopback unless configured, and behind a token when one is set. Real HTTP on real sockets."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess

import pytest
import requests

from settings import Settings
from tasks.metrics import WorkerMetrics
from tests.support.redis_server import free_port

TOKEN = "s3cret-metrics-token"


def metrics() -> WorkerMetrics:
    served = WorkerMetrics("mh1", lambda: {"state": "running", "cache": {"hits": 3}})
    served.round_done("completed", 1.5)
    return served


def own_global_address() -> str | None:
    ip = shutil.which("ip")
    if ip is None:
        return None
    links = json.loads(subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, check=True).stdout)
    for link in links:
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and info.get("scope") == "global":
                return str(info["local"])
    return None


def test_by_default_the_metrics_listen_on_loopback_only() -> None:
    settings = Settings()
    assert settings.metrics_address == "127.0.0.1" and settings.metrics_token is None
    port = free_port()
    assert metrics().serve(port, settings.metrics_address)
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'roundhouse_rounds_total{host="mh1",status="completed"} 1.0' in text
    outside = own_global_address()
    if outside is None:
        assert os.environ.get("CI") != "true", "CI has a non-loopback address to check from"
        pytest.skip("no non-loopback address on this machine")
    with pytest.raises(OSError), socket.create_connection((outside, port), timeout=5):
        pass


def test_with_a_token_only_a_request_that_presents_it_is_answered() -> None:
    port = free_port()
    assert metrics().serve(port, "127.0.0.1", TOKEN)
    url = f"http://127.0.0.1:{port}/metrics"
    wrong_basic = "Basic " + base64.b64encode(b"prometheus:guess").decode()
    for headers in (
        {},
        {"Authorization": "Bearer guess"},
        {"Authorization": wrong_basic},
        {"Authorization": TOKEN},
    ):
        refused = requests.get(url, headers=headers, timeout=10)
        assert refused.status_code == 401 and "roundhouse_" not in refused.text, headers
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")
    right_basic = "Basic " + base64.b64encode(f"prometheus:{TOKEN}".encode()).decode()
    for header in (f"Bearer {TOKEN}", right_basic):
        answered = requests.get(url, headers={"Authorization": header}, timeout=10)
        assert answered.status_code == 200 and "roundhouse_state" in answered.text, header


def test_the_token_is_a_secret_setting() -> None:
    settings = Settings(metrics_token=TOKEN)
    assert TOKEN not in repr(settings) and settings.metrics_token is not None
    assert settings.metrics_token.get_secret_value() == TOKEN
