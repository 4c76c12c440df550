"""The deployment files: docker-compose.yml, the Dockerfile and the Procfile name real commands."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tasks.cli import _parser

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def check_command(argv: list[str]) -> None:
    """A service command must be one this project provides, with arguments it accepts."""
    if argv[0] == "roundhouse":
        args, extra = _parser().parse_known_args(argv[1:])  # exits on an unknown subcommand or option
        if args.command == "demo":
            from orchestrator.demo import parser as demo_parser

            demo_parser().parse_args(extra)
        else:
            assert not extra, argv
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
    assert set(services) == {"redis", "minio", "worker", "worker-cpu", "flower", "demo"}
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
