"""The worker's metrics endpoint shows tenant activity, so it is kept close (docs/SECURITY.md):
on loopback unless configured, and behind a token when one is set. Real HTTP on real sockets."""

from __future__ import annotations

import base64
import socket

import requests

from settings import Settings
from tasks.metrics import WorkerMetrics
from tests.support.redis_server import free_port

TOKEN = "s3cret-metrics-token"


def metrics() -> WorkerMetrics:
    served = WorkerMetrics("mh1", lambda: {"state": "running", "cache": {"hits": 3}})
    served.round_done("completed", 1.5)
    return served


def listening_addresses(port: int) -> set[str]:
    """The local addresses of every socket listening on ``port``, as the kernel lists them."""
    found = set()
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as file:
            for line in file.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)
                    # /proc prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
                    found.add(socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, words))
    return found


def test_by_default_the_metrics_listen_on_loopback_only() -> None:
    settings = Settings()
    assert settings.metrics_address == "127.0.0.1" and settings.metrics_token is None
    port = free_port()
    assert metrics().serve(port, settings.metrics_address)
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'roundhouse_rounds_total{host="mh1",status="completed"} 1.0' in text
    # Listening on 127.0.0.1 alone: no other address of this host answers (checked where the
    # kernel lists listening sockets, so that no test traffic leaves loopback).
    assert listening_addresses(port) == {"127.0.0.1"}


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
