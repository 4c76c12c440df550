"""The signed control plane's parts (tasks/trust/: signing.py, gate.py, keys.py, acl.py):
Celery's own wire format both ways, what an envelope binds, the replay store on a real Redis,
the start-up policy, the keys and the ACL file (parsed by a real redis-server where one with
selectors is installed). The whole path with real workers: tests/integration/test_control_plane.py.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery.security.certificate import Certificate, FSCertStore
from celery.security.key import PrivateKey
from celery.security.serialization import SecureSerializer

from settings import Settings, celery_config
from tasks.embedded_redis import tls_binary
from tasks.trust import replay
from tasks.trust.acl import acl_file
from tasks.trust.gate import is_loopback, startup_problem
from tasks.trust.keys import DevKeys, init_keys
from tasks.trust.replay import LEDGER_NAME, NonceLedger, ReplayStore
from tasks.trust.signing import SEP, Refused, Signer, TaskEnvelope, Verifier, check_task, check_times
from tests.conftest import SESSION_KEYS
from tests.support.redis_server import RedisServer


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer.from_files(str(SESSION_KEYS.signing_key()), str(SESSION_KEYS.signing_cert()))


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    return Verifier(str(SESSION_KEYS.trusted))


def test_the_wire_format_is_celerys_auth_serializer_both_ways(signer: Signer, verifier: Verifier) -> None:
    # What Celery signs, Roundhouse verifies; what Roundhouse signs, Celery verifies.
    key, cert = SESSION_KEYS.signing_key().read_text(), SESSION_KEYS.signing_cert().read_text()
    celery_signer = SecureSerializer(PrivateKey(key), Certificate(cert), None, "sha256", "json")
    body = [[], {"steps": 3}, {"callbacks": None}]
    assert verifier.open(celery_signer.serialize(body)) == body
    celery_verifier = SecureSerializer(None, None, FSCertStore(str(SESSION_KEYS.trusted)), "sha256", "json")
    assert celery_verifier.deserialize(signer.sign(body)) == body
    raw = base64.b64decode(signer.sign(body))
    assert raw.count(SEP) >= 4 and raw.split(SEP, 4)[2] == b"application/json"


def test_untrusted_tampered_and_malformed_payloads_are_told_apart(
    verifier: Verifier, signer: Signer, tmp_path: Path
) -> None:
    other, _ = init_keys(tmp_path / "other")
    stranger = Signer.from_files(str(other.signing_key()), str(other.signing_cert()))
    with pytest.raises(Refused) as untrusted:
        verifier.open(stranger.sign({"a": 1}))
    assert untrusted.value.reason == "untrusted_signer"
    raw = base64.b64decode(signer.sign({"a": 1}))
    with pytest.raises(Refused) as tampered:
        verifier.open(base64.b64encode(raw.replace(b'"a": 1', b'"a": 2')))
    assert tampered.value.reason == "bad_signature"
    for junk in (b"", b"not base64 !", base64.b64encode(b"no separators")):
        with pytest.raises(Refused) as malformed:
            verifier.open(junk)
        assert malformed.value.reason == "malformed"


def envelope(**changes: object) -> dict[str, object]:
    now = time.time()
    fields = {"task": "roundhouse.status", "id": "t-1", "queue": "roundhouse.h1", "iat": now,
              "exp": now + 600, "nonce": "ab" * 16}  # fmt: skip
    return {**TaskEnvelope(**fields).to_json(), **changes}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "headers", "reason"),
    [
        ({}, {"task": "roundhouse.reset", "id": "t-1"}, "wrong_task"),
        ({}, {"task": "roundhouse.status", "id": "t-2"}, "wrong_id"),
        ({"queue": "roundhouse.h2"}, None, "wrong_host"),
        ({"iat": time.time() - 7200, "exp": time.time() - 3600}, None, "expired"),
        ({"iat": time.time() + 3600, "exp": time.time() + 3700}, None, "not_yet_valid"),
        ({"exp": time.time() + 10 * 86400}, None, "lifetime_too_long"),
        ({"eta": "2999-01-01T00:00:00+00:00"}, None, "eta_after_expiry"),
        ({"nonce": "short"}, None, "malformed"),
        ({"v": 2}, None, "malformed"),
    ],
)
def test_an_envelope_binds_task_id_host_and_lifetime(
    changes: dict, headers: dict | None, reason: str
) -> None:
    headers = headers or {"task": "roundhouse.status", "id": "t-1"}
    with pytest.raises(Refused) as refused:
        check_task(envelope(**changes), headers, queue="roundhouse.h1", max_age_s=3600)
    assert refused.value.reason == reason
    with pytest.raises(Refused) as missing:
        check_task(None, headers, queue="roundhouse.h1", max_age_s=3600)
    assert missing.value.reason == "no_envelope"


def test_a_good_envelope_passes_and_clock_skew_is_tolerated() -> None:
    headers = {"task": "roundhouse.status", "id": "t-1"}
    assert check_task(envelope(), headers, queue="roundhouse.h1", max_age_s=3600).nonce == "ab" * 16
    now = time.time()
    check_times(now + 30, now + 630, max_age_s=600, now=now)  # a signer's clock 30 s ahead


N1, N2, N3, C1 = "a1" * 8, "a2" * 8, "a3" * 8, "c1" * 8


def test_the_replay_store_counts_deliveries_and_refuses_what_finished(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    ledger = str(tmp_path / "replay")
    try:
        store = ReplayStore(server.client(), "h1", NonceLedger(ledger))
        assert store.admit(N1, 60) == 1 and store.admit(N1, 60) == 2  # a redelivery
        store.done(N1, 60)
        with pytest.raises(Refused, match="replay"):
            store.admit(N1, 60)
        assert store.admit(C1, 60, once=True) == 1
        with pytest.raises(Refused, match="replay"):
            store.admit(C1, 60, once=True)
        assert 0 < server.client().ttl(f"roundhouse:nonce:h1:{N1}") <= 60
        # A new process (a restarted worker) remembers through Redis, when its disk lost the ledger ...
        with pytest.raises(Refused):
            ReplayStore(server.client(), "h1", NonceLedger(str(tmp_path / "other"))).admit(N1, 60)
        # ... and with Redis away, this process still remembers through its ledger.
        server.kill()
        with pytest.raises(Refused):
            store.admit(N1, 60)
        assert store.admit(N2, 60) == 1
    finally:
        server.kill()


def test_the_ledger_is_the_authority_and_the_gate_fails_closed(tmp_path: Path) -> None:
    """Redis's record deleted (a hostile broker, a restart that lost writes): the worker's own
    ledger still refuses a finished message, across a restart; neither store writable: refused."""
    server = RedisServer(tmp_path / "redis").start()
    directory = tmp_path / "replay"
    try:
        store = ReplayStore(server.client(), "h1", NonceLedger(str(directory)))
        store.admit(N1, 60)
        store.done(N1, 60)
        assert store.admit(N2, 60) == 1
        with open(directory / LEDGER_NAME, "ab") as torn:
            torn.write(b"a3a3a3a3a3a3a3a3 d 99")  # a crash mid-line: no newline
        server.client().delete(f"roundhouse:nonce:h1:{N1}", f"roundhouse:nonce:h1:{N2}")
        restarted = ReplayStore(server.client(), "h1", NonceLedger(str(directory)))
        with pytest.raises(Refused, match="replay"):
            restarted.admit(N1, 60)
        assert restarted.admit(N2, 60) == 2, "the delivery count survives on disk"
        assert restarted.admit(N3, 60) == 1  # the torn line was dropped, not misread
        server.client().set(f"roundhouse:nonce:h1:{C1}", "d")  # Redis can only make it stricter
        with pytest.raises(Refused, match="replay"):
            restarted.admit(C1, 60)
        # Neither store can be written: nothing is admitted.
        (directory / LEDGER_NAME).unlink()
        (directory / LEDGER_NAME).mkdir()
        server.kill()
        with pytest.raises(Refused) as refused:
            restarted.admit("b1" * 8, 60)
        assert refused.value.reason == "replay_store"
        with pytest.raises(Refused, match="replay"):
            restarted.admit(N1, 60)  # and what finished is still remembered
    finally:
        server.kill()


def test_the_ledger_forgets_expired_nonces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay, "COMPACT_MIN_LINES", 4)  # rewritten while running, not only at start
    ledger = NonceLedger(str(tmp_path / "replay"))
    for count in range(1, 20):
        ledger.put(N3, str(count), time.time() + 60)
    assert len((tmp_path / "replay" / LEDGER_NAME).read_text().splitlines()) <= 5
    assert NonceLedger(str(tmp_path / "replay")).get(N3) == "19"
    ledger.put(N1, "d", time.time() - 1)
    ledger.put(N2, "d", time.time() + 60)
    assert ledger.get(N1) is None and ledger.get(N2) == "d"
    again = NonceLedger(str(tmp_path / "replay"))
    assert len(again) == 2 and again.get(N3) == "19"
    assert N1 not in (tmp_path / "replay" / LEDGER_NAME).read_text(), "an expired record was kept"
    assert (tmp_path / "replay").stat().st_mode & 0o777 == 0o700


def test_an_unsigned_worker_starts_only_on_loopback_or_when_told() -> None:
    unsigned = {"trusted_certs": None, "signing_key": None, "signing_cert": None}
    assert is_loopback("redis://127.0.0.1:6379/0") and is_loopback("redis://localhost/0")
    assert is_loopback("redis+socket:///run/redis.sock") and not is_loopback("rediss://redis.internal:6379/0")
    assert startup_problem(Settings(broker_url="redis://127.0.0.1:6379/0", **unsigned)) is None
    problem = startup_problem(Settings(broker_url="redis://10.1.2.3:6379/0", **unsigned))
    assert problem is not None and "ROUNDHOUSE_INSECURE=1" in problem and "10.1.2.3" in problem
    assert startup_problem(Settings(broker_url="redis://10.1.2.3:6379/0", insecure=True, **unsigned)) is None
    remote_results = Settings(result_backend="redis://10.1.2.3/1", **unsigned)
    assert startup_problem(remote_results) is not None
    assert startup_problem(Settings(broker_url="rediss://10.1.2.3:6379/0")) is None  # signed (the session's)


def test_signed_celery_config_accepts_only_the_auth_content_type() -> None:
    config = celery_config(Settings(broker_url="rediss://r:6379/0", host_id="h1", tls_ca_file="/ca.crt"))
    assert config["accept_content"] == ["application/data"] and config["task_serializer"] == "auth"
    assert config["result_serializer"] == "json" and config["result_accept_content"] == ["json"]
    assert config["broker_use_ssl"]["ssl_ca_certs"] == "/ca.crt"
    assert config["broker_transport_options"]["unacked_key"] == "roundhouse:unacked:h1"
    assert config["broker_transport_options"]["priority_steps"] == [0]
    url = Settings(broker_url="rediss://r:6379/0", tls_ca_file="/ca.crt").redis_events_url
    assert url == "rediss://r:6379/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.crt"


def test_keys_init_is_idempotent_and_one_set_wins_a_race(tmp_path: Path) -> None:
    target = tmp_path / "keys"
    racers = [
        subprocess.Popen(
            [sys.executable, "-m", "tasks.cli", "keys", "init", str(target)], stdout=subprocess.PIPE
        )
        for _ in range(3)
    ]
    assert all(racer.wait(timeout=120) == 0 for racer in racers)
    keys = DevKeys(target)
    assert keys.complete() and oct(keys.signing_key().stat().st_mode)[-3:] == "600"
    before = keys.signing_cert().read_bytes()
    _, made = init_keys(target)
    assert not made and keys.signing_cert().read_bytes() == before
    assert (keys.trusted / "orchestrator.crt").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".keys.")], "a staging dir was left"
    Signer.from_files(str(keys.signing_key()), str(keys.signing_cert()))
    assert Verifier(str(keys.trusted)).trusted


def test_keys_init_makes_a_trusted_pair_for_each_signer(tmp_path: Path) -> None:
    """``--signer flower`` (docs/SECURITY.md): Flower signs with a pair of its own that the
    workers' trust store holds beside the orchestrator's; a signer left out is not trusted,
    and adding one later to the same directory keeps the existing pairs."""
    target = tmp_path / "keys"
    command = [sys.executable, "-m", "tasks.cli", "keys", "init", str(target), "--signer", "orchestrator"]
    subprocess.run([*command, "--signer", "flower"], check=True, capture_output=True, timeout=120)
    keys = DevKeys(target)
    assert keys.complete(("orchestrator", "flower"))
    verifier = Verifier(str(keys.trusted))
    signed = {}
    for name in ("orchestrator", "flower"):
        pair = Signer.from_files(str(keys.signing_key(name)), str(keys.signing_cert(name)))
        signed[name] = pair.sign({"by": name})
        assert verifier.open(signed[name]) == {"by": name}
    assert keys.signing_key("flower").read_bytes() != keys.signing_key("orchestrator").read_bytes()
    before = {name: keys.signing_cert(name).read_bytes() for name in ("orchestrator", "flower")}
    subprocess.run([*command, "--signer", "ci"], check=True, capture_output=True, timeout=120)
    assert {name: keys.signing_cert(name).read_bytes() for name in before} == before
    ci = Signer.from_files(str(keys.signing_key("ci")), str(keys.signing_cert("ci")))
    assert Verifier(str(keys.trusted)).open(ci.sign([1])) == [1]
    with pytest.raises(Refused) as untrusted:
        verifier.open(ci.sign([1]))  # the trust store as it was read before "ci" was added
    assert untrusted.value.reason == "untrusted_signer"


@pytest.mark.skipif(tls_binary() is None, reason="no Redis 7 (ACL selectors) here")
def test_the_acl_file_is_one_redis_accepts(tmp_path: Path) -> None:
    acl = tmp_path / "users.acl"
    acl.write_text(acl_file({"worker-gpu-0": "a", "orchestrator": "b", "admin": "c"}, ["gpu-0"]))
    binary = tls_binary()
    assert binary is not None
    check = subprocess.run(
        [binary, "--port", "0", "--aclfile", str(acl), "--save", "", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert "ACL errors" not in check.stdout + check.stderr, check.stdout[-2000:]
    with pytest.raises(ValueError):
        acl_file({}, ["bad host*"])


def test_the_shipped_acl_template_is_what_the_generator_makes() -> None:
    template = (Path(__file__).resolve().parents[2] / "deploy" / "redis" / "users.acl.template").read_text()
    hosts = ["gpu-host-0", "cpu-host-0"]
    expected = acl_file({f"worker-{h}": None for h in hosts} | {"orchestrator": None}, hosts)
    assert template == expected, (
        "regenerate: python -m tasks.trust.acl --template --worker gpu-host-0 --worker cpu-host-0"
    )
