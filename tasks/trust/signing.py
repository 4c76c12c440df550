"""Signed commands (DESIGN §11): Celery's ``auth`` serializer, and what Roundhouse binds in it.

Only the orchestrator commands a worker. A worker trusts exactly the certificates in
``ROUNDHOUSE_TRUSTED_CERTS``; a client signs with ``ROUNDHOUSE_SIGNING_KEY`` and
``ROUNDHOUSE_SIGNING_CERT``. Signed are task messages, control commands (revoke,
shutdown, inspect …) and ``RoundClient.stop``'s Redis stop requests; results and events
stay JSON (what a worker says is not a command). The certificates in
``ROUNDHOUSE_CONTROL_CERTS`` (Flower's) are trusted for control commands only.

The wire format is Celery's own (``celery.security.serialization``, unchanged from 5.5 to
5.7: pinned in pyproject.toml, and ``tests/unit/test_signing.py`` checks it against
Celery's code). A message's content type is ``application/data`` and its body is::

    base64( base64(signer_id) SEP base64(signature) SEP content_type SEP content_encoding SEP json )

with ``SEP = b"\\x00\\x01"``, ``signature`` = RSA-PSS (MGF1-SHA-256, maximal salt) over the
JSON bytes, ``signer_id`` = the certificate's issuer and serial.

Celery signs the body only: a task's name, id, eta, expiry and time limits travel in
headers that anyone on the broker can change, and a captured message verifies forever.
So the body binds what matters. A task's kwargs carry ``roundhouse_envelope`` (removed
before the task runs)::

    {"v": 1, "task": name, "id": task_id, "queue": "roundhouse.<host_id>",
     "iat": unix_s, "exp": unix_s, "nonce": hex, "eta": iso8601|null, "expires": iso8601|null,
     "timelimit": [hard_s|null, soft_s|null], "ignore_result": bool|null}

and a control command's ``arguments`` carry ``{"v": 1, "command", "iat", "exp", "nonce"}``
(its destination is part of the signed body already; one without, a broadcast, is refused
by a worker that started after its ``iat``). A worker refuses a message whose
envelope names another task, id or queue, has expired (``exp``, at most
``ROUNDHOUSE_MESSAGE_MAX_AGE_S`` after ``iat``), or whose nonce it has seen finish
(``tasks.trust.gate``); it takes eta, expiry and time limits from the envelope, not the headers.
A stop request is a signed ``{"v": 1, "stop": task_id, "host": host_id, "iat", "exp"}``.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import glob
import hashlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from celery.exceptions import SecurityError
from celery.security.certificate import Certificate, CertStore, FSCertStore
from celery.security.key import PrivateKey
from celery.security.serialization import SecureSerializer
from celery.utils.log import get_logger
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from kombu.serialization import loads, registry
from kombu.utils.encoding import bytes_to_str, ensure_bytes

from settings import Settings
from settings.celery import AUTH_CONTENT_TYPE
from tasks.names import ENVELOPE_KEY

logger = get_logger(__name__)

DIGEST = "sha256"
SEP = b"\x00\x01"
ENVELOPE_VERSION = 1
CLOCK_SKEW_S = 60.0  # how far a signer's clock may run ahead of, or behind, the worker's
STOP_TOKEN_AGE_S = 24 * 3600.0  # a stop may be sent long before its task starts

NO_KEY = (
    "this process has no signing key, and the workers accept only signed commands: set "
    "ROUNDHOUSE_SIGNING_KEY and ROUNDHOUSE_SIGNING_CERT (`roundhouse keys init DIR` makes a "
    "development pair)"
)


class SigningError(RuntimeError):
    """The keys or certificates of the control plane are missing or unusable (configuration)."""


REFUSAL_DETAIL_MAX_CHARS = 512


class Refused(Exception):
    """A message a worker will not act on; ``reason`` is a stable code.

    ``unsigned``, ``untrusted_signer``, ``bad_signature`` (tampered, or an expired
    certificate), ``malformed``, ``no_envelope``, ``wrong_task``, ``wrong_id``,
    ``wrong_host``, ``expired``, ``not_yet_valid``, ``lifetime_too_long``,
    ``eta_after_expiry``, ``replay``, ``replay_store`` (neither replay store could record
    it), ``unknown_task``, ``before_start`` (a broadcast older than the worker).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        # The detail often quotes what the sender chose (a content type, a name): cut here, so
        # that neither the worker log nor the refusal event carries a sender's megabyte.
        if len(detail) > REFUSAL_DETAIL_MAX_CHARS:
            detail = detail[:REFUSAL_DETAIL_MAX_CHARS] + f"… ({len(detail)} characters)"
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


# ---------------------------------------------------------------- keys


class Signer:
    """One signing identity: Celery's SecureSerializer with a key and its certificate.

    Its encoder is registered with kombu under a name of its own (``auth.<digest>``), not
    Celery's process-wide ``auth``, so that one process can hold two identities (a test
    with an untrusted key beside the trusted one)."""

    def __init__(self, key_pem: str, cert_pem: str, *, password: str | None = None) -> None:
        try:
            cert = Certificate(cert_pem)
            key = PrivateKey(key_pem, password=password)
        except SecurityError as exc:
            raise SigningError(f"unusable signing key or certificate: {exc}") from None
        if cert.has_expired():
            raise SigningError(f"the signing certificate {cert.get_id()!r} has expired")
        probe = b"roundhouse key check"
        if not _signature_holds(cert, probe, key.sign(probe, _digest())):
            raise SigningError("the signing key does not belong to the signing certificate")
        self.signer_id = cert.get_id()
        self._serializer = SecureSerializer(key, cert, None, DIGEST, "json")
        self.serializer_name = "auth." + hashlib.sha256(cert_pem.encode()).hexdigest()[:16]
        registry.register(self.serializer_name, self._serializer.serialize, None, AUTH_CONTENT_TYPE, "utf-8")

    @classmethod
    def from_files(cls, key_path: str, cert_path: str) -> Signer:
        return cls(_read(key_path, "ROUNDHOUSE_SIGNING_KEY"), _read(cert_path, "ROUNDHOUSE_SIGNING_CERT"))

    def sign(self, value: Any) -> str:
        """``value`` as JSON, signed: the body of an ``application/data`` message."""
        return bytes_to_str(self._serializer.serialize(value))


class Verifier:
    """The trust store: which signers a worker obeys. ``control``: signers obeyed for control
    commands only (``ROUNDHOUSE_CONTROL_CERTS``, Flower's): :meth:`open`, which tasks and stop
    requests pass through, does not know them, so what they sign as a task is refused
    ``untrusted_signer``."""

    def __init__(self, store: str, control: str | None = None) -> None:
        self._store = _cert_store(store, "ROUNDHOUSE_TRUSTED_CERTS")
        self.trusted = sorted(cert.get_id() for cert in self._store.itercerts())
        if not self.trusted:
            raise SigningError(f"no certificate in the trust store {store}")
        self._serializer = SecureSerializer(None, None, self._store, DIGEST, "json")
        commanders = CertStore()  # the mailbox's decoder: every signer a command may come from
        for cert in self._store.itercerts():
            commanders.add_cert(cert)
        self.control_only: list[str] = []
        for cert in _cert_store(control, "ROUNDHOUSE_CONTROL_CERTS").itercerts() if control else ():
            if cert.get_id() not in self.trusted:
                commanders.add_cert(cert)
                self.control_only.append(cert.get_id())
        self._control_serializer = SecureSerializer(None, None, commanders, DIGEST, "json")

    def register(self) -> None:
        """Celery's decoder for ``application/data``, with this store and the control-only
        signers: kombu decodes control commands with it. A task is decoded with it too, but
        runs only once the gate's :meth:`open`, which knows the task signers alone, passed it
        (the prefork child takes the body the gate checked)."""
        registry.register("auth", None, self._control_serializer.deserialize, AUTH_CONTENT_TYPE, "utf-8")

    def open(self, payload: bytes | str) -> Any:
        """The JSON inside a signed payload; :class:`Refused` saying why not."""
        try:
            raw = base64.b64decode(ensure_bytes(payload), validate=False)
            signer_b64, signature_b64, content_type, encoding, body = raw.split(SEP, 4)
            signer, signature = base64.b64decode(signer_b64), base64.b64decode(signature_b64)
        except (ValueError, TypeError, binascii.Error):
            raise Refused("malformed", "not a payload of Celery's auth serializer") from None
        try:
            cert = self._store[signer]
        except SecurityError:
            raise Refused("untrusted_signer", f"signed by {bytes_to_str(signer)!r}") from None
        if cert.has_expired():
            raise Refused("bad_signature", f"the certificate of {cert.get_id()!r} has expired")
        if not _signature_holds(cert, body, signature):
            raise Refused("bad_signature", "the signature does not match the body")
        try:
            return loads(
                body, bytes_to_str(content_type), bytes_to_str(encoding), accept=["application/json"]
            )
        except Exception:
            raise Refused("malformed", "the signed body is not JSON") from None


@dataclass(frozen=True)
class Security:
    """What this process can do on the signed control plane."""

    signer: Signer | None
    verifier: Verifier | None
    max_age_s: float


def load_security(settings: Settings) -> Security | None:
    """The process's keys, from the settings (None: the unsigned control plane)."""
    if settings.keys_dir:
        from tasks.trust.keys import ensure_keys

        ensure_keys(settings.keys_dir)
    if not settings.signed:
        return None
    signer = None
    if settings.signing_key or settings.signing_cert:
        if not (settings.signing_key and settings.signing_cert):
            raise SigningError("ROUNDHOUSE_SIGNING_KEY and ROUNDHOUSE_SIGNING_CERT go together")
        signer = Signer.from_files(settings.signing_key, settings.signing_cert)
    verifier = Verifier(settings.trusted_certs, settings.control_certs) if settings.trusted_certs else None
    return Security(signer, verifier, settings.message_max_age_s)


def _cert_store(store: str, setting: str) -> FSCertStore:
    if not (os.path.isdir(store) or glob.glob(store)):
        raise SigningError(f"{setting} names nothing: {store}")
    try:
        return FSCertStore(store)
    except SecurityError as exc:
        raise SigningError(f"unusable trust store {store}: {exc}") from None


def _read(path: str, setting: str) -> str:
    try:
        with open(path, encoding="ascii") as file:
            return file.read()
    except OSError as exc:
        raise SigningError(f"{setting}: cannot read {path}: {exc.strerror}") from None


def _digest() -> hashes.HashAlgorithm:
    return hashes.SHA256()


def _signature_holds(cert: Certificate, data: bytes, signature: bytes) -> bool:
    """Celery's check, made directly: its ``Certificate.verify`` (5.7) raises TypeError, not
    SecurityError, on a bad signature (its ``reraise_errors`` catches a module)."""
    public = cert.get_pubkey()
    if not isinstance(public, rsa.RSAPublicKey):
        return False
    pad = padding.PSS(mgf=padding.MGF1(_digest()), salt_length=padding.PSS.MAX_LENGTH)
    try:
        public.verify(signature, data, pad, _digest())
    except InvalidSignature:
        return False
    return True


# ---------------------------------------------------------------- envelopes


@dataclass(frozen=True)
class TaskEnvelope:
    task: str
    id: str
    queue: str
    iat: float
    exp: float
    nonce: str
    eta: str | None = None
    expires: str | None = None
    timelimit: tuple[float | None, float | None] = (None, None)
    ignore_result: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "v": ENVELOPE_VERSION, "task": self.task, "id": self.id, "queue": self.queue,
            "iat": self.iat, "exp": self.exp, "nonce": self.nonce, "eta": self.eta,
            "expires": self.expires, "timelimit": list(self.timelimit), "ignore_result": self.ignore_result,
        }  # fmt: skip

    @classmethod
    def from_json(cls, raw: object) -> TaskEnvelope:
        body = _envelope_fields(raw)
        try:
            hard, soft = body.get("timelimit") or (None, None)
            return cls(
                task=str(body["task"]), id=str(body["id"]), queue=str(body["queue"]),
                iat=float(body["iat"]), exp=float(body["exp"]), nonce=_nonce(body["nonce"]),
                eta=_opt_str(body.get("eta")), expires=_opt_str(body.get("expires")),
                timelimit=(_opt_float(hard), _opt_float(soft)),
                ignore_result=_opt_bool(body.get("ignore_result")),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused("malformed", f"bad envelope: {exc!r}") from None


@dataclass(frozen=True)
class ControlEnvelope:
    command: str
    iat: float
    exp: float
    nonce: str

    def to_json(self) -> dict[str, Any]:
        return {
            "v": ENVELOPE_VERSION,
            "command": self.command,
            "iat": self.iat,
            "exp": self.exp,
            "nonce": self.nonce,
        }

    @classmethod
    def from_json(cls, raw: object) -> ControlEnvelope:
        body = _envelope_fields(raw)
        try:
            return cls(str(body["command"]), float(body["iat"]), float(body["exp"]), _nonce(body["nonce"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused("malformed", f"bad envelope: {exc!r}") from None


def _envelope_fields(raw: object) -> dict[str, Any]:
    if raw is None:
        raise Refused("no_envelope", f"the signed body carries no {ENVELOPE_KEY}")
    if not isinstance(raw, dict) or raw.get("v") != ENVELOPE_VERSION:
        raise Refused("malformed", f"{ENVELOPE_KEY} is not a version {ENVELOPE_VERSION} envelope")
    return raw


def _nonce(value: object) -> str:
    text = str(value)
    if not 16 <= len(text) <= 64 or not all(c in "0123456789abcdef" for c in text):
        raise ValueError("nonce must be 16-64 lowercase hex digits")
    return text


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _opt_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _opt_bool(value: object) -> bool | None:
    return None if value is None else bool(value)


def new_nonce() -> str:
    return uuid.uuid4().hex


def check_times(iat: float, exp: float, *, max_age_s: float, now: float | None = None) -> None:
    """Refuse a message issued in the future, expired, or granted more life than allowed."""
    now = time.time() if now is None else now
    if iat > now + CLOCK_SKEW_S:
        raise Refused("not_yet_valid", f"issued {iat - now:.0f} s in the future")
    if now > exp + CLOCK_SKEW_S:
        raise Refused("expired", f"expired {now - exp:.0f} s ago")
    if exp - iat > max_age_s + CLOCK_SKEW_S:
        raise Refused("lifetime_too_long", f"valid for {exp - iat:.0f} s, more than {max_age_s:.0f} s")


def replay_ttl_s(exp: float, now: float | None = None) -> int:
    """How long to remember a nonce: until the message would be refused as expired anyway."""
    now = time.time() if now is None else now
    return max(1, int(exp + CLOCK_SKEW_S - now) + 1)


def check_task(raw: object, headers: dict[str, Any], *, queue: str, max_age_s: float) -> TaskEnvelope:
    """The envelope of a task message whose signature verified, checked against its headers
    and this worker's queue."""
    envelope = TaskEnvelope.from_json(raw)
    if headers.get("task") != envelope.task:
        raise Refused("wrong_task", f"headers say {headers.get('task')!r}, the signature {envelope.task!r}")
    if headers.get("id") != envelope.id:
        raise Refused("wrong_id", f"headers say {headers.get('id')!r}, the signature {envelope.id!r}")
    if envelope.queue != queue:
        raise Refused("wrong_host", f"signed for {envelope.queue!r}, this worker is {queue!r}")
    check_times(envelope.iat, envelope.exp, max_age_s=max_age_s)
    if envelope.eta is not None and _timestamp(envelope.eta) > envelope.exp:
        raise Refused("eta_after_expiry", f"eta {envelope.eta} is after the message expires")
    return envelope


def check_control(raw: object, command: str, *, max_age_s: float) -> ControlEnvelope:
    envelope = ControlEnvelope.from_json(raw)
    if envelope.command != command:
        raise Refused("wrong_task", f"the message says {command!r}, the signature {envelope.command!r}")
    check_times(envelope.iat, envelope.exp, max_age_s=max_age_s)
    return envelope


def _timestamp(iso: str) -> float:
    try:
        moment = datetime.datetime.fromisoformat(iso)
    except ValueError:
        raise Refused("malformed", f"bad time {iso!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def stop_token(signer: Signer, host_id: str, task_id: str, now: float | None = None) -> str:
    now = time.time() if now is None else now
    return signer.sign(
        {"v": ENVELOPE_VERSION, "stop": task_id, "host": host_id, "iat": now, "exp": now + STOP_TOKEN_AGE_S}
    )


def open_stop_token(verifier: Verifier, token: bytes | str, host_id: str) -> str:
    """The task id a signed stop request names; :class:`Refused` unless it is for this host."""
    body = verifier.open(token)
    if not isinstance(body, dict) or body.get("v") != ENVELOPE_VERSION or "stop" not in body:
        raise Refused("malformed", "not a stop request")
    if body.get("host") != host_id:
        raise Refused("wrong_host", f"a stop for {body.get('host')!r}")
    check_times(float(body["iat"]), float(body["exp"]), max_age_s=STOP_TOKEN_AGE_S)
    return str(body["stop"])


SYNC_TOKEN_AGE_S = 6 * 3600.0  # a sync is sent while the round that awaits it runs


def sync_token(signer: Signer, host_id: str, order: dict[str, Any], now: float | None = None) -> str:
    """A signed sync order for an overlapped round (``tasks.overlap.SyncOrder``'s JSON)."""
    now = time.time() if now is None else now
    return signer.sign(
        {"v": ENVELOPE_VERSION, "sync": order, "host": host_id, "iat": now, "exp": now + SYNC_TOKEN_AGE_S}
    )


def open_sync_token(verifier: Verifier, token: bytes | str, host_id: str) -> Any:
    """The sync order a signed token carries; :class:`Refused` unless it is for this host."""
    body = verifier.open(token)
    if not isinstance(body, dict) or body.get("v") != ENVELOPE_VERSION or "sync" not in body:
        raise Refused("malformed", "not a sync order")
    if body.get("host") != host_id:
        raise Refused("wrong_host", f"a sync for {body.get('host')!r}")
    try:
        check_times(float(body["iat"]), float(body["exp"]), max_age_s=SYNC_TOKEN_AGE_S)
    except (KeyError, TypeError, ValueError):
        raise Refused("malformed", "a sync order without valid times") from None
    return body["sync"]
