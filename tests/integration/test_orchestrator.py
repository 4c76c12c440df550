"""The reference orchestrator with two real workers: rounds, exclusion and re-sync, bit-exactness."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import requests

from executor.delta import state_hash
from orchestrator.artifacts import ArtifactServer
from orchestrator.demo import TRAIN, build_model, build_shards
from orchestrator.diloco import Orchestrator, Session, pick_hosts
from settings import Settings
from tasks.client import RoundClient
from tests.support.redis_server import RedisServer, free_port
from tests.support.worker import WorkerProcess

pytestmark = pytest.mark.timeout(300)

SLOW_ON_CUE = (
    """
if params.get("slow_host") == host_id and round_num == params.get("slow_round"):
    emit_log("slow round started")
    while True:
        should_stop()
"""
    + TRAIN
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    cache = tmp_path_factory.mktemp("cache")
    ports = {"orch-a": free_port(), "orch-b": free_port()}
    workers = [
        WorkerProcess(
            host,
            redis_server.url,
            tmp_path_factory.mktemp(host),
            cache_dir=cache,
            env={"ROUNDHOUSE_METRICS_PORT": str(port)},
        )
        for host, port in ports.items()
    ]
    threads = [threading.Thread(target=w.start) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store_dir = tmp_path_factory.mktemp("artifacts")
    with ArtifactServer(store_dir) as store:
        client = RoundClient(Settings(broker_url=redis_server.url, host_id="orch-test"))
        yield client, store, ports, store_dir
    for worker in workers:
        worker.stop()
    redis_server.stop()


def publish_shards(store: ArtifactServer, directory: Path) -> list[dict]:
    return [
        {"url": store.publish(name, path), "compression": "zstd", "size_bytes": path.stat().st_size}
        for name, path in build_shards(directory)
    ]


def test_three_rounds_keep_every_worker_bit_identical(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store, ports, _dir = cluster
    hosts = pick_hosts(client, 2)
    assert hosts == ["orch-a", "orch-b"]
    session = Session(
        hosts, publish_shards(store, tmp_path), TRAIN, params={"lr": 0.2}, steps=10, tenant="t1"
    )
    orchestrator = Orchestrator(client, store, build_model(), session)
    orchestrator.load()
    for round_num in range(3):
        summary = orchestrator.round(round_num, 3)
        assert summary.included == hosts and summary.via == {h: "delta" for h in hosts}
        held = {host: status["model_hash"] for host, status in orchestrator.statuses().items()}
        assert set(held.values()) == {orchestrator.global_hash} == {state_hash(orchestrator.global_state)}
        assert summary.model_hash == orchestrator.global_hash
    orchestrator.close()
    # Each worker's metrics saw the rounds.
    for host, port in ports.items():
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert f'roundhouse_rounds_total{{host="{host}",status="completed"}}' in text, text[:2000]
        assert f'roundhouse_state{{host="{host}",state="loaded"}} 1.0' in text
        assert "roundhouse_cache_hits_total" in text and "roundhouse_round_seconds_bucket" in text


def test_a_worker_stopped_mid_round_is_left_out_then_resynced_by_full_download(
    cluster, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    client, store, _ports, _dir = cluster
    hosts = ["orch-a", "orch-b"]
    params = {"lr": 0.2, "slow_host": "orch-b", "slow_round": 1}
    session = Session(
        hosts, publish_shards(store, tmp_path), SLOW_ON_CUE, params=params, steps=10, tenant="t2"
    )

    def stop_the_slow_one(round_num: int, task_ids: dict[str, str]) -> None:
        if round_num == 1:
            # Stop orch-b's round once it is busy (it never ends by itself).
            threading.Timer(2.0, client.stop, args=(task_ids["orch-b"], "orch-b")).start()

    orchestrator = Orchestrator(client, store, build_model(), session, on_round_start=stop_the_slow_one)
    orchestrator.load()
    summaries = [orchestrator.round(n, 3) for n in range(3)]
    assert summaries[0].excluded == {} and summaries[2].excluded == {}
    assert list(summaries[1].excluded) == ["orch-b"] and "stopped" in summaries[1].excluded["orch-b"]
    assert summaries[1].included == ["orch-a"]
    # Its model is still the round's base (a stopped round leaves it as it was): it takes the
    # sync delta like everyone, and every worker ends on the orchestrator's hash.
    assert summaries[1].via == {"orch-a": "delta", "orch-b": "delta"}
    assert summaries[2].via == {"orch-a": "delta", "orch-b": "delta"}
    held = {status["model_hash"] for status in orchestrator.statuses().values()}
    assert held == {orchestrator.global_hash}
    orchestrator.close()
