"""A Redis that stops taking events (paused clients, a restart, maxmemory reached) never holds up
log() and costs no event while the producer's buffers have room; an ingester trims acknowledged
entries when Redis nears its maxmemory, whatever --retain says."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import redis

import runbus
from runbus import wire
from runbus.ingester import maintenance
from runbus.ingester.localredis import LocalRedis
from runbus.ingester.worker import Worker, WorkerSettings
from tests.conftest import private_redis
from tests.helpers import QUIET, ingest, read_store, store_group, wait_for, xadd_event

# One rank's tight loop of log() calls until a stop file appears; then its finish, and what it
# measured: the calls, the longest one, what was dropped.
TIGHT_LOOP = textwrap.dedent(
    """
    import json, os, sys, time, runbus
    stop_file, options = sys.argv[1], json.loads(sys.argv[2])
    run = runbus.init(system_interval=None, hardware=False, console="off", quiet=True, **options)
    print("ready", flush=True)
    longest, step, clock = 0.0, 0, time.perf_counter
    while not os.path.exists(stop_file):
        for _ in range(1000):
            began = clock()
            run.log({"loss": 0.5}, step=step)
            longest = max(longest, clock() - began)
            step += 1
    finished = run.finish(timeout=300)
    print(json.dumps({"calls": step, "longest": longest, "dropped": run.dropped, "finished": finished}))
    """
)
# Far longer than log() ever waits for room on a loaded machine, far shorter than the outages.
LONGEST_LOG = 1.0


@pytest.fixture
def lone_redis() -> Iterator[LocalRedis]:
    """A private redis-server (no persistence) this test may pause."""
    yield from private_redis()


def start_tight_loop(redis_url: str, run_id: str, stop_file: str, **options) -> subprocess.Popen:
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url, "RUNBUS_RUN_ID": run_id}
    proc = subprocess.Popen(
        [sys.executable, "-c", TIGHT_LOOP, stop_file, json.dumps({"max_backoff": 0.2, **options})],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def results(proc: subprocess.Popen, stop_file: str) -> dict:
    open(stop_file, "w").close()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    return json.loads(out)


def shipped_in_order(client: redis.Redis, key: str) -> tuple[int, int]:
    """Read the stream: every seq from 1 up, in order (a batch sent again after a lost reply
    repeats seqs already there, which is allowed: the store keeps one); (last seq, metrics)."""
    last, metrics, start = 0, 0, "-"
    while True:
        entries = client.xrange(key, min=start, count=20_000)
        for _, fields in entries:
            seq = int(fields[b"seq"])
            assert seq <= last + 1, f"seq {seq} after {last}: a gap, or out of order"
            if seq == last + 1:
                last = seq
                metrics += fields[b"kind"] == b"metric"
        if len(entries) < 20_000:
            return last, metrics
        start = "(" + entries[-1][0].decode()


def assert_all_shipped(
    proc: subprocess.Popen, stop_file: str, client: redis.Redis, key: str, what: str
) -> None:
    """Stop the loop: no log() took LONGEST_LOG or more, nothing was dropped, and its stream
    holds every event in order, its finish last."""
    outcome = results(proc, stop_file)
    assert outcome["longest"] < LONGEST_LOG, outcome
    assert outcome["dropped"] == 0 and outcome["finished"] is True
    last, metrics = shipped_in_order(client, key)
    assert metrics == outcome["calls"]
    final = client.xrevrange(key, count=1)[0][1]
    assert (final[b"kind"], int(final[b"seq"])) == (b"finish", last)
    print(f"\nFIGURE {what}: events {metrics}, dropped 0, longest log() {outcome['longest'] * 1e3:.1f} ms")


def test_log_does_not_wait_while_redis_pauses_its_clients(lone_redis, tmp_path):
    # A failover pauses clients: log() must not wait for Redis, and nothing may be lost while
    # the buffers (memory, then the spool) have room.
    stop_file, key = str(tmp_path / "stop"), wire.stream_key("paused", "rank0")
    proc = start_tight_loop(lone_redis.url, "paused", stop_file, spool_dir=str(tmp_path / "spool"))
    client = redis.Redis.from_url(lone_redis.url)
    try:
        wait_for("the loop's first batches", lambda: client.xlen(key) > 2000)
        client.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        paused_at = time.monotonic()
        before = client.xlen(key)  # answered once the pause is over
        wait_for("shipping after the pause", lambda: client.xlen(key) > before + 10_000)
        assert time.monotonic() - paused_at >= 2.5  # the loop did log through the pause
        assert_all_shipped(proc, stop_file, client, key, "CLIENT PAUSE 3 s")
    finally:
        proc.kill()
        client.close()


def test_log_neither_waits_nor_drops_while_redis_restarts(local_redis, tmp_path):
    # Killed and restarted on the same port (AOF, fsync always: nothing acknowledged is lost).
    # A tight loop with a small queue: the queue drains into the byte buffer, never drops.
    stop_file, key = str(tmp_path / "stop"), wire.stream_key("restarted", "rank0")
    proc = start_tight_loop(
        local_redis.url, "restarted", stop_file, spool_dir=str(tmp_path / "spool"), max_buffer_events=100
    )
    client = redis.Redis.from_url(local_redis.url)
    try:
        wait_for("the loop's first batches", lambda: client.xlen(key) > 2000)
        local_redis.kill()
        time.sleep(1.5)  # the outage: the loop logs on meanwhile
        local_redis.start()
        before = client.xlen(key)
        wait_for("shipping after the restart", lambda: client.xlen(key) > before + 10_000, timeout=120)
        assert_all_shipped(proc, stop_file, client, key, "Redis killed for 1.5 s")
    finally:
        proc.kill()
        client.close()


@pytest.fixture
def full_redis() -> Iterator[LocalRedis]:
    """A private redis-server of 4 MB that refuses writes past it (-OOM), as maxmemory does."""
    yield from private_redis(extra_args=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))


def oom_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]


def test_redis_at_maxmemory_holds_events_until_an_ingester_trims(full_redis, store_url, caplog):
    caplog.set_level(logging.WARNING)
    events = 60_000  # about 10 MB in the stream: more than Redis may hold
    run = runbus.init(
        run_id="full",
        label="rank0",
        redis_url=full_redis.url,
        max_backoff=0.2,
        max_buffer_events=1000,
        finish_timeout=120,
        **QUIET,
    )
    client = redis.Redis.from_url(full_redis.url)
    key = wire.stream_key("full", "rank0")
    wait_for("the start event", lambda: client.xlen(key) > 0)
    ingest(full_redis.url, store_url)  # the store's group reads the stream from now on
    for step in range(events):
        run.log({"loss": 0.5}, step=step)
    wait_for("Redis to refuse with -OOM", lambda: oom_warnings(caplog))
    assert run.dropped == 0 and run.buffered > 0

    async def ingest_while_finishing() -> tuple[bool, int]:
        # --retain 3600: only Redis's memory makes the worker trim what it acknowledged.
        worker = Worker(
            WorkerSettings(
                redis_url=full_redis.url,
                store_url=store_url,
                retain=3600,
                memory_interval=0.2,
                handle_signals=False,
            )
        )
        task = asyncio.create_task(worker.async_run())
        finished = await asyncio.to_thread(run.finish)
        worker.request_stop()
        await task
        return finished, worker.stats.trimmed

    finished, trimmed = asyncio.run(ingest_while_finishing())
    assert (finished, run.dropped) == (True, 0)
    assert trimmed > 0 and client.xlen(key) < events
    assert len(oom_warnings(caplog)) == 1  # once, not per event or per try
    client.close()
    ingest(full_redis.url, store_url)
    stored = read_store(store_url, "run", "full")
    assert (stored.state, stored.labels[0].missing, stored.counts["metric"]) == ("finished", 0, events)


def test_memory_pressure_trims_acknowledged_entries_whatever_their_age(lone_redis, store_url):
    client = redis.Redis.from_url(lone_redis.url)
    key = wire.stream_key("pressed", "rank0")
    for seq in range(1, 3001):
        xadd_event(client, "pressed", "rank0", "metric", 1, seq, {"x": 1.0}, step=seq)
    ingest(lone_redis.url, store_url, retain=3600)
    for seq in range(3001, 3201):
        xadd_event(client, "pressed", "rank0", "metric", 1, seq, {"x": 1.0}, step=seq)
    pending = client.xreadgroup(store_group(store_url), "elsewhere", {key: ">"}, count=50)[0][1]

    async def trim(limit: int) -> tuple[float | None, int]:
        async_client = redis.asyncio.Redis.from_url(lone_redis.url)
        try:
            await async_client.config_set("maxmemory", limit)
            return await maintenance.trim_for_memory(async_client, [key])
        finally:
            await async_client.config_set("maxmemory", 0)
            await async_client.aclose()

    used = client.info("memory")["used_memory"]
    share, trimmed = asyncio.run(trim(used * 4))  # far from full: --retain decides
    assert share is not None and share < maintenance.MEMORY_TRIM_AT and trimmed == 0
    share, trimmed = asyncio.run(trim(int(used / 0.9)))
    assert share is not None and share >= maintenance.MEMORY_TRIM_AT
    assert trimmed == 3000  # every acknowledged entry, young as they are
    assert client.xrange(key, count=1)[0][0] == pending[0][0]  # nothing read and not acknowledged
    assert client.xlen(key) == 200
    client.close()
