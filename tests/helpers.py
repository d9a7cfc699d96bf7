"""Small helpers the tests share: ingesting in burst mode, writing raw entries, reading a store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
import redis
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient

from runbus import storage, wire
from runbus.ingester.worker import Worker, WorkerSettings

# Two lease epochs of a label as a producer takes them (docs/wire.md: milliseconds since 1970).
FIRST_LIFE, SECOND_LIFE = 1_764_190_000_000, 1_764_190_005_000


def restarted_run(run: str) -> list[wire.Event]:
    """rank0 lives twice (restarted, its second life lost seq 3); rank1 once, later than both."""
    return [
        wire.Event(run, "rank0", "start", FIRST_LIFE, 1, 100.0, {"primary": True}),
        wire.Event(run, "rank0", "metric", FIRST_LIFE, 2, 101.0, {"loss": 2.0}, 0),
        wire.Event(run, "rank0", "start", SECOND_LIFE, 1, 105.0, {"primary": True}),
        wire.Event(run, "rank0", "metric", SECOND_LIFE, 2, 106.0, {"loss": 1.5}, 1),
        wire.Event(run, "rank0", "metric", SECOND_LIFE, 4, 107.0, {"loss": 1.0}, 2),
        wire.Event(run, "rank0", "log", SECOND_LIFE, 5, 108.0, {"stream": "stdout", "text": "resumed"}),
        wire.Event(run, "rank1", "start", SECOND_LIFE + 1, 1, 105.0, {"primary": False}),
    ]


# The open_stores fixture's (tests/conftest.py): open and connect a store, closed after the test.
OpenStore = Callable[..., Awaitable[storage.Store]]


def ingest(redis_url: str, store_url: str, **settings: Any):
    """Run one burst worker in this process until nothing is left; its stats."""
    worker = Worker(
        WorkerSettings(redis_url=redis_url, store_url=store_url, burst=True, handle_signals=False, **settings)
    )
    return asyncio.run(worker.async_run())


T0 = 1_700_000_000.0  # a ts the wire accepts (2023); entries written by hand count from it
# init() options for a test Run that samples nothing, captures no console and describes no host.
QUIET = {"system_interval": None, "hardware": False, "console": "off"}


def xadd_event(
    client: redis.Redis,
    run: str,
    label: str,
    kind: str,
    epoch: int,
    seq: int,
    data: dict | None = None,
    step: int | None = None,
    ts: float | None = None,
) -> bytes:
    """Write one well-formed entry by hand, as redis-cli would (ts: T0 + seq unless given)."""
    fields = wire.encode_fields(
        kind, run, label, epoch, seq, ts if ts is not None else T0 + seq, orjson.dumps(data or {}), step
    )
    return client.xadd(wire.stream_key(run, label), fields)


def read_store(store_url: str, method: str, *args: Any, **kwargs: Any):
    """Call one read method of the store (connect, call, close)."""

    async def call():
        store = storage.open_store(store_url)
        await store.connect()
        try:
            return await getattr(store, method)(*args, **kwargs)
        finally:
            await store.close()

    return asyncio.run(call())


def store_group(store_url: str) -> str:
    """The consumer group of this store's ingesters by default (creating the store if need be)."""
    return wire.store_group(read_store(store_url, "identity"))


async def store_group_async(store_url: str) -> str:
    """store_group, inside an event loop."""
    store = storage.open_store(store_url)
    await store.connect()
    try:
        return wire.store_group(await store.identity())
    finally:
        await store.close()


def pending_count(client: redis.Redis, key: str) -> int:
    """Entries of `key` read and not acknowledged, in every consumer group."""
    return sum(group["pending"] for group in client.xinfo_groups(key))


def run_cli(*args: str, env: dict[str, str] | None = None, check: bool = True, cwd: str | None = None):
    """Run `python -m runbus ARGS` and return the CompletedProcess (text mode)."""
    result = subprocess.run(
        [sys.executable, "-m", "runbus", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        cwd=cwd,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"runbus {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def ingest_command(redis_url: str, store_url: str, *args: str) -> list[str]:
    """The argv of `runbus ingest` against this Redis and store, as its own process."""
    return [sys.executable, "-m", "runbus", "--store", store_url, "ingest", "--redis", redis_url, *args]


async def get_json(client: TestClient, path: str, status: int = 200, **params: Any) -> Any:
    """GET `path` from an aiohttp test client: its JSON body, once the status is `status`."""
    response = await client.get(path, params=params)
    body = await response.read()
    assert response.status == status, body
    assert response.content_type == "application/json"
    return orjson.loads(body)


async def assert_idle_connections_closed(port: int, path: str, count: int = 200, within: float = 30) -> None:
    """An HTTP server on 127.0.0.1:`port` with a short idle timeout closes `count` connections
    that each send part of a request and never the rest, and one left idle after a whole
    request (keep-alive), while it goes on answering GET `path` with 200."""

    async def closed(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionResetError):
            while await reader.read(65536):  # until the server closes it
                pass

    partial = [b"GET /heal", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "]
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count + 1)]
    for index, (_, writer) in enumerate(connections[:count]):
        writer.write(partial[index % len(partial)])
    reader, writer = connections[count]
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    waits = asyncio.gather(*(closed(reader) for reader, _ in connections))
    deadline = time.monotonic() + within
    try:
        async with ClientSession() as session:
            while not waits.done():
                assert time.monotonic() < deadline, "idle connections still open"
                async with session.get(f"http://127.0.0.1:{port}{path}") as response:
                    assert response.status == 200
                await asyncio.wait([waits], timeout=0.1)
        waits.result()
    finally:
        waits.cancel()
        for _, writer in connections:
            writer.close()


def unset_runbus() -> dict[str, str]:
    """os.environ without its RUNBUS_* settings, but for RUNBUS_SPOOL_DIR: the test's own spool
    directory (tests/conftest.py), never the user's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RUNBUS_") or k == "RUNBUS_SPOOL_DIR"}


def wait_for(
    what: str, check: Callable[[], Any], timeout: float = 30.0, *, running: subprocess.Popen | None = None
) -> Any:
    """Poll `check` until it returns something true (returned), failing after `timeout` seconds,
    or as soon as the process `running` (when given) has exited."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        _still_waiting(what, deadline, running)
        time.sleep(0.05)
    return result


async def wait_for_async(
    what: str,
    check: Callable[[], Any],
    timeout: float = 30.0,  # noqa: ASYNC109 (wait_for's arguments, in its order)
    *,
    running: subprocess.Popen | None = None,
) -> Any:
    """wait_for inside an event loop: `check` may also be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        _still_waiting(what, deadline, running)
        await asyncio.sleep(0.05)


def _still_waiting(what: str, deadline: float, running: subprocess.Popen | None) -> None:
    assert running is None or running.poll() is None, f"exited with {running.returncode} before {what}"
    assert time.monotonic() < deadline, f"timed out waiting for {what}"


# What undoes schema 8 (column chunks) in a store whose values are all still head rows (see
# keep_values_in_rows): for the tests of the migrations before it.
UNDO_CHUNKS = (
    # Migration 9 (storage/beats.py) first: the store as it was before chunks had neither.
    "DROP TABLE beats",
    "DROP TABLE health",
    "DROP TABLE chunks",
    "DROP INDEX IF EXISTS label_epochs_due",
    "ALTER TABLE label_epochs DROP COLUMN head",
)


async def undo_migrations(url: str, statements: Iterable[str], before: int) -> None:
    """Run `statements` in the store at `url` (SQLite or PostgreSQL), then set its schema version
    back to `before`: the store as an older runbus left it."""
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            for statement in statements:
                con.execute(statement)
            con.execute(f"PRAGMA user_version = {before}")
        finally:
            con.close()
        return
    import asyncpg  # the postgres extra's: a SQLite-only checkout runs the tests without it

    pg = await asyncpg.connect(url)
    try:
        for statement in statements:
            await pg.execute(statement)
        await pg.execute("DELETE FROM schema_version WHERE version > $1", before)
    finally:
        await pg.close()


def keep_values_in_rows(monkeypatch: Any) -> None:
    """From now on, stores keep every value as a head row (no label epoch is ever due for
    compaction into chunks): how runbus kept them before schema 8."""
    from runbus.storage import chunking

    monkeypatch.setattr(chunking, "is_due", lambda head, added, ended: False)


def stderr_on_a_terminal(command: list[str], timeout: float = 300) -> bytes:
    """What `command` writes on its stderr when that is a terminal (a pty), once it has ended;
    its stdout goes to a pipe. It must exit 0."""
    terminal, its_end = os.openpty()
    try:
        subprocess.run(command, stdout=subprocess.PIPE, stderr=its_end, timeout=timeout, check=True)
        os.close(its_end)
        drawn = b""
        while True:
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # EIO: the other end is closed and everything was read
                break
            if not chunk:
                break
            drawn += chunk
        return drawn
    finally:
        os.close(terminal)
