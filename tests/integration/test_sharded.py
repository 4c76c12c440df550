"""``reduce_shard`` through real workers (docs/SHARDED.md): two hosts each reduce one shard of two
rounds of three contributors' deltas, and the sync and state shards they PUT are, bit for bit,
the star path's outer step, sync delta and velocity on the same deltas (the velocity carried between rounds
as store objects); a contribution that does not match its hash fails the reduce naming its host;
a host that does not hold the round's base model, or a malformed request, is refused."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from executor.delta import make_sync_delta, read_delta, state_hash, write_delta
from executor.reduce import model_partition, read_delta_shard, write_delta_shards
from executor.tensorfile import read_header
from orchestrator.artifacts import ArtifactServer
from orchestrator.collect import describe
from orchestrator.demo import TRAIN, build_model, build_shards
from orchestrator.diloco import Orchestrator, Session
from orchestrator.outer import OuterOptimizer
from settings import Settings
from tasks.client import RoundClient
from tests.support.redis_server import RedisServer
from tests.support.worker import WorkerProcess

pytestmark = pytest.mark.timeout(300)

HOSTS = ["sh-a", "sh-b"]
CONTRIBUTORS = ["sh-c", "sh-a", "sh-b"]  # the deltas' hosts (a third that reduces nothing), unsorted


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    cache = tmp_path_factory.mktemp("cache")
    workers = [WorkerProcess(h, redis_server.url, tmp_path_factory.mktemp(h), cache_dir=cache) for h in HOSTS]
    threads = [threading.Thread(target=w.start) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with ArtifactServer(tmp_path_factory.mktemp("artifacts")) as store:
        client = RoundClient(Settings(broker_url=redis_server.url, host_id="sh-orchestrator"))
        yield client, store
    for worker in workers:
        worker.stop()
    redis_server.stop()


def load(client: RoundClient, store: ArtifactServer, state: dict[str, torch.Tensor], tmp_path: Path) -> str:
    save_file(state, str(tmp_path / "model.safetensors"))
    url = store.publish("model.safetensors", tmp_path / "model.safetensors")
    shards = [
        {"url": store.publish(name, path), "compression": "zstd", "size_bytes": path.stat().st_size}
        for name, path in build_shards(tmp_path)
    ]
    for task in [
        client.load_model(h, url, shards, TRAIN, params={"lr": 0.2}, tenant="sharded") for h in HOSTS
    ]:
        task.get(timeout=120)
    return url


def contributions(
    store: ArtifactServer, theta: dict[str, torch.Tensor], round_num: int, tmp_path: Path
) -> tuple[list[dict[str, Any]], dict[str, dict[str, torch.Tensor]]]:
    """Each contributor's trained state written as two shard objects (as its host would);
    returns the shard-0/1 task entries per shard and each host's whole delta as read back."""
    save_file(theta, str(tmp_path / "theta.safetensors"))
    with open(tmp_path / "theta.safetensors", "rb") as f:
        split = model_partition(read_header(f).specs, 2)
    entries: list[dict[str, Any]] = [{"list": []}, {"list": []}]
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for n, host in enumerate(CONTRIBUTORS):
        g = torch.Generator().manual_seed(100 * round_num + n)
        trained = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in theta.items()}
        paths = [str(tmp_path / f"r{round_num}-{host}-{j}") for j in range(2)]
        # float32: summed in another order, float16 values would still add up exactly in fp32
        files = write_delta_shards(str(tmp_path / "theta.safetensors"), trained, split, torch.float32, paths)
        whole: dict[str, list[torch.Tensor]] = {}
        for j, (path, written) in enumerate(zip(paths, files, strict=True)):
            url = store.publish(f"rounds/{round_num}/delta/{host}/{j}", path)
            entries[j]["list"].append({"host": host, "url": url, "hash": written.hash})
            for key, value in read_delta_shard(path, split, j).items():
                whole.setdefault(key, []).append(value)
        deltas[host] = {k: torch.cat(v).reshape(theta[k].shape) for k, v in whole.items()}
    return [e["list"] for e in entries], deltas


Lists = list[list[dict[str, Any]]]


def reduce_round(
    client: RoundClient,
    store: ArtifactServer,
    round_num: int,
    base_hash: str,
    lists: Lists,
    velocity: list[dict[str, str] | None],
) -> list[dict[str, Any]]:
    tasks = [
        client.reduce_shard(
            host,
            shard=j,
            count=2,
            base_hash=base_hash,
            contributions=lists[j],
            velocity=velocity[j],
            sync_url=store.url_put(f"rounds/{round_num}/sync/{j}"),
            state_url=store.url_put(f"rounds/{round_num}/state/{j}"),
            velocity_url=store.url_put(f"rounds/{round_num}/velocity/{j}"),
        )
        for j, host in enumerate(HOSTS)
    ]
    return [task.get(timeout=120) for task in tasks]


def test_two_reducers_make_the_star_paths_sync_bit_for_bit_over_two_rounds(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store = cluster
    theta = build_model()
    model_url = load(client, store, theta, tmp_path)
    star = OuterOptimizer()
    velocity: list[dict[str, str] | None] = [None, None]
    for round_num in range(2):
        base_hash = state_hash(theta)
        lists, deltas = contributions(store, theta, round_num, tmp_path)
        before = len(store.requests)
        results = reduce_round(client, store, round_num, base_hash, lists, velocity)
        # Each reducer kept the velocity it made for its shard: none is GOT back from the store.
        assert not [r for r in store.requests[before:] if r[0] == "GET" and "/velocity/" in r[1]]
        # The star path: the mean in sorted host order, its outer step and float16 sync delta.
        order = sorted(deltas)
        mean = {k: sum((deltas[h][k] for h in order[1:]), deltas[order[0]][k].float()) / 3 for k in theta}
        sync = make_sync_delta(theta, star.step(theta, mean), base_hash=base_hash)
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {"sync": {}, "state": {}, "velocity": {}}
        for j, result in enumerate(results):
            assert result["contributors"] == sorted(CONTRIBUTORS) and result["shard"] == j
            for name in pieces:
                local = tmp_path / f"{name}-{round_num}-{j}"
                store.fetch(f"rounds/{round_num}/{name}/{j}", local)
                values = read_delta(str(local))
                assert state_hash(values) == result[name]["hash"]
                for key, value in values.items():
                    pieces[name].setdefault(key, []).append(value)
        for key in theta:
            assert torch.equal(torch.cat(pieces["sync"][key]), sync.delta[key].reshape(-1)), key
            assert torch.equal(torch.cat(pieces["state"][key]), sync.result[key].reshape(-1)), key
            # float32: the sum's order shows here (the float16 sync can round it away)
            assert torch.equal(torch.cat(pieces["velocity"][key]), star.velocity[key].reshape(-1)), key
        velocity = [
            {"url": store.url_get(f"rounds/{round_num}/velocity/{j}"), "hash": r["velocity"]["hash"]}
            for j, r in enumerate(results)
        ]
        # Every host takes the round's sync (here the star path's, through apply_delta) and
        # holds the model the next round's reducers step from.
        delta_file = tmp_path / f"sync-{round_num}"
        write_delta(sync.delta, str(delta_file))
        delta_url = store.publish(f"rounds/{round_num}/star-sync", delta_file)
        for task in [
            client.apply_delta(
                h, model_url, delta_url=delta_url, base_hash=base_hash, result_hash=sync.result_hash
            )
            for h in HOSTS
        ]:
            assert task.get(timeout=120)["via"] == "delta"
        theta = sync.result


def test_a_bad_contribution_a_wrong_base_and_a_malformed_request_are_refused(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store = cluster
    theta = build_model()
    load(client, store, theta, tmp_path)
    base_hash = state_hash(theta)
    lists, _ = contributions(store, theta, 7, tmp_path)
    forged = [dict(entry) for entry in lists[0]]
    forged[1]["hash"] = "sha256:" + "0" * 64  # sh-a's shard does not match what it reported
    with pytest.raises(Exception) as refused:
        reduce_round(client, store, 7, base_hash, [forged, lists[1]], [None, None])
    said = describe(refused.value)
    assert "bad_artifact" in said and "sh-a" in said, said
    with pytest.raises(Exception) as stale:
        reduce_round(client, store, 8, "sha256:" + "1" * 64, lists, [None, None])
    assert "hash_mismatch" in describe(stale.value), describe(stale.value)
    for bad in ({"shard": 2}, {"contributions": []}, {"outer": {"lr": float("nan")}}, {"sync_url": None}):
        arguments: dict[str, Any] = {
            "shard": 0, "count": 2, "base_hash": base_hash, "contributions": lists[0],
            "sync_url": store.url_put("x/sync"), "state_url": store.url_put("x/state"),
            "velocity_url": store.url_put("x/velocity"), **bad,
        }  # fmt: skip
        with pytest.raises(Exception) as malformed:
            client.reduce_shard(HOSTS[0], **arguments).get(timeout=60)
        assert "invalid_request" in describe(malformed.value), (bad, describe(malformed.value))
    # The worker is none the worse: it still reduces.
    assert reduce_round(client, store, 9, base_hash, lists, [None, None])[0]["contributors"] == sorted(
        CONTRIBUTORS
    )


def test_a_sharded_round_end_to_end_leaves_every_host_on_the_star_paths_model(
    cluster, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Each host trains and PUTs its delta as two shards, each reduces one shard of both, and
    each applies the two sync shards: both end on one model, whose hash is the star path's on the
    same deltas. A host that does not hold the base, and one given a forged sync shard, assembles
    the same model from the state shards instead; a forged state shard fails the sync."""
    client, store = cluster
    theta = build_model()
    model_url = load(client, store, theta, tmp_path)
    base_hash = state_hash(theta)
    rounds = [
        client.run_round(
            h, steps=5, round_num=0, delta_url=[store.url_put(f"e2e/delta/{h}/{j}") for j in range(2)]
        )
        for h in HOSTS
    ]
    results = dict(zip(HOSTS, [task.get(timeout=180) for task in rounds], strict=True))
    for result in results.values():
        assert result["status"] == "completed" and result["delta"]["hash"] is None, result
        assert [s["hash"] for s in result["delta"]["shards"]] and len(result["delta"]["shards"]) == 2
    lists = [
        [
            {
                "host": h,
                "url": store.url_get(f"e2e/delta/{h}/{j}"),
                "hash": results[h]["delta"]["shards"][j]["hash"],
            }
            for h in HOSTS
        ]
        for j in range(2)
    ]
    reduced = [
        client.reduce_shard(
            host,
            shard=j,
            count=2,
            base_hash=base_hash,
            contributions=lists[j],
            sync_url=store.url_put(f"e2e/sync/{j}"),
            state_url=store.url_put(f"e2e/state/{j}"),
            velocity_url=store.url_put(f"e2e/velocity/{j}"),
        ).get(timeout=120)
        for j, host in enumerate(HOSTS)
    ]
    # The star path on the same deltas (each host's shards read back whole, sorted host order).
    save_file(theta, str(tmp_path / "theta.safetensors"))
    with open(tmp_path / "theta.safetensors", "rb") as f:
        split = model_partition(read_header(f).specs, 2)
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for host in HOSTS:
        parts: dict[str, list[torch.Tensor]] = {}
        for j in range(2):
            store.fetch(f"e2e/delta/{host}/{j}", tmp_path / f"e2e-{host}-{j}")
            for key, value in read_delta_shard(str(tmp_path / f"e2e-{host}-{j}"), split, j).items():
                parts.setdefault(key, []).append(value.float())
        deltas[host] = {k: torch.cat(v).reshape(theta[k].shape) for k, v in parts.items()}
    mean = {k: (deltas[HOSTS[0]][k] + deltas[HOSTS[1]][k]) / 2 for k in deltas[HOSTS[0]]}
    expected = make_sync_delta(theta, OuterOptimizer().step(theta, mean), base_hash=base_hash).result_hash
    shards = [
        {
            "url": store.url_get(f"e2e/sync/{j}"),
            "hash": r["sync"]["hash"],
            "result_hash": r["result_hash"],
            "state_url": store.url_get(f"e2e/state/{j}"),
        }
        for j, r in enumerate(reduced)
    ]
    applied = client.apply_delta(HOSTS[0], model_url, delta_url=shards, base_hash=base_hash).get(timeout=120)
    assert applied["via"] == "delta" and applied["model_hash"] == expected, applied
    # A reducer's word on the state its shard makes that does not hold, on a host on the base:
    # the apply is refused (and so is the assembly, from that state), the model stays the base.
    lying = [dict(shards[0], result_hash="sha256:" + "0" * 64), shards[1]]
    with pytest.raises(Exception) as refused_made:
        client.apply_delta(HOSTS[1], model_url, delta_url=lying, base_hash=base_hash).get(timeout=120)
    assert "hash_mismatch" in describe(refused_made.value), describe(refused_made.value)
    assert client.status(HOSTS[1]).get(timeout=30)["model_hash"] == base_hash
    # A sync shard that does not match the hash its reducer reported: the model is assembled
    # from the state shards instead, and is the same.
    forged = [dict(shards[0], hash="sha256:" + "0" * 64), shards[1]]
    assembled = client.apply_delta(HOSTS[1], model_url, delta_url=forged, base_hash=base_hash).get(
        timeout=120
    )
    assert assembled["via"] == "full" and assembled["model_hash"] == expected, assembled
    assert assembled["fallback"]["code"] == "hash_mismatch", assembled
    assert {client.status(h).get(timeout=30)["model_hash"] for h in HOSTS} == {expected}
    # Not on the base any more (it holds the result): the model is assembled from the state shards.
    again = client.apply_delta(HOSTS[0], model_url, delta_url=shards, base_hash=base_hash).get(timeout=120)
    assert again["via"] == "full" and again["model_hash"] == expected, again
    # A state shard that does not match its hash is refused too: the sync fails, the model stays.
    bad_state = [shards[0], dict(shards[1], result_hash="sha256:" + "0" * 64)]
    with pytest.raises(Exception) as refused:
        client.apply_delta(HOSTS[0], model_url, delta_url=bad_state, base_hash=base_hash).get(timeout=120)
    assert "hash_mismatch" in describe(refused.value), describe(refused.value)
    assert client.status(HOSTS[0]).get(timeout=30)["model_hash"] == expected


def orchestrated(
    client: RoundClient, store: Any, tmp_path: Path, tenant: str, aggregation: str, **options: Any
) -> Orchestrator:  # fmt: skip
    shards = [
        {"url": store.publish(name, path), "compression": "zstd", "size_bytes": path.stat().st_size}
        for name, path in build_shards(tmp_path)
    ]
    session = Session(
        HOSTS, shards, TRAIN, params={"lr": 0.2}, steps=5, tenant=tenant, aggregation=aggregation, **options
    )
    orchestrator = Orchestrator(client, store, build_model(), session)
    orchestrator.load()
    return orchestrator


def star_models(client: RoundClient, store: Any, where: Path, tenant: str, **options: Any) -> list[str]:
    """The global model's hash after each of three rounds of the same demo session, star path:
    what a sharded session's models are compared with."""
    where.mkdir(exist_ok=True)
    star = orchestrated(client, store, where, tenant, "star", **options)
    hashes = [s.model_hash for s in star.run(3)]
    star.close()
    return hashes


def test_a_sharded_session_through_the_orchestrator_is_the_star_sessions_model(
    cluster, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Three rounds of the demo on two hosts, star then sharded: with two float16 deltas the
    sum is exact in fp32 whatever its order, so the two sessions' models are bit for bit the
    same, round after round; every host holds the global model after each sharded sync, and
    no tensor byte of a sharded round passes through the orchestrator (it GETs nothing)."""
    client, store = cluster
    star_hashes = star_models(client, store, tmp_path, "star-run")
    (tmp_path / "s").mkdir()
    sharded = orchestrated(client, store, tmp_path / "s", "sharded-run", "sharded")
    fetched: list[str] = []
    real_fetch = store.fetch
    store.fetch = lambda name, dest: (fetched.append(name), real_fetch(name, dest))[1]  # type: ignore[method-assign]
    before = len(store.requests)
    try:
        history = sharded.run(3)
    finally:
        store.fetch = real_fetch  # type: ignore[method-assign]
    assert [s.model_hash for s in history] == star_hashes
    # Each reducer (sh-a shard 0, sh-b shard 1) reads its own contribution where its round kept
    # it: never GOT; the other host's shard is.
    gets = [path for method, path in store.requests[before:] if method == "GET" and "/delta/" in path]
    assert not [p for p in gets if "/delta/sh-a/0." in p or "/delta/sh-b/1." in p], gets
    assert len([p for p in gets if "/delta/sh-b/0." in p]) == 3, gets
    assert all(s.included == HOSTS and not s.excluded and not s.kept for s in history), history
    assert all(s.via == dict.fromkeys(HOSTS, "delta") for s in history), [s.via for s in history]
    assert {st["model_hash"] for st in sharded.statuses().values()} == {sharded.global_hash}
    assert fetched == []
    events = [e["event"] for e in sharded.story]
    assert events.count("sharded-sync") == 3 and "sharded-failed" not in events
    # The reducers' state and velocity, deferred to their applies, are in the store as recorded,
    # each confirmed by its reducer's apply (none restored by the orchestrator).
    assert "shard-restored" not in events and sharded.sharded.pending is None
    assert_stored(store, sharded, tmp_path)
    sharded.close()


def assert_stored(store: ArtifactServer, orchestrator: Orchestrator, tmp_path: Path) -> None:
    state = orchestrator.sharded
    for kind, objects in (("state", state.state), ("velocity", state.velocity)):
        for j, item in enumerate(objects):
            local = tmp_path / f"stored-{kind}-{j}"
            store.fetch(item["name"], local)
            assert state_hash(read_delta(str(local))) == item["hash"], (kind, j)


def test_a_deferred_store_no_apply_confirms_is_restored_by_the_orchestrator(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Round 1's reducer of shard 1 is told, in its apply, a velocity it never made (what a
    reducer lost between its reduce and its apply, or a failed PUT, leaves): its apply still
    applies and reports the shard not stored, the orchestrator makes that shard's state and
    velocity again from the store's objects and PUTs them, and the session goes on to the star
    session's models, round after round."""
    client, store = cluster
    star_hashes = star_models(client, store, tmp_path / "ref", "restore-ref")
    sharded = orchestrated(client, store, tmp_path, "restore-run", "sharded")
    send, said = client.apply_delta, []

    def apply_delta(host: str, model_url: str, **arguments: Any) -> Any:
        shards = arguments.get("delta_url")
        if isinstance(shards, list) and sharded.next_round == 1 and "store" in shards[1]:
            shards[1]["store"]["velocity_hash"] = "sha256:" + "0" * 64
            task = send(host, model_url, **arguments)
            said.append(task)
            return task
        return send(host, model_url, **arguments)

    client.apply_delta = apply_delta  # type: ignore[method-assign]
    try:
        history = sharded.run(3)
    finally:
        client.apply_delta = send  # type: ignore[method-assign]
    assert [s.model_hash for s in history] == star_hashes
    assert len(said) == 1
    stored = said[0].get(timeout=30)["stored"]
    assert stored == [
        {"shard": 1, "ok": False, "reason": "this host does not hold the shard's state and velocity"}
    ]
    restored = [e for e in sharded.story if e["event"] == "shard-restored"]
    assert [(e["round"], e["shard"]) for e in restored] == [(1, 1)], restored
    assert_stored(store, sharded, tmp_path)
    sharded.close()


class CorruptShard:
    """The cluster's store, but one host's shard 0 of round 1 (reduced by the other host: a
    reducer reads its own shard where it kept it) is replaced by another file before its
    reducer GETs it: what it downloads no longer matches its host's hash."""

    def __init__(self, store: ArtifactServer, host: str, tmp_path: Path) -> None:
        self._store, self._host, self._path = store, host, tmp_path / "junk"
        write_delta({"0.weight": torch.zeros(5)}, str(self._path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def url_get(self, name: str, expires_s: float = 6 * 3600) -> str:
        if f"round-1/delta/{self._host}/0." in name:
            self._store.publish(name, self._path)
        return self._store.url_get(name, expires_s)


def test_a_corrupted_shard_drops_its_host_from_the_round_and_the_rest_reduce(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store = cluster
    broken = CorruptShard(store, HOSTS[1], tmp_path)
    orchestrator = orchestrated(client, broken, tmp_path, "sharded-bad", "sharded")
    history = orchestrator.run(2)
    assert history[0].included == HOSTS
    assert history[1].included == [HOSTS[0]] and HOSTS[1] in history[1].excluded, history[1]
    assert "sh-b's shard" in history[1].excluded[HOSTS[1]], history[1].excluded
    refused = [e for e in orchestrator.story if e["event"] == "shard-refused"]
    assert [e["host"] for e in refused] == [HOSTS[1]]
    # The round still closed without it, and every host is on the one model.
    assert not history[1].kept and history[1].model_hash != history[0].model_hash
    assert {st["model_hash"] for st in orchestrator.statuses().values()} == {orchestrator.global_hash}
    orchestrator.close()


def test_a_joiner_takes_a_shard_and_a_reducer_that_dies_is_replaced(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Three shards, two starting hosts: a third host joins after round 0 (its model assembled
    from the state shards), contributes and reduces from round 2; in round 3 it dies as its
    reduce is sent (the whole worker, SIGKILL): its shard goes to another host of S, the round
    closes with its delta (it contributed before dying), and the others hold the one model."""
    client, store = cluster
    joiner = WorkerProcess("sh-c", client.settings.broker_url, tmp_path / "sh-c")
    shards = [
        {"url": store.publish(name, path), "compression": "zstd", "size_bytes": path.stat().st_size}
        for name, path in build_shards(tmp_path)
    ]
    everyone = [*HOSTS, "sh-c"]
    session = Session(
        HOSTS, shards, TRAIN, params={"lr": 0.2}, steps=5, tenant="sharded-join", aggregation="sharded",
        max_hosts=3, allowed_hosts=everyone, join_wait_s=60,
    )  # fmt: skip
    orchestrator = Orchestrator(client, store, build_model(), session)
    orchestrator.load()
    try:
        assert orchestrator.run(1)[0].included == HOSTS and orchestrator.sharded.count == 3
        joiner.start()
        killed: list[int] = []
        send = client.reduce_shard

        def reduce_shard(host: str, **arguments: Any) -> Any:
            if host == "sh-c" and orchestrator.next_round == 3 and not killed:
                killed.append(joiner.process.pid)  # type: ignore[union-attr]
                os.killpg(joiner.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            return send(host, **arguments)

        client.reduce_shard = reduce_shard  # type: ignore[method-assign]
        history = orchestrator.run(4)
    finally:
        client.reduce_shard = send  # type: ignore[method-assign]
        joiner.stop()
    assert [s.included for s in history[2:]] == [everyone, everyone], [s.included for s in history]
    events = [(e["event"], e["host"]) for e in orchestrator.story]
    assert ("joined", "sh-c") in events or ("rejoined", "sh-c") in events, events
    assert killed and ("reduce-failed", "sh-c") in events, events
    assert not history[3].kept and history[3].model_hash != history[2].model_hash
    assert {client.status(h).get(timeout=30)["model_hash"] for h in HOSTS} == {orchestrator.global_hash}
    orchestrator.close()


class Died(Exception):
    pass


def test_an_orchestrator_killed_between_a_rounds_reduce_and_its_sync_is_resumed(
    cluster, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The orchestrator dies once round 1's shards are reduced, before any host is told: the
    resumed one brings the hosts to that round's model from the store's state shards, records
    the round and goes on; its models are the star session's, round after round."""
    client, store = cluster
    star_hashes = star_models(client, store, tmp_path / "ref", "resume-ref")
    shards = [
        {"url": store.publish(name, path), "compression": "zstd", "size_bytes": path.stat().st_size}
        for name, path in build_shards(tmp_path)
    ]
    session = Session(
        HOSTS, shards, TRAIN, params={"lr": 0.2}, steps=5, tenant="resume", aggregation="sharded"
    )
    state_dir = tmp_path / "state"
    first = Orchestrator(client, store, build_model(), session, state_dir=state_dir)
    first.load()
    send = client.apply_delta

    def apply_delta(host: str, model_url: str, **arguments: Any) -> Any:
        if isinstance(arguments.get("delta_url"), list) and first.sharded.round == 1:
            raise Died("the orchestrator died before it told any host")
        return send(host, model_url, **arguments)

    client.apply_delta = apply_delta  # type: ignore[method-assign]
    try:
        with pytest.raises(Died):
            first.run(3)
    finally:
        client.apply_delta = send  # type: ignore[method-assign]
    first.close()
    resumed = Orchestrator.resume(client, store, state_dir)
    assert [s.model_hash for s in resumed.history] == star_hashes[:2], resumed.history
    assert [e["event"] for e in resumed.story if e["event"] == "resumed-reduced"]
    history = resumed.run(3)
    assert [s.model_hash for s in history] == star_hashes
    assert {st["model_hash"] for st in resumed.statuses().values()} == {resumed.global_hash}
    resumed.close()


def test_a_round_that_cannot_close_falls_back_to_the_star_path(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Every reduce of round 1 is refused (an outer rule no worker takes), so the round cannot
    close: the orchestrator folds it from the hosts' shards (the model and velocity assembled
    from the store's shards), syncs it by the star path and writes them back as shards; round 2
    is sharded again. The models are the star session's, round after round."""
    client, store = cluster
    star_hashes = star_models(client, store, tmp_path / "ref", "fallback-ref")
    sharded = orchestrated(client, store, tmp_path, "fallback", "sharded")
    send = client.reduce_shard

    def reduce_shard(host: str, **arguments: Any) -> Any:
        if sharded.next_round == 1:
            arguments = {**arguments, "outer": {"lr": -1.0}}
        return send(host, **arguments)

    client.reduce_shard = reduce_shard  # type: ignore[method-assign]
    try:
        history = sharded.run(3)
    finally:
        client.reduce_shard = send  # type: ignore[method-assign]
    assert [s.model_hash for s in history] == star_hashes
    assert all(s.included == HOSTS and not s.kept for s in history), history
    events = [(e["event"], e["round"]) for e in sharded.story]
    assert ("sharded-failed", 1) in events and ("star-fallback", 1) in events, events
    assert ("sharded-sync", 0) in events and ("sharded-sync", 2) in events, events
    assert {st["model_hash"] for st in sharded.statuses().values()} == {sharded.global_hash}
    sharded.close()


def test_an_int8_sharded_session_is_the_int8_star_sessions_model(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """int8 deltas with error feedback, sharded: each host's blocks are its whole delta's, cut
    where the shards are, and its residual the same; three rounds, the star session's models."""
    client, store = cluster
    star_hashes = star_models(client, store, tmp_path / "ref", "int8-ref", delta_dtype="int8")
    sharded = orchestrated(client, store, tmp_path, "int8-sharded", "sharded", delta_dtype="int8")
    history = sharded.run(3)
    assert [s.model_hash for s in history] == star_hashes
    assert all(s.included == HOSTS and s.via == dict.fromkeys(HOSTS, "delta") for s in history), history
    sharded.close()
