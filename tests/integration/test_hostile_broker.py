"""A hostile broker (DESIGN §11): whoever holds a Redis password — a worker's own ACL user, or
the orchestrator's — but no signing key, against real parts: a Redis 7 over TLS with the ACL
users of ``tasks.trust.acl`` and real ``roundhouse worker`` processes.

- A finished signed message stays finished when Redis forgets its nonce (deleted with the
  worker's own credentials, or lost by Redis), across a worker restart; a message neither
  replay store can record is refused.
- A message naming a task the worker does not have writes no result under the id it claims.
- A signed broadcast captured before a worker started is refused by that worker.
- A heartbeat speaks only for the host its key names.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from orchestrator.local import LocalWorker
from settings import Settings
from tasks.client import RoundClient
from tasks.names import HEARTBEAT_INDEX, heartbeat_key, nonce_key
from tasks.trust.acl import worker_rules
from tasks.trust.replay import LEDGER_NAME, ledger_dir
from tasks.trust.signing import SEP
from tests.conftest import SESSION_KEYS
from tests.support.rounds import event_seq
from tests.support.secure_redis import SecureRedis, tls_binary
from tests.support.worker import WorkerProcess

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        tls_binary() is None and os.environ.get("CI") != "true",
        reason="no redis-server with TLS (apt-get install redis-server; make test installs it)",
    ),
]

HOSTS = ("hb1", "hb2", "hb3")
UNSIGNED = {"trusted_certs": None, "signing_key": None, "signing_cert": None}
QUIET = {"ROUNDHOUSE_SANDBOX": "off"}


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory):
    server = SecureRedis(tmp_path_factory.mktemp("hostile-redis"), SESSION_KEYS, HOSTS).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(secure_redis: SecureRedis) -> RoundClient:
    return RoundClient(Settings(broker_url=secure_redis.url("orchestrator"), host_id="hb-orchestrator"))


@pytest.fixture(scope="module")
def attacker(secure_redis: SecureRedis) -> RoundClient:
    """The orchestrator's Redis credentials, no key: plain JSON."""
    return RoundClient(Settings(broker_url=secure_redis.url("orchestrator"), host_id="attacker", **UNSIGNED))


def refusals(client: RoundClient, host: str, since: int, count: int = 1) -> list[dict[str, Any]]:
    """The refusals in ``host``'s events after ``since``, once ``count`` came (or 60 s passed)."""
    deadline = time.monotonic() + 60
    while True:
        events = client.events(host, since=since, idle_timeout_s=1.0)
        found = [dict(e.data, task_id=e.task_id) for e in events if e.data.get("event") == "refused"]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def push(secure_redis: SecureRedis, host: str, raw: bytes) -> None:
    """Put a copy of a captured message in ``host``'s queue, with a delivery tag of its own."""
    message = json.loads(raw)
    message["properties"]["delivery_tag"] = str(uuid.uuid4())
    secure_redis.client("admin").lpush(f"roundhouse.{host}", json.dumps(message))


def envelope_of(raw: bytes) -> dict[str, Any]:
    message = json.loads(raw)
    signed = base64.b64decode(base64.b64decode(message["body"])).split(SEP, 4)[4]
    return dict(json.loads(signed)[1]["roundhouse_envelope"])


def restart(worker: LocalWorker) -> None:
    """Stop and start ``worker`` on the same work dir; back when the new process is ready (its
    log is appended to: the first process's "ready" line is already there)."""
    ready = worker.log().count(" ready.")
    worker.stop()
    worker.start()
    deadline = time.monotonic() + 120
    while worker.log().count(" ready.") <= ready:
        assert time.monotonic() < deadline, worker.log()[-3000:]
        time.sleep(0.2)


def set_worker_acl(secure_redis: SecureRedis, host: str, *, nonces: bool) -> None:
    """The worker's ACL as deployed, or without its nonce keys (Redis refuses every nonce write)."""
    args: list[str] = []
    for rule in worker_rules(host):
        if not nonces and rule.startswith("~roundhouse:nonce:"):
            continue
        args += [rule] if rule.startswith("(") else rule.split()
    admin = secure_redis.client("admin")
    admin.execute_command(
        "ACL", "SETUSER", f"worker-{host}", "resetkeys", "resetchannels", "clearselectors", "-@all", *args
    )


def test_a_finished_message_stays_finished_when_redis_forgets(  # type: ignore[no-untyped-def]
    secure_redis, client, tmp_path
) -> None:
    """Item 3: the worker's own ledger is the authority on what finished."""
    pending = client.reset("hb1")  # no worker yet: the signed message waits in the queue
    captured = secure_redis.client("admin").lindex("roundhouse.hb1", 0)
    assert captured is not None
    nonce = envelope_of(captured)["nonce"]
    worker_dir = tmp_path / "hb1"
    worker = WorkerProcess("hb1", secure_redis.url("worker-hb1"), worker_dir, env=QUIET).start()
    try:
        assert "wiped_bytes" in pending.get(timeout=60)
        own = secure_redis.client("worker-hb1")
        for attempt in ("deleted", "restarted"):
            since = event_seq(client, "hb1")
            # The worker's own credentials suffice to make Redis forget (as would a restart of
            # Redis that lost its last writes, or an eviction).
            own.delete(nonce_key("hb1", nonce))
            push(secure_redis, "hb1", captured)
            found = refusals(client, "hb1", since)
            assert [r["reason"] for r in found] == ["replay"], (attempt, found)
            assert worker.log().count(f"[{pending.id}] received") == 1, f"{attempt}: the reset ran again"
            if attempt == "deleted":
                restart(worker)
        # Neither store can record a message: it is refused, and runs when one can again.
        ledger = Path(ledger_dir(str(worker_dir / "work"), "hb1")) / LEDGER_NAME
        ledger.unlink()
        ledger.mkdir()  # the disk refuses the append (EISDIR; the test runs as root)
        set_worker_acl(secure_redis, "hb1", nonces=False)
        try:
            since = event_seq(client, "hb1")
            refused = client.status("hb1")
            found = refusals(client, "hb1", since)
            assert [r["reason"] for r in found] == ["replay_store"], found
            assert f"[{refused.id}] received" not in worker.log()
        finally:
            set_worker_acl(secure_redis, "hb1", nonces=True)
            shutil.rmtree(ledger)
        assert client.status("hb1").get(timeout=60)["host_id"] == "hb1"
    finally:
        worker.stop()
        secure_redis.client("admin").execute_command("ACL", "LOG", "RESET")


def test_an_unknown_task_writes_no_result_under_the_id_it_claims(  # type: ignore[no-untyped-def]
    secure_redis, client, attacker, tmp_path
) -> None:
    """Item 9: Celery's on_unknown_task wrote FAILURE under the claimed id, outside the gate."""
    worker = WorkerProcess("hb1", secure_redis.url("worker-hb1"), tmp_path / "hb1", env=QUIET).start()
    try:
        # Another host's task that has not ended (Celery would not overwrite a SUCCESS).
        victim = client.status("hb2")
        secure_redis.client("admin").delete("roundhouse.hb2")
        since = event_seq(client, "hb1")
        queue = {"queue": "roundhouse.hb1", "routing_key": "roundhouse.hb1"}
        attacker.app.send_task("roundhouse.no_such_task", kwargs={}, task_id=victim.id, **queue)
        client.app.send_task("roundhouse.no_such_task", kwargs={}, **queue)  # signed, but unknown
        found = refusals(client, "hb1", since, count=2)
        written = secure_redis.client("admin").get(f"celery-task-meta-{victim.id}")
        assert written is None, f"a result was written under another host's task id: {written!r}"
        assert sorted(r["reason"] for r in found) == ["unknown_task", "unsigned"], found
        assert client.status("hb1").get(timeout=60)["host_id"] == "hb1", "the worker stopped answering"
    finally:
        worker.stop()


def test_a_captured_broadcast_is_refused_by_a_worker_that_started_later(  # type: ignore[no-untyped-def]
    secure_redis, client, tmp_path
) -> None:
    """Item 14: a broadcast names no host; a worker takes only one issued after it started."""
    first = WorkerProcess("hb1", secure_redis.url("worker-hb1"), tmp_path / "hb1", env=QUIET).start()
    later = WorkerProcess("hb2", secure_redis.url("worker-hb2"), tmp_path / "hb2", env=QUIET)
    try:
        watch = secure_redis.client("admin").pubsub()
        watch.psubscribe("/0.celery.pidbox")
        copies: list[bytes] = []
        listener = threading.Thread(target=lambda: copies.extend(_messages(watch)), daemon=True)
        listener.start()
        time.sleep(0.3)
        assert client.app.control.ping(timeout=2), "hb1 did not answer a signed broadcast"
        listener.join(15)
        assert copies, "no control message seen"
        later.start()
        since = event_seq(client, "hb2")
        secure_redis.client("admin").publish("/0.celery.pidbox", copies[0])
        found = refusals(client, "hb2", since)
        assert [r["reason"] for r in found] == ["before_start"], found
        assert {r["kind"] for r in found} == {"control"}
        answered = client.app.control.ping(timeout=3)
        assert len(answered) == 2, f"a fresh broadcast reaches both: {answered}"
    finally:
        later.stop()
        first.stop()


def _messages(pubsub: Any) -> list[bytes]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "pmessage":
            return [message["data"]]
    return []


def test_a_heartbeat_speaks_only_for_the_host_its_key_names(secure_redis, client) -> None:  # type: ignore[no-untyped-def]
    """Item 12: one worker's credentials cannot list another host (here idle) in ``hosts()``."""
    # The beats the stopped workers of the tests above left (they live HEARTBEAT_TTL_S).
    secure_redis.client("admin").delete(*(heartbeat_key(host) for host in HOSTS))
    own = secure_redis.client("worker-hb3")
    with pytest.raises(redis.exceptions.NoPermissionError):
        own.set(heartbeat_key("hb2"), json.dumps({"host_id": "hb2", "state": "idle"}))
    own.set(heartbeat_key("hb3"), json.dumps({"host_id": "hb2", "state": "idle"}), ex=30)
    # The fleet's index of beats: a worker may add entries, for any name, and do nothing else.
    own.zadd(HEARTBEAT_INDEX, {"hb3": time.time() + 30, "hb2": time.time() + 30, "no*such host": 1e12})
    for command in (
        ("ZREM", HEARTBEAT_INDEX, "hb1"),
        ("DEL", HEARTBEAT_INDEX),
        ("ZRANGE", HEARTBEAT_INDEX, 0, -1),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            own.execute_command(*command)
    try:
        assert all(beat["host_id"] != "hb2" for beat in client.hosts()), client.hosts()
        assert all(beat["host_id"] != "hb2" for beat in client.hosts(idle_only=True))
        assert client.heartbeat("hb3") is None
        own.set(heartbeat_key("hb3"), "not json", ex=30)
        assert client.heartbeat("hb3") is None and "hb3" not in {b["host_id"] for b in client.hosts()}
        # Its entry went with its lying beats (a listing drops an entry whose key holds no beat of
        # its host); its next beat, as a worker writes one, puts it back.
        own.set(heartbeat_key("hb3"), json.dumps({"host_id": "hb3", "state": "idle"}), ex=30)
        own.zadd(HEARTBEAT_INDEX, {"hb3": time.time() + 30})
        assert "hb3" in [beat["host_id"] for beat in client.hosts(idle_only=True)]
        # The entries with no beat behind them (hb2's, the name no host spells) were listed as
        # nothing and are gone from the index: a flood of them costs one listing.
        index = set(secure_redis.client("admin").zrange(HEARTBEAT_INDEX, 0, -1))
        assert b"hb2" not in index and b"no*such host" not in index and b"hb3" in index, index
    finally:
        own.delete(heartbeat_key("hb3"))
