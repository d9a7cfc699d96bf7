"""A worker's claims, transactions and burst end: a store held slow by a lock the test takes,
wide events, an unreachable server, and a Redis holding runs from before the store (`--from`)."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest
import redis

from runbus import wire
from runbus.ingester.localredis import free_port
from runbus.ingester.worker import Worker, WorkerSettings
from runbus.storage import open_store
from tests.helpers import pending_count, read_store, run_cli, wait_for_async, xadd_event

LABELS = ("rank0", "rank1", "rank2", "rank3")


async def burst(redis_url: str, store_url: str, **settings) -> Worker:
    """One burst worker in this event loop, run until it ends; the worker (its stats)."""
    worker = Worker(
        WorkerSettings(redis_url=redis_url, store_url=store_url, burst=True, handle_signals=False, **settings)
    )
    await worker.async_run()
    return worker


@asynccontextmanager
async def store_held(store_url: str) -> AsyncIterator[None]:
    """Another client holding what the worker's writes need until the block ends: SQLite's
    write lock (BEGIN IMMEDIATE), or on PostgreSQL every label row (SELECT ... FOR UPDATE)."""
    if store_url.startswith("sqlite"):
        con = sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None, timeout=30)
        con.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            con.rollback()
            con.close()
        return
    pg = await asyncpg.connect(store_url)
    try:
        transaction = pg.transaction()
        await transaction.start()
        await pg.fetch("SELECT id FROM labels FOR UPDATE")
        try:
            yield
        finally:
            await transaction.rollback()
    finally:
        await pg.close()


async def metric_count(store_url: str, run: str) -> int:
    store = open_store(store_url)
    await store.connect()
    try:
        summary = await store.run(run)
        return 0 if summary is None else summary.counts["metric"]
    finally:
        await store.close()


async def test_a_store_held_past_claim_idle_makes_no_self_claim_and_no_duplicate(redis_url, any_store_url):
    # The worker reads a batch, reads the next ahead and the one after while the first waits for
    # the store, longer than claim-idle: those it holds are its own, neither claimed nor rewritten.
    run, metrics = "held", 40
    with redis.Redis.from_url(redis_url) as client:
        for label in LABELS:
            xadd_event(client, run, label, "start", 1, 1, {"primary": label == "rank0"})
        await burst(redis_url, any_store_url)  # the store, its group and its label rows
        for label in LABELS:
            for seq in range(2, metrics + 2):
                xadd_event(client, run, label, "metric", 1, seq, {"x": float(seq)}, step=seq)
        keys = [wire.stream_key(run, label) for label in LABELS]

        def pending() -> int:
            return sum(pending_count(client, key) for key in keys)

        async with store_held(any_store_url):
            worker = asyncio.create_task(burst(redis_url, any_store_url, claim_idle=1.0, batch_size=10))
            # The first batch, the one read ahead, and the next read ahead while the store waits.
            await wait_for_async("three batches read", lambda: pending() >= 3 * 10 * len(LABELS), 60)
            await asyncio.sleep(3.5)  # the store stays held for more than three claim-idle periods
        stats = (await asyncio.wait_for(worker, timeout=120)).stats  # the burst ends
        assert stats.claimed == 0
        assert stats.duplicates == 0
        assert stats.stored == stats.entries == metrics * len(LABELS)
        assert pending() == 0
    assert await metric_count(any_store_url, run) == metrics * len(LABELS)


async def test_a_read_of_wide_events_is_written_in_transactions_of_bounded_rows(redis_url, postgres_url):
    keys, events, limit = 50, 60, 510
    with redis.Redis.from_url(redis_url) as client:
        for label in ("rank0", "rank1"):
            for seq in range(1, events + 1):
                data = {f"k{i}": float(seq + i) for i in range(keys)}
                xadd_event(client, "wide", label, "metric", 1, seq, data, step=seq)
    stats = (await burst(redis_url, postgres_url, batch_size=100, batch_rows=limit)).stats
    assert stats.stored == 2 * events and stats.batches == 1  # one read: 120 events, 6,000 values
    pg = await asyncpg.connect(postgres_url)
    try:
        # xmin: the transaction that inserted each row.
        per_transaction = [
            row["n"] for row in await pg.fetch("SELECT count(*) AS n FROM metrics GROUP BY xmin::text")
        ]
    finally:
        await pg.close()
    assert sum(per_transaction) == 2 * events * keys
    assert max(per_transaction) <= limit and len(per_transaction) >= 2 * events * (keys + 1) // limit


@pytest.mark.parametrize("away", ["store", "redis", "store-two-workers"])
def test_a_burst_gives_up_on_an_unreachable_server_with_one_line(away, redis_url, store_url):
    port = free_port()  # nothing listens there
    if away.startswith("store"):
        store_url, extra = f"postgresql://root@127.0.0.1:{port}/runbus", []
        extra = ["--workers", "2"] if away == "store-two-workers" else []
    else:
        redis_url, extra = f"redis://127.0.0.1:{port}/0", []
    started = time.monotonic()
    result = run_cli(
        "--store",
        store_url,
        "ingest",
        "--redis",
        redis_url,
        "--burst",
        "--give-up-after",
        "2",
        *extra,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 90
    assert "Traceback" not in result.stderr
    gave_up = [line for line in result.stderr.splitlines() if " gave up: " in line]
    assert gave_up and all("unreachable for" in line and "--give-up-after 2s" in line for line in gave_up)
    assert len(gave_up) == (2 if away == "store-two-workers" else 1)  # neither worker restarted
    assert str(port) in gave_up[0]


def test_from_now_skips_what_redis_holds_and_from_start_reads_it(redis_url, tmp_path):
    fresh, late = f"sqlite:///{tmp_path / 'fresh.db'}", f"sqlite:///{tmp_path / 'late.db'}"
    with redis.Redis.from_url(redis_url) as client:
        for seq in range(1, 4):
            xadd_event(client, "old", "rank0", "metric", 1, seq, {"x": 1.0}, step=seq)

        def ingest(store_url: str, *args: str) -> list[str]:
            result = run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst", *args)
            return [line for line in result.stderr.splitlines() if "worker" in line or "group" in line]

        lines = ingest(late, "--from", "now")
        starting = next(line for line in lines if " starting: " in line)
        assert "read from when the group started (--from now)" in starting
        assert any(
            re.search(r"made on 1 of 1 streams at \d+-0 \(--from now: .* of their 3 entries", x)
            for x in lines
        )
        assert read_store(late, "run", "old") is None
        # Written while no ingester runs: to the old run's stream, and a new run's.
        for seq in range(4, 6):
            xadd_event(client, "old", "rank0", "metric", 1, seq, {"x": 1.0}, step=seq)
            xadd_event(client, "new", "rank0", "metric", 1, seq, {"x": 1.0}, step=seq)
        # Restarted with the same flag: the group's start stays where its first ingest put it.
        lines = ingest(late, "--from", "now")
        assert any("made on 1 of 2 streams" in line for line in lines)
        assert read_store(late, "run", "old").counts["metric"] == 2
        assert read_store(late, "run", "new").counts["metric"] == 2

        lines = ingest(fresh)  # the default
        assert "read from its first entry (--from start)" in next(x for x in lines if " starting: " in x)
        assert any(
            "made on 2 of 2 streams, read from their first entry (--from start): 7 entries" in x
            for x in lines
        )
        assert read_store(fresh, "run", "old").counts["metric"] == 5
        assert read_store(fresh, "run", "new").counts["metric"] == 2
