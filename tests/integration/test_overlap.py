"""Overlapped rounds (docs/OVERLAP.md) through real workers: every host's copy of the global model
bit-identical after N rounds, a stop mid-round, a host killed mid-round, a worker child killed
mid-round, a host joining mid-session (its delta taken against what it started from), an
orchestrator killed and resumed, and forged, unsigned or replayed sync orders refused (DESIGN §11)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from safetensors.torch import save_file

from executor.delta import read_delta, state_hash
from orchestrator.artifacts import ArtifactServer
from orchestrator.checkpoint import StateDir
from orchestrator.collect import describe
from orchestrator.demo import TRAIN, build_model, build_shards
from orchestrator.diloco import Orchestrator, RoundSummary, Session
from settings import Settings
from tasks.client import RoundClient
from tasks.names import sync_key
from tasks.overlap import SyncOrder
from tasks.trust.keys import init_keys
from tasks.trust.signing import Signer, sync_token
from tests.support.redis_server import RedisServer
from tests.support.rounds import SLOW_ON_CUE, event_seq, wait_for_log
from tests.support.worker import WorkerProcess

pytestmark = pytest.mark.timeout(400)

HOSTS = ["ov-a", "ov-b"]


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
        client = RoundClient(Settings(broker_url=redis_server.url, host_id="ov-orchestrator"))
        yield client, store, redis_server, cache
    for worker in workers:
        worker.stop()
    redis_server.stop()


def shards(store: ArtifactServer, directory: Path) -> list[dict[str, Any]]:
    return [
        {"url": store.publish(name, path), "compression": "zstd", "size_bytes": path.stat().st_size}
        for name, path in build_shards(directory)
    ]


def session(hosts: list[str], store: ArtifactServer, tmp_path: Path, tenant: str, **options: Any) -> Session:
    code = options.pop("code", TRAIN)
    params = {"lr": 0.2, **options.pop("params", {})}
    return Session(
        hosts, shards(store, tmp_path), code, params=params, steps=10, tenant=tenant, overlap=True, **options
    )


def held(orchestrator: Orchestrator) -> set[str]:
    return {status["model_hash"] for status in orchestrator.statuses().values()}


def test_overlapped_rounds_keep_every_hosts_global_copy_bit_identical(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store, _redis, _cache = cluster
    seen: list[RoundSummary] = []
    tasks: dict[int, dict[str, str]] = {}
    orchestrator = Orchestrator(
        client, store, build_model(), session(HOSTS, store, tmp_path, "ov1"), on_summary=seen.append,
        on_round_start=tasks.__setitem__,
    )  # fmt: skip
    orchestrator.load()
    initial = orchestrator.global_hash
    history = orchestrator.run(4)
    # Every round rebuilt the working copy the next one started from (G + its own delta), on
    # the global model its sync left (round k ends on θ_k, the outer step of round k-1): the
    # delta path, beside the round, from round 1 on.
    for round_num, ids in tasks.items():
        for task_id in ids.values():
            said = client.app.AsyncResult(task_id).get(timeout=30)["overlap"]
            expected = history[round_num - 1].model_hash if round_num else initial  # θ_k at round k's end
            assert said["rebased"] and said["global_hash"] == expected, (round_num, said)
            assert (said["sync"] or {}).get("via") == ("delta" if round_num else None), said
    assert [s.round_num for s in history] == [0, 1, 2, 3] and seen == history
    assert all(s.overlap and s.included == HOSTS and not s.excluded for s in history)
    # Rounds 1-3 each awaited the sync of the round before, applied beside the round on every
    # host (its own apply time) and rebuilt the working copy; round 0 awaited none.
    for summary in history:
        for phases in summary.host_phases.values():
            assert {"training", "delta_write", "upload", "sync_wait", "rebase"} <= set(phases), phases
            assert ("apply" in phases) == (summary.round_num > 0), (summary.round_num, phases)
    # No host ever needed a re-sync: each ended every round on the orchestrator's model.
    assert not [e for e in orchestrator.story if e["event"] in ("resync-needed", "rejoined", "join-stale")]
    # The last round's sync came as in sequential mode, and every copy is the global model.
    assert history[-1].via == {h: "delta" for h in HOSTS}
    assert held(orchestrator) == {orchestrator.global_hash} == {state_hash(orchestrator.global_state)}
    assert len({s.model_hash for s in history}) == 4  # the model moved every round
    orchestrator.close()


def test_a_stop_mid_round_leaves_the_host_out_and_it_resyncs(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store, _redis, _cache = cluster
    options = {"code": SLOW_ON_CUE, "params": {"slow_host": "ov-b", "slow_round": 1}}
    since = event_seq(client, "ov-b")

    def stop_once_spinning(task_id: str) -> None:
        wait_for_log(client, "ov-b", since, "slow round started", timeout_s=120)
        client.stop(task_id, "ov-b")

    stopped: list[str] = []

    def stop_the_slow_one(round_num: int, task_ids: dict[str, str]) -> None:
        if round_num == 1:
            stopped.append(task_ids["ov-b"])
            threading.Thread(target=stop_once_spinning, args=(task_ids["ov-b"],), daemon=True).start()

    orchestrator = Orchestrator(
        client, store, build_model(), session(HOSTS, store, tmp_path, "ov2", **options),
        on_round_start=stop_the_slow_one,
    )  # fmt: skip
    orchestrator.load()
    history = orchestrator.run(4)
    assert list(history[1].excluded) == ["ov-b"] and "stopped" in history[1].excluded["ov-b"]
    assert history[1].included == ["ov-a"]
    # Its own progress is dropped (no working copy); its copy of the global model is the one
    # the sync order left when that came before the stop, else it is re-synced first.
    said = client.app.AsyncResult(stopped[0]).get(timeout=30)
    assert said["status"] == "stopped" and not said["overlap"]["rebased"]
    events = [(e["host"], e["event"]) for e in orchestrator.story if e["round"] >= 1]
    assert (said["overlap"]["global_hash"] == history[0].model_hash) != (("ov-b", "resync-needed") in events)
    assert history[2].included == HOSTS and history[3].included == HOSTS  # and it trains again
    assert held(orchestrator) == {orchestrator.global_hash}
    orchestrator.close()


def test_a_host_killed_mid_round_is_lost_and_the_rest_go_on(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store, redis_server, cache = cluster
    doomed = WorkerProcess("ov-doomed", redis_server.url, tmp_path / "doomed", cache_dir=cache)
    doomed.start()
    try:
        hosts = ["ov-a", "ov-doomed"]
        options = {
            "code": SLOW_ON_CUE, "params": {"slow_host": "ov-doomed", "slow_round": 1},
            "allowed_hosts": hosts,  # the module's idle ov-b must not join in the doomed one's place
        }  # fmt: skip
        since = event_seq(client, "ov-doomed")

        def kill_once_spinning() -> None:
            wait_for_log(client, "ov-doomed", since, "slow round started", timeout_s=120)
            assert doomed.process is not None
            os.killpg(doomed.process.pid, signal.SIGKILL)  # the whole worker: no goodbye

        def kill_the_doomed(round_num: int, _ids: dict[str, str]) -> None:
            if round_num == 1:
                threading.Thread(target=kill_once_spinning, daemon=True).start()

        orchestrator = Orchestrator(
            client, store, build_model(), session(hosts, store, tmp_path, "ov3", **options),
            on_round_start=kill_the_doomed,
        )  # fmt: skip
        orchestrator.load()
        history = orchestrator.run(3)
        assert history[1].lost == ["ov-doomed"] and history[1].included == ["ov-a"]
        assert history[2].included == ["ov-a"] and orchestrator.membership.active() == ["ov-a"]
        assert held(orchestrator) == {orchestrator.global_hash}
        orchestrator.close()
    finally:
        doomed.stop()


PLUS_ONE = """
state = load_model(model_path)
for tensor in state.values():
    if tensor.is_floating_point():
        tensor.add_(1.0)
save_model(state)
"""


def test_a_host_that_joins_mid_session_ships_its_delta_against_the_model_it_started_from(  # type: ignore[no-untyped-def]
    cluster, tmp_path: Path
) -> None:
    """A joiner's first overlapped round starts from the global model it loaded while the sync
    of the round before is applied to that file in place: its delta must still be ``trained -
    start``. Every round adds exactly 1.0 to every weight, so every delta any host ships is 1.0."""
    client, store, _redis, _cache = cluster
    other = tmp_path / "other.safetensors"
    save_file(build_model(), other)
    # ov-b holds another tenant's session (no candidate: docs/OPERATIONS.md) until round 0 starts;
    # its reset then takes a while (a clean-clone run under the whole suite: longer than three
    # rounds), so it joins at some boundary after round 0, when a sync is due.
    client.load_model("ov-b", store.publish("ov-other", other), [], PLUS_ONE, tenant="ov-other").get(
        timeout=120
    )

    def free_ov_b(round_num: int, _ids: dict[str, str]) -> None:
        if round_num == 0:
            client.reset("ov-b")  # sent, not awaited: the orchestrator's loop owns the results here

    hosts = ["ov-a"]
    options = {"code": PLUS_ONE, "max_hosts": 2, "join_wait_s": 60.0}
    orchestrator = Orchestrator(
        client,
        store,
        build_model(),
        session(hosts, store, tmp_path, "ov5", **options),
        on_round_start=free_ov_b,
    )
    orchestrator.load()
    history = orchestrator.run(6)
    joined = [s.round_num for s in history if "ov-b" in s.included]
    assert joined and joined[0] >= 1 and history[-1].included == HOSTS, [s.included for s in history]
    for summary in history:
        for host in summary.included:
            shipped = read_delta(str(store.path(orchestrator.delta_name(summary.round_num, host))))
            assert shipped and all(torch.equal(v, torch.ones_like(v)) for v in shipped.values()), (
                summary.round_num, host, {k: v.flatten()[:3] for k, v in shipped.items()},
            )  # fmt: skip
    assert held(orchestrator) == {orchestrator.global_hash}
    orchestrator.close()


LONG_ON_CUE = (
    """
if params.get("long_host") == host_id and round_num == params.get("long_round"):
    emit_log("long round started")
    import time
    until = time.monotonic() + float(params["long_s"])
    while time.monotonic() < until:
        should_stop()
        time.sleep(0.05)
"""
    + TRAIN
)


def test_a_worker_child_killed_mid_round_is_replaced_and_its_host_trains_on_in_sync(  # type: ignore[no-untyped-def]
    cluster, tmp_path: Path
) -> None:
    """The OOM killer's case (docs/OVERLAP.md): Celery runs the round again on the replacement
    child, which drops W; if the dead child had applied the round's sync, the rerun refuses
    (the host no longer holds the round's base) and the host is re-synced; either way it
    trains again and every copy ends on the global model."""
    client, store, redis_server, cache = cluster
    victim = WorkerProcess("ov-child", redis_server.url, tmp_path / "child", cache_dir=cache)
    victim.start()
    try:
        hosts = ["ov-a", "ov-child"]
        options = {
            "code": LONG_ON_CUE, "params": {"long_host": "ov-child", "long_round": 1, "long_s": 6.0},
            "allowed_hosts": hosts,
        }  # fmt: skip
        since = event_seq(client, "ov-child")
        killed: list[int] = []

        def kill_the_child() -> None:
            wait_for_log(client, "ov-child", since, "long round started", timeout_s=120)
            killed.append(victim.child_pid())
            os.kill(killed[0], signal.SIGKILL)

        def on_start(round_num: int, _ids: dict[str, str]) -> None:
            if round_num == 1:
                threading.Thread(target=kill_the_child, daemon=True).start()

        orchestrator = Orchestrator(
            client,
            store,
            build_model(),
            session(hosts, store, tmp_path, "ov6", **options),
            on_round_start=on_start,
        )
        orchestrator.load()
        history = orchestrator.run(4)
        assert killed and victim.child_pid() != killed[0], "the child was killed and replaced"
        assert "ov-child" in history[3].included and history[3].included == hosts, [
            s.included for s in history
        ]
        assert held(orchestrator) == {orchestrator.global_hash}
        orchestrator.close()
    finally:
        victim.stop()


class Died(Exception):
    pass


def test_an_orchestrator_killed_mid_round_is_resumed(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store, _redis, _cache = cluster
    state = tmp_path / "state"

    def die_while_round_2_trains(summary: RoundSummary) -> None:
        if summary.round_num == 1:  # written while round 2 trains, its sync order sent
            raise Died

    first = Orchestrator(
        client, store, build_model(), session(HOSTS, store, tmp_path, "ov4"), state_dir=state,
        on_summary=die_while_round_2_trains,
    )  # fmt: skip
    first.load()
    with pytest.raises(Died):
        first.run(4)
    first.close()  # and is never heard of again
    saved = StateDir(state).load()
    assert saved.round_done == 1 and StateDir(state).load_inflight() is not None  # round 2 in flight
    resumed = Orchestrator.resume(client, store, state)
    assert resumed.next_round == 2 and resumed.global_hash == state_hash(saved.model)
    history = resumed.run(4)
    assert [s.round_num for s in history] == [0, 1, 2, 3]
    assert history[-1].included == HOSTS and history[2].included == HOSTS
    assert held(resumed) == {resumed.global_hash} and StateDir(state).load().round_done == 3
    resumed.close()


def test_forged_unsigned_and_replayed_sync_orders_are_refused(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An overlapped round awaits the sync its own signed task names; what else lies under its
    key (plain JSON, another key's signature, a genuine order of another round) is refused,
    reported, and leaves its copy of the global model as it was."""
    client, store, redis_server, _cache = cluster
    host = "ov-a"
    orchestrator = Orchestrator(client, store, build_model(), session([host], store, tmp_path, "ov5"))
    orchestrator.load()
    base = orchestrator.global_hash
    raw = redis.Redis.from_url(redis_server.url)
    other, _ = init_keys(tmp_path / "other-keys")
    impostor = Signer(other.signing_key().read_text(), other.signing_cert().read_text())
    bogus = "sha256:" + "0" * 64  # what a forger would have the host install

    def order(sync_id: str, result_hash: str = bogus) -> dict[str, Any]:
        return SyncOrder(sync_id, 0, orchestrator.model_url(), None, base, result_hash).to_json()

    def overlapped(sync_id: str, wait_s: float) -> dict[str, Any]:
        task = client.run_round(
            host, steps=2, round_num=1, delta_url=store.url_put(f"ov5/{sync_id}"),
            overlap={"base_hash": base, "sync_id": sync_id, "sync_wait_s": wait_s},
        )  # fmt: skip
        return dict(task.get(timeout=120))

    since = event_seq(client, host)
    forged = {
        "unsigned": json.dumps(order("forgery1")),
        "untrusted_signer": sync_token(impostor, host, order("forgery1")),
    }
    for sync_id, token in (("forgery1", forged["unsigned"]),):
        raw.set(sync_key(host, sync_id), token)
    result = overlapped("forgery1", 3.0)
    assert result["status"] == "completed" and result["overlap"]["global_hash"] == base
    assert not result["overlap"]["rebased"] and "no sync order" in result["overlap"]["sync_error"]
    raw.set(sync_key(host, "forgery2"), forged["untrusted_signer"])
    result = overlapped("forgery2", 3.0)
    assert result["overlap"]["global_hash"] == base and not result["overlap"]["rebased"]
    # A genuine order, signed by the orchestrator, but for another round's id: a replay.
    client.send_sync(host, SyncOrder.from_json(order("genuine1", base)))
    raw.set(sync_key(host, "replay1"), raw.get(sync_key(host, "genuine1")) or b"")
    result = overlapped("replay1", 3.0)
    assert result["overlap"]["global_hash"] == base and not result["overlap"]["rebased"]
    reasons = [
        e.data.get("reason")
        for e in client.events(host, since, idle_timeout_s=1.0)
        if e.data.get("event") == "refused" and e.data.get("kind") == "sync"
    ]
    # Plain JSON is not a token at all (malformed); the impostor's signature is nobody's we trust.
    assert reasons[:3] == ["malformed", "untrusted_signer", "wrong_id"], reasons
    # The genuine order under its own id is taken: the round rebuilds its working copy.
    result = overlapped("genuine1", 30.0)
    assert result["overlap"]["rebased"] and result["overlap"]["sync"]["model_hash"] == base
    assert held(orchestrator) == {base}
    orchestrator.close()


def test_an_overlapped_round_on_a_model_the_host_does_not_hold_is_refused(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, store, _redis, _cache = cluster
    orchestrator = Orchestrator(client, store, build_model(), session(["ov-b"], store, tmp_path, "ov6"))
    orchestrator.load()
    task = client.run_round(
        "ov-b", steps=2, round_num=0, overlap={"base_hash": "sha256:" + "1" * 64, "sync_id": None}
    )
    with pytest.raises(Exception) as refused:
        task.get(timeout=60)
    assert describe(refused.value).startswith("NotInSync (hash_mismatch)"), describe(refused.value)
    assert held(orchestrator) == {orchestrator.global_hash}  # nothing changed on the host
    orchestrator.close()


class BrokenPut:
    """The cluster's artifact server, but one host's delta URL of one round is refused (403):
    an upload that fails beside the next round."""

    def __init__(self, server: ArtifactServer, broken: str) -> None:
        self.server, self.broken = server, broken

    def url_put(self, name: str, expires_s: float = 3600) -> str:
        url = self.server.url_put(name, expires_s)
        return url + "0" if name.endswith(self.broken) else url  # a signature that does not verify

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)


def test_a_delta_whose_upload_fails_beside_the_next_round_is_left_out(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client, server, _redis, _cache = cluster
    orchestrator = Orchestrator(client, server, build_model(), session(HOSTS, server, tmp_path, "ov7"))
    orchestrator.store = BrokenPut(server, orchestrator.delta_name(1, "ov-b"))  # type: ignore[assignment]
    orchestrator.load()
    history = orchestrator.run(3)
    # Its round completed (the delta written, its PUT handed to a thread): the PUT failed beside
    # round 2, its heartbeat said so, and the orchestrator left that delta out, nothing else.
    assert history[1].included == ["ov-a"], history[1].excluded
    assert "upload failed" in history[1].excluded["ov-b"] and "download_failed" in history[1].excluded["ov-b"]
    assert history[0].included == HOSTS and history[2].included == HOSTS
    assert held(orchestrator) == {orchestrator.global_hash}
    orchestrator.close()
