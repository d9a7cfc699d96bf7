"""Ingest throughput against the number of worker processes (`runbus ingest --workers N`).

The events are written to Redis first, under staging keys no worker looks at. For each N: a
fresh database, N workers started and ready (their /readyz answers), then one MULTI copies every
staged stream to its real key and registers it; the clock runs from there until every stream's
group has nothing unread and nothing pending (all stored: workers acknowledge after the commit).

Besides the rate: CPU per event of the workers, of PostgreSQL (its postmaster and the backends it
reaped) and of redis-server, steadier than rates on a shared machine; and on PostgreSQL where the
workers waited for each other: pg_stat_activity sampled every 20 ms while they run, the share of
samples of a worker's statement waiting for a lock, by lock and statement (`lock_waits`).

    python bench/scale.py [--workers 1,2,4] [--runs 4] [--ranks 8] [--events 5000] [--store postgres|sqlite]

PostgreSQL is RUNBUS_BENCH_POSTGRES_DSN, else a throwaway cluster in the temp dir on disk with
fsync and synchronous_commit on; Redis is RUNBUS_BENCH_REDIS_URL, else a throwaway redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator

import orjson
import psutil
import redis
from common import emit, private_redis

from runbus import wire
from runbus.ingester.localredis import free_port
from tests.pgserver import LocalPostgres, create_database, drop_database

STAGE = "bench:stage:"


@contextlib.contextmanager
def postgres_server() -> Iterator[tuple[str, str]]:
    """(DSN, description)."""
    dsn = os.environ.get("RUNBUS_BENCH_POSTGRES_DSN")
    if dsn:
        yield dsn, "RUNBUS_BENCH_POSTGRES_DSN"
        return
    with LocalPostgres(directory=tempfile.mkdtemp(prefix="runbus-bench-pg-")) as server:

        async def durable() -> None:
            import asyncpg

            con = await asyncpg.connect(server.dsn)
            try:
                for setting in ("fsync", "synchronous_commit", "full_page_writes"):
                    await con.execute(f"ALTER SYSTEM SET {setting} = on")
                await con.execute("SELECT pg_reload_conf()")
            finally:
                await con.close()

        asyncio.run(durable())
        yield server.dsn, "throwaway cluster on disk, fsync on"


def stage(client: redis.Redis, runs: int, ranks: int, events: int) -> list[tuple[str, str]]:
    """Write every event under a staging key; the (staging key, real key) pairs."""
    pairs = []
    for r in range(runs):
        run = f"scale-{r}"
        for rank in range(ranks):
            label = f"rank{rank}"
            staged = f"{STAGE}{run}:{label}"
            client.delete(staged)
            pipe = client.pipeline(transaction=False)
            start = orjson.dumps({"primary": rank == 0, "rank": rank, "world_size": ranks, "config": {}})
            pipe.xadd(staged, wire.encode_fields("start", run, label, 1, 1, time.time(), start, None))
            for step in range(events - 2):
                data = orjson.dumps({"loss": 1.0 / (step + 1), "lr": 3e-4, "grad_norm": 0.5, "tokens_s": 1e5})
                fields = wire.encode_fields("metric", run, label, 1, step + 2, time.time(), data, step)
                pipe.xadd(staged, fields)
                if len(pipe) >= 5000:
                    pipe.execute()
            finish = orjson.dumps({"exit_code": 0})
            pipe.xadd(staged, wire.encode_fields("finish", run, label, 1, events, time.time(), finish, None))
            pipe.execute()
            pairs.append((staged, wire.stream_key(run, label)))
    return pairs


def release(client: redis.Redis, pairs: list[tuple[str, str]]) -> None:
    """Make every staged stream visible to the workers at once."""
    pipe = client.pipeline(transaction=True)
    for staged, key in pairs:
        pipe.copy(staged, key, replace=True)
        pipe.sadd(wire.REGISTRY_KEY, key)
    pipe.execute()


def drained(client: redis.Redis, keys: list[str]) -> bool:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.xinfo_groups(key)
    for groups in pipe.execute():
        if not groups or any(g["lag"] != 0 or g["pending"] for g in groups):
            return False
    return True


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except urllib.error.HTTPError as exc:  # 503 until connected
        exc.close()
        return False
    except OSError:
        return False


class LockWaits:
    """pg_stat_activity sampled every 20 ms on its own connection while the workers run: how
    often a statement of theirs was active, and waiting for a lock (by lock and statement)."""

    def __init__(self, store_url: str) -> None:
        self.store_url = store_url
        self.samples = 0
        self.active: int = 0
        self.waiting: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._sample()), daemon=True)

    async def _sample(self) -> None:
        import asyncpg

        con = await asyncpg.connect(self.store_url)
        try:
            while not self._stop.is_set():
                rows = await con.fetch(
                    "SELECT wait_event_type, wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 70) "
                    "FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' "
                    "AND pid <> pg_backend_pid()"
                )
                self.samples += 1
                self.active += len(rows)
                for kind, event, query in rows:
                    if kind == "Lock":
                        self.waiting[f"{event}: {query}"] += 1
                await asyncio.sleep(0.02)
        finally:
            await con.close()

    def __enter__(self) -> LockWaits:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict:
        """Of the samples of an active worker statement: the share waiting on a lock, and by what."""
        active = max(1, self.active)
        return {
            "active_statement_samples": self.active,
            "waiting_for_a_lock": round(sum(self.waiting.values()) / active, 3),
            "by_lock_and_statement": {k: round(v / active, 3) for k, v in self.waiting.most_common(6)},
        }


def server_cpu(process: psutil.Process | None) -> float | None:
    """CPU seconds of a server process and the children it reaped (PostgreSQL's backends)."""
    if process is None:
        return None
    try:
        times = process.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system + times.children_user + times.children_system


def postmaster(store_url: str) -> psutil.Process | None:
    """The PostgreSQL server process behind `store_url`, when it runs on this machine."""

    async def find() -> psutil.Process | None:
        import asyncpg

        con = await asyncpg.connect(store_url)
        try:  # looked up while the backend lives: it exits once the connection closes
            return psutil.Process(await con.fetchval("SELECT pg_backend_pid()")).parent()
        except psutil.Error:
            return None
        finally:
            await con.close()

    try:
        return asyncio.run(find())
    except OSError:
        return None


def redis_process(client: redis.Redis) -> psutil.Process | None:
    try:
        return psutil.Process(int(client.info("server")["process_id"]))
    except (psutil.Error, KeyError, ValueError):
        return None


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(redis_url: str, store_url: str, workers: int, pairs: list[tuple[str, str]]) -> dict:
    """Seconds for `workers` to store every staged event; CPU seconds of the workers, PostgreSQL
    and redis-server meanwhile; where the workers waited for locks (PostgreSQL)."""
    client = redis.Redis.from_url(redis_url)
    keys = [key for _, key in pairs]
    client.delete(*keys, wire.REGISTRY_KEY)
    base = free_port()
    on_postgres = store_url.startswith("postgres")
    pg = postmaster(store_url) if on_postgres else None
    server = redis_process(client)
    before = (children_cpu(), server_cpu(pg), server_cpu(server))
    waits = LockWaits(store_url) if on_postgres else None
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runbus",
            "--store",
            store_url,
            "--log-level",
            "WARNING",
            "ingest",
            "--redis",
            redis_url,
            "--workers",
            str(workers),
            "--http",
            f"127.0.0.1:{base}",
        ],
    ) as supervisor:
        try:
            deadline = time.monotonic() + 120
            while not all(ready(base + i) for i in range(workers)):
                if time.monotonic() > deadline or supervisor.poll() is not None:
                    raise RuntimeError("the workers did not become ready")
                time.sleep(0.1)
            with waits or contextlib.nullcontext():
                started = time.perf_counter()
                release(client, pairs)
                while not drained(client, keys):
                    time.sleep(0.02)
                elapsed = time.perf_counter() - started
        finally:
            supervisor.send_signal(signal.SIGTERM)
            supervisor.wait(timeout=60)
    after = (children_cpu(), server_cpu(pg), server_cpu(server))
    client.close()
    cpu = {
        name: None if b is None or a is None else a - b
        for name, a, b in zip(("workers", "postgres", "redis"), after, before, strict=True)
    }
    return {"seconds": elapsed, "cpu_s": cpu, "lock_waits": waits.report() if waits else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="worker counts to measure (default %(default)s)")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=8, help="labels per run, one stream each")
    parser.add_argument("--events", type=int, default=5000, help="events per stream")
    parser.add_argument("--store", choices=("postgres", "sqlite"), default="postgres")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    total = args.runs * args.ranks * args.events
    results = []
    with private_redis() as redis_url, contextlib.ExitStack() as stack:
        client = redis.Redis.from_url(redis_url)
        pairs = stage(client, args.runs, args.ranks, args.events)
        if args.store == "postgres":
            dsn, where = stack.enter_context(postgres_server())
        else:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="runbus-bench-"))
            where = "SQLite (WAL) in the temp dir"
        for n in counts:
            if args.store == "postgres":
                store_url = asyncio.run(create_database(dsn))
            else:
                store_url = f"sqlite:///{directory}/scale-{n}.db"
            try:
                found = measure(redis_url, store_url, n, pairs)
            finally:
                if args.store == "postgres":
                    asyncio.run(drop_database(dsn, store_url))
            seconds = found["seconds"]
            rate = round(total / seconds)
            results.append(
                {
                    "workers": n,
                    "seconds": round(seconds, 2),
                    "events_per_s": rate,
                    # The workers' includes their start and stop (imports, connecting): a fixed cost.
                    "cpu_us_per_event": {
                        name: None if value is None else round(value / total * 1e6, 2)
                        for name, value in found["cpu_s"].items()
                    },
                    "lock_waits": found["lock_waits"],
                }
            )
            print(
                f"{n} workers: {total} events in {seconds:.2f}s, {total / seconds:,.0f} events/s",
                file=sys.stderr,
                flush=True,
            )
        client.delete(*[staged for staged, _ in pairs])
        client.close()
    emit(
        "scale",
        {
            "store": f"{args.store}: {where}",
            "events": total,
            "streams": len(pairs),
            "events_per_stream": args.events,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
