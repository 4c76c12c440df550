"""Only the orchestrator commands a worker (DESIGN §11), against real parts: a Redis 7 over TLS
with the ACL users of ``tasks.trust.acl``, real ``roundhouse worker`` processes that trust only the
session's orchestrator certificate, and an attacker who holds the orchestrator's Redis
credentials (everything but its signing key).

Each refused message must leave no trace of running: no "received" line in the worker's
log, no result, no task-started event; and it must leave a trace of being refused: a
``refused`` line in the log and a ``state`` event ``{"event": "refused", "reason"}``.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import redis
from safetensors.torch import save_file

from orchestrator.collect import Deadline, Ending, Waiter
from settings import Settings
from tasks.client import RoundClient
from tasks.trust.keys import DevKeys, init_keys
from tasks.trust.signing import Signer
from tests.conftest import SESSION_KEYS
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.forgery import payload_parts, with_signed_json
from tests.support.http_server import FaultServer
from tests.support.rounds import STOP_PATHS, event_seq, stop_task, stored_result, wait_for_log
from tests.support.secure_redis import SecureRedis, tls_binary
from tests.support.worker import REPO, WorkerProcess

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        tls_binary() is None and os.environ.get("CI") != "true",
        reason="no redis-server with TLS (apt-get install redis-server; make test installs it)",
    ),
]

HOSTS = ("cp1", "cp2")
SPIN_IN_ROUND_ZERO = """
if round_num == 0:
    emit_log("round zero started")
    while True:
        pass
save_report({"round": round_num})
"""
UNSIGNED = {"trusted_certs": None, "signing_key": None, "signing_cert": None}


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory):
    server = SecureRedis(tmp_path_factory.mktemp("secure-redis"), SESSION_KEYS, HOSTS).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(secure_redis: SecureRedis, tmp_path_factory: pytest.TempPathFactory):
    process = WorkerProcess(
        "cp1",
        secure_redis.url("worker-cp1"),
        tmp_path_factory.mktemp("cp1"),
        env={"ROUNDHOUSE_SANDBOX": "off"},
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(secure_redis: SecureRedis) -> RoundClient:
    return RoundClient(Settings(broker_url=secure_redis.url("orchestrator"), host_id="cp-orchestrator"))


@pytest.fixture(scope="module")
def attacker(secure_redis: SecureRedis) -> RoundClient:
    """On the broker with the orchestrator's own Redis credentials, but no key: plain JSON."""
    return RoundClient(Settings(broker_url=secure_redis.url("orchestrator"), host_id="attacker", **UNSIGNED))


@pytest.fixture(scope="module")
def impostor(secure_redis: SecureRedis, tmp_path_factory: pytest.TempPathFactory) -> RoundClient:
    """Signs, with a key of its own that no worker trusts."""
    other, _ = init_keys(tmp_path_factory.mktemp("other") / "keys")
    settings = Settings(
        broker_url=secure_redis.url("orchestrator"), host_id="impostor",
        signing_key=str(other.signing_key()), signing_cert=str(other.signing_cert()),
    )  # fmt: skip
    return RoundClient(settings)


def node(host: str) -> str:
    """The Celery node name of a local worker (``roundhouse worker`` without --gpu)."""
    return f"{host}@{socket.gethostname()}"


def refusals(client: RoundClient, host: str, since: int) -> list[dict[str, Any]]:
    events = client.events(host, since=since, idle_timeout_s=1.5)
    return [dict(e.data, task_id=e.task_id) for e in events if e.data.get("event") == "refused"]


def never_ran(worker: WorkerProcess, client: RoundClient, task_id: str) -> bool:
    stored = client.redis.exists(f"celery-task-meta-{task_id}")
    return not stored and f"[{task_id}] received" not in worker.log()


def in_flight(secure_redis: SecureRedis, host: str, task_id: str) -> dict[str, Any]:
    """A copy of a running task's message, as anyone who can read Redis takes one: kombu keeps
    it in the host's unacked hash until the task ends."""
    admin = secure_redis.client("admin")
    key = f"roundhouse:unacked:{host}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for raw in admin.hvals(key):
            message, _exchange, _routing_key = json.loads(raw)
            if message["headers"]["id"] == task_id:
                return dict(message)
        time.sleep(0.1)
    raise AssertionError(f"{task_id} is not in flight")


def push(secure_redis: SecureRedis, host: str, message: dict[str, Any]) -> None:
    """Put a (forged) message in ``host``'s queue, with a delivery tag of its own."""
    message = json.loads(json.dumps(message))
    message["properties"]["delivery_tag"] = str(uuid.uuid4())
    secure_redis.client("admin").lpush(f"roundhouse.{host}", json.dumps(message))


@pytest.fixture(scope="module")
def loaded(worker, client, tmp_path_factory):  # type: ignore[no-untyped-def]
    """cp1 with a model whose round 0 spins until it is stopped."""
    root = tmp_path_factory.mktemp("srv")
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        descriptors = shard_descriptors(server, shards)
        code = SPIN_IN_ROUND_ZERO
        client.load_model("cp1", server.url("model.safetensors"), descriptors, code).get(timeout=60)
        yield server


def test_forged_tasks_are_refused_and_never_run(
    loaded, worker, client, attacker, impostor, secure_redis
) -> None:  # type: ignore[no-untyped-def]
    since = event_seq(client, "cp1")
    unsigned = attacker.status("cp1")
    untrusted = impostor.status("cp1")
    # A real round, copied while it runs, then stopped: it ran once.
    real = client.run_round("cp1", steps=1, round_num=0)
    wait_for_log(client, "cp1", since, "round zero started")
    message = in_flight(secure_redis, "cp1", real.id)
    client.stop(real.id, host="cp1")
    assert stored_result(real)["status"] == "stopped"
    body = json.loads(payload_parts(message)[4])
    nonce = body[1]["roundhouse_envelope"]["nonce"]
    # Replayed as it is; its signed body changed; its headers naming another task; and an old
    # message, signed with the real key but long expired.
    push(secure_redis, "cp1", message)
    flipped = ("0" if nonce[0] != "0" else "1") + nonce[1:]
    push(
        secure_redis,
        "cp1",
        with_signed_json(message, lambda signed: signed.replace(nonce.encode(), flipped.encode())),
    )
    renamed = json.loads(json.dumps(message))
    renamed["headers"]["task"] = "roundhouse.reset"
    push(secure_redis, "cp1", renamed)
    signer = Signer.from_files(str(SESSION_KEYS.signing_key()), str(SESSION_KEYS.signing_cert()))
    old = json.loads(json.dumps(body))
    old[1]["roundhouse_envelope"].update(
        iat=time.time() - 7200, exp=time.time() - 3600, nonce=uuid.uuid4().hex
    )
    expired = json.loads(json.dumps(message))
    expired["body"] = base64.b64encode(signer.sign(old).encode()).decode()
    push(secure_redis, "cp1", expired)
    # Signed for another host, taken from its queue and put in this one's.
    for_cp2 = client.status("cp2")
    other = json.loads(secure_redis.client("admin").rpop("roundhouse.cp2"))
    push(secure_redis, "cp1", other)

    deadline = time.monotonic() + 60
    while len(found := refusals(client, "cp1", since)) < 7 and time.monotonic() < deadline:
        time.sleep(0.5)
    by_reason = {r["reason"]: r for r in found}
    assert sorted(by_reason) == sorted(
        ["unsigned", "untrusted_signer", "replay", "bad_signature", "wrong_task", "expired", "wrong_host"]
    ), found
    assert (
        by_reason["unsigned"]["task_id"] == unsigned.id and by_reason["wrong_host"]["task_id"] == for_cp2.id
    )
    for pending in (unsigned, untrusted, for_cp2):
        assert never_ran(worker, client, pending.id), pending.id
    log = worker.log()
    assert log.count(f"[{real.id}] received") == 1, "a replayed or forged copy of the round ran"
    assert log.count("refused task") == 7 and "untrusted_signer" in log and "bad_signature" in log
    events = client.events("cp1", since=since, idle_timeout_s=1)
    starts = [e.task_id for e in events if e.data.get("event") == "task-started"]
    assert starts == [real.id], "a refused message reached the child"
    assert not secure_redis.acl_log(), "the worker or the client needed more than its ACL gives"


def test_an_orchestrator_whose_tasks_are_refused_hears_why_at_once(  # type: ignore[no-untyped-def]
    loaded, worker, client, attacker, impostor
) -> None:
    """A refused task has no result; the orchestrator's waiter finds the refusal in the
    host's events and ends that host's wait with the reason, long before its deadline."""
    for sender, reason in ((impostor, "untrusted_signer"), (attacker, "unsigned")):
        task = sender.run_round("cp1", steps=1, round_num=1)
        waiter = Waiter(sender, lambda hosts, sender=sender: {h: sender.heartbeat(h) for h in hosts})
        started = time.monotonic()
        outcome = waiter.wait({"cp1": task}, Deadline(deadline_s=600))["cp1"]
        waited = time.monotonic() - started
        assert outcome.ending is Ending.ERROR and f"gate: {reason}" in str(outcome.reason), outcome
        assert waited < 60, f"{waited:.1f} s: the refusal was not noticed; the deadline ended the wait"
        assert never_ran(worker, client, task.id)


def test_a_signed_stop_ends_a_round_on_every_path(loaded, worker, client, secure_redis) -> None:  # type: ignore[no-untyped-def]
    child = worker.child_pid()
    for how in STOP_PATHS:
        since = event_seq(client, "cp1")
        pending = client.run_round("cp1", steps=1, round_num=0)
        wait_for_log(client, "cp1", since, "round zero started")
        stop_task(client, how, pending.id, "cp1")
        assert stored_result(pending)["status"] == "stopped", how
        assert worker.child_pid() == child, f"{how}: the child did not survive"
    assert client.run_round("cp1", steps=1, round_num=1).get(timeout=60)["status"] == "completed"
    assert not secure_redis.acl_log()


def test_only_a_signed_control_command_is_obeyed(  # type: ignore[no-untyped-def]
    worker, client, attacker, impostor, secure_redis, tmp_path
) -> None:
    since = event_seq(client, "cp1")
    attacker.app.control.broadcast("shutdown")  # JSON: what stopped a worker before
    impostor.app.control.broadcast("shutdown")
    # A signed ping, captured off the control channel and published again.
    admin = secure_redis.client("admin")
    watch = admin.pubsub()
    watch.psubscribe("/0.celery.pidbox")
    # Redis confirms a subscription once it is in place: from then on every message published
    # on the channel waits in this connection until read, so the ping cannot be missed.
    assert _confirmed(watch, "psubscribe"), "the control channel subscription was not confirmed"
    # With a destination, ping returns at the first reply: the timeout is only a deadline.
    assert client.app.control.ping(destination=[node("cp1")], timeout=30)
    copies = _messages(watch, 1)
    assert copies, "no control message seen"
    admin.publish("/0.celery.pidbox", copies[0])
    expected = ["replay", "unsigned", "untrusted_signer"]
    deadline = time.monotonic() + 60
    while len(found := refusals(client, "cp1", since)) < len(expected) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(r["reason"] for r in found) == expected, found
    assert {r["kind"] for r in found} == {"control"}
    assert worker.process is not None and worker.process.poll() is None, "an unsigned shutdown stopped it"
    pong = client.app.control.ping(destination=[node("cp1")], timeout=30)
    assert pong, "the worker no longer answers signed commands"
    # The real thing: a signed shutdown ends a worker (exit 0).
    other = WorkerProcess(
        "cp2", secure_redis.url("worker-cp2"), tmp_path / "cp2", env={"ROUNDHOUSE_SANDBOX": "off"}
    ).start()
    client.app.control.broadcast("shutdown", destination=[node("cp2")])
    assert other.process is not None and other.process.wait(timeout=60) == 0
    assert not secure_redis.acl_log()


def _confirmed(pubsub: Any, kind: str) -> bool:
    """Whether Redis confirmed the (p)subscription within a generous deadline."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == kind:
            return True
    return False


def _messages(pubsub: Any, count: int) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(got) < count and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "pmessage":
            got.append(message["data"])
    return got


def test_a_worker_user_cannot_administer_redis_or_touch_another_worker(worker, secure_redis) -> None:  # type: ignore[no-untyped-def]
    mine = secure_redis.client("worker-cp1")
    for command in (
        ("CONFIG", "GET", "*"), ("FLUSHALL",), ("KEYS", "*"), ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"),
        ("ACL", "LIST"), ("MONITOR",), ("CLIENT", "KILL", "TYPE", "normal"), ("SCAN", "0"),
    ):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            mine.execute_command(*command)
    others = (
        ("GET", "roundhouse:stop:cp2:t"), ("LPUSH", "roundhouse.cp2", "x"), ("BRPOP", "roundhouse.cp2", "1"),
        ("HGETALL", "roundhouse:unacked:cp2"), ("SET", "roundhouse:nonce:cp2:n", "d"),
        ("SET", "roundhouse:hosts:cp2", "{}"), ("XADD", "roundhouse:events:cp2:log", "*", "msg", "x"),
        ("SADD", "_kombu.binding.roundhouse.cp2", "roundhouse.cp2\x06\x16\x06\x16mine"),
        ("SADD", "_kombu.binding.reply.celery.pidbox", "x"), ("PUBLISH", "roundhouse:control:cp2", "t"),
        ("SET", "roundhouse:stop:cp1:t", "forged"),
    )  # fmt: skip
    for command in others:
        with pytest.raises(redis.exceptions.NoPermissionError):
            mine.execute_command(*command)
    listen = mine.pubsub()
    listen.subscribe("roundhouse:control:cp2")
    with pytest.raises(redis.exceptions.NoPermissionError):
        listen.get_message(timeout=2)
    # Its own: readable.
    assert mine.get("roundhouse:stop:cp1:t") is None and mine.exists("roundhouse.cp1") in (0, 1)


def test_rediss_with_a_wrong_ca_is_refused_at_connect(secure_redis, tmp_path) -> None:  # type: ignore[no-untyped-def]
    other: DevKeys = init_keys(tmp_path / "other")[0]
    for ca in (str(other.ca_cert), None):  # another CA, or the system's store
        options = {"ssl_ca_certs": ca} if ca else {}
        plain = redis.Redis.from_url(secure_redis.url("orchestrator"), socket_connect_timeout=3, **options)
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            plain.ping()
    app = RoundClient(
        Settings(
            broker_url=secure_redis.url("orchestrator"), host_id="wrong-ca", tls_ca_file=str(other.ca_cert)
        )
    ).app
    with pytest.raises(Exception, match="certificate verify failed"), app.connection() as connection:
        connection.ensure_connection(max_retries=1)


def test_a_worker_off_loopback_refuses_to_start_unsigned(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {
        **os.environ, **{f"ROUNDHOUSE_{k.upper()}": "" for k in UNSIGNED},
        "ROUNDHOUSE_BROKER_URL": "redis://192.0.2.1:6379/0", "ROUNDHOUSE_WORK_DIR": str(tmp_path),
    }  # fmt: skip
    for argv in (
        [sys.executable, "-m", "tasks.cli", "worker"],
        [sys.executable, "-m", "celery", "-A", "tasks", "worker"],
    ):
        run = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and "ROUNDHOUSE_TRUSTED_CERTS is not set" in run.stdout + run.stderr, argv
    # Said so explicitly: it starts (and tries to reach that broker).
    started = subprocess.Popen(
        [sys.executable, "-m", "tasks.cli", "worker"], env={**env, "ROUNDHOUSE_INSECURE": "1"}, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        time.sleep(8)
        assert started.poll() is None, "ROUNDHOUSE_INSECURE=1 did not let it start"
    finally:
        os.killpg(started.pid, signal.SIGKILL)
        started.wait(timeout=30)
