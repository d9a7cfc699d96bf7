"""A realistic run end to end through public interfaces: bytes per point, history() and ingest rates.

Issue #22's run: LABELS labels x STEPS steps x KEYS keys (64 x 2,000 x 20: 2.56M points) of
bench/columns.py's mix (noisy full-mantissa losses, warmup + cosine schedules, constants, integer
counters, float32-origin values; a clock ticking 0.35 s a step with jitter; now and then a log line
takes a seq between two steps, as a producer's log capture does). Each label is written to Redis
as a producer writes it (claimed epoch, sealed entries, a `start` first and a `finish` with exit
code 0 last), then stored by one `runbus ingest --burst` worker. Nothing below the CLI, the wire
and `runbus.Api` is touched, so the script measures today's store and any that replaces it.

Reported, per store (SQLite and PostgreSQL):
- bytes per point as the store stands after ingest, less an empty store's (SQLite: every file of
  the store's directory but -shm, after `PRAGMA wal_checkpoint(TRUNCATE)`; PostgreSQL: the sum of
  pg_total_relation_size over the tables of a fresh database, indexes and TOAST included); and
  of a separate run of the same shape holding only constants and integer counters (7 keys),
  and what those 7 keys add to the main run (its bytes less the same run's without them, over
  their points: the labels, clocks and log lines both runs hold left out);
- history() of the whole run and of one key across every label (`keys="loss"`), each in a fresh
  subprocess: values/s (best of two calls) and the peak RSS it added (ru_maxrss after the first
  call less before it) per value returned, beside the bytes per value the returned table holds
  itself (pandas' memory_usage of its columns);
- history(keys="loss") of a longer run (LONG_KEYS keys, --long-steps steps: 10x by default) in a
  fresh subprocess alike: one key's read where its values outnumber a read's fixed costs;
- ingest points/s (events x keys) of one worker for the 20-key events, and for 2-key and
  WIDE_KEYS-key events (fresh stores), timed from the first entry read to the worker's exit;
- what a 512-rank x 50-key x 100,000-step run would take on disk, to ingest, and to read one key
  across its ranks (time and memory), from these rates (the one key's from the long run's read).

    python bench/history.py [--store sqlite,postgres] [--labels 64] [--steps 2000] [--keys 20]
                            [--wide-keys 50] [--long-steps 20000] [--quick]

PostgreSQL is RUNBUS_BENCH_POSTGRES_DSN, else postgresql://root@127.0.0.1:5432/postgres; each
store is a throwaway database there, dropped after. Redis is RUNBUS_BENCH_REDIS_URL, else a
throwaway redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import orjson
import redis
from columns import KINDS, TICK_US, key_values
from common import ROOT, emit, private_redis
from ingest import burst

from runbus import wire

TARGETS = {
    "bytes_per_point": 6.0,
    "constant_and_counter_bytes_per_point": 1.0,
    "history_values_per_s": 10e6,
    "history_one_key_values_per_s": 20e6,
    "history_peak_bytes_per_value": 40.0,
}
KEY_NAMES = {  # kind of key (bench/columns.py) -> the names its keys take, in order
    "noisy": ["loss", "loss_lm", "loss_aux", "val_loss", "ppl_noise", "loss_z"],
    "grad_norm": ["grad_norm", "grad_norm_clipped"],
    "schedule": ["lr", "weight_decay", "momentum"],
    "constant": ["batch_size", "dropout", "max_lr"],
    "int_counter": ["tokens_seen", "samples_seen", "epoch"],
    "float_counter": ["global_step"],
    "float32": ["accuracy", "top5"],
}
COUNTER_KINDS = ("constant", "int_counter", "float_counter")
PRELOAD_BATCH = 2000
DEFAULT_DSN = "postgresql://root@127.0.0.1:5432/postgres"
EXTRAPOLATE = {"ranks": 512, "keys": 50, "steps": 100_000}
LONG_KEYS = 2  # the long run's keys (loss and loss_lm): one key's read of many values, soon ingested


class Key(NamedTuple):
    name: str
    kind: str
    nth: int  # the how-many-th key of its kind (columns.key_values varies the shape by it)


def key_specs(count: int, kinds: tuple[str, ...] | None = None) -> list[Key]:
    """`count` keys in the issue's proportions (the 20-key template repeated; names numbered past it)."""
    template = [
        Key(name, kind, index)
        for kind, total in KINDS.items()
        if kinds is None or kind in kinds
        for index, name in enumerate(KEY_NAMES[kind][:total])
    ]
    keys = []
    for n in range(count):
        base = template[n % len(template)]
        lap = n // len(template)
        name = base.name if lap == 0 else f"{base.name}_{lap}"
        keys.append(Key(name, base.kind, base.nth + lap * KINDS[base.kind]))
    return keys


def label_entries(index: int, labels: int, steps: int, keys: list[Key], epoch: int) -> Iterator[tuple]:
    """One label's entries, (kind, epoch, seq, ts, step, data) as its producer would send them."""
    rng = np.random.default_rng(index)
    numbers = np.arange(steps, dtype=np.int64)
    # A log line now and then takes a seq between two steps' events (seq 1 is the start).
    gaps = rng.random(steps) < 0.05
    seqs = 2 + numbers + np.cumsum(gaps)
    ticks = TICK_US + rng.normal(0, 4_000, steps).astype(np.int64) + (rng.random(steps) < 0.01) * 2_000_000
    ts = (1_764_190_000_000_000 + index * 1_000 + np.cumsum(ticks)) / 1e6
    # A short run's later schedules warm up past its end: numpy's unused branch divides by zero.
    with np.errstate(divide="ignore", invalid="ignore"):
        columns = [key_values(key.nth, key.kind, numbers, rng).tolist() for key in keys]
    names = [key.name for key in keys]
    start = {
        "primary": index == 0,
        "host": f"node{index // 8:03d}",
        "pid": 1000 + index,
        "rank": index,
        "local_rank": index % 8,
        "world_size": labels,
        "restart_count": 0,
        "launcher": "torchrun",
        "config": {"lr": 3e-4, "batch_size": 256, "model": "bench-history"},
    }
    yield ("start", epoch, 1, float(ts[0]) - 5.0, None, orjson.dumps(start).decode())
    seq_list, ts_list = seqs.tolist(), ts.tolist()
    for step in range(steps):
        if gaps[step]:
            line = {"stream": "logging", "level": "INFO", "text": f"step {step}: checkpoint saved"}
            yield ("log", epoch, seq_list[step] - 1, ts_list[step] - 0.1, None, orjson.dumps(line).decode())
        data = dict(zip(names, (column[step] for column in columns), strict=True))
        yield ("metric", epoch, seq_list[step], ts_list[step], step, orjson.dumps(data).decode())
    yield (
        "finish",
        epoch,
        seq_list[-1] + 1,
        ts_list[-1] + 1.0,
        None,
        orjson.dumps({"exit_code": 0}).decode(),
    )


def write_run(url: str, run_id: str, labels: int, steps: int, keys: list[Key]) -> list[str]:
    """Every label's entries into Redis, claimed and sealed as producers do; the stream keys."""
    client = redis.Redis.from_url(url)
    script = client.register_script(wire.XADD_MANY_SCRIPT)
    streams = []
    for index in range(labels):
        label = f"rank{index}"
        key = wire.stream_key(run_id, label)
        streams.append(key)
        epoch = int(client.incr(wire.epoch_key(run_id, label)))
        secret = wire.new_seal_secret()
        client.hset(wire.seal_key(run_id, label), str(epoch), secret.hex())
        client.sadd(wire.REGISTRY_KEY, key)
        batch: list[tuple] = []
        for entry in label_entries(index, labels, steps, keys, epoch):
            batch.append(entry)
            if len(batch) == PRELOAD_BATCH:
                script(keys=[key], args=wire.xadd_many_args(run_id, label, batch, {epoch: secret}))
                batch = []
        if batch:
            script(keys=[key], args=wire.xadd_many_args(run_id, label, batch, {epoch: secret}))
    client.close()
    return streams


class Backend:
    """Fresh stores of one kind, and how big one is."""

    def __init__(self, kind: str, directory: str, dsn: str) -> None:
        self.kind, self.directory, self.dsn = kind, directory, dsn

    @contextlib.contextmanager
    def fresh(self, name: str) -> Iterator[str]:
        if self.kind == "sqlite":
            folder = os.path.join(self.directory, name)
            os.makedirs(folder)
            yield f"sqlite:///{folder}/runbus.db"
            return
        from tests.pgserver import create_database, drop_database

        url = asyncio.run(create_database(self.dsn))
        try:
            yield url
        finally:
            asyncio.run(drop_database(self.dsn, url))

    def size(self, url: str) -> int:
        if self.kind == "sqlite":
            path = url.removeprefix("sqlite:///")
            with contextlib.closing(sqlite3.connect(path)) as con:
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            folder = os.path.dirname(path)
            return sum(
                os.path.getsize(os.path.join(folder, name))
                for name in os.listdir(folder)
                if not name.endswith("-shm")
            )
        return asyncio.run(postgres_size(url))

    def log_bytes(self, url: str) -> int:
        """What the run's log lines take: the logs table with its index (SQLite: their pages)."""
        if self.kind == "sqlite":
            with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as con:
                found = con.execute("SELECT sum(pgsize) FROM dbstat WHERE name IN ('logs', 'logs_by_ts')")
                return int(found.fetchone()[0] or 0)
        return asyncio.run(postgres_size(url, "logs"))


async def postgres_size(url: str, table: str | None = None) -> int:
    """pg_total_relation_size summed over the database's own tables (indexes and TOAST with them)."""
    import asyncpg

    con = await asyncpg.connect(url)
    try:
        total = await con.fetchval(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relkind IN ('r', 'm', 'p')"
            " AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')"
            " AND ($1::text IS NULL OR c.relname = $1)",
            table,
        )
    finally:
        await con.close()
    return int(total)


def ingest(redis_url: str, store_url: str, run_id: str, labels: int, steps: int, keys: list[Key]) -> dict:
    """The run written to an emptied Redis, then one `runbus ingest --burst` worker."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    started = time.perf_counter()
    streams = write_run(redis_url, run_id, labels, steps, keys)
    written = time.perf_counter() - started
    wall, sustained = burst(redis_url, store_url, 1, streams)
    points = labels * steps * len(keys)
    return {
        "keys": len(keys),
        "events": labels * steps,
        "points": points,
        "redis_write_s": round(written, 2),
        "ingest_s": round(sustained, 2),
        "points_per_s": round(points / sustained),
        "events_per_s": round(labels * steps / sustained),
        "with_start_up_points_per_s": round(points / wall),
    }


def empty_size(backend: Backend, redis_url: str) -> int:
    """An empty store's bytes: its schema, made by a worker over an empty Redis."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    with backend.fresh("empty") as url:
        burst(redis_url, url, 1, [])
        return backend.size(url)


def read_in_child(store_url: str, run_id: str, keys: str | None) -> dict:
    """history() in a fresh interpreter (see child_main)."""
    command = [sys.executable, os.path.abspath(__file__), "--child-read", store_url, run_id]
    if keys:
        command += ["--child-keys", keys]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, check=False, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"history() child failed:\n{out.stderr.decode()[-3000:]}")
    return orjson.loads(out.stdout.splitlines()[-1])


def child_main(store_url: str, run_id: str, keys: str | None) -> None:
    """Api().run(ID).history() twice; the values, each call's seconds, the peak RSS the first added."""
    import runbus

    api = runbus.Api(store_url)
    run = api.run(run_id)
    # A small read first loads what a read imports (pandas, the tables' modules): the peak
    # measured below is then the table's and what built it.
    run.history(keys="loss", labels=run.labels[0])

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, values = [], 0
    for attempt in range(2):
        started = time.perf_counter()
        table = run.history(keys=keys)
        times.append(time.perf_counter() - started)
        values = len(table)
        if attempt == 0:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            # What the table returned holds itself (its columns, with the API's dtypes): the part
            # of the peak no reader can avoid, beside what reading it cost on top.
            held = int(table.memory_usage(index=False).sum())
        del table
    api.close()
    print(
        orjson.dumps(
            {
                "values": values,
                "first_s": round(times[0], 3),
                "best_s": round(min(times), 3),
                "values_per_s": round(values / min(times)),
                "peak_rss_added_mb": round((peak - before) / 1024, 1),
                "peak_bytes_per_value": round((peak - before) * 1024 / max(1, values), 1),
                "table_bytes_per_value": round(held / max(1, values), 1),
            }
        ).decode()
    )


def run_state(store_url: str, run_id: str) -> str:
    import runbus

    with runbus.Api(store_url) as api:
        run = api.run(run_id)
        states = {label.state for label in run.record.labels}
        return f"{run.state} ({', '.join(sorted(states))} labels)"


def measure_store(backend: Backend, redis_url: str, args: argparse.Namespace) -> dict:
    labels, steps = args.labels, args.steps
    empty = empty_size(backend, redis_url)
    found: dict[str, Any] = {"empty_store_bytes": empty}
    with backend.fresh("main") as url:
        main = ingest(redis_url, url, "bench-history", labels, steps, key_specs(args.keys))
        size = backend.size(url)
        main["store_bytes"] = size
        main["bytes_per_point"] = round((size - empty) / main["points"], 2)
        main["state"] = run_state(url, "bench-history")
        found["main"] = main
        print(f"{backend.kind} main: {main}", file=sys.stderr, flush=True)
        found["history_whole_run"] = read_in_child(url, "bench-history", None)
        found["history_one_key"] = read_in_child(url, "bench-history", "loss")
        # Every value stored and read back: a rate over a short table would flatter the store.
        found["history_whole_run"]["complete"] = found["history_whole_run"]["values"] == main["points"]
        found["history_one_key"]["complete"] = found["history_one_key"]["values"] == labels * steps
        print(
            f"{backend.kind} history: {found['history_whole_run']} / {found['history_one_key']}",
            file=sys.stderr,
        )
    if args.long_steps:
        found["history_one_key_long"] = one_key_at_length(backend, redis_url, labels, args.long_steps)
    with backend.fresh("counters") as url:
        counters = ingest(redis_url, url, "bench-counters", labels, steps, key_specs(7, COUNTER_KINDS))
        counters["bytes_per_point"] = round((backend.size(url) - empty) / counters["points"], 2)
        # The run's log lines (5% of its steps, as in the main run) are not its keys' points.
        counters["log_bytes_per_point"] = round(backend.log_bytes(url) / counters["points"], 2)
        found["constants_and_counters"] = counters
    # What the constant and counter keys add to the main run: its bytes less those of the same run
    # without them (the labels, their clocks and log lines are the same in both).
    others = [key for key in key_specs(args.keys) if key.kind not in COUNTER_KINDS]
    with backend.fresh("others") as url:
        rest = ingest(redis_url, url, "bench-history", labels, steps, others)
        added = (size - backend.size(url)) / (main["points"] - rest["points"])
        counters["added_to_main_bytes_per_point"] = round(added, 2)
    for width in (2, args.wide_keys):
        with backend.fresh(f"keys{width}") as url:
            found[f"ingest_{width}_keys"] = ingest(
                redis_url, url, f"bench-{width}k", labels, args.wide_steps, key_specs(width)
            )
    found["extrapolated"] = extrapolate(found, args.wide_keys)
    return found


def one_key_at_length(backend: Backend, redis_url: str, labels: int, steps: int) -> dict:
    """history(keys="loss") of a run LONG_KEYS keys wide and `steps` long: one key's read where
    its values outnumber a read's fixed costs (its statements, its first pages), as they do in
    the 512-rank run extrapolate() speaks of."""
    with backend.fresh("long") as url:
        ingest(redis_url, url, "bench-long", labels, steps, key_specs(LONG_KEYS))
        read = read_in_child(url, "bench-long", "loss")
    read["complete"] = read["values"] == labels * steps
    print(f"{backend.kind} one key of {labels} x {steps}: {read}", file=sys.stderr, flush=True)
    return read


def extrapolate(found: dict, wide_keys: int) -> dict:
    """A 512-rank x 50-key x 100k-step run at the measured rates."""
    ranks, keys, steps = EXTRAPOLATE["ranks"], EXTRAPOLATE["keys"], EXTRAPOLATE["steps"]
    points = ranks * keys * steps
    one_key = ranks * steps
    # The longest one-key read measured: the nearest to 51M values.
    read = found.get("history_one_key_long", found["history_one_key"])
    ingest_rate = found[f"ingest_{wide_keys}_keys"]["points_per_s"]
    return {
        "run": f"{ranks} ranks x {keys} keys x {steps} steps",
        "points": points,
        "disk_gb": round(points * found["main"]["bytes_per_point"] / 1e9, 1),
        "ingest_hours_one_worker": round(points / ingest_rate / 3600, 1),
        "one_key_values": one_key,
        "one_key_read_s": round(one_key / read["values_per_s"], 1),
        "one_key_read_peak_gb": round(one_key * read["peak_bytes_per_value"] / 1e9, 2),
    }


def table(results: dict) -> str:
    rows = [
        ("bytes/point", "main", "bytes_per_point", "{:.1f}"),
        ("bytes/point, constants+counters", "constants_and_counters", "bytes_per_point", "{:.2f}"),
        ("  of which their log lines", "constants_and_counters", "log_bytes_per_point", "{:.2f}"),
        ("  added to the main run", "constants_and_counters", "added_to_main_bytes_per_point", "{:.2f}"),
        ("history() whole run, values/s", "history_whole_run", "values_per_s", "{:,}"),
        ("history() whole run, peak B/value", "history_whole_run", "peak_bytes_per_value", "{}"),
        ("  the table returned, B/value", "history_whole_run", "table_bytes_per_value", "{}"),
        ("history(keys='loss'), values/s", "history_one_key", "values_per_s", "{:,}"),
        ("history(keys='loss'), peak B/value", "history_one_key", "peak_bytes_per_value", "{}"),
        ("  the table returned, B/value", "history_one_key", "table_bytes_per_value", "{}"),
        ("history(keys='loss'), long run, values/s", "history_one_key_long", "values_per_s", "{:,}"),
        ("  its peak B/value", "history_one_key_long", "peak_bytes_per_value", "{}"),
        ("ingest 20-key, points/s", "main", "points_per_s", "{:,}"),
    ]
    stores = [name for name in ("sqlite", "postgres") if name in results]
    lines = [f"{'':38}" + "".join(f"{name:>16}" for name in stores)]
    for title, part, field, shape in rows:
        if all(part in results[s] for s in stores):
            cells = [shape.format(results[s][part][field]) for s in stores]
            lines.append(f"{title:38}" + "".join(f"{cell:>16}" for cell in cells))
    for part in [p for p in results[stores[0]] if p.startswith("ingest_")]:
        title = f"ingest {part.split('_')[1]}-key, points/s"
        lines.append(f"{title:38}" + "".join(f"{results[s][part]['points_per_s']:>16,}" for s in stores))
    for s in stores:
        lines.append(f"{s}, extrapolated: {results[s]['extrapolated']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="sqlite,postgres", help="sqlite, postgres or both")
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL only (as --store postgres)")
    parser.add_argument("--labels", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--wide-keys", type=int, default=50)
    parser.add_argument("--wide-steps", type=int, default=None, help="steps of the 2- and wide-key runs")
    parser.add_argument(
        "--long-steps", type=int, default=None, help="the one-key long run's steps (0: none; 10x --steps)"
    )
    parser.add_argument("--quick", action="store_true", help="8 labels x 250 steps: a smoke run")
    parser.add_argument("--child-read", nargs=2, metavar=("STORE", "RUN"), help=argparse.SUPPRESS)
    parser.add_argument("--child-keys", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_read:
        store_url, run_id = args.child_read
        child_main(store_url, run_id, args.child_keys)
        return
    if args.quick:
        args.labels, args.steps = 8, 250
    args.wide_steps = args.wide_steps or args.steps
    args.long_steps = 10 * args.steps if args.long_steps is None else args.long_steps
    stores = ["postgres"] if args.postgres else args.store.split(",")
    logging.disable(logging.WARNING)
    dsn = os.environ.get("RUNBUS_BENCH_POSTGRES_DSN", DEFAULT_DSN)
    results: dict[str, Any] = {}
    with private_redis() as redis_url, tempfile.TemporaryDirectory(prefix="runbus-bench-history-") as tmp:
        for kind in stores:
            results[kind] = measure_store(Backend(kind, os.path.join(tmp, kind), dsn), redis_url, args)
    print(table(results), file=sys.stderr, flush=True)
    emit(
        "history",
        {
            "labels": args.labels,
            "steps": args.steps,
            "keys": args.keys,
            "points": args.labels * args.steps * args.keys,
            "targets": TARGETS,
            **results,
        },
    )


if __name__ == "__main__":
    main()
