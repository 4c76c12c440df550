"""The deployment files: docker-compose.yml, the Dockerfile and the Procfile name real commands."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import command_parser

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def check_command(argv: list[str]) -> None:
    """A service command must be one this project provides, with arguments it accepts."""
    if argv[0] == "roundhouse":
        args, extra = command_parser().parse_known_args(argv[1:])  # exits on an unknown subcommand or option
        if args.command == "demo":
            from orchestrator.demo import parser as demo_parser

            demo_parser().parse_args(extra)
        elif args.command == "keys":
            assert extra[0] == "init" and len(extra) == 2, argv
        else:
            assert not extra, argv
        if args.command == "flower":
            assert importlib.util.find_spec("flower") is not None
    elif argv[:3] == ["celery", "-A", "tasks"]:
        assert argv[3] in ("worker", "flower", "inspect"), argv
        if argv[3] == "flower":
            assert importlib.util.find_spec("flower") is not None
        from tasks.app import app

        assert "roundhouse.run_round" in app.tasks
    else:
        raise AssertionError(f"unknown command {argv}")


def copied_sources(dockerfile: str) -> list[str]:
    """The sources of a Dockerfile's ``COPY`` lines, relative to its build context."""
    return [
        source
        for line in dockerfile.splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
    ]


def test_compose_has_the_stack(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"keys", "redis", "minio", "worker", "worker-cpu", "flower", "demo"}
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["worker-cpu"]["profiles"] == ["cpu"] and "deploy" not in services["worker-cpu"]
    assert services["demo"]["restart"] == "no"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name in ("worker", "worker-cpu"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    env = services["demo"]["environment"]
    assert env["ROUNDHOUSE_S3_ENDPOINT"] == "http://minio:9000"
    assert env["ROUNDHOUSE_BROKER_URL"] == "redis://redis:6379/0"


def test_every_service_command_exists(compose: dict) -> None:
    for name, service in compose["services"].items():
        if service.get("image", "").startswith(("redis:", "minio/")):
            continue
        check_command(service["command"])
        if name.startswith("worker"):
            assert "roundhouse-data:/var/lib/roundhouse" in service["volumes"]


def test_procfile_and_dockerfile_commands_exist() -> None:
    for line in (REPO / "Procfile").read_text().splitlines():
        if not line.strip():
            continue
        _name, command = line.split(":", 1)
        # The shell's ${VAR:-default}: check with the defaults.
        command = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", command)
        # A VAR=value prefix sets the command's environment; the command follows it.
        command = re.sub(r"^\s*(?:[A-Z_]+=\S*\s+)+", "", command)
        check_command(shlex.split(command))
    dockerfile = (REPO / "Dockerfile").read_text()
    for source in copied_sources(dockerfile):
        assert (REPO / source).exists(), source
    cmd = next(line for line in dockerfile.splitlines() if line.startswith("CMD "))
    check_command(yaml.safe_load(cmd[4:]))


def test_the_no_registry_override_builds_every_image_from_files_that_exist(compose: dict) -> None:
    # deploy/compose/no-registry.yml is what `make compose-test` runs (tests/compose): each
    # service it changes is one of the stack's, each build names a Dockerfile here, and every
    # file those Dockerfiles COPY is in their context.
    override = yaml.safe_load((REPO / "deploy" / "compose" / "no-registry.yml").read_text())
    assert set(override["services"]) <= set(compose["services"])
    for name, service in override["services"].items():
        build = service["build"]
        assert build["network"] == "host" and "BASE_IMAGE" in build["args"], name
        context = REPO / build["context"]
        dockerfile = (context / build.get("dockerfile", "Dockerfile")).read_text()
        assert dockerfile.startswith("#") and "FROM ${BASE_IMAGE}" in dockerfile, name
        for source in copied_sources(dockerfile):
            path = context / source
            assert path.exists(), (name, source)
            assert not source.endswith(".sh") or os.access(path, os.X_OK), (name, source)
    assert os.access(REPO / "scripts" / "docker_base.sh", os.X_OK)


# ---------------------------------------------------------------- each role's keys (issue 25, item 7)

WORKERS_AND_FLOWER = ("worker", "worker-cpu", "flower")


def with_defaults(text: str) -> str:
    """Compose's interpolation with nothing set: ``${X:-default}`` is its default, ``${X}``
    and ``${X:?error}`` are empty (the latter refuses to run)."""
    return re.sub(r"\$\{[A-Za-z_]+(?::-([^}]*)|:?\?[^}]*)?\}", lambda m: m.group(1) or "", text)


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """A service's named volumes: name -> (target, mode)."""
    found = {}
    for spec in service.get("volumes", []):
        name, target, *mode = spec.split(":")
        found[name] = (target, mode[0] if mode else "rw")
    return found


def private_keys(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and b"PRIVATE KEY" in p.read_bytes()
    )


def test_compose_gives_workers_and_flower_no_orchestrator_or_ca_key(compose: dict, tmp_path: Path) -> None:
    from tasks.trust.keys import init_keys

    services = compose["services"]
    # The keys service lays out `roundhouse keys init DIR`, one volume per role directory.
    command = services["keys"]["command"]
    assert command[:3] == ["roundhouse", "keys", "init"], command
    root = command[3]
    by_target = {target: name for name, (target, _) in mounts(services["keys"]).items()}
    everything, orchestrator = by_target[root], by_target[f"{root}/orchestrator"]
    role_volume = {role: by_target[f"{root}/{role}"] for role in ("worker", "flower")}
    for name, service in services.items():
        if name != "keys":
            assert everything not in mounts(service), f"{name} mounts the CA key's volume"
    for name in WORKERS_AND_FLOWER:
        service = services[name]
        env = {key: str(value) for key, value in service["environment"].items()}
        assert "ROUNDHOUSE_KEYS_DIR" not in env, name  # it names the orchestrator's key too
        assert not [v for v in env.values() if v.endswith(("ca.key", "orchestrator.key"))], (name, env)
        held = mounts(service)
        assert orchestrator not in held, name
        role = "flower" if name == "flower" else "worker"
        target, mode = held[role_volume[role]]
        assert mode == "ro", name
        assert not [v for k, v in held.items() if k.startswith("keys") and k != role_volume[role]], name
        if role == "worker":
            assert "ROUNDHOUSE_SIGNING_KEY" not in env, name
            assert env["ROUNDHOUSE_TRUSTED_CERTS"] == f"{target}/trusted", name
            assert env["ROUNDHOUSE_CONTROL_CERTS"] == f"{target}/control", name
            assert env["ROUNDHOUSE_TLS_CA_FILE"] == f"{target}/ca.crt", name
        else:
            assert env["ROUNDHOUSE_SIGNING_KEY"] == f"{target}/flower.key", name
    # What those volumes hold, made as the keys service makes them.
    keys, _ = init_keys(tmp_path / "keys")
    assert private_keys(keys.role("worker")) == []
    assert private_keys(keys.role("flower")) == ["flower.key"]
    flower_key = keys.flower_key.read_bytes()
    assert flower_key not in (keys.signing_key().read_bytes(), keys.ca_key.read_bytes())
    assert sorted(p.name for p in keys.worker_trusted.iterdir()) == ["orchestrator.crt"]
    assert sorted(p.name for p in keys.worker_control.iterdir()) == ["flower.crt"]


def test_compose_publishes_flower_and_minio_on_loopback_with_no_committed_secret(compose: dict) -> None:
    services = compose["services"]
    flower = services["flower"]
    assert flower["command"][:2] == ["roundhouse", "flower"], flower["command"]  # refuses without a password
    for name in ("flower", "minio"):
        for port in services[name]["ports"]:
            assert with_defaults(port).startswith("127.0.0.1:"), (name, port)
    secrets = [
        (name, key, value)
        for name, service in services.items()
        for key, value in (service.get("environment") or {}).items()
        if re.search(r"PASSWORD|SECRET|AUTH", key)
    ]
    assert {key for _, key, _ in secrets} >= {
        "FLOWER_BASIC_AUTH",
        "MINIO_ROOT_PASSWORD",
        "ROUNDHOUSE_S3_SECRET_KEY",
    }
    for name, key, value in secrets:
        assert with_defaults(str(value)) == "", f"{name}: {key} has a committed default: {value}"


def procfile() -> dict[str, str]:
    lines = (REPO / "Procfile").read_text().splitlines()
    return dict((part.strip() for part in line.split(":", 1)) for line in lines if line.strip())  # type: ignore[misc]


def test_procfile_gives_the_worker_and_flower_their_role_keys_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from settings import Settings
    from tasks.cli import role_env
    from tasks.trust.gate import startup_warnings
    from tasks.trust.keys import init_keys

    keys, _ = init_keys(tmp_path / "keys")
    for name, role in (("worker", "worker"), ("flower", "flower")):
        command = procfile()[name]
        assert not re.search(r"ROUNDHOUSE_(KEYS_DIR|SIGNING_KEY|SIGNING_CERT|TRUSTED_CERTS)=", command), (
            command
        )
        argv = shlex.split(re.sub(r"^\s*(?:[A-Z_]+=\S*\s+)+", "", with_defaults(command)))
        args, _ = command_parser().parse_known_args(argv[1:])
        assert args.command == role and args.keys == "var/keys", command
        if role == "flower":
            assert args.address == "127.0.0.1", command
        # What honcho hands the process (the whole set, as ROUNDHOUSE_KEYS_DIR), then what
        # `--keys` leaves of it.
        monkeypatch.setenv("ROUNDHOUSE_KEYS_DIR", str(keys.root))
        monkeypatch.setenv("ROUNDHOUSE_SIGNING_KEY", str(keys.signing_key()))
        for key, value in role_env(role, str(keys.root)).items():
            monkeypatch.setenv(key, value)
        settings = Settings()
        given = [settings.trusted_certs, settings.control_certs, settings.signing_key, settings.signing_cert]
        given += [settings.tls_ca_file]
        assert all(path is None or path == "" or path.startswith(str(keys.role(role))) for path in given), (
            given
        )
        if role == "worker":
            assert not settings.signing_key and settings.trusted_certs == str(keys.worker_trusted)
            assert not startup_warnings(settings)
        else:
            assert settings.signing_key == str(keys.flower_key) and not settings.trusted_certs


def test_the_signing_key_warning_fires_for_a_worker_even_with_a_keys_dir(tmp_path: Path) -> None:
    from settings import Settings
    from tasks.trust.gate import startup_warnings

    worker = Settings(keys_dir=str(tmp_path / "keys"), broker_url="redis://127.0.0.1:6379/0")
    assert worker.signing_key and worker.trusted_certs  # what ROUNDHOUSE_KEYS_DIR hands it
    assert any("holds a signing key" in warning for warning in startup_warnings(worker))


@pytest.mark.parametrize(
    ("auth", "why"),
    [
        (None, "FLOWER_BASIC_AUTH is not set"),
        ("ops:change-me", "known default"),
        ("ops:short", "shorter than 12"),
        ("ops:", "missing"),
    ],
)
def test_flower_refuses_to_start_without_a_password_of_your_own(
    tmp_path: Path, auth: str | None, why: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    if auth is not None:
        env["FLOWER_BASIC_AUTH"] = auth
    keys = tmp_path / "keys"
    run = subprocess.run(
        [sys.executable, "-m", "tasks.cli", "flower", "--keys", str(keys), "--port", "1"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "roundhouse flower: refusing to start" in run.stderr and why in run.stderr, run.stderr
    assert not keys.exists()  # refused before anything else


def test_flower_accepts_a_password_of_your_own() -> None:
    from tasks.cli import flower_problem

    assert flower_problem({"FLOWER_BASIC_AUTH": "ops:a-long-one-of-mine"}, []) is None
    assert flower_problem({"FLOWER_BASIC_AUTH": "ops:a-long-one-of-mine"}, ["--basic-auth=x:y"])
    unauthenticated = {"FLOWER_BASIC_AUTH": "ops:a-long-one-of-mine", "FLOWER_UNAUTHENTICATED_API": "true"}
    assert flower_problem(unauthenticated, [])


def test_a_worker_trusts_flowers_pair_for_control_commands_only(tmp_path: Path) -> None:
    from tasks.trust.keys import init_keys
    from tasks.trust.signing import Refused, Signer, Verifier

    keys, _ = init_keys(tmp_path / "keys")
    verifier = Verifier(str(keys.worker_trusted), str(keys.worker_control))  # a worker's, by role
    orchestrator = Signer.from_files(str(keys.signing_key()), str(keys.signing_cert()))
    flower = Signer.from_files(str(keys.flower_key), str(keys.flower_cert))
    assert verifier.control_only == [flower.signer_id] and verifier.trusted == [orchestrator.signer_id]
    assert verifier.open(orchestrator.sign([1])) == [1]
    with pytest.raises(Refused) as refused:
        verifier.open(flower.sign([1]))  # what tasks and stop requests pass through
    assert refused.value.reason == "untrusted_signer"


def test_keys_made_before_the_role_directories_get_them_once_under_a_race(tmp_path: Path) -> None:
    # A var/keys of an earlier version (no role directories) that the Procfile's three
    # processes fill at once: one Flower pair, whose key and certificate belong together.
    from tasks.trust.keys import ROLES, DevKeys, init_keys
    from tasks.trust.signing import Signer

    keys, _ = init_keys(tmp_path / "keys")
    for role in ROLES:
        shutil.rmtree(keys.role(role))
    assert not keys.complete()
    racers = [
        subprocess.Popen(
            [sys.executable, "-m", "tasks.cli", "keys", "init", str(keys.root)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        for _ in range(4)
    ]
    assert all(racer.wait(timeout=120) == 0 for racer in racers)
    keys = DevKeys(keys.root)
    assert keys.complete()
    flower = Signer.from_files(str(keys.flower_key), str(keys.flower_cert))  # a matching pair
    assert (keys.worker_control / "flower.crt").read_bytes() == keys.flower_cert.read_bytes()
    assert flower.signer_id
