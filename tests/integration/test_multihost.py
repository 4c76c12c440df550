"""Training that survives lost hosts, a cut link, a joiner and its own restart, on many hosts.

Each worker is a real ``roundhouse worker`` (``celery worker`` prefork, sandboxed when
bubblewrap works) in a network namespace of its own, with its own address on a veth pair
and a rate-limited link (``tc tbf``); Redis and the orchestrator's artifact server are on
the host side of the bridge (tests/support/netns.py). The orchestrator is ``roundhouse train
--state-dir``, run as a subprocess. Four workers train eight rounds while

- round 1: one worker's whole process tree is killed mid-round (it never comes back);
- round 2: another's link goes down mid-round, and comes back up when round 4 starts;
- round 3: a fifth worker appears;
- round 5: the orchestrator itself is killed mid-round, and resumed from its state directory.

The run completes, every live host ends bit-identical to the orchestrator's model, the loss
falls, and the story of each host (the orchestrator's events beside the workers' own) says
what happened to it. Skipped, with the reason, where network namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from orchestrator.demo import TRAIN, build_model, build_shards
from orchestrator.local import EmbeddedRedis, LocalWorker
from settings import Settings
from tasks.client import RoundClient
from tasks.events import Event
from tasks.names import stream_name
from tests.support import netns
from tests.support.worker import REPO, TEST_ENV

pytestmark = pytest.mark.timeout(900)

ROUNDS = 8
TTL_S = float(TEST_ENV["ROUNDHOUSE_HEARTBEAT_TTL_S"])
# A short pause per step, so that a round lasts long enough to be cut in the middle.
SCRIPT = "import time\n" + TRAIN.replace(
    "    should_stop()\n", "    should_stop()\n    time.sleep(params['step_sleep_s'])\n", 1
)


def sandbox_mode() -> str:
    from executor.sandbox import bwrap_works

    return "auto" if bwrap_works() else "off"  # the default sandbox where it works here


class Cluster:
    def __init__(self, base: Path, net: netns.Network) -> None:
        self.base, self.net = base, net
        self.redis = EmbeddedRedis(base / "redis", bind=net.host_address).start()
        self.client = RoundClient(Settings(broker_url=self.redis.url, host_id="mh-test"))
        self.workers: dict[str, LocalWorker] = {}
        self.namespaces: dict[str, netns.Namespace] = {}
        self.env = {**TEST_ENV, "ROUNDHOUSE_URL_ALLOW": net.cidr, "ROUNDHOUSE_SANDBOX": sandbox_mode()}

    def start_worker(self, host: str) -> LocalWorker:
        ns = self.namespaces[host] = self.net.add()
        worker = LocalWorker(
            host, self.redis.url, self.base / host, cache_dir=self.base / host / "cache", env=self.env,
            prefix=tuple(ns.argv()),
        )  # fmt: skip
        self.workers[host] = worker
        return worker.start(timeout_s=240)

    def events(self, host: str) -> list[Event]:
        return [Event.from_json(f[b"msg"]) for _id, f in self.client.redis.xrange(stream_name(host))]  # type: ignore[index]

    def round_started(self, host: str, round_num: int) -> bool:
        return any(
            e.type == "state" and e.task == "run_round" and e.round == round_num
            and e.data.get("event") == "task-started"
            for e in self.events(host)
        )  # fmt: skip

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop(timeout_s=10)
        self.redis.stop()


def wait_until(what: str, check: Any, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.1)


def inflight_round(state: Path) -> int | None:
    try:
        return int(json.loads((state / "inflight.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture
def cluster(tmp_path: Path):
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces are unavailable here: {reason}")
    with netns.Network(rate="100mbit") as net:
        cluster = Cluster(tmp_path, net)
        try:
            yield cluster
        finally:
            cluster.close()


def test_training_survives_lost_hosts_a_cut_link_a_joiner_and_its_own_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    first = ["mh0", "mh1", "mh2", "mh3"]
    threads = [threading.Thread(target=cluster.start_worker, args=(host,)) for host in first]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(cluster.workers) == first, "every worker started"
    (tmp_path / "shards").mkdir()
    build_shards(tmp_path / "shards")
    save_file(build_model(), tmp_path / "model.safetensors")
    (tmp_path / "train.py").write_text(SCRIPT)
    state, out = tmp_path / "state", tmp_path / "out"
    argv = [
        sys.executable, "-m", "orchestrator.cli", "train", "--model", str(tmp_path / "model.safetensors"),
        "--script", str(tmp_path / "train.py"), "--shards", str(tmp_path / "shards"), "--hosts", "4",
        "--rounds", str(ROUNDS), "--steps", "12", "--tenant", "mh",
        "--params", json.dumps({"lr": 0.2, "step_sleep_s": 0.15}), "--outer-lr", "0.8",
        "--outer-momentum", "0.5", "--state-dir", str(state), "--out", str(out),
        "--bind", cluster.net.host_address, "--join-wait-s", "20", "--round-deadline-s", "120",
        "--no-progress",
    ]  # fmt: skip
    # The session's environment (its signing key: tests/conftest.py), on this cluster's Redis.
    env = {**os.environ, "ROUNDHOUSE_BROKER_URL": cluster.redis.url, "ROUNDHOUSE_HOST_ID": "mh-orchestrator"}
    logs = [tmp_path / "orchestrator-1.log", tmp_path / "orchestrator-2.log"]

    def orchestrator(log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as file:
            return subprocess.Popen(argv, cwd=REPO, env=env, stdout=file, stderr=subprocess.STDOUT)

    def logs_text() -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in logs if p.exists())

    run = orchestrator(logs[0])
    try:
        # Round 1: mh1's whole process tree dies mid-round.
        wait_until("mh1 in round 1", lambda: cluster.round_started("mh1", 1))
        killed = netns.kill_tree(cluster.workers["mh1"].main_pid)
        assert len(killed) >= 2, "the MainProcess and its prefork child (and the sandbox) at least"
        # Round 2: mh2's link goes down mid-round.
        wait_until("mh2 in round 2", lambda: cluster.round_started("mh2", 2))
        cluster.net.link_down(cluster.namespaces["mh2"])
        # Round 3: a fifth worker appears (it joins once it is up, whenever that is).
        wait_until("round 3", lambda: (inflight_round(state) or 0) >= 3)
        joiner = threading.Thread(target=cluster.start_worker, args=("mh4",))
        joiner.start()
        # Round 4: mh2's link comes back (two rounds later).
        wait_until("round 4", lambda: (inflight_round(state) or 0) >= 4)
        cluster.net.link_up(cluster.namespaces["mh2"])
        # Round 5: the orchestrator is killed mid-round, and resumed from its state directory.
        wait_until("round 5", lambda: (inflight_round(state) or 0) >= 5)
        killed_at = time.time()
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        resumed_at = json.loads((state / "state.json").read_text())["round_done"] + 1
        assert resumed_at >= 5, "killed mid-round 5 (or, on a slow machine, a later one)"
        run = orchestrator(logs[1])
        assert run.wait(timeout=600) == 0, logs_text()
        joiner.join()
    finally:
        if run.poll() is None:
            run.kill()
    check_the_outcome(cluster, state, killed_at, resumed_at, logs_text())


def check_the_outcome(cluster: Cluster, state: Path, killed_at: float, resumed_at: int, logs: str) -> None:
    saved = json.loads((state / "state.json").read_text())
    story = [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines()]
    print_stories(cluster, story)
    assert saved["round_done"] == ROUNDS - 1 and [h["round_num"] for h in saved["history"]] == list(
        range(ROUNDS)
    )
    # Every live host holds the orchestrator's model, bit for bit (asked of the worker itself).
    live = ["mh0", "mh2", "mh3", "mh4"]
    held = {host: cluster.client.status(host).get(timeout=60)["model_hash"] for host in live}
    assert held == dict.fromkeys(live, saved["global_hash"]), logs
    assert sorted(saved["history"][-1]["members"]) == live
    # The loss fell.
    losses = [h["losses"] for h in saved["history"]]
    mean = [sum(x.values()) / len(x) for x in losses if x]
    assert mean[-1] < 0.5 * mean[0], mean

    def events(host: str | None, kind: str) -> list[dict[str, Any]]:
        return [e for e in story if e["host"] == host and e["event"] == kind]

    # mh1: lost in round 1 within the heartbeat TTL plus a second of its last beat; never back.
    (lost,) = events("mh1", "lost")
    assert lost["round"] == 1 and lost["detected_ts"] - lost["last_beat_ts"] <= TTL_S + 1.0, lost
    assert not events("mh1", "rejoined") and not events("mh1", "kept")
    assert all("mh1" not in h["included"] for h in saved["history"][2:])
    # mh2: lost in round 2 (its link), rejoined after the link came back, trained again.
    assert [e["round"] for e in events("mh2", "lost")][:1] == [2]
    back = [e for e in story if e["host"] == "mh2" and e["event"] in ("rejoined", "kept") and e["round"] >= 4]
    assert back, "mh2 rejoined"
    assert any("mh2" in h["included"] for h in saved["history"][back[0]["round"] :])
    # mh4: joined (loaded the global model) once it was up, and trained.
    joins = events("mh4", "joined")
    assert joins, "mh4 never joined"
    joined = joins[0]
    assert joined["round"] >= 3 and any("mh4" in h["included"] for h in saved["history"][joined["round"] :])
    # Loaded twice only when it joined in the very round the orchestrator died in: that join
    # was not checkpointed yet, so the resumed orchestrator met mh4 as a new host.
    assert len(joins) == 1 or (len(joins) == 2 and joined["round"] == resumed_at), joins
    # The restart: the dead orchestrator's round was stopped, the round run again, and the
    # hosts that held the model were not loaded again.
    assert [e["round"] for e in events(None, "resumed")] == [resumed_at]
    assert {e["host"] for e in events_named(story, "stopped-after-restart")} >= {"mh0", "mh3"}
    kept = {e["host"] for e in events_named(story, "kept") if e["round"] == resumed_at}
    assert {"mh0", "mh3"} <= kept
    for host in kept:
        loads = [
            e for e in cluster.events(host)
            if e.task == "load_model" and e.data.get("event") == "task-started" and (e.ts or 0) > killed_at
        ]  # fmt: skip
        assert not loads, f"{host} was loaded again after the restart"


def events_named(story: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in story if e["event"] == kind]


def print_stories(cluster: Cluster, story: list[dict[str, Any]]) -> None:
    """Each host's story, the orchestrator's events beside the worker's own tasks (pytest -s)."""
    for host in sorted({e["host"] for e in story if e["host"]} | set(cluster.workers)):
        print(f"--- {host}")
        told = [
            (e["ts"], f"orchestrator: round {e['round']} {e['event']} {e.get('reason', '')}{after_beat(e)}")
            for e in story if e["host"] == host
        ]  # fmt: skip
        marks = ("task-started", "task-finished")
        tasks = [
            (e.ts or 0, f"worker: {e.task} round {e.round} {e.data.get('event')} {e.data.get('outcome', '')}")
            for e in cluster.events(host) if e.type == "state" and e.data.get("event") in marks
        ]  # fmt: skip
        for _ts, line in sorted(told + tasks):
            print(f"  {line}")


def after_beat(event: dict[str, Any]) -> str:
    if event.get("detected_ts") is None or event.get("last_beat_ts") is None:
        return ""
    return f" ({event['detected_ts'] - event['last_beat_ts']:.2f} s after its last heartbeat)"
