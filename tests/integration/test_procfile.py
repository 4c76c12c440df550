"""The Procfile, run for real under honcho: embedded Redis over TLS, a worker, Flower, all on
the signed control plane of its development keys (made when missing); a round through it.
Each process holds its role's keys only: Flower's own pair commands the worker (inspect) but
a task sent from Flower's API is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
import requests
from safetensors.torch import save_file

from settings import Settings
from tasks.client import RoundClient
from tasks.embedded_redis import tls_binary
from tasks.trust.keys import DevKeys
from tests.support.engine import TRAIN_CODE, make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
from tests.support.redis_server import free_port
from tests.support.worker import REPO

pytestmark = pytest.mark.timeout(300)
FLOWER_PASSWORD = "procfile-flower-password"


def wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (redis.RedisError, requests.RequestException, ValueError):
            pass
        time.sleep(0.3)
    raise TimeoutError(what)


@pytest.mark.skipif(tls_binary() is None, reason="no redis-server with TLS (apt-get install redis-server)")
def test_procfile_under_honcho_runs_a_round(tmp_path: Path) -> None:
    redis_port, flower_port = free_port(), free_port()
    broker = f"rediss://127.0.0.1:{redis_port}/0"
    keys = DevKeys(tmp_path / "keys")  # none yet: the Procfile's processes make them
    venv_bin = str(Path(os.sys.executable).parent)
    # The session's own keys are not the stack's: the Procfile wires its processes itself.
    session = (
        "ROUNDHOUSE_TRUSTED_CERTS",
        "ROUNDHOUSE_SIGNING_KEY",
        "ROUNDHOUSE_SIGNING_CERT",
        "ROUNDHOUSE_TLS_CA_FILE",
    )
    env = {
        **{k: v for k, v in os.environ.items() if k not in session},
        "ROUNDHOUSE_KEYS_DIR": str(keys.root),
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
        "ROUNDHOUSE_REDIS_PORT": str(redis_port),
        "ROUNDHOUSE_REDIS_DIR": str(tmp_path / "redis"),
        "ROUNDHOUSE_FLOWER_PORT": str(flower_port),
        "ROUNDHOUSE_BROKER_URL": broker,
        "ROUNDHOUSE_HOST_ID": "procfile",
        "ROUNDHOUSE_WORK_DIR": str(tmp_path / "work"),
        "ROUNDHOUSE_CACHE_DIR": str(tmp_path / "cache"),
        "ROUNDHOUSE_HEARTBEAT_INTERVAL_S": "0.5",
        "FLOWER_BASIC_AUTH": f"ops:{FLOWER_PASSWORD}",
    }
    log = open(tmp_path / "honcho.log", "wb")  # noqa: SIM115 - closed below
    honcho = subprocess.Popen(
        [os.path.join(venv_bin, "honcho"), "start", "-f", str(REPO / "Procfile"), "-d", str(REPO)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    root = tmp_path / "srv"
    root.mkdir()
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    try:
        wait_for(lambda: keys.complete(), 60, "no development keys")
        orchestrator = {"signing_key": str(keys.signing_key()), "signing_cert": str(keys.signing_cert())}
        client = RoundClient(
            Settings(
                broker_url=broker, host_id="procfile-client", tls_ca_file=str(keys.ca_cert), **orchestrator
            )
        )
        wait_for(lambda: client.heartbeat("procfile") is not None, 120, "no worker heartbeat")
        # TLS only, with the keys' CA: a plain connection to the port gets nothing.
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=redis_port, socket_connect_timeout=2, socket_timeout=2).ping()
        unsigned = RoundClient(
            Settings(broker_url=broker, host_id="procfile-unsigned", tls_ca_file=str(keys.ca_cert),
                     trusted_certs=None, signing_key=None, signing_cert=None)
        )  # fmt: skip
        ignored = unsigned.status("procfile")
        with FaultServer(root) as server:
            descriptors = shard_descriptors(server, shards)
            client.load_model("procfile", server.url("model.safetensors"), descriptors, TRAIN_CODE).get(
                timeout=60
            )
            result = client.run_round("procfile", steps=3).get(timeout=120)
        assert result["status"] == "completed", result
        assert ignored.state == "PENDING", "an unsigned task ran on the Procfile's worker"
        refused = [
            e.data for e in client.events("procfile", idle_timeout_s=1) if e.data.get("event") == "refused"
        ]
        assert [r["reason"] for r in refused] == ["unsigned"], refused
        # The demo against the Procfile's stack (its broker, its running worker), which takes
        # only a host that is idle or already its tenant's: end this test's session first.
        client.reset("procfile").get(timeout=60)
        demo = subprocess.run(
            [os.path.join(venv_bin, "roundhouse"), "demo", "--workers", "1", "--rounds", "2", "--steps", "10",
             "--out", str(tmp_path / "demo")],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        assert "using the broker and the workers at ROUNDHOUSE_BROKER_URL" in demo.stdout
        api = f"http://127.0.0.1:{flower_port}/api/workers?refresh=1"
        wait_for(
            lambda: any(
                n.startswith("procfile@")
                for n in requests.get(api, auth=("ops", FLOWER_PASSWORD), timeout=5).json()
            ),
            60,
            "Flower does not list the worker",
        )  # inspect, signed with Flower's own key: obeyed (control commands only)
        # A task from Flower's API is signed with that key too: the worker refuses it.
        sent = requests.post(
            f"http://127.0.0.1:{flower_port}/api/task/send-task/roundhouse.load_model",
            json={"kwargs": {"model_url": "http://127.0.0.1:1/m", "dataset_shards": [], "code": "pass"},
                  "queue": "roundhouse.procfile"},
            auth=("ops", FLOWER_PASSWORD), timeout=30,
        )  # fmt: skip
        assert sent.ok, sent.text
        task_id = sent.json()["task-id"]

        def refusals() -> list[tuple[str, str]]:
            return [
                (e.data["reason"], e.data["name"])
                for e in client.events("procfile", idle_timeout_s=0.5)
                if e.data.get("event") == "refused" and e.task_id == task_id
            ]

        # The refusal is the worker's answer: wait for it, whatever the machine's load.
        wait_for(refusals, 60, "the worker never answered Flower's task")
        from_flower = refusals()
        assert from_flower == [("untrusted_signer", "roundhouse.load_model")], from_flower
        assert not (keys.role("worker") / "flower.key").exists() and keys.flower_key.is_file()
    finally:
        os.killpg(honcho.pid, signal.SIGTERM)
        try:
            honcho.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
        log.close()
