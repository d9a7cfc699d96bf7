"""Ingest throughput: one `runbus ingest --burst` worker (and two) against the raw ceiling.

EVENTS events from 8 labels are pre-loaded into Redis, the same way for every measurement. The
raw ceiling is measured in the same run on an identical copy: XREADGROUP + orjson decode + XACK
and no validation or storage. The workers decode with the path RUNBUS_DECODER names (the fast
one unless it says `reference`), reported as "decoder". Stores: SQLite always, PostgreSQL when
RUNBUS_BENCH_POSTGRES_DSN is set (or --postgres starts a throwaway cluster, as the tests do). With
--http each worker serves its ops endpoints (`runbus ingest --http`, as the Dockerfile runs it), on
a port of its own.

    python bench/ingest.py [--events 1000000] [--postgres [--no-sqlite]] [--http]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time

import orjson
import psutil
import redis
from common import ROOT, emit, private_redis

from runbus import config, wire

LABELS = 8
PRELOAD_BATCH = 5000


def preload(url: str, run_id: str, events: int) -> None:
    """EVENTS metric events (2 keys each) spread over LABELS labels, as producers write them."""
    client = redis.Redis.from_url(url)
    script = client.register_script(wire.XADD_MANY_SCRIPT)
    per_label = events // LABELS
    now = time.time()
    for label in (f"rank{i}" for i in range(LABELS)):
        client.sadd(wire.REGISTRY_KEY, wire.stream_key(run_id, label))
        # Sealed as a producer's claim seals epoch 1: the workers check every entry's seal.
        secret = wire.new_seal_secret()
        client.set(wire.epoch_key(run_id, label), 1)
        client.hset(wire.seal_key(run_id, label), "1", secret.hex())
        for first in range(1, per_label + 1, PRELOAD_BATCH):
            entries = [
                (
                    "metric",
                    1,
                    seq,
                    now + seq * 1e-3,
                    seq,
                    orjson.dumps({"loss": 1.0 / seq, "lr": 1e-4}).decode(),
                )
                for seq in range(first, min(per_label, first + PRELOAD_BATCH - 1) + 1)
            ]
            script(
                keys=[wire.stream_key(run_id, label)],
                args=wire.xadd_many_args(run_id, label, entries, {1: secret}),
            )
    client.close()


async def raw_ceiling(url: str, keys: list[str], batch: int | None = None, passes: int = 2) -> list[float]:
    """Events/s for XREADGROUP + decode + XACK alone (no validation, no storage), per pass.

    Entries are read `batch` per stream at a time, by default as many as a worker reads.

    Replies are read the way the worker reads them (flat, not one dict per entry, which would
    halve this ceiling), through the worker's client (commands packed by hiredis) and with its
    garbage-collector settings, so the fraction of the ceiling is what validation and storage cost.
    Each pass re-reads every entry (the group is set back to the start); the fraction is taken
    of the best pass, since this shared VM's rates vary by a fifth from one second to the next.
    """
    from runbus.ingester.process import GC_THRESHOLDS
    from runbus.ingester.worker import WorkerSettings, _raw_reply
    from runbus.redis import async_client

    batch = batch or WorkerSettings.batch_size
    client = async_client(url)
    client.set_response_callback("XREADGROUP", _raw_reply)
    for key in keys:
        await client.xgroup_create(key, "raw", id="0")
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    rates = []
    for _ in range(passes):
        for key in keys:
            await client.xgroup_setid(key, "raw", "0")
        done, started = 0, time.perf_counter()
        while True:
            reply = await client.xreadgroup("raw", "raw-1", dict.fromkeys(keys, ">"), count=batch)
            if not reply:
                break
            pipe = client.pipeline(transaction=False)
            for key, items in reply.items() if isinstance(reply, dict) else reply:
                for _, fields in items:
                    orjson.loads(wire.fields_dict(fields)[b"data"])
                pipe.xack(key, "raw", *[entry_id for entry_id, _ in items])
                done += len(items)
            await pipe.execute()
        rates.append(done / (time.perf_counter() - started))
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    await client.aclose()
    return rates


def burst(url: str, store_url: str, workers: int, keys: list[str], http: bool = False) -> tuple[float, float]:
    """Seconds for `workers` concurrent `runbus ingest --burst` processes until all are done:
    (from launch, from the first entry read). The second is the sustained rate's window: it
    leaves out the interpreter's start, imports and connecting, as the raw ceiling does. With
    `http`, each serves its ops endpoints on a free loopback port."""
    cmd = [
        sys.executable,
        "-m",
        "runbus",
        "--log-level",
        "WARNING",
        "--store",
        store_url,
        "ingest",
        "--redis",
        url,
        "--burst",
        *(["--http", "127.0.0.1:0"] if http else []),
    ]
    client = redis.Redis.from_url(url)
    started = time.perf_counter()
    procs = [subprocess.Popen([*cmd, "--consumer", f"bench-{i}"], cwd=ROOT) for i in range(workers)]
    reading = None
    while reading is None and procs[0].poll() is None:
        if any(first_read(client, key) for key in keys):
            reading = time.perf_counter()
        else:
            time.sleep(0.002)
    client.close()
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"runbus ingest exited {proc.returncode}")
    ended = time.perf_counter()
    return ended - started, ended - (reading or started)


def first_read(client: redis.Redis, key: str) -> bool:
    """Whether the workers' group has read anything from `key` yet."""
    return any(group["pending"] or group.get("entries-read") for group in client.xinfo_groups(key))


def measure(url: str, store_url: str, events: int, workers: int, http: bool = False) -> dict:
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    start_up_cpu = idle_cpu_seconds(url, store_url, workers, http)
    run_id = f"bench-{workers}w"
    preload(url, run_id, events)
    keys = [wire.stream_key(run_id, f"rank{i}") for i in range(LABELS)]
    passes = asyncio.run(raw_ceiling(url, keys))
    ceiling = max(passes)
    # The identical copy for the workers: the same entries, re-read from id 0 by the real group.
    client = redis.Redis.from_url(url)
    for key in keys:
        client.xgroup_destroy(key, "raw")
    redis_server = local_process(client)
    client.close()
    before = cpu_seconds(redis_server)
    wall, sustained = burst(url, store_url, workers, keys, http)
    after = cpu_seconds(redis_server)
    stored = events - events % LABELS
    worker_cpu = after[0] - before[0]
    return {
        "workers": workers,
        "events": stored,
        "events_per_s": round(stored / sustained),
        "with_start_up_per_s": round(stored / wall),
        "start_up_s": round(wall - sustained, 3),
        "raw_ceiling_per_s": round(ceiling),
        "raw_ceiling_passes": [round(rate) for rate in passes],
        "fraction_of_ceiling": round(stored / sustained / ceiling, 2),
        "cpu_us_per_event": {
            **{
                part: None if b is None else round((a - b) / stored * 1e6, 2)
                for part, a, b in zip(("workers", "redis", "rest"), after, before, strict=True)
            },
            "workers_without_start_up": round((worker_cpu - start_up_cpu) / stored * 1e6, 2),
        },
        "start_up_cpu_s": round(start_up_cpu, 3),
    }


def idle_cpu_seconds(url: str, store_url: str, workers: int, http: bool) -> float:
    """CPU seconds of the same workers over an empty Redis: the fixed cost of starting (the
    interpreter, imports, connecting, the store's schema) and exiting, which the CPU per event
    of a short run would otherwise carry (an --http worker imports aiohttp and prometheus_client
    too), left out of `workers_without_start_up`."""
    before = cpu_seconds(None)[0]
    burst(url, store_url, workers, [], http)
    return cpu_seconds(None)[0] - before


def local_process(client: redis.Redis) -> psutil.Process | None:
    """The redis-server process behind `client`, when it runs on this machine."""
    try:
        return psutil.Process(int(client.info("server")["process_id"]))
    except (psutil.Error, KeyError, ValueError):
        return None


def cpu_seconds(redis_server: psutil.Process | None) -> tuple[float, float | None, float]:
    """CPU seconds so far of (finished child processes: the workers, redis-server, the rest of
    the machine: PostgreSQL and anything else). CPU per event is steadier than rates on a
    shared VM."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    workers = children.ru_utime + children.ru_stime
    server = None
    if redis_server is not None:
        times = redis_server.cpu_times()
        server = times.user + times.system
    machine = psutil.cpu_times()
    busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    return workers, server, busy - workers - (server or 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--postgres", action="store_true", help="start a throwaway PostgreSQL cluster")
    parser.add_argument(
        "--http", action="store_true", help="workers serve their ops endpoints (ingest --http)"
    )
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only (with --postgres)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    results: dict = {}
    with private_redis() as url, tempfile.TemporaryDirectory() as tmp:
        for workers in () if args.no_sqlite else (1, 2):
            results[f"sqlite_{workers}w"] = measure(
                url, f"sqlite:///{tmp}/bench-{workers}.db", args.events, workers, args.http
            )
        dsn = os.environ.get("RUNBUS_BENCH_POSTGRES_DSN")
        server = None
        if dsn is None and args.postgres:
            from tests.pgserver import LocalPostgres

            server = LocalPostgres()
            server.start()
            dsn = server.dsn
        try:
            if dsn:
                from tests.pgserver import create_database

                for workers in (1, 2):
                    store = asyncio.run(create_database(dsn))
                    results[f"postgres_{workers}w"] = measure(url, store, args.events, workers, args.http)
        finally:
            if server is not None:
                server.cleanup()
    emit("ingest", {"events": args.events, "decoder": config.decoder(), "http": args.http, **results})


if __name__ == "__main__":
    main()
