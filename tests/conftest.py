"""Shared fixtures: a real Redis for every test that needs one, never a fake."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any, NoReturn

import pytest
import redis

from runbus.ingester import decoding
from runbus.ingester.localredis import LocalRedis, RedisServerNotFound
from runbus.storage import Store, open_store
from tests.helpers import OpenStore
from tests.pgserver import LocalPostgres, PostgresNotFound, create_database, drop_database


def _as_a_terminal_delivers_them() -> None:
    """Ctrl-C and hang-ups at their usual dispositions in this process, so its children inherit
    them so: tests send SIGINT and SIGHUP to processes they start, or have them send one to
    themselves, and expect what a terminal's would do. A suite started in the background
    (`nohup`, or `&` from a shell without job control) inherits both ignored, and an ignored
    signal stays ignored across exec."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


_as_a_terminal_delivers_them()

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_server(what: str) -> None:
    """Fail under CI=true (nothing skips silently there), else skip with the reason."""
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but none could be started", pytrace=False)
    pytest.skip(f"{what} is not available")


def missing_package(what: str) -> NoReturn:
    """In a test module's `except ImportError`, for a package of the dev extra: under CI=true its
    absence fails (nothing skips silently there), else the module is skipped."""
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true (the dev extra) but is not installed", pytrace=False)
    pytest.skip(f"{what} is not installed", allow_module_level=True)


@pytest.fixture(autouse=True)
def private_spool_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> str:
    """Producers' default spool directory (RUNBUS_SPOOL_DIR) is the test's own, for it and the
    processes it starts: never the user's cache, never another test's."""
    directory = str(tmp_path_factory.mktemp("spool"))
    monkeypatch.setenv("RUNBUS_SPOOL_DIR", directory)
    return directory


@pytest.fixture(params=sorted(decoding.DECODERS))
def decoder(request: pytest.FixtureRequest) -> Iterator[decoding.Decoder]:
    """The ingester decoding with each of its paths in turn (runbus.ingester.decoding: the fast
    one and runbus.wire's reference): its decode_stream, also what an in-process Worker uses."""
    before = decoding.decoder_in_use
    decoding.use(request.param)
    try:
        yield decoding.decode_stream
    finally:
        decoding.use(before)


def docker_answers() -> bool:
    """Whether a Docker engine answers, so testcontainers can run a server."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://") and not os.path.exists(host[len("unix://") :]):
        return False
    import docker  # type: ignore[import-untyped]

    try:
        client = docker.from_env(timeout=3)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """RUNBUS_TEST_REDIS_URL; else a testcontainers Redis; else a throwaway redis-server."""
    url = os.environ.get("RUNBUS_TEST_REDIS_URL")
    if url:
        yield url
        return
    if docker_answers():
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7") as container:
            host = container.get_container_host_ip()
            yield f"redis://{host}:{container.get_exposed_port(6379)}/0"
        return
    try:
        server = LocalRedis().start()
    except RedisServerNotFound:
        missing_server("a Redis server")
        return
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.fixture
def redis_url(redis_server_url: str) -> Iterator[str]:
    """The test Redis, emptied before each test."""
    client = redis.Redis.from_url(redis_server_url)
    client.flushdb()
    client.close()
    yield redis_server_url


def private_redis(**options: Any) -> Iterator[LocalRedis]:
    """The body of a fixture giving a private redis-server (LocalRedis `options`), removed after
    the test; a missing redis-server fails under CI=true, else skips."""
    try:
        server = LocalRedis(**options).start()
    except RedisServerNotFound:
        missing_server("redis-server")
        return
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def local_redis() -> Iterator[LocalRedis]:
    """A private redis-server this test may kill and restart (AOF on, fsync on every write, so
    a SIGKILL loses nothing it acknowledged)."""
    yield from private_redis(appendonly=True, appendfsync="always")


@pytest.fixture
def store_url(tmp_path) -> str:
    """A fresh SQLite store in the test's temp dir."""
    return f"sqlite:///{tmp_path / 'runbus.db'}"


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """RUNBUS_TEST_POSTGRES_DSN; else a testcontainers PostgreSQL; else a throwaway cluster."""
    dsn = os.environ.get("RUNBUS_TEST_POSTGRES_DSN")
    if dsn:
        yield dsn
        return
    if docker_answers():
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers before the community split
            from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as container:
            yield container.get_connection_url()
        return
    server = LocalPostgres()
    try:
        server.start()
    except PostgresNotFound:
        server.cleanup()
        missing_server("PostgreSQL")
        return
    except BaseException:
        server.cleanup()
        raise
    try:
        yield server.dsn
    finally:
        server.cleanup()


@pytest.fixture
def local_postgres() -> Iterator[LocalPostgres]:
    """A private PostgreSQL cluster (trust auth) this test may stop or reconfigure."""
    server = LocalPostgres()
    try:
        server.start()
    except PostgresNotFound:
        server.cleanup()
        missing_server("PostgreSQL (initdb and pg_ctl)")
        return
    except BaseException:
        server.cleanup()
        raise
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def postgres_url(postgres_dsn: str) -> Iterator[str]:
    """A fresh, empty database for this test alone, dropped after it."""
    url = asyncio.run(create_database(postgres_dsn))
    try:
        yield url
    finally:
        asyncio.run(drop_database(postgres_dsn, url))


@pytest.fixture(params=["sqlite", "postgres"])
def any_store_url(request: pytest.FixtureRequest, store_url: str) -> str:
    """A fresh, empty store of each backend in turn."""
    if request.param == "sqlite":
        return store_url
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def open_stores(any_store_url: str) -> AsyncIterator[OpenStore]:
    """Open and connect a store (on the test's URL unless told), closed after the test."""
    opened: list[Store] = []

    async def open_(url: str = any_store_url) -> Store:
        store = open_store(url)
        opened.append(store)
        await store.connect()
        return store

    yield open_
    for store in opened:
        await store.close()


@pytest.fixture
async def store(open_stores: OpenStore) -> Store:
    """A fresh store of each backend in turn, connected."""
    return await open_stores()
