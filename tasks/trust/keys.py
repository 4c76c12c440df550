"""``roundhouse keys init DIR``: the keys of a development control plane (DESIGN §11).

What it makes, all PEM, private keys mode 0600::

    DIR/ca.key, DIR/ca.crt                  a development CA (signs everything below)
    DIR/orchestrator.key, .crt              the orchestrator's signing pair (RSA: Celery's
                                            ``auth`` serializer signs with RSA-PSS only)
    DIR/trusted/orchestrator.crt            the trust store: what a worker's
                                            ROUNDHOUSE_TRUSTED_CERTS names (certificates, not
                                            the CA: Celery trusts exactly the certificates in it)
    DIR/redis.key, DIR/redis.crt            a TLS server certificate for Redis (localhost,
                                            127.0.0.1, ::1, ``redis`` and any --redis-host)

and one directory per role of a deployment, each holding copies of what that role needs and
nothing else (what compose mounts and ``roundhouse worker|flower --keys DIR`` reads)::

    DIR/orchestrator/                       each signer's pair, ca.crt
    DIR/worker/trusted/, DIR/worker/ca.crt  the trust store (a copy of DIR/trusted), the CA
                                            certificate (Redis TLS)
    DIR/worker/control/flower.crt           trusted for control commands only
                                            (ROUNDHOUSE_CONTROL_CERTS): never for a task
    DIR/flower/flower.key, .crt, ca.crt     Flower's own signing pair (made here only)

The CA key is in no role directory, the orchestrator's key in the orchestrator's alone.
More signers (``--signer ci``) get their own pair and a certificate in ``trusted/``.
The directory is made in one step (built beside it, then renamed), so several processes
that need keys at once — the Procfile's — end with one set: whoever loses the rename uses
the winner's. An existing complete directory is left as it is.

The CA is a development convenience: production trust stores hold the orchestrator's own
certificate, from whatever PKI the operator runs; nothing here checks a chain.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["DevKeys", "ensure_keys", "init_keys"]

KEY_BITS = 2048
CA_DAYS = 3650
LEAF_DAYS = 825  # what browsers and most TLS stacks still accept for a leaf
REDIS_HOSTS = ("localhost", "127.0.0.1", "::1", "redis")
ROLES = ("orchestrator", "worker", "flower")


@dataclass(frozen=True)
class DevKeys:
    """The paths of one key directory (whether or not the files exist yet)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def trusted(self) -> Path:
        return self.root / "trusted"

    def signing_key(self, name: str = "orchestrator") -> Path:
        return self.root / f"{name}.key"

    def signing_cert(self, name: str = "orchestrator") -> Path:
        return self.root / f"{name}.crt"

    @property
    def redis_cert(self) -> Path:
        return self.root / "redis.crt"

    @property
    def redis_key(self) -> Path:
        return self.root / "redis.key"

    def role(self, name: str) -> Path:
        """The directory of one role (``ROLES``): all that a process of that role is given."""
        return self.root / name

    @property
    def worker_trusted(self) -> Path:
        return self.root / "worker" / "trusted"

    @property
    def worker_control(self) -> Path:
        return self.root / "worker" / "control"

    @property
    def flower_key(self) -> Path:
        return self.root / "flower" / "flower.key"

    @property
    def flower_cert(self) -> Path:
        return self.root / "flower" / "flower.crt"

    def complete(self, signers: tuple[str, ...] = ("orchestrator",)) -> bool:
        paths = [self.ca_cert, self.ca_key, self.redis_cert, self.redis_key]
        for name in signers:
            paths += [self.signing_key(name), self.signing_cert(name), self.trusted / f"{name}.crt"]
            paths += [self.role("orchestrator") / f"{name}.key", self.worker_trusted / f"{name}.crt"]
        paths += [self.role(role) / "ca.crt" for role in ROLES]
        paths += [self.flower_key, self.flower_cert, self.worker_control / "flower.crt"]
        return all(path.is_file() for path in paths)


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Roundhouse development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, public: rsa.RSAPublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        # Celery names a signer by issuer + serial: random serials keep two runs apart.
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _make_ca(common_name: str) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    key = _new_key()
    name = _name(common_name)
    cert = (
        _builder(name, name, key.public_key(), CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_leaf(
    ca_key: rsa.RSAPrivateKey, ca: x509.Certificate, common_name: str, *, server_hosts: tuple[str, ...] = ()
) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    key = _new_key()
    builder = _builder(_name(common_name), ca.subject, key.public_key(), LEAF_DAYS).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True
    )
    builder = builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
    )
    if server_hosts:
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys(server_hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
    return key, builder.sign(ca_key, hashes.SHA256())


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _load_ca(keys: DevKeys) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    key = serialization.load_pem_private_key(keys.ca_key.read_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{keys.ca_key} is not an RSA key")
    return key, x509.load_pem_x509_certificate(keys.ca_cert.read_bytes())


def _fill(keys: DevKeys, signers: tuple[str, ...], redis_hosts: tuple[str, ...]) -> None:
    """Write whatever of ``keys`` is missing."""
    if keys.ca_cert.is_file() and keys.ca_key.is_file():
        ca_key, ca = _load_ca(keys)
    else:
        ca_key, ca = _make_ca(f"Roundhouse development CA {uuid.uuid4().hex[:8]}")
        _write(keys.ca_key, _key_pem(ca_key), private=True)
        _write(keys.ca_cert, _cert_pem(ca))
    for name in signers:
        if not (keys.signing_key(name).is_file() and keys.signing_cert(name).is_file()):
            key, cert = _make_leaf(ca_key, ca, name)
            _write(keys.signing_key(name), _key_pem(key), private=True)
            _write(keys.signing_cert(name), _cert_pem(cert))
        trusted = keys.trusted / f"{name}.crt"
        if not trusted.is_file():
            _write(trusted, keys.signing_cert(name).read_bytes())
    if not (keys.redis_cert.is_file() and keys.redis_key.is_file()):
        key, cert = _make_leaf(ca_key, ca, "redis", server_hosts=REDIS_HOSTS + redis_hosts)
        _write(keys.redis_key, _key_pem(key), private=True)
        _write(keys.redis_cert, _cert_pem(cert))
    _fill_roles(keys, ca_key, ca, signers)


def _fill_roles(
    keys: DevKeys, ca_key: rsa.RSAPrivateKey, ca: x509.Certificate, signers: tuple[str, ...]
) -> None:
    """Each role's directory: copies, so that a role is given its directory and no other.
    Flower's pair is its own (not the orchestrator's) and workers trust it for control
    commands only: a task it signs is refused (docs/SECURITY.md)."""
    for role in ROLES:
        _copy(keys.ca_cert, keys.role(role) / "ca.crt")
    for name in signers:
        _copy(keys.signing_key(name), keys.role("orchestrator") / f"{name}.key", private=True)
        _copy(keys.signing_cert(name), keys.role("orchestrator") / f"{name}.crt")
    for trusted in sorted(keys.trusted.glob("*.crt")):  # the whole trust store, earlier signers too
        _copy(trusted, keys.worker_trusted / trusted.name)
    if not (keys.flower_key.is_file() and keys.flower_cert.is_file()):
        key, cert = _make_leaf(ca_key, ca, "flower (control commands only)")
        _write(keys.flower_key, _key_pem(key), private=True)
        _write(keys.flower_cert, _cert_pem(cert))
    _copy(keys.flower_cert, keys.worker_control / "flower.crt")
    for role in ("orchestrator", "flower"):  # they hold private keys
        os.chmod(keys.role(role), 0o700)


def _copy(source: Path, target: Path, *, private: bool = False) -> None:
    if not target.is_file():
        _write(target, source.read_bytes(), private=private)


def init_keys(
    directory: str | os.PathLike[str],
    *,
    signers: tuple[str, ...] = ("orchestrator",),
    redis_hosts: tuple[str, ...] = (),
    force: bool = False,
) -> tuple[DevKeys, bool]:
    """Make the key directory (see the module's docstring); returns it and whether anything
    was written. ``force`` replaces an existing one."""
    keys = DevKeys(Path(directory).resolve())
    if force and keys.root.exists():
        shutil.rmtree(keys.root)
    if keys.complete(signers):
        return keys, False
    if keys.root.exists():  # the operator's own directory, or one made before the role
        # directories: add what is missing, one process at a time (two would each make a
        # Flower pair and leave one's key beside the other's certificate).
        with open(keys.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if keys.complete(signers):
                return keys, False
            _fill(keys, signers, redis_hosts)
        return keys, True
    keys.root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=keys.root.parent, prefix=f".{keys.root.name}."))
    try:
        _fill(DevKeys(staging), signers, redis_hosts)
        os.chmod(staging, 0o700)
        try:
            os.rename(staging, keys.root)
        except OSError:
            if not keys.complete(signers):  # not another process's complete set: a real error
                raise
            return keys, False
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return keys, True


def ensure_keys(directory: str | os.PathLike[str]) -> DevKeys:
    """The key directory, made first when it is missing (``ROUNDHOUSE_KEYS_DIR``)."""
    return init_keys(directory)[0]


def main(argv: list[str]) -> int:
    """``roundhouse keys init DIR [--signer NAME]… [--redis-host HOST]… [--force]``."""
    import argparse

    options = argparse.ArgumentParser(prog="roundhouse keys", description=__doc__.split("\n\n")[0])
    actions = options.add_subparsers(dest="action", required=True)
    init = actions.add_parser("init", help="make a development CA, signing key pairs and a trust store")
    init.add_argument("directory")
    init.add_argument("--signer", action="append", default=None, help="signers to make (orchestrator)")
    init.add_argument("--redis-host", action="append", default=[], help="another name of the Redis server")
    init.add_argument("--force", action="store_true", help="replace an existing directory")
    args = options.parse_args(argv)
    signers = tuple(args.signer or ("orchestrator",))
    keys, made = init_keys(
        args.directory, signers=signers, redis_hosts=tuple(args.redis_host), force=args.force
    )
    print(("made" if made else "kept") + f" development keys in {keys.root}")
    orchestrator = keys.role("orchestrator")
    print(f"  workers:       ROUNDHOUSE_TRUSTED_CERTS={keys.worker_trusted}")
    print(f"                 ROUNDHOUSE_CONTROL_CERTS={keys.worker_control}")
    print(f"                 ROUNDHOUSE_TLS_CA_FILE={keys.role('worker') / 'ca.crt'}")
    print(f"                 (or: roundhouse worker --keys {keys.root})")
    print(f"  orchestrator:  ROUNDHOUSE_SIGNING_KEY={orchestrator / f'{signers[0]}.key'}")
    print(f"                 ROUNDHOUSE_SIGNING_CERT={orchestrator / f'{signers[0]}.crt'}")
    print(f"  Flower:        roundhouse flower --keys {keys.root} (control commands only)")
    print(f"  Redis TLS:     server: {keys.redis_cert}, {keys.redis_key}")
    return 0
