"""Refused access stops instead of retrying forever: a wrong Redis or PostgreSQL password, a
Redis user without the rights, an untrusted TLS certificate. A worker logs one error line (no
password in it) and exits 1; a producer logs it once, keeps buffering, and never raises."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import redis

import runbus
from runbus.errors import AccessDenied
from runbus.ingester.localredis import LocalRedis, RedisServerNotFound, free_port
from runbus.ingester.worker import Worker, WorkerSettings
from tests.conftest import missing_server, private_redis
from tests.helpers import ingest, read_store, run_cli, wait_for, xadd_event
from tests.pgserver import LocalPostgres

PASSWORD = "right horse"


@pytest.fixture
def guarded_redis() -> Iterator[LocalRedis]:
    """A private redis-server whose default user needs PASSWORD."""
    yield from private_redis(extra_args=("--requirepass", PASSWORD))


def with_password(url: str, password: str, user: str = "") -> str:
    return url.replace("redis://", f"redis://{user}:{password.replace(' ', '%20')}@")


def wrong_passwords(admin: redis.Redis) -> int:
    """How many times this server has answered WRONGPASS."""
    return admin.info("errorstats").get("errorstat_WRONGPASS", {}).get("count", 0)


def errors_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line]


@pytest.mark.parametrize("burst", [True, False], ids=["burst", "long-running"])
def test_a_wrong_redis_password_stops_the_worker_with_one_error(guarded_redis, store_url, burst):
    url = with_password(guarded_redis.url, "wrong staple")
    result = run_cli("--store", store_url, "ingest", "--redis", url, *(["--burst"] * burst), check=False)
    assert result.returncode == 1, result.stderr
    [error] = errors_in(result.stderr)
    assert "refused the credentials" in error and "fix the user or password" in error, error
    assert f"redis://:***@127.0.0.1:{guarded_redis.port}/0" in error, error
    assert "staple" not in result.stderr


def test_no_password_for_a_redis_that_needs_one_stops_the_worker(guarded_redis, store_url):
    result = run_cli("--store", store_url, "ingest", "--redis", guarded_redis.url, "--burst", check=False)
    assert result.returncode == 1, result.stderr
    [error] = errors_in(result.stderr)
    assert "needs a password" in error and "redis://[USER]:PASSWORD@HOST:PORT/DB" in error, error


def test_a_redis_user_without_the_rights_stops_the_worker(guarded_redis, store_url):
    with redis.Redis.from_url(with_password(guarded_redis.url, PASSWORD)) as admin:
        xadd_event(admin, "acl", "rank0", "start", 1, 1, {"primary": True})
        # May read the registry and streams, but not read as a consumer group.
        admin.acl_setuser("reader", enabled=True, passwords=["+ro pass"], keys=["*"], commands=["+@read"])
    url = with_password(guarded_redis.url, "ro pass", user="reader")
    result = run_cli("--store", store_url, "ingest", "--redis", url, "--burst", check=False)
    assert result.returncode == 1, result.stderr
    [error] = errors_in(result.stderr)
    assert "does not let this user run a command" in error and "reader:***@" in error, error


def test_supervised_workers_refused_access_are_not_restarted(guarded_redis, store_url):
    url = with_password(guarded_redis.url, "wrong")
    result = run_cli("--store", store_url, "ingest", "--redis", url, "--workers", "2", check=False)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("refused the credentials") == 2, result.stderr
    assert result.stderr.count("not restarting it") == 2, result.stderr
    assert "restarting it in" not in result.stderr
    assert "supervisor stopped: 0 restarts; last exit codes [78, 78]" in result.stderr


def test_the_embedded_worker_raises_access_denied(guarded_redis, store_url):
    settings = WorkerSettings(
        redis_url=with_password(guarded_redis.url, "wrong"),
        store_url=store_url,
        burst=True,
        handle_signals=False,
    )
    with pytest.raises(AccessDenied, match="refused the credentials"):
        asyncio.run(Worker(settings).async_run())


@pytest.fixture
def tls_redis(tmp_path) -> Iterator[tuple[LocalRedis, int]]:
    """A private redis-server that also speaks TLS, with a self-signed certificate: (the server,
    its TLS port)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not available to make a certificate")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    tls_port = free_port()
    tls = (
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key,
        "--tls-auth-clients",
        "no",
    )
    try:
        server = LocalRedis(extra_args=tls).start()
    except RedisServerNotFound:
        missing_server("redis-server")
        return
    except RuntimeError as exc:  # built without TLS
        pytest.skip(f"redis-server cannot serve TLS: {exc}")
    try:
        yield server, tls_port
    finally:
        server.cleanup()


def test_an_untrusted_tls_certificate_stops_the_worker(tls_redis, store_url):
    _, tls_port = tls_redis
    url = f"rediss://:secret@127.0.0.1:{tls_port}/0"
    result = run_cli("--store", store_url, "ingest", "--redis", url, "--burst", check=False)
    assert result.returncode == 1, result.stderr
    [error] = errors_in(result.stderr)
    assert "TLS certificate is not trusted (self-signed certificate)" in error, error
    assert f"rediss://:***@127.0.0.1:{tls_port}/0" in error and "secret" not in result.stderr, error


def test_a_wrong_postgres_password_stops_the_worker(redis_url, local_postgres: LocalPostgres):
    dsn = asyncio.run(local_postgres.password_user("runbus_worker", PASSWORD))
    store = dsn.replace("runbus_worker@", "runbus_worker:wrong@")
    result = run_cli("--store", store, "ingest", "--redis", redis_url, check=False)
    assert result.returncode == 1, result.stderr
    [error] = errors_in(result.stderr)
    assert "refused access" in error and "InvalidPasswordError" in error, error
    assert "runbus_worker:***@" in error and ":wrong@" not in result.stderr, error


def test_a_producer_refused_by_redis_logs_once_buffers_and_ships_once_fixed(guarded_redis, store_url, caplog):
    caplog.set_level(logging.INFO, logger="runbus.producer")
    later = "changed later"
    url = with_password(guarded_redis.url, later)
    run = runbus.init(
        run_id="refused",
        label="rank0",
        redis_url=url,
        system_interval=None,
        hardware=False,
        console="off",
        max_backoff=0.2,
    )  # never raises into training code
    for step in range(200):
        run.log({"loss": float(step)}, step=step)
    with redis.Redis.from_url(with_password(guarded_redis.url, PASSWORD)) as admin:
        wait_for("several retries, each refused", lambda: wrong_passwords(admin) >= 3)
        refusals = [r for r in caplog.records if "refused the credentials" in r.getMessage()]
        assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR, caplog.text
        assert "buffering up to" in refusals[0].getMessage() and "changed" not in caplog.text

        # Once the server wants the password the producer has, what it buffered is shipped.
        admin.config_set("requirepass", later)
    assert run.finish(timeout=30)
    ingest(url, store_url)
    stored = read_store(store_url, "run", "refused")
    assert (stored.state, stored.counts["metric"], stored.labels[0].missing) == ("finished", 200, 0)
    assert len([r for r in caplog.records if "refused the credentials" in r.getMessage()]) == 1
