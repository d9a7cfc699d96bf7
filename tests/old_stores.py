"""Stores older runbus wrote (schema 7: a row per value; schema 10: open rollup rows), for migration tests.

tests/data/schema7.sqlite.gz and tests/data/schema7.pg.sql.gz (a `pg_dump --inserts` of the
same) were written by `python tests/old_stores.py OUT_DIR POSTGRES_DSN` run with the code of
commit 30e2163, the last before schema 8 (a worktree of it, with runbus installed from it):
`write()` below is all it runs, through Store.write, which that code and this take alike.
tests/data/schema10.* were written so (`... OUT_DIR POSTGRES_DSN schema10`) by the code of commit
9ebfc01, the last whose stores keep each series' open bucket as a label_open row (schema 10).
`events()` is deterministic, so a test knows every value those stores hold.

Two runs: "done", whose three labels ended (the primary restarted once), and "live", whose label
is still running; noisy, smooth, constant and integer keys, NaN and ±inf, steps never given,
system samples and log lines between the metrics.
"""

from __future__ import annotations

import asyncio
import gzip
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile

from runbus.wire import Event

T0 = 1_700_000_000.25


def _label_events(
    run: str, label: str, epoch: int, first_ts: float, count: int, rnd: random.Random
) -> list[Event]:
    events = [
        Event(run, label, "start", epoch, 1, first_ts, {"primary": label == "rank0", "config": {}}, None)
    ]
    ts = first_ts
    for seq in range(2, count + 2):
        ts += 0.05 + rnd.random() * 0.01
        if seq % 17 == 0:
            events.append(
                Event(run, label, "log", epoch, seq, ts, {"stream": "stdout", "text": f"step {seq}"}, None)
            )
            continue
        if seq % 29 == 0:
            events.append(
                Event(
                    run, label, "system", epoch, seq, ts, {"cpu": rnd.random() * 100, "rss_mb": 812.0}, None
                )
            )
            continue
        values: dict[str, float | int] = {
            "loss": 2.0 / seq + rnd.gauss(0, 0.01),
            "lr": 0.001 * (1 - seq / 10_000),
            "const": 3.0,
            "tokens": seq * 4096,
        }
        if seq % 101 == 0:
            values["loss"] = [math.nan, math.inf, -math.inf][seq % 3]
        step = None if seq % 13 == 0 else seq
        events.append(Event(run, label, "metric", epoch, seq, ts, values, step))
    return events


def events() -> list[Event]:
    """Every event the old stores were written from."""
    rnd = random.Random(22)
    out: list[Event] = []
    for n in range(3):
        label = f"rank{n}"
        out += _label_events("done", label, 1, T0 + n, 1200, rnd)
        end = out[-1].seq + 1
        if label == "rank0":  # dies, then lives again in a later lease epoch
            out.append(Event("done", label, "finish", 1, end, out[-1].ts + 1, {"exit_code": 1}, None))
            out += _label_events("done", label, 2, T0 + 500, 300, rnd)
            end = out[-1].seq + 1
            out.append(Event("done", label, "finish", 2, end, out[-1].ts + 1, {"exit_code": 0}, None))
        else:
            out.append(Event("done", label, "finish", 1, end, out[-1].ts + 1, {"exit_code": 0}, None))
    out += _label_events("live", "rank0", 1, T0 + 900, 700, rnd)
    return out


async def write(url: str) -> None:
    from runbus.storage import open_store

    store = open_store(url)
    await store.connect()
    try:
        made = events()
        for first in range(0, len(made), 500):
            await store.write(made[first : first + 500])
    finally:
        await store.close()


def _pg_dump() -> str:
    found = shutil.which("pg_dump")
    if found:
        return found
    for version in sorted(os.listdir("/usr/lib/postgresql"), reverse=True):
        return f"/usr/lib/postgresql/{version}/bin/pg_dump"
    raise SystemExit("pg_dump not found")


def main(out_dir: str, dsn: str, name: str = "schema7") -> None:
    """Write both old stores into `out_dir` as NAME.sqlite.gz and NAME.pg.sql.gz (run with the old
    code: see the module)."""
    import asyncpg

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "old.db")
        asyncio.run(write(f"sqlite:///{path}"))
        with open(path, "rb") as source, gzip.open(os.path.join(out_dir, f"{name}.sqlite.gz"), "wb") as out:
            shutil.copyfileobj(source, out)

    async def fresh_database() -> str:
        con = await asyncpg.connect(dsn)
        try:
            await con.execute(f"DROP DATABASE IF EXISTS runbus_{name}")
            await con.execute(f"CREATE DATABASE runbus_{name}")
        finally:
            await con.close()
        return dsn.rsplit("/", 1)[0] + f"/runbus_{name}"

    url = asyncio.run(fresh_database())
    asyncio.run(write(url))
    dump = subprocess.run(
        [_pg_dump(), "--inserts", "--no-owner", "--no-privileges", url], check=True, capture_output=True
    ).stdout
    with gzip.open(os.path.join(out_dir, f"{name}.pg.sql.gz"), "wb") as out:
        out.write(dump)


if __name__ == "__main__":
    main(*sys.argv[1:4])
