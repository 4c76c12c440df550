"""The worker's gate (tasks/trust/gate.py), fast: the real ``Gate`` bootstep around the least of a
consumer it reads, real task messages (sent by ``RoundClient`` with the session's orchestrator
key, or by an attacker or an impostor, carried by a real Redis and read back as kombu delivers
them to a worker), handed to the task strategies the gate wraps, as Celery's consumer hands them.

What the gate admits reaches the strategy; what it refuses never does, is acknowledged and
dropped (neither in the queue nor in flight), and is reported with its reason on the host's
events stream. The whole path with real workers: tests/integration/test_control_plane.py.
"""

from __future__ import annotations

import base64
import copy
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Connection, Consumer
from kombu.message import Message

from settings import Settings, celery_config
from settings.celery import unacked_keys
from tasks.client import RoundClient
from tasks.events import Event
from tasks.names import ENVELOPE_KEY, TASK_NAMES, nonce_key, queue_name, stream_name
from tasks.trust import gate as gate_module
from tasks.trust.gate import Gate
from tasks.trust.keys import init_keys
from tasks.trust.signed_app import SignedCelery
from tasks.trust.signing import ControlEnvelope, Signer, new_nonce
from tests.conftest import SESSION_KEYS
from tests.support.forgery import payload_parts, with_signed_json
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0  # for the broker's delivery and the events thread: far beyond either on a loaded host


@dataclass
class Delivery:
    """What reached the strategy behind the gate: Celery would build a request from it."""

    message: Message
    ack: Callable[..., Any]


@dataclass
class Worker:
    """One signed worker's MainProcess, as far as its gate sees it."""

    host: str
    gate: Gate
    consumer: SimpleNamespace
    connection: Connection
    inbox: list[Message]
    orchestrator: RoundClient
    reached: list[Delivery] = field(default_factory=list)

    @property
    def queue_name(self) -> str:
        return queue_name(self.host)

    def taken(self, queue: str | None = None) -> dict[str, Any]:
        """The message just sent to ``queue`` (this worker's), taken out of it as anyone with
        the broker's credentials can."""
        raw = self.orchestrator.redis.rpop(queue or self.queue_name)
        assert isinstance(raw, bytes), "nothing was sent"
        return dict(json.loads(raw))

    def push(self, message: dict[str, Any]) -> None:
        """Put a (copied or forged) message in this worker's queue, with a delivery tag of its own."""
        message = copy.deepcopy(message)
        message["properties"]["delivery_tag"] = str(uuid.uuid4())
        self.orchestrator.redis.lpush(self.queue_name, json.dumps(message))

    def deliver_next(self) -> None:
        """What Celery's consumer does with the next message of the queue (protocol 2: the body
        is decoded later, in the pool): its task's strategy, or the unknown-task handler."""
        deadline = time.monotonic() + WAIT_S
        while not self.inbox:
            self.connection.drain_events(timeout=max(0.0, deadline - time.monotonic()))
        message = self.inbox.pop(0)
        try:
            strategy = self.consumer.strategies[message.headers["task"]]
        except KeyError as exc:
            self.consumer.on_unknown_task(None, message, exc)
            return
        strategy(message, None, message.ack_log_error, message.reject_log_error, [])

    def deliver(self, message: dict[str, Any]) -> None:
        self.push(message)
        self.deliver_next()

    def refusals(self, count: int, kind: str = "task") -> list[Event]:
        """The gate's refusals of ``kind`` on this host's events stream, once ``count`` of them
        are there (the gate's events thread publishes them)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            entries = self.orchestrator.redis.xrange(stream_name(self.host)) or []
            events = [Event.from_json(fields[b"msg"]) for _entry_id, fields in entries]  # type: ignore[index]
            found = [e for e in events if e.data.get("event") == "refused" and e.data.get("kind") == kind]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def nothing_left(self) -> bool:
        """No message in the queue, none delivered and unacknowledged (kombu's in-flight hash)."""
        redis = self.orchestrator.redis
        return redis.llen(self.queue_name) == 0 and redis.hlen(unacked_keys(self.host)["unacked_key"]) == 0


@pytest.fixture(scope="module")
def orchestrator(redis_server: RedisServer) -> RoundClient:
    """Signs with the session's orchestrator key, which the workers trust (tests/conftest.py)."""
    return RoundClient(Settings(broker_url=redis_server.url, host_id="orchestrator"))


@pytest.fixture(scope="module")
def attacker(redis_server: RedisServer) -> RoundClient:
    """On the broker, with no key: plain JSON."""
    settings = Settings(
        broker_url=redis_server.url,
        host_id="attacker",
        trusted_certs=None,
        signing_key=None,
        signing_cert=None,
    )
    return RoundClient(settings)


@pytest.fixture(scope="module")
def impostor(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> RoundClient:
    """Signs, with a key of its own that no worker trusts."""
    other, _ = init_keys(tmp_path_factory.mktemp("impostor") / "keys")
    settings = Settings(
        broker_url=redis_server.url, host_id="impostor",
        signing_key=str(other.signing_key()), signing_cert=str(other.signing_cert()),
    )  # fmt: skip
    return RoundClient(settings)


@pytest.fixture
def worker(
    redis_server: RedisServer, orchestrator: RoundClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Worker]:
    """A gated worker of a host of its own (its queue, replay records and events stream are
    this test's alone), holding the trust store only, as deployed."""
    host = f"gate-{uuid.uuid4().hex[:8]}"
    work_dir = str(tmp_path / "work")
    settings = Settings(
        broker_url=redis_server.url, host_id=host, work_dir=work_dir, signing_key=None, signing_cert=None
    )
    app = SignedCelery(host, set_as_current=False)
    app.conf.update(celery_config(settings))
    app.use_settings(settings)  # what the gate reads (Celery builds the step itself, from the app)
    monkeypatch.setattr(gate_module, "_active", None)
    connection = app.connection_for_read()  # the worker's own transport options (its in-flight keys)
    reached: list[Delivery] = []

    def strategy(message: Message, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any) -> None:
        reached.append(Delivery(message, ack))

    consumer = SimpleNamespace(
        app=app,
        connection_errors=connection.connection_errors,
        strategies=dict.fromkeys(TASK_NAMES, strategy),
        on_decode_error=None,
        on_unknown_task=None,
    )
    gate = Gate(consumer)
    gate.start(consumer)
    assert consumer.strategies[TASK_NAMES[0]] is not strategy, "the gate wrapped no strategy"
    # Raw messages, undecoded, as Celery's consumer takes them (on_message: the body is decoded
    # in the pool, after the gate).
    inbox: list[Message] = []
    receiver = Consumer(connection.channel(), [app.amqp.queues[settings.queue]], on_message=inbox.append)
    receiver.consume()
    try:
        yield Worker(host, gate, consumer, connection, inbox, orchestrator, reached)
    finally:
        receiver.cancel()
        connection.release()
        if gate.refusals._events is not None:  # its thread would retry a Redis the module stops
            gate.refusals._events.close()


def resigned(message: dict[str, Any], edit: Callable[[list[Any]], None]) -> dict[str, Any]:
    """``message`` with its body edited and signed again with the orchestrator's own key: what
    passes the signature and must still fail the envelope."""
    forged = copy.deepcopy(message)
    body = json.loads(payload_parts(forged)[4])
    edit(body)
    signer = Signer.from_files(str(SESSION_KEYS.signing_key()), str(SESSION_KEYS.signing_cert()))
    forged["body"] = base64.b64encode(signer.sign(body).encode()).decode()
    return forged


def test_a_signed_task_runs_once_per_delivery_and_never_after_it_finished(worker: Worker) -> None:
    """The broker's redelivery of an unfinished message (``acks_late``: a child was lost) is
    admitted again and counted in ``retries``; once acknowledged, a copy is a replay."""
    sent = worker.orchestrator.status(worker.host)
    message = worker.taken()
    worker.deliver(message)
    assert [d.message.headers["id"] for d in worker.reached] == [sent.id]
    assert worker.reached[0].message.headers["retries"] == 0
    worker.reached[0].message.requeue()  # what GatedRequest does when the child died
    worker.deliver_next()
    assert [d.message.headers["id"] for d in worker.reached] == [sent.id, sent.id]
    assert worker.reached[1].message.headers["retries"] == 1, "the second delivery was not counted"
    worker.reached[1].ack(gate_module.logger, worker.connection.connection_errors)  # the task finished
    nonce = json.loads(payload_parts(message)[4])[1][ENVELOPE_KEY]["nonce"]
    assert worker.orchestrator.redis.get(nonce_key(worker.host, nonce)) == b"d", "its end was not recorded"

    worker.deliver(message)  # the same signed message, put back by anyone on the broker
    assert len(worker.reached) == 2, "a finished message ran again"
    [refusal] = worker.refusals(1)
    assert (refusal.data["reason"], refusal.task_id) == ("replay", sent.id)
    assert worker.nothing_left()
    assert worker.gate.refusals.total == 1


def test_the_envelope_not_the_headers_says_when_and_how_long(worker: Worker) -> None:
    """Headers anyone on the broker can change: eta, expiry, time limits and the delivery count
    the request is built from are the signed envelope's (and the gate's count)."""
    worker.orchestrator.status(worker.host)
    message = worker.taken()
    message["headers"].update(eta="2999-01-01T00:00:00+00:00", expires="2000-01-01T00:00:00+00:00",
                              timelimit=[0.01, 0.01], ignore_result=True, retries=99)  # fmt: skip
    worker.deliver(message)
    [delivery] = worker.reached
    headers = delivery.message.headers
    assert (headers["eta"], headers["expires"], headers["ignore_result"]) == (None, None, None)
    assert (headers["timelimit"], headers["retries"]) == ([None, None], 0)


def _unsigned(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    attacker.status(worker.host)
    return worker.taken()


def _untrusted(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    impostor.status(worker.host)
    return worker.taken()


def _tampered(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    # The arguments changed, the envelope left valid: only the signature can tell.
    worker.orchestrator.reset(worker.host, tenant="alice")
    return with_signed_json(worker.taken(), lambda body: body.replace(b'"alice"', b'"mallory"'))


def _renamed(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    # A signed status, its headers naming a reset: the body would run as a reset.
    worker.orchestrator.status(worker.host)
    message = worker.taken()
    message["headers"]["task"] = "roundhouse.reset"
    return message


def _renumbered(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    worker.orchestrator.status(worker.host)
    message = worker.taken()
    message["headers"]["id"] = str(uuid.uuid4())
    return message


def _other_host(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    # Signed for another worker, taken from its queue and put in this one's.
    other = f"{worker.host}-other"
    worker.orchestrator.status(other)
    return worker.taken(queue_name(other))


def _expired(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    worker.orchestrator.status(worker.host)

    def age(body: list[Any]) -> None:
        body[1][ENVELOPE_KEY].update(iat=time.time() - 7200, exp=time.time() - 3600)

    return resigned(worker.taken(), age)


def _no_envelope(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    # Signed with the trusted key, but as plain Celery signs: nothing binds the headers.
    worker.orchestrator.status(worker.host)
    return resigned(worker.taken(), lambda body: body[1].pop(ENVELOPE_KEY))


def _unknown_task(worker: Worker, attacker: RoundClient, impostor: RoundClient) -> dict[str, Any]:
    worker.orchestrator.app.send_task(
        "roundhouse.nope", queue=worker.queue_name, routing_key=worker.queue_name
    )
    return worker.taken()


FORGERIES = {
    "unsigned": _unsigned,
    "untrusted_signer": _untrusted,
    "bad_signature": _tampered,
    "wrong_task": _renamed,
    "wrong_id": _renumbered,
    "wrong_host": _other_host,
    "expired": _expired,
    "no_envelope": _no_envelope,
    "unknown_task": _unknown_task,
}


@pytest.mark.parametrize("reason", list(FORGERIES))
def test_a_forged_task_never_reaches_the_strategy(
    reason: str, worker: Worker, attacker: RoundClient, impostor: RoundClient
) -> None:
    message = FORGERIES[reason](worker, attacker, impostor)
    worker.deliver(message)
    assert worker.reached == [], f"a message to refuse as {reason} was admitted"
    [refusal] = worker.refusals(1)
    assert refusal.data["kind"] == "task" and refusal.data["reason"] == reason, refusal.data
    # What the message claimed, for the operator to recognise it (not to be trusted).
    assert (refusal.task_id, refusal.task) == (message["headers"]["id"], message["headers"]["task"])
    assert worker.nothing_left(), "a refused message was left in the queue or in flight"


def test_a_control_command_is_obeyed_once_and_a_broadcast_only_if_issued_after_start(
    worker: Worker,
) -> None:
    """The gate's half of the control plane (kombu verified the signature before it): the
    envelope names the command, runs once, and a broadcast older than the worker is refused."""

    def signed(command: str, issued: float) -> dict[str, Any]:
        envelope = ControlEnvelope(command, issued, issued + 600, new_nonce())
        return {"task_id": "t-1", ENVELOPE_KEY: envelope.to_json()}

    revoke = signed("revoke", time.time())
    assert worker.gate.admit_control("revoke", revoke) == {"task_id": "t-1"}
    assert worker.gate.admit_control("revoke", revoke) is None  # replayed
    assert worker.gate.admit_control("shutdown", signed("revoke", time.time())) is None
    early = signed("revoke", worker.gate.started - 5)
    assert worker.gate.admit_control("revoke", early, broadcast=True) is None
    assert worker.gate.admit_control("revoke", early) == {"task_id": "t-1"}  # sent to this worker by name
    assert worker.gate.admit_control("ping", None) is None
    unsigned = SimpleNamespace(content_type="application/json")
    assert not worker.gate.admits_control_message({"method": "shutdown"}, unsigned)
    reasons = [e.data["reason"] for e in worker.refusals(5, kind="control")]
    assert reasons == ["replay", "wrong_task", "before_start", "no_envelope", "unsigned"]
