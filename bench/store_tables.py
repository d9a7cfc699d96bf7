"""Where a store's bytes go, table by table: bench/history.py's run ingested into a fresh store,
then each relation's forks, indexes and TOAST, its rows, their average width and its dead space.

    python bench/store_tables.py [--store sqlite,postgres] [--labels 64] [--steps 2000]
                                 [--keys 7 | --counters]

--counters is history.py's constants-and-counters run (key_specs(7, COUNTER_KINDS)); otherwise
`--keys` keys of the main run's mix. Bytes per point are history.py's: the store less an empty
one, over the points. PostgreSQL's dead space comes from pgstattuple where the server has it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sqlite3
import tempfile
import time
from typing import Any

from common import private_redis
from history import COUNTER_KINDS, DEFAULT_DSN, Backend, empty_size, ingest, key_specs

# One row per relation: its forks, its TOAST (with TOAST's index), its rows and their width.
_RELATIONS = (
    "SELECT c.oid, c.relname, pg_relation_size(c.oid, 'main') AS main, "
    "pg_relation_size(c.oid, 'fsm') AS fsm, pg_relation_size(c.oid, 'vm') AS vm, "
    "coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0) AS toast, "
    "pg_total_relation_size(c.oid) AS total FROM pg_class c "
    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'm', 'p') "
    "AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast') ORDER BY total DESC"
)
_INDEXES = (
    "SELECT i.indexrelid::regclass::text AS name, pg_relation_size(i.indexrelid) AS size "
    "FROM pg_index i WHERE i.indrelid = $1 ORDER BY 1"
)


async def postgres_tables(url: str, points: int) -> list[str]:
    import asyncpg

    con = await asyncpg.connect(url)
    try:
        stattuple = await con.fetchval(
            "SELECT count(*) FROM pg_available_extensions WHERE name = 'pgstattuple'"
        )
        if stattuple:
            await con.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        lines = [
            f"{'relation':14}{'total':>10}{'main':>10}{'fsm':>8}{'vm':>7}{'toast':>9}{'rows':>9}"
            f"{'avg row':>8}{'dead':>9}{'free':>9}{'B/pt':>7}  indexes"
        ]
        for rel in await con.fetch(_RELATIONS):
            name = rel["relname"]
            rows, width = await con.fetchrow(f'SELECT count(*), avg(pg_column_size(t.*)) FROM "{name}" t')
            dead = free = 0
            if stattuple:
                found = await con.fetchrow(
                    "SELECT dead_tuple_len, free_space FROM pgstattuple($1::text)", f'"{name}"'
                )
                dead, free = found["dead_tuple_len"], found["free_space"]
            indexes = ", ".join(f"{i['name']} {i['size']}" for i in await con.fetch(_INDEXES, rel["oid"]))
            lines.append(
                f"{name:14}{rel['total']:>10}{rel['main']:>10}{rel['fsm']:>8}{rel['vm']:>7}"
                f"{rel['toast']:>9}{rows:>9}{float(width or 0):>8.1f}{dead:>9}{free:>9}"
                f"{rel['total'] / points:>7.3f}  {indexes}"
            )
        if stattuple:
            await con.execute("DROP EXTENSION pgstattuple")
    finally:
        await con.close()
    return lines


def sqlite_tables(url: str, points: int) -> list[str]:
    path = url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as con:
        found = con.execute(
            "SELECT name, sum(pgsize), sum(payload), sum(unused), sum(ncell) FROM dbstat "
            "GROUP BY name ORDER BY 2 DESC"
        ).fetchall()
    lines = [f"{'btree':24}{'pages':>10}{'payload':>10}{'unused':>9}{'cells':>9}{'B/pt':>7}"]
    lines += [f"{n:24}{s:>10}{p:>10}{u:>9}{c:>9}{s / points:>7.3f}" for n, s, p, u, c in found]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="sqlite,postgres")
    parser.add_argument("--labels", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--counters", action="store_true", help="the constants-and-counters run")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    keys = key_specs(7, COUNTER_KINDS) if args.counters else key_specs(args.keys)
    dsn = os.environ.get("RUNBUS_BENCH_POSTGRES_DSN", DEFAULT_DSN)
    with private_redis() as redis_url, tempfile.TemporaryDirectory(prefix="runbus-bench-tables-") as tmp:
        for kind in args.store.split(","):
            backend = Backend(kind, os.path.join(tmp, kind), dsn)
            empty = empty_size(backend, redis_url)
            with backend.fresh("run") as url:
                cpu = time.process_time()
                found: dict[str, Any] = ingest(redis_url, url, "bench-tables", args.labels, args.steps, keys)
                size = backend.size(url)
                points = found["points"]
                print(
                    f"{kind}: {points} points, {size - empty} bytes over an empty store's {empty}: "
                    f"{(size - empty) / points:.3f} B/point; log lines {backend.log_bytes(url) / points:.3f} "
                    f"B/point; ingest {found['ingest_s']} s (bench CPU {time.process_time() - cpu:.1f} s)"
                )
                lines = (
                    sqlite_tables(url, points)
                    if kind == "sqlite"
                    else asyncio.run(postgres_tables(url, points))
                )
                print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
