"""docker-compose.yml and the Dockerfile, checked without Docker: the services, how they are wired,
that every command is a real `runbus` command. Where a Docker engine answers, `docker compose
config` checks the file as well."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from runbus.cli import parse_args
from runbus.dashboard.security import check_binding
from tests.conftest import docker_answers

ROOT = Path(__file__).resolve().parents[1]
RUNBUS_SERVICES = {"ingester": "ingest", "dashboard": "serve", "trainer": "demo"}
ENV = {"RUNBUS_API_TOKEN": "test-token"}


def interpolate(value, env: dict[str, str]):
    """Compose's `${NAME}`, `${NAME:-default}`, `${NAME:?error}` and `$$`, through lists and dicts."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise AssertionError(f"${{{name}}} is required: {arg}")
        return arg or ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?|-)([^}]*))?\}", one, value).replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), ENV)


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, one entry per occurrence (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            found.setdefault(instruction.upper(), []).append(rest.strip())
    return found


def test_the_services_and_their_volumes(compose):
    services = compose["services"]
    assert set(services) == {"redis", "postgres", *RUNBUS_SERVICES}
    redis = services["redis"]
    assert redis["command"][0] == "redis-server"
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert "redis-data:/data" in redis["volumes"]
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert set(compose["volumes"]) == {"redis-data", "postgres-data"}
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_long_running_services_have_health_checks(compose):
    for name in ("redis", "postgres", "ingester", "dashboard"):
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
        if test[:3] == ["CMD", "python", "-c"]:
            compile(test[3], f"{name} healthcheck", "exec")  # the snippet is valid Python


def test_the_runbus_services_reach_redis_and_postgres_by_service_name(compose):
    services = compose["services"]
    postgres_env = services["postgres"]["environment"]
    for name in RUNBUS_SERVICES:
        env = services[name]["environment"]
        redis_url = urlsplit(env["RUNBUS_REDIS_URL"])
        assert (redis_url.scheme, redis_url.hostname, redis_url.port) == ("redis", "redis", 6379)
        store = urlsplit(env["RUNBUS_STORE"])
        assert (store.scheme, store.hostname, store.port) == ("postgresql", "postgres", 5432)
        assert store.username == postgres_env["POSTGRES_USER"]
        assert store.password == postgres_env["POSTGRES_PASSWORD"]
        assert store.path == f"/{postgres_env['POSTGRES_DB']}"
        assert "redis" in services[name]["depends_on"] or "ingester" in services[name]["depends_on"]


def test_every_command_is_a_real_runbus_command(compose, dockerfile):
    for name, command in RUNBUS_SERVICES.items():
        service = compose["services"][name]
        assert service["build"] == "." and service["image"] == "runbus:latest"
        assert "entrypoint" not in service  # the image's: runbus
        args = parse_args(service["command"])
        assert args.command == command, name
    assert json.loads(dockerfile["ENTRYPOINT"][-1]) == ["runbus"]
    assert parse_args(json.loads(dockerfile["CMD"][-1])).command == "ingest"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["runbus"] == "runbus.cli:main"


def test_ingesters_scale_and_serve_their_health_where_the_check_looks(compose, dockerfile):
    ingester = compose["services"]["ingester"]
    # --scale needs containers without a fixed name or host port.
    assert "container_name" not in ingester and "ports" not in ingester
    args = parse_args(ingester["command"])
    assert args.workers == 1 and args.http == ("0.0.0.0", 9100)
    assert "http://127.0.0.1:9100/readyz" in ingester["healthcheck"]["test"][-1]
    assert "9100" in dockerfile["EXPOSE"][-1].split()
    # SIGTERM must get to drain before Docker's SIGKILL.
    grace = int(ingester["stop_grace_period"].removesuffix("s"))
    assert grace > args.drain_timeout


def test_the_dashboard_is_guarded_and_published_on_loopback_only(compose):
    dashboard = compose["services"]["dashboard"]
    args = parse_args(dashboard["command"])
    check_binding(args.host, dashboard["environment"]["RUNBUS_API_TOKEN"])  # would refuse without it
    assert dashboard["ports"] == [f"127.0.0.1:{args.port}:{args.port}"]
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert ":?" in raw["services"]["dashboard"]["environment"]["RUNBUS_API_TOKEN"]  # no default token
    with pytest.raises(AssertionError, match=r"RUNBUS_API_TOKEN\} is required"):
        interpolate(raw, {})


def test_the_dockerfile_installs_the_package(dockerfile):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(config["tool"]["setuptools"]["package-dir"].values())
    copied = {source.rstrip("/") for args in dockerfile["COPY"] for source in args.split()[:-1]}
    assert packages | {"pyproject.toml", "README.md"} <= copied
    assert any(re.search(r"pip install \"?\.\[postgres\]", run) for run in dockerfile["RUN"])
    assert dockerfile["FROM"][0].startswith("python:3.11")
    assert dockerfile["USER"][-1] not in ("root", "0")
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv"} <= ignored
    assert not ignored & copied


def test_docker_compose_config_accepts_it():
    if not docker_answers():
        pytest.skip("no Docker engine answers here: `docker compose config` not run")
    if (
        not shutil.which("docker")
        or subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode
    ):
        pytest.skip("the docker compose plugin is not installed")
    result = subprocess.run(
        ["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
