"""The orchestrator's parts without workers: artifact serving, the outer step, S3 presigning,
streaming aggregation, checkpoints, and (against a real Redis, with heartbeats written by
the test) deadlines, lost hosts and membership."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
import zstandard

from executor import transfer
from executor.configs import transfer_config
from executor.delta import state_hash, write_delta
from executor.fileio import atomic_writer
from orchestrator.aggregate import DeltaFolder, DeltaRejected, RunningMean
from orchestrator.artifacts import ArtifactServer
from orchestrator.checkpoint import Checkpoint, CheckpointError, StateDir
from orchestrator.collect import Deadline, Ending, Waiter, round_failure
from orchestrator.diloco import OuterOptimizer, RoundSummary, Session, mean_delta
from orchestrator.membership import MAX_FAILURES, HostState, Membership, join_kind
from orchestrator.phases import PhaseClock, worker_phases
from orchestrator.s3 import presign
from settings import Settings
from tasks.client import RoundClient
from tasks.events import Event
from tasks.names import heartbeat_key, stream_name
from tests.support.redis_server import RedisServer


@pytest.fixture
def store(tmp_path: Path):
    with ArtifactServer(tmp_path / "store") as server:
        yield server


def test_signed_urls_are_required_and_expire(store: ArtifactServer, tmp_path: Path) -> None:
    source = tmp_path / "blob"
    source.write_bytes(os.urandom(1000))
    url = store.publish("a/blob", source)
    assert requests.get(url, timeout=10).content == source.read_bytes()
    unsigned = url.split("?")[0]
    assert requests.get(unsigned, timeout=10).status_code == 403
    assert requests.get(url.replace("X-Signature=", "X-Signature=0"), timeout=10).status_code == 403
    assert requests.put(url, data=b"x", timeout=10).status_code == 403  # a GET signature cannot PUT
    assert requests.get(store.url_get("a/blob", expires_s=-1), timeout=10).status_code == 403
    traversal = store.url_get("../../etc/passwd")
    assert requests.get(traversal, timeout=10).status_code in (403, 404)


def test_publishing_links_the_file_and_a_rewritten_source_leaves_it_as_published(
    store: ArtifactServer, tmp_path: Path
) -> None:
    # Same file system: a hard link, not a model-sized copy a round.
    source = tmp_path / "global.safetensors"
    source.write_bytes(b"round one")
    url = store.publish("model/global", source)
    assert os.stat(store.path("model/global")).st_ino == os.stat(source).st_ino
    # The orchestrator rewrites its files whole (a new inode): the published bytes stay.
    with atomic_writer(str(source)) as file:
        file.write(b"round two")
    assert requests.get(url, timeout=10).content == b"round one"
    assert store.publish("model/global", source) and requests.get(url, timeout=10).content == b"round two"


def test_ranges_and_atomic_puts_work_with_the_executors_transfer(
    store: ArtifactServer, tmp_path: Path
) -> None:
    data = os.urandom(3 << 20)
    (tmp_path / "big").write_bytes(data)
    url = store.publish("big", tmp_path / "big")
    ranged = requests.get(url, headers={"Range": "bytes=10-19"}, timeout=10)
    assert ranged.status_code == 206 and ranged.content == data[10:20]
    config = transfer_config(
        Settings(
            parallel_min_bytes=1 << 20,
            parallel_connections=3,
            parallel_below_bytes_s=0,
            download_backoff_s=0.01,
        )
    )
    result = transfer.fetch(url, str(tmp_path / "copy"), config=config)
    assert (tmp_path / "copy").read_bytes() == data and result.connections == 3
    transfer.upload(str(tmp_path / "copy"), store.url_put("up/delta.zst"), config=config)
    fetched = tmp_path / "fetched"
    store.fetch("up/delta.zst", fetched)
    assert fetched.read_bytes() == data


def test_mean_delta_and_plain_averaging() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])}
    b = {"w": torch.tensor([3.0, 6.0])}  # no "b": counts as zero
    mean = mean_delta([a, b])
    assert torch.equal(mean["w"], torch.tensor([2.0, 4.0])) and torch.equal(mean["b"], torch.tensor([2.0]))
    params = {"w": torch.zeros(2), "b": torch.zeros(1), "steps": torch.tensor(3)}
    plain = OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False).step(params, mean)
    assert torch.equal(plain["w"], mean["w"]) and torch.equal(plain["steps"], torch.tensor(3))


def test_nesterov_momentum_follows_its_formula() -> None:
    opt = OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True)
    theta = {"w": torch.tensor([1.0])}
    delta = {"w": torch.tensor([0.2])}
    first = opt.step(theta, delta)  # g = -0.2, v = -0.2, update = g + 0.9 v = -0.38
    assert torch.allclose(first["w"], torch.tensor([1.0 + 0.5 * 0.38]))
    second = opt.step(first, delta)  # v = 0.9 * -0.2 - 0.2 = -0.38, update = -0.2 + 0.9 * -0.38
    assert torch.allclose(second["w"], first["w"] + 0.5 * (0.2 + 0.9 * 0.38))


def test_a_rounds_phases_are_timed_in_loop_order_and_a_workers_account_is_only_numbers() -> None:
    clock = PhaseClock()
    for name in ("fold", "dispatch", "fold"):
        with clock.phase(name):
            time.sleep(0.01)
    assert list(clock.to_json()) == ["dispatch", "fold"] and clock.seconds["fold"] >= 0.02
    with pytest.raises(ValueError), clock.phase("lunch"):
        pass
    honest = {"training_time": 2.5, "delta": {"write_s": 0.25, "upload_s": 1, "hash": "x"}}
    assert worker_phases(honest) == {"training": 2.5, "delta_write": 0.25, "upload": 1.0}
    # A worker's result is data from the broker: what is not a finite, non-negative duration
    # is left out, never raised on (it would end the orchestrator's round) nor written to the
    # checkpoint (NaN is not JSON).
    for hostile in (
        {"training_time": "2.5", "delta": ["write_s"]},
        {"training_time": float("nan"), "delta": {"write_s": float("inf"), "upload_s": -1.0}},
        {"training_time": True, "delta": {"write_s": None, "upload_s": {"s": 1}}},
    ):
        assert worker_phases(hostile) == {}, hostile
    assert worker_phases(None) == {} and worker_phases({"training_time": 1}) == {"training": 1.0}


def test_s3_presigning_matches_the_aws_documented_example() -> None:
    # AWS's published query-string authentication example (Signature Version 4, GET).
    url = presign(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        access_key="AKIAIOSFODNN7EXAMPLE",
        secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        expires_s=86400,
        now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC),
    )
    assert url.endswith("X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404")


S3_KEYS = [
    "round-3/gp0.delta.zst", "a b/c+d=e~f/é.zst", "x!*'()$&,;@:=", "deep/er/path/", "日本語/ключ",
    "%41already-encoded-stays-literal", "tab\there",
]  # fmt: skip


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com"])
def test_s3_presigning_equals_botocores_for_every_kind_of_key(endpoint: str) -> None:
    """The hand-written signer (kept: 3.5 x faster, bench.presign; a sharded round signs N x N
    URLs) against botocore's S3SigV4QueryAuth, the maintained implementation, given the key
    encoded as boto3's serializer does: the same URL, byte for byte."""
    from unittest import mock
    from urllib.parse import quote, urlsplit, urlunsplit

    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    moment = dt.datetime(2026, 12, 5, 10, 0, 0, tzinfo=dt.UTC)
    credentials = Credentials("AKIDEXAMPLE", "wJalr/K7MDENG+bPxRfi=CY")
    checked = 0
    for key in S3_KEYS:
        raw = f"{endpoint}/bucket/roundhouse/{key}"
        parts = urlsplit(raw)
        encoded = urlunsplit((parts.scheme, parts.netloc, quote(parts.path, safe="/~"), "", ""))
        for method in ("GET", "PUT", "HEAD", "DELETE"):
            for region, expires in (("us-east-1", 1), ("eu-west-1", 3600), ("auto", 604800)):
                request = AWSRequest(method=method, url=encoded)
                with mock.patch.object(
                    botocore.auth, "get_current_datetime", return_value=moment.replace(tzinfo=None)
                ):
                    botocore.auth.S3SigV4QueryAuth(credentials, "s3", region, expires=expires).add_auth(
                        request
                    )
                ours = presign(
                    method, raw, access_key=credentials.access_key, secret_key=credentials.secret_key,
                    region=region, expires_s=expires, now=moment,
                )  # fmt: skip
                assert ours == request.url, (key, method, region)
                checked += 1
    assert checked == len(S3_KEYS) * 12


# ---------------------------------------------------------------- streaming aggregation


def _deltas(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(64, 32, generator=g).half(), "b": torch.randn(32, generator=g).half()}
        if i % 3
        else {"w": torch.randn(64, 32, generator=g).half()}  # no "b": counts as zero
        for i in range(count)
    ]


MODEL = {"w": torch.zeros(64, 32), "b": torch.zeros(32), "steps": torch.tensor(7)}


def test_the_running_mean_is_the_naive_mean_bit_for_bit() -> None:
    deltas = _deltas(5)
    running = RunningMean(MODEL)
    for delta in deltas:
        running.add(delta)
    assert running.count == 5
    streamed, naive = running.mean(), mean_delta(deltas)
    assert set(streamed) == set(naive) == {"w", "b"}
    for key in naive:
        assert torch.equal(streamed[key], naive[key]) and streamed[key].dtype == torch.float32


@pytest.mark.parametrize(
    ("delta", "why"),
    [
        ({"x": torch.zeros(3)}, "lacks"),
        ({"steps": torch.zeros(())}, "lacks"),  # a non-floating key cannot be trained
        ({"w": torch.zeros(32, 64)}, "shape"),
        ({"w": torch.zeros(64, 32, dtype=torch.int32)}, "floating"),
    ],
)
def test_a_delta_that_does_not_fit_the_model_is_refused_before_anything_is_added(
    delta: dict[str, torch.Tensor], why: str
) -> None:
    running = RunningMean(MODEL)
    running.add({"w": torch.ones(64, 32)})
    with pytest.raises(DeltaRejected, match=why):
        running.add({"b": torch.ones(32), **delta})
    assert running.count == 1 and torch.equal(running.mean()["w"], torch.ones(64, 32))


def test_the_folder_fetches_in_parallel_holds_at_most_its_bound_and_sorts_out_bad_deltas(
    store: ArtifactServer, tmp_path: Path
) -> None:
    deltas = _deltas(6)
    hashes = {}
    for i, delta in enumerate(deltas):
        write_delta(delta, str(tmp_path / "d.zst"))
        store.publish(f"deltas/h{i}", tmp_path / "d.zst")
        hashes[f"h{i}"] = state_hash(delta)
    (tmp_path / "junk").write_bytes(b"not a delta at all")
    store.publish("deltas/junk", tmp_path / "junk")
    write_delta({"w": torch.zeros(3)}, str(tmp_path / "wrong.zst"))
    store.publish("deltas/wrong", tmp_path / "wrong.zst")
    seen = []
    folder = DeltaFolder(
        store, str(tmp_path / "scratch"), MODEL, parallel=4, in_memory=2, on_done=seen.append
    )
    for host, digest in hashes.items():
        folder.submit(host, f"deltas/{host}", digest)
    folder.submit("liar", "deltas/h0", hashes["h1"])  # a reported hash that is not the file's
    folder.submit("junk", "deltas/junk", "sha256:00")
    folder.submit("wrong", "deltas/wrong", state_hash({"w": torch.zeros(3)}))
    folder.submit("gone", "deltas/never-uploaded", "sha256:00")
    results = folder.results()
    folder.close()
    assert {h for h, r in results.items() if r.error is None} == set(hashes)
    assert "reported hash" in (results["liar"].error or "")
    assert "unreadable" in (results["junk"].error or "") and "unreadable" in (results["gone"].error or "")
    assert "does not fit" in (results["wrong"].error or "")
    assert len(seen) == 10 and 1 <= folder.peak_decoded <= 2
    assert not list((tmp_path / "scratch").iterdir()), "fetched files are removed"
    mean, naive = folder.mean.mean(), mean_delta(deltas)
    for key in naive:  # folded in arrival order: equal up to the order of the additions
        assert torch.allclose(mean[key], naive[key], rtol=0, atol=1e-6)


def test_an_uploaded_delta_is_refused_before_decoding_when_it_is_pickle_or_too_large(
    store: ArtifactServer, tmp_path: Path
) -> None:
    """Issue 25 item 2: the orchestrator decodes what anyone holding a PUT URL uploaded. The
    seed's pickle format (a worker never writes it) and a file larger than any delta of the
    model compresses to are refused unread; a PUT over the store's cap is refused unread."""
    plain = io.BytesIO()
    torch.save({"w": torch.zeros(64, 32)}, plain)
    (tmp_path / "pickled.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.getvalue()))
    store.publish("deltas/pickled", tmp_path / "pickled.zst")
    (tmp_path / "huge.zst").write_bytes(os.urandom(2 << 20))  # a delta of MODEL takes 1.2 MB at most
    store.publish("deltas/huge", tmp_path / "huge.zst")
    folder = DeltaFolder(store, str(tmp_path / "scratch"), MODEL)
    folder.submit("pickled", "deltas/pickled", state_hash({"w": torch.zeros(64, 32)}))
    folder.submit("huge", "deltas/huge", "sha256:00")
    results = folder.results()
    folder.close()
    assert "torch format" in (results["pickled"].error or ""), results["pickled"]
    assert "over the cap" in (results["huge"].error or ""), results["huge"]
    store.max_put_bytes = 1 << 20
    put = store.url_put("deltas/put")
    assert requests.put(put, data=bytes(1 << 20), timeout=10).status_code == 201
    with contextlib.suppress(requests.ConnectionError):  # the server may close before the body is sent
        assert requests.put(put, data=bytes((1 << 20) + 1), timeout=10).status_code == 413
    assert store.path("deltas/put").stat().st_size == 1 << 20


# ---------------------------------------------------------------- checkpoints


def _checkpoint(round_done: int, scale: float) -> Checkpoint:
    return Checkpoint(
        round_done, 8, {"w": torch.full((4, 4), scale), "n": torch.tensor(round_done)},
        {"w": torch.full((4, 4), -scale)}, {"lr": 0.7, "momentum": 0.9, "nesterov": True},
        {"code": "pass", "steps": 3}, {"a": {"state": "active"}}, [{"round_num": round_done}],
    )  # fmt: skip


def test_a_checkpoint_round_trips_and_only_the_last_one_is_kept(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    assert not state.exists()
    state.save(_checkpoint(2, 1.0))
    state.save(_checkpoint(3, 2.0))
    loaded = state.load()
    assert loaded.round_done == 3 and loaded.total_rounds == 8
    assert torch.equal(loaded.model["w"], torch.full((4, 4), 2.0)) and int(loaded.model["n"]) == 3
    assert torch.equal(loaded.velocity["w"], torch.full((4, 4), -2.0))
    assert loaded.session == {"code": "pass", "steps": 3} and loaded.members == {"a": {"state": "active"}}
    assert loaded.global_hash == state_hash(loaded.model)
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert names == ["model-00003.safetensors", "outer-00003.safetensors", "state.json"]
    state.update(round_done=3, history=[{"round_num": 3, "x": 1}])
    assert state.load().history == [{"round_num": 3, "x": 1}]


def test_the_quantised_sync_deltas_residual_is_checkpointed(tmp_path: Path) -> None:
    """A resumed session keeps the orchestrator's error feedback (issue 16): the residual of the
    last sync delta is saved with its round and only the last round's is kept."""
    state = StateDir(tmp_path)
    first, second = _checkpoint(2, 1.0), _checkpoint(3, 2.0)
    first.sync_residual = {"w": torch.full((4, 4), 1e-3)}
    second.sync_residual = {"w": torch.full((4, 4), -2e-3)}
    state.save(first)
    assert torch.equal(state.load().sync_residual["w"], torch.full((4, 4), 1e-3))
    state.save(second)
    assert torch.equal(state.load().sync_residual["w"], torch.full((4, 4), -2e-3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00003.safetensors", "outer-00003.safetensors", "residual-00003.safetensors", "state.json",
    ]  # fmt: skip
    state.save(_checkpoint(4, 3.0))  # a float sync delta keeps none
    assert state.load().sync_residual == {} and not list(tmp_path.glob("residual-*"))


def test_a_crash_before_the_commit_point_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    state.save(_checkpoint(4, 1.0))
    # A save that died after writing the next round's model, before state.json named it:
    (tmp_path / "model-00005.safetensors").write_bytes(b"half a model")
    assert state.load().round_done == 4
    # A model file that no longer matches the hash state.json recorded is refused.
    with open(tmp_path / "model-00004.safetensors", "r+b") as file:
        file.seek(-4, os.SEEK_END)
        file.write(b"\xff\xff\xff\x7f")
    with pytest.raises(CheckpointError, match="does not hash"):
        state.load()
    (tmp_path / "state.json").write_text("{")
    with pytest.raises(CheckpointError):
        state.load()


def test_the_round_in_flight_and_the_story_are_kept_beside_the_checkpoint(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    assert state.load_inflight() is None
    state.save_inflight(5, {"a": "task-1", "b": "task-2"})
    assert state.load_inflight() == (5, {"a": "task-1", "b": "task-2"})
    state.clear_inflight()
    assert state.load_inflight() is None
    state.append_event({"event": "lost", "host": "a"})
    state.append_event({"event": "rejoined", "host": "a"})
    assert [e["event"] for e in state.events()] == ["lost", "rejoined"]


def test_session_and_summary_survive_json() -> None:
    session = Session(["a", "b"], [{"name": "data/s0"}], "code", params={"lr": 1}, quorum=0.5, min_hosts=2)
    assert Session.from_json(json.loads(json.dumps(session.to_json()))) == session
    summary = RoundSummary(3, {"a": 0.5}, ["a"], {"b": "lost"}, {"a": "delta"}, "sha256:x", 1.5, lost=["b"])
    assert RoundSummary.from_json(json.loads(json.dumps(summary.to_json()))) == summary


# ---------------------------------------------------------------- deadlines, lost hosts, membership


class Beats:
    """Heartbeat keys written the way a worker writes them (JSON, a short TTL), for hosts the
    test names; a host whose beating stops expires like a dead worker's."""

    def __init__(self, client: RoundClient, ttl_s: int = 1) -> None:
        self.client, self.ttl_s = client, ttl_s
        self.hosts: dict[str, dict] = {}
        self.last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def beat(self, host: str, **status: object) -> None:
        self.hosts[host] = {"host_id": host, "state": "idle", "model_hash": None, "tenant": None, **status}
        self._write(host)

    def silence(self, host: str) -> float:
        """Stop beating for ``host``; returns the time of its last beat."""
        self.hosts.pop(host)
        return self.last[host]

    def _write(self, host: str) -> None:
        now = time.time()
        self.client.redis.set(heartbeat_key(host), json.dumps({**self.hosts[host], "ts": now}), ex=self.ttl_s)
        self.last[host] = now

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for host in list(self.hosts):
                with contextlib.suppress(KeyError):
                    self._write(host)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def beats(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    client = RoundClient(Settings(broker_url=server.url, host_id="orch-unit"))
    beats = Beats(client)
    yield beats
    beats.close()
    server.stop()


def stop_requested(client: RoundClient, task_id: str) -> bool:
    return any(task_id in key.decode() for key in client.redis.scan_iter(match="roundhouse:stop:*"))


def test_a_host_whose_heartbeat_expires_is_lost_within_the_ttl_plus_a_second(beats: Beats) -> None:
    client = beats.client
    beats.beat("a")
    beats.beat("b")
    # Nobody consumes these queues: the tasks stay pending, as on a host that died.
    pending = {"a": client.run_round("a", steps=1), "b": client.run_round("b", steps=1)}
    members = Membership(client, "t", max_hosts=2)
    threading.Timer(0.5, lambda: silenced.append(beats.silence("b"))).start()
    silenced: list[float] = []
    outcomes = Waiter(client, members.alive).wait(pending, Deadline(deadline_s=4.0))
    lost, late = outcomes["b"], outcomes["a"]
    assert lost.ending is Ending.LOST and late.ending is Ending.STRAGGLER
    assert lost.last_beat_ts is not None and lost.detected_ts is not None
    assert abs(lost.last_beat_ts - silenced[0]) < 0.05
    assert lost.detected_ts - lost.last_beat_ts <= beats.ttl_s + 1.0
    assert "deadline" in (late.reason or "")
    # Both were stopped through Redis: neither runs late, even if its worker comes back.
    assert stop_requested(client, pending["a"].id) and stop_requested(client, pending["b"].id)


def test_a_result_ends_the_wait_without_waiting_out_the_heartbeat_poll(beats: Beats) -> None:
    # Heartbeats and refusals are read every poll_s; a stored result is seen within a tick of
    # it (two waits a round: a round's end and its sync's), not at the next poll.
    client = beats.client
    beats.beat("a")
    pending = {"a": client.run_round("a", steps=1)}  # nobody consumes it: the result is stored by hand
    result = {"status": "completed", "training_time": 0.1, "report": None, "error": None, "delta": None}
    threading.Timer(0.3, lambda: client.app.backend.store_result(pending["a"].id, result, "SUCCESS")).start()
    waiter = Waiter(client, Membership(client, "t", max_hosts=1).alive, poll_s=30.0)
    started = time.monotonic()
    outcomes = waiter.wait(pending, Deadline(deadline_s=60.0))
    assert outcomes["a"].ending is Ending.RESULT and outcomes["a"].result == result
    assert time.monotonic() - started < 10.0, "the wait slept out its heartbeat poll"


def _refuse(client: RoundClient, host: str, task_id: str, reason: str = "untrusted_signer") -> None:
    """A refusal as ``host``'s gate publishes it (tasks.trust.gate.Refusals)."""
    name = "roundhouse.run_round"
    data = {"event": "refused", "kind": "task", "reason": reason, "detail": "test", "name": name}
    event = Event(type="state", host=host, data=data, task_id=task_id, task=name, ts=time.time())
    client.redis.xadd(stream_name(host), {"msg": json.dumps(event.to_json())})


def test_a_refusal_ends_the_wait_only_for_its_own_host_and_a_task_not_running(beats: Beats) -> None:
    """A refusal's task id is what the refused message claimed: one on another host's stream,
    or one for a task this host's heartbeat shows running, changes nothing; a refusal on the
    host that is to run the task ends its wait at once, with the reason, and stops the task."""
    client = beats.client
    waiter = Waiter(client, Membership(client, "t", max_hosts=2).alive)
    beats.beat("a")
    beats.beat("b")
    # Nobody consumes these queues: the tasks stay pending. Both hosts are waited for, so
    # both streams are read.
    pending = {"a": client.run_round("a", steps=1), "b": client.run_round("b", steps=1)}
    _refuse(client, "b", pending["a"].id)  # forged onto b's queue, claiming a's task id
    outcomes = waiter.wait(pending, Deadline(1.5))
    assert outcomes["a"].ending is Ending.STRAGGLER, outcomes
    running = client.run_round("a", steps=1)
    beats.beat("a", state="running", task_id=running.id)
    _refuse(client, "a", running.id)  # a copy claiming the id of the task that runs
    outcome = waiter.wait({"a": running}, Deadline(1.5))["a"]
    assert outcome.ending is Ending.STRAGGLER, outcome
    refused = client.run_round("a", steps=1)
    beats.beat("a")
    _refuse(client, "a", refused.id, reason="expired")
    started = time.monotonic()
    outcome = waiter.wait({"a": refused}, Deadline(60))["a"]
    assert outcome.ending is Ending.ERROR and outcome.reason == "refused by a's gate: expired: test", outcome
    assert time.monotonic() - started < 10 and stop_requested(client, refused.id)


def test_quorum_plus_grace_ends_a_round_and_stops_the_stragglers(beats: Beats) -> None:
    client = beats.client
    for host in ("a", "b", "c"):
        beats.beat(host, state="running")
    pending = {host: client.run_round(host, steps=1) for host in ("a", "b", "c")}
    done = {"status": "completed", "delta": {"hash": "sha256:00"}, "report": {"final_loss": 0.5}}
    client.app.backend.store_result(pending["a"].id, done, "SUCCESS")
    client.app.backend.store_result(
        pending["b"].id, {"status": "failed", "error": {"code": "gpu_oom"}}, "SUCCESS"
    )
    seen = []
    started = time.monotonic()
    waiter = Waiter(client, Membership(client, "t", max_hosts=3).alive)
    outcomes = waiter.wait(pending, Deadline(60.0, quorum=0.3, grace_s=0.5), on_outcome=seen.append)
    assert time.monotonic() - started < 5, "the grace after the quorum ended the round, not the deadline"
    assert outcomes["a"].completed and round_failure(outcomes["a"]) is None
    assert round_failure(outcomes["b"]) == "failed: gpu_oom"
    assert outcomes["c"].ending is Ending.STRAGGLER and "quorum" in (outcomes["c"].reason or "")
    assert [o.host for o in seen][:2] == ["a", "b"] and stop_requested(client, pending["c"].id)
    assert Deadline(1, quorum=0.75).quorum_count(4) == 3 and Deadline(1).quorum_count(3) == 3
    assert Deadline(1, quorum=0.01).quorum_count(8) == 1 and Deadline(1).quorum_count(0) == 0


def test_membership_chooses_who_may_join_and_how(beats: Beats) -> None:
    client = beats.client
    beats.beat("free", state="idle")
    beats.beat("theirs", state="loaded", tenant="other")  # someone else's session
    beats.beat("ours", state="loaded", tenant="t", model_hash="sha256:old")
    beats.beat("busy", state="running", tenant="t")
    beats.beat("back", state="loaded", tenant="t", model_hash="sha256:old")
    notes: list[tuple] = []
    members = Membership(client, "t", max_hosts=3, note=lambda *a, **k: notes.append((*a, k)))
    back = members.add("back", 0)
    back.held_session = True
    members.set("back", HostState.LOST, 1, "lost")
    live = members.beats()
    assert set(live) == {"free", "theirs", "ours", "busy", "back"}
    # Former members first, then strangers that are idle or of this tenant; never a busy one.
    assert members.candidates(live) == ["back", "free", "ours"]
    assert join_kind(back, live["back"], "t") == "apply"  # holds this session: no load_model
    assert join_kind(members.add("ours", 1), live["ours"], "t") == "load"  # never held it
    members.set("back", HostState.ACTIVE, 2, "rejoined")
    # "ours" is a member now, still to be synced: it comes before the strangers.
    assert members.candidates(live) == ["ours", "free"] and members.active() == ["back"]
    named = Membership(client, "t", max_hosts=5, allowed=["theirs"])
    assert named.candidates(live) == ["theirs"]  # a named host is taken whoever loaded it
    for _ in range(MAX_FAILURES):
        members.failed("ours", 3, "hash_mismatch")
    assert members.members["ours"].state is HostState.DROPPED
    assert "ours" not in members.candidates(live)
    assert members.alive(["back", "nobody"])["nobody"] is None
    restored = Membership(client, "t", max_hosts=3)
    restored.restore(json.loads(json.dumps(members.to_json())))
    # After a restart nobody is active until it has shown what it holds.
    assert restored.members["back"].state is HostState.RESYNC and restored.members["back"].held_session
    assert restored.members["ours"].state is HostState.DROPPED
    assert ("back", "lost", 1, {}) in notes
