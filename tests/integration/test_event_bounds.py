"""A worker's events take bounded broker memory (DESIGN §5, §12), against real parts: a Redis 7
over TLS with the ACL users of ``tasks.trust.acl`` (the byte bound is kept with a worker's own
commands), a real ``roundhouse worker``, and a tenant that spends its full legal budget.

- a tenant emitting its whole per-round budget of stats and logs, round after round, leaves the
  stream within ``ROUNDHOUSE_EVENTS_STREAM_MAX_MB`` (before: every round's bytes, kept);
- an unsigned message whose content type is 1 MiB is refused with an event within
  ``ROUNDHOUSE_EVENTS_MAX_EVENT_BYTES`` that still says why (before: a 1 MiB event);
- after ``reset`` (the tenant boundary) a replay holds nothing of the last tenant's.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from settings import Settings
from tasks.client import RoundClient
from tasks.events import Event
from tasks.names import stream_account_keys, stream_name
from tests.conftest import SESSION_KEYS
from tests.support.engine import make_shards, mlp_state, shard_descriptors
from tests.support.http_server import FaultServer
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

HOST, ELSEWHERE = "eb1", "eb2"
STREAM_MAX_MB = 1
ROUNDS = 4
# Each round: 40 stats messages of ~60 KiB and 100 log lines of 16 KiB, past both 1 MiB budgets.
LOUD_TENANT = """
blob = "s" * 60000
for i in range(40):
    emit_stats({"round": round_num, "i": i, "blob": blob})
line = "l" * 16000
for i in range(100):
    emit_log(line)
save_report({"round": round_num})
"""


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    server = SecureRedis(tmp_path_factory.mktemp("events-redis"), SESSION_KEYS, (HOST, ELSEWHERE)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(secure_redis: SecureRedis, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    env = {
        "ROUNDHOUSE_SANDBOX": "off",
        "ROUNDHOUSE_ROUND_STATS_MAX_MB": "1",
        "ROUNDHOUSE_ROUND_LOG_MAX_MB": "1",
        "ROUNDHOUSE_EVENTS_STREAM_MAX_MB": str(STREAM_MAX_MB),
    }
    process = WorkerProcess(HOST, secure_redis.url(f"worker-{HOST}"), tmp_path_factory.mktemp(HOST), env=env)
    yield process.start()
    process.stop()


@pytest.fixture(scope="module")
def client(secure_redis: SecureRedis) -> RoundClient:
    return RoundClient(Settings(broker_url=secure_redis.url("orchestrator"), host_id="eb-orchestrator"))


def held(secure_redis: SecureRedis) -> tuple[list[bytes], int]:
    """The messages the host's stream holds, and what Redis says the stream takes in memory."""
    admin = secure_redis.client("admin")
    messages = [fields[b"msg"] for _id, fields in admin.xrange(stream_name(HOST))]
    return messages, int(admin.memory_usage(stream_name(HOST), samples=0) or 0)


def unsigned_with_content_type(secure_redis: SecureRedis, client: RoundClient, content_type: str) -> str:
    """A message as an attacker on the broker writes one: a real task message (taken from a
    queue no worker reads), its content type replaced, put in the host's queue."""
    attacker = RoundClient(
        Settings(
            broker_url=secure_redis.url("orchestrator"),
            host_id="eb-attacker",
            trusted_certs=None,
            signing_key=None,
            signing_cert=None,
        )
    )
    pending = attacker.status(ELSEWHERE)
    admin = secure_redis.client("admin")
    message: dict[str, Any] = json.loads(admin.rpop(f"roundhouse.{ELSEWHERE}"))
    message["content-type"] = content_type
    message["properties"]["delivery_tag"] = str(uuid.uuid4())
    admin.lpush(f"roundhouse.{HOST}", json.dumps(message))
    return str(pending.id)


def test_a_loud_tenant_and_a_huge_refusal_stay_within_the_bounds(worker, client, secure_redis) -> None:  # type: ignore[no-untyped-def]
    limits = Settings()
    root = Path(worker.directory) / "srv"
    root.mkdir(exist_ok=True)
    save_file(mlp_state(), str(root / "model.safetensors"))
    shards = make_shards(root)
    with FaultServer(root) as server:
        descriptors = shard_descriptors(server, shards)
        client.load_model(HOST, server.url("model.safetensors"), descriptors, LOUD_TENANT).get(timeout=120)
    for round_num in range(ROUNDS):
        since = event_seq(client, HOST)
        pending = client.run_round(HOST, steps=1, round_num=round_num)
        result = pending.get(timeout=120)
        assert result["status"] == "completed", result
        assert result["dropped"].get("stats") and result["dropped"].get("log"), f"budget not spent: {result}"
    # The child publishes behind the round: the refusal is to come after all of it.
    for event in client.events(HOST, since=since, idle_timeout_s=60):
        if event.task_id == pending.id and event.data.get("event") == "task-finished":
            break
    since = event_seq(client, HOST)
    task_id = unsigned_with_content_type(secure_redis, client, "application/x-" + "c" * (1 << 20))
    refused: list[Event] = []
    deadline = time.monotonic() + 60
    while not refused and time.monotonic() < deadline:
        events = client.events(HOST, since=since, idle_timeout_s=1.0)
        refused = [e for e in events if e.data.get("event") == "refused"]
    assert refused and refused[0].data["reason"] == "unsigned" and refused[0].task_id == task_id, refused
    # Cut where the refusal is made (its detail quotes the sender's content type), and says so.
    detail = refused[0].data["detail"]
    assert len(detail) < 1024 and detail.endswith(" characters)"), detail[:200]
    assert int(detail.rsplit("(", 1)[1].split()[0]) > 1 << 20, detail[-100:]

    messages, memory = held(secure_redis)
    budget = STREAM_MAX_MB << 20
    assert sum(map(len, messages)) <= budget, f"{sum(map(len, messages))} bytes kept of {ROUNDS} rounds"
    assert max(map(len, messages)) <= limits.events_max_event_bytes
    # Redis's own count: the messages, rounded up to the allocator's size classes (a quarter at
    # most), plus a stream node's own bytes for each entry.
    assert memory <= budget * 5 // 4 + 512 * len(messages), memory
    tail = [json.loads(message)["data"].get("event") for message in messages[-3:]]
    assert "refused" in tail, f"the newest are the ones kept: {tail}"
    admin = secure_redis.client("admin")
    for key in (stream_name(HOST), *stream_account_keys(HOST)):
        assert 0 < admin.ttl(key) <= limits.events_stream_ttl_s, key

    client.reset(HOST).get(timeout=60)
    replay = list(client.events(HOST, idle_timeout_s=1.0))
    kinds = [(e.type, e.data.get("event")) for e in replay]
    assert kinds == [("state", "task-finished")], f"the last tenant's events replayed after reset: {kinds}"
    assert not secure_redis.acl_log(), "the worker needed more than its ACL gives"
