"""docker-compose.yml built and run: Redis, a CPU worker, Flower and the one-shot demo.

Run by ``make compose-test`` (its own target, run by CI after ``make test``; not part of the
default pytest run: marker ``compose``). The images are built from a Debian base made by
debootstrap, with Redis from Debian and SeaweedFS's S3 gateway in MinIO's place
(``deploy/compose/no-registry.yml``): no registry is reachable here. Each test below is one
claim of the README's compose section.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest
import requests

from tests.support.docker_engine import DockerEngine, Stack, missing_tools

IN_CI = os.environ.get("CI") == "true"
pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]
WORKER = "cpu-host-0"


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the test's own dockerd and debootstrap need root"
    if missing := missing_tools():
        return f"missing {', '.join(missing)} (make compose-test installs them from Debian)"
    return None


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if reason := _unavailable():
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    engine = DockerEngine().start()
    stack = Stack(engine, f"rhtest{os.getpid()}")
    try:
        engine.ensure_base_image()
        stack.compose("build", "redis", "minio", "worker-cpu", timeout=1800)
        stack.compose("--profile", "cpu", "up", "-d", "redis", "minio", "worker-cpu", "flower", timeout=300)
        yield stack
    finally:
        stack.down()
        engine.stop()


def heartbeat(stack: Stack) -> dict:
    """The worker's heartbeat, read with redis-cli inside the Redis container."""
    result = stack.compose(
        "exec", "-T", "redis", "redis-cli", "--raw", "get", f"roundhouse:hosts:{WORKER}", check=False
    )
    text = result.stdout.strip()
    return json.loads(text) if text.startswith("{") else {}


def wait_for_heartbeat(stack: Stack, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while not (beat := heartbeat(stack)):
        if time.monotonic() > deadline:
            pytest.fail(f"no heartbeat from {WORKER} in {timeout_s} s:\n{stack.logs('worker-cpu')}")
        time.sleep(1)
    return beat


def test_the_cpu_worker_comes_up_idle_with_tenant_code_sandboxed(stack: Stack) -> None:
    beat = wait_for_heartbeat(stack)
    assert beat["state"] == "idle", beat
    assert beat["sandbox"]["mode"] == "bwrap", beat  # the container's caps let bubblewrap work


def test_flower_answers_behind_its_basic_auth_and_lists_the_worker(stack: Stack) -> None:
    wait_for_heartbeat(stack)
    url = f"http://127.0.0.1:{stack.flower_port}/api/workers?refresh=1"
    deadline = time.monotonic() + 120
    while True:
        try:
            refused = requests.get(url, timeout=30)
            listed = requests.get(url, auth=stack.flower_auth, timeout=30)
            if listed.ok and any(name.startswith(f"{WORKER}@") for name in listed.json()):
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"Flower never listed {WORKER}:\n{stack.logs('flower')}")
        time.sleep(2)
    assert refused.status_code == 401


def private_keys(stack: Stack, service: str) -> list[str]:
    """The files holding a PEM private key where a container keeps keys and data."""
    scan = 'grep -rl "PRIVATE KEY" /etc/roundhouse /var/lib/roundhouse; echo scanned'
    result = stack.compose("exec", "-T", service, "sh", "-c", scan, check=False)
    found = result.stdout.split()
    assert found[-1:] == ["scanned"], f"{service}: {result.stdout}{result.stderr}"  # it ran there
    return sorted(found[:-1])


def test_the_worker_and_flower_hold_their_roles_keys_only(stack: Stack) -> None:
    wait_for_heartbeat(stack)
    assert private_keys(stack, "worker-cpu") == []  # the trust store and the CA certificate only
    assert private_keys(stack, "flower") == ["/etc/roundhouse/keys/flower.key"]


def test_the_demo_trains_on_the_stack_and_ends_bit_exact(stack: Stack) -> None:
    wait_for_heartbeat(stack)
    result = stack.compose("--profile", "demo", "run", "--rm", "-T", "demo", timeout=900, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{output}\n{stack.logs('worker-cpu', 'minio')}"
    assert "every worker holds the orchestrator's model" in output, output
    assert f"hosts: {WORKER}" in output, output
