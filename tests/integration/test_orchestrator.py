"""The reference orchestrator with two real workers: rounds, exclusion and re-sync, bit-exactness,
stragglers and min_hosts, a restart from the state directory, a failed sync re-synced."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import requests

from executor.delta import state_hash
from orchestrator.artifacts import ArtifactServer
from orchestrator.checkpoint import StateDir
from orchestrator.demo import TRAIN, build_model, build_shards
from orchestrator.diloco import Orchestrator, Session, pick_hosts
from orchestrator.phases import PHASES
from settings import Settings
from tasks.client import RoundClient
from tests.support.redis_server import RedisServer, free_port
from tests.support.rounds import SLOW_ON_CUE, event_seq, wait_for_log
from tests.support.worker import WorkerProcess

pytestmark = pytest.mark.timeout(300)


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
        # Where the round's wall time went, every phase of the loop timed, in loop order (all but
        # a sharded round's reduce).
        assert list(summary.phases) == [p for p in PHASES if p != "reduce"], summary.phases
        assert summary.phases["wait"] > 0 and summary.phases["apply"] > 0
        assert sum(summary.phases.values()) <= summary.seconds
        # And each host's own account of its side: the round, its delta's write and PUT, the sync.
        assert set(summary.host_phases) == set(hosts)
        for phases in summary.host_phases.values():
            assert list(phases) == ["training", "delta_write", "upload", "apply"], phases
            assert all(seconds > 0 for seconds in phases.values()), phases
    orchestrator.close()
    # Each worker's metrics saw the rounds.
    for host, port in ports.items():
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert f'roundhouse_rounds_total{{host="{host}",status="completed"}}' in text, text[:2000]
        assert f'roundhouse_state{{host="{host}",state="loaded"}} 1.0' in text
        assert "roundhouse_cache_hits_total" in text and "roundhouse_round_seconds_bucket" in text


def test_a_worker_stopped_mid_round_is_left_out_of_the_mean_and_takes_the_sync_delta(
    cluster, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    client, store, _ports, _dir = cluster
    hosts = ["orch-a", "orch-b"]
    params = {"lr": 0.2, "slow_host": "orch-b", "slow_round": 1}
    session = Session(
        hosts, publish_shards(store, tmp_path), SLOW_ON_CUE, params=params, steps=10, tenant="t2"
    )

    since = event_seq(client, "orch-b")

    def stop_once_spinning(task_id: str) -> None:
        wait_for_log(client, "orch-b", since, "slow round started", timeout_s=120)
        client.stop(task_id, "orch-b")

    def stop_the_slow_one(round_num: int, task_ids: dict[str, str]) -> None:
        if round_num == 1:
            # Stop orch-b's round once its tenant says it spins (it never ends by itself):
            # a stop before it started would pass this test without a mid-round stop.
            threading.Thread(target=stop_once_spinning, args=(task_ids["orch-b"],), daemon=True).start()

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


SLOW_ROUNDS = (
    """
if params.get("slow_host") == host_id and round_num in params.get("slow_rounds", ()):
    while True:
        should_stop()
"""
    + TRAIN
)


def test_stragglers_are_stopped_after_quorum_and_grace_and_too_few_keep_the_model(
    cluster, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    client, store, _ports, _dir = cluster
    hosts = ["orch-a", "orch-b"]
    params = {"lr": 0.2, "slow_host": "orch-b", "slow_rounds": [0, 1]}
    session = Session(
        hosts, publish_shards(store, tmp_path), SLOW_ROUNDS, params=params, steps=10, tenant="t3",
        quorum=0.5, grace_s=1.0,
    )  # fmt: skip
    orchestrator = Orchestrator(client, store, build_model(), session)
    orchestrator.load()
    first = orchestrator.round(0, 3)  # orch-b never ends by itself: stopped once orch-a is done + 1 s
    assert first.included == ["orch-a"] and first.excluded["orch-b"].startswith("straggler")
    assert first.via == {"orch-a": "delta", "orch-b": "delta"}  # its model is still the base
    assert [e["host"] for e in orchestrator.story if e["event"] == "straggler-stopped"] == ["orch-b"]
    session.min_hosts = 2
    before = orchestrator.global_hash
    second = orchestrator.round(1, 3)  # one completes, two are needed: the model stays as it was
    assert second.kept and second.included == ["orch-a"] and second.model_hash == before
    assert orchestrator.global_hash == before and second.via == {}
    assert list(second.phases) == ["dispatch", "wait", "fold", "outer"]  # no sync to build, publish, apply
    session.quorum = 1.0  # wait for everyone (a runner stopped twice may start slower than a grace)
    third = orchestrator.round(2, 3)
    assert not third.kept and third.included == hosts and third.model_hash != before
    held = {status["model_hash"] for status in orchestrator.statuses().values()}
    assert held == {orchestrator.global_hash}
    orchestrator.close()


def test_a_restarted_orchestrator_resumes_without_loading_the_workers_again(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store, _ports, _dir = cluster
    hosts = ["orch-a", "orch-b"]
    state = tmp_path / "state"
    session = Session(
        hosts, publish_shards(store, tmp_path), TRAIN, params={"lr": 0.2}, steps=10, tenant="t4"
    )
    first = Orchestrator(client, store, build_model(), session, state_dir=state)
    first.load()
    first.run(2)
    checkpointed = first.global_hash
    first.close()  # and is never heard of again, as if it had died
    resumed = Orchestrator.resume(client, store, state)
    assert resumed.next_round == 2 and resumed.global_hash == checkpointed
    assert [s.round_num for s in resumed.history] == [0, 1] and resumed.session == session
    resumed.run(3)
    events = [(e["host"], e["event"]) for e in resumed.story if e["host"]]
    assert ("orch-a", "kept") in events and ("orch-b", "kept") in events  # no load, no download
    assert not [e for e in events if e[1] in ("joined", "rejoined")]
    assert resumed.history[-1].included == hosts
    held = {status["model_hash"] for status in resumed.statuses().values()}
    assert held == {resumed.global_hash} and StateDir(state).load().round_done == 2
    resumed.close()


class FlakyStore:
    """The cluster's artifact server, but the sync deltas' URLs and the first URL of one model
    version lead nowhere (404): a sync that fails on a worker even after its own fallback."""

    def __init__(self, server: ArtifactServer, broken_model: str) -> None:
        self.server, self.broken_model = server, broken_model
        self.broken_once = True

    def url_get(self, name: str, expires_s: float = 3600) -> str:
        broken = name.startswith("sync/") or (name == self.broken_model and self.broken_once)
        if name == self.broken_model:
            self.broken_once = False
        return self.server.url_get("missing/" + name if broken else name, expires_s)

    def url_put(self, name: str, expires_s: float = 3600) -> str:
        return self.server.url_put(name, expires_s)

    def publish(self, name: str, source: str | os.PathLike[str]) -> str:
        return self.server.publish(name, source)  # the orchestrator's own copy: not flaky

    def fetch(self, name: str, dest: str | os.PathLike[str]) -> None:
        self.server.fetch(name, dest)


def test_a_failed_sync_is_resynced_by_full_download_not_the_end_of_the_run(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, server, _ports, _dir = cluster
    hosts = ["orch-a", "orch-b"]
    store = FlakyStore(server, "model/global-1.safetensors")
    session = Session(
        hosts, publish_shards(server, tmp_path), TRAIN, params={"lr": 0.2}, steps=5, tenant="t5"
    )
    orchestrator = Orchestrator(client, store, build_model(), session)
    orchestrator.load()
    summary = orchestrator.round(0, 2)
    # Neither could use the delta; the first host's full download failed too (its apply_delta
    # raised): it was given a second chance by full download at once.
    assert summary.via == {"orch-a": "full", "orch-b": "full"}
    (resynced,) = [e for e in orchestrator.story if e["event"] == "resynced"]
    assert resynced["host"] in hosts and "download_failed" in resynced["reason"]
    assert orchestrator.membership.active() == hosts
    held = {status["model_hash"] for status in orchestrator.statuses().values()}
    assert held == {orchestrator.global_hash}
    orchestrator.close()
