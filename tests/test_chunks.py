"""Values in column chunks (storage/chunking.py, storage/values.py), on every backend: what goes in
comes back bit for bit and in order, whether it is read from the head rows, from chunks or from
both, and whatever order its batches came in."""

from __future__ import annotations

import asyncio
import math
import random
import sqlite3
import struct
import time

import asyncpg
import pytest

from runbus.storage import Store
from runbus.storage import sqlite as sqlite_backend
from runbus.storage.chunking import COMPACT_EVENTS
from tests.helpers import OpenStore
from tests.test_storage import RUN, finish, metric, start, system

# Bit patterns a float64 store must keep: signed zeros, infinities, the extremes, subnormals.
AWKWARD = [
    0.0,
    -0.0,
    math.inf,
    -math.inf,
    5e-324,
    -5e-324,
    1.7976931348623157e308,
    0.1 + 0.2,
    2.0**53 + 2,
    -1.5,
]


def bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def same(a: float, b: float) -> bool:
    """Equal bit for bit, any NaN equal to any NaN (SQLite's head keeps NaN as NULL)."""
    return (math.isnan(a) and math.isnan(b)) or bits(a) == bits(b)


async def point_rows(store: Store, table: str = "metrics") -> list[tuple]:
    read = store.metrics if table == "metrics" else store.system
    return [(p.label, p.key, p.step, p.epoch, p.seq, bits(p.ts), p.value) for p in await read(RUN)]


async def chunk_count(store: Store) -> int:
    values = await store.values(RUN)
    return len(values)


def noisy(seq: int) -> float:
    return 2.0 / (1 + seq) + random.Random(seq).gauss(0, 0.01)


async def test_values_come_back_bit_for_bit_from_the_head_and_from_chunks(store: Store) -> None:
    timestamps = [1_700_000_000.123456 + i * 0.0173 + random.Random(i).random() * 1e-6 for i in range(40)]
    events = [start(1, primary=True)]
    for i, value in enumerate(AWKWARD * 3 + [math.nan] * 2):
        events.append(metric(2 + i, {"x": value, "y": i}, step=i if i % 7 else None, ts=timestamps[i]))
    events.append(system(40, {"cpu": -0.0}, ts=timestamps[39]))
    await store.write(events)
    before = await point_rows(store)
    assert len(before) == 2 * (len(AWKWARD) * 3 + 2)
    await store.write([finish(41)])  # the label ends: its head is compacted
    after = await point_rows(store)
    assert [r[:6] for r in after] == [r[:6] for r in before]
    assert all(same(a[6], b[6]) for a, b in zip(after, before, strict=True))
    by_seq = {p.seq: p for p in await store.metrics(RUN, key="x")}
    for i, value in enumerate(AWKWARD * 3):
        assert same(by_seq[2 + i].value, value), (i, value, by_seq[2 + i].value)
        assert bits(by_seq[2 + i].ts) == bits(timestamps[i])
        assert by_seq[2 + i].step == (i if i % 7 else None)
    (cpu,) = await store.system(RUN)
    assert bits(cpu.ts) == bits(timestamps[39])


async def test_a_label_epoch_is_compacted_once_its_head_is_full_and_reads_span_both(store: Store) -> None:
    total = COMPACT_EVENTS + 1500
    await store.write([start(1, primary=True)])
    for first in range(2, total + 2, 1000):
        await store.write(
            [
                metric(s, {"loss": noisy(s), "lr": 0.001}, step=s - 2)
                for s in range(first, min(first + 1000, total + 2))
            ]
        )
    values = await store.values(RUN)
    assert len(values) == 2 * total
    assert values.keys == ["loss", "lr"]
    loss = await store.metrics(RUN, key="loss")
    assert [p.seq for p in loss] == list(range(2, total + 2))
    assert [p.value for p in loss] == [noisy(s) for s in range(2, total + 2)]


async def test_a_late_event_inside_a_compacted_range_is_read_in_its_place(store: Store) -> None:
    await store.write([start(1, primary=True)])
    await store.write([metric(s, {"loss": float(s)}, step=s) for s in range(2, 600) if s != 300])
    await store.write([finish(600)])
    await store.write([metric(300, {"loss": 300.0}, step=300)])  # after compaction: a head row
    await store.write([metric(300, {"loss": -1.0}, step=300)])  # redelivered: absorbed
    seqs = [p.seq for p in await store.metrics(RUN, key="loss")]
    assert seqs == list(range(2, 600))
    page = []
    after = None
    while True:
        got = await store.point_page("metrics", RUN, "rank0", after, 97)
        page += got
        if len(got) < 97:
            break
        after = (got[-1].key, got[-1].epoch, got[-1].seq)
    assert [p.seq for p in page] == list(range(2, 600))
    assert [p.value for p in page] == [float(s) for s in range(2, 600)]


async def test_pages_of_chunks_and_head_read_every_point_once_in_order(store: Store) -> None:
    await store.write([start(1, primary=True)])
    events = [
        metric(s, {f"k{s % 5}": noisy(s), "all": float(s)}, step=s) for s in range(2, COMPACT_EVENTS + 900)
    ]
    random.Random(7).shuffle(events)
    for first in range(0, len(events), 700):
        await store.write(events[first : first + 700])
    whole = await store.metrics(RUN)
    keyed = sorted((p.key, p.epoch, p.seq, p.value) for p in whole)
    for limit in (50, 333, 5000):
        paged, after = [], None
        while True:
            got = await store.point_page("metrics", RUN, "rank0", after, limit)
            paged += [(p.key, p.epoch, p.seq, p.value) for p in got]
            if len(got) < limit:
                break
            after = (got[-1].key, got[-1].epoch, got[-1].seq)
        assert paged == keyed


@pytest.mark.parametrize("table", ["metrics", "system"])
async def test_a_read_of_some_keys_and_labels_reads_only_those(store: Store, table: str) -> None:
    made = metric if table == "metrics" else system
    events = []
    for rank in range(3):
        label = f"rank{rank}"
        events += [start(1, primary=rank == 0, label=label)]
        events += [made(s, {"a": s * 1.0, "b": -s * 1.0}, label=label) for s in range(2, 50)]
        events += [finish(50, label=label)]
    await store.write(events)
    values = await store.values(RUN, table, keys=["b"], labels=["rank2", "rank0"])
    assert values.labels == ["rank0", "rank2"] and values.keys == ["b"]
    assert len(values) == 2 * 48
    assert sorted(set(values.value.tolist())) == sorted({-s * 1.0 for s in range(2, 50)})
    assert len(await store.values(RUN, table, keys=[])) == 0


async def run_sql(url: str, *statements: str) -> list[tuple]:
    """Run `statements` on the store at `url` as it stands (its own connection): the last one's rows."""
    found: list[tuple] = []
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            for statement in statements:
                found = con.execute(statement).fetchall()
        finally:
            con.close()
        return found
    pg = await asyncpg.connect(url)
    try:
        for statement in statements:
            found = [tuple(row) for row in await pg.fetch(statement)]
    finally:
        await pg.close()
    return found


async def head_and_chunks(url: str) -> tuple[int, int]:
    """How many head rows (metrics and system) and chunk rows the store holds."""
    ((head, chunks),) = await run_sql(
        url,
        "SELECT (SELECT count(*) FROM metrics) + (SELECT count(*) FROM system), "
        "(SELECT count(*) FROM chunks)",
    )
    return head, chunks


def labelled_values(labels: int) -> list:
    events = []
    for rank in range(labels):
        label = f"rank{rank}"
        events += [start(1, primary=rank == 0, label=label)]
        events += [metric(s, {"loss": noisy(s), "zero": -0.0}, step=s, label=label) for s in range(2, 300)]
        events += [system(s, {"cpu": s / 3}, label=label) for s in range(300, 340)]
    return events


async def test_a_store_from_before_chunks_is_compacted_a_few_label_epochs_at_a_time(
    open_stores: OpenStore, any_store_url: str
) -> None:
    first = await open_stores()
    await first.write(labelled_values(3))
    want = (await point_rows(first), await point_rows(first, "system"))
    await first.close()
    # The store as schema 7 left it: values in rows only.
    version = sqlite_backend.MIGRATIONS.index(sqlite_backend.CHUNKS_SCHEMA)
    if any_store_url.startswith("sqlite"):
        old = ["DROP INDEX label_epochs_due", f"PRAGMA user_version = {version}"]
    else:
        old = [f"DELETE FROM schema_version WHERE version > {version}"]
    await run_sql(any_store_url, "DROP TABLE chunks", *old, "ALTER TABLE label_epochs DROP COLUMN head")
    migrated = await open_stores()
    assert (await point_rows(migrated), await point_rows(migrated, "system")) == want
    assert await migrated.compact_due(2) == 1
    assert await migrated.compact_due(2) == 0
    assert (await head_and_chunks(any_store_url))[0] == 0
    assert (await point_rows(migrated), await point_rows(migrated, "system")) == want


async def test_a_crashed_labels_values_are_compacted(open_stores: OpenStore, any_store_url: str) -> None:
    store = await open_stores()
    await store.write(labelled_values(2))
    want = (await point_rows(store), await point_rows(store, "system"))
    assert await head_and_chunks(any_store_url) == (2 * (2 * 298 + 40), 0)
    assert len(await store.mark_crashed(time.time() + 60)) == 2
    head, chunks = await head_and_chunks(any_store_url)
    assert head == 0 and chunks == 2 * 4  # per label: loss, zero, cpu and the clock
    assert (await point_rows(store), await point_rows(store, "system")) == want


async def test_compaction_while_batches_are_written_loses_and_doubles_nothing(
    store: Store, any_store_url: str
) -> None:
    labels = [f"rank{n}" for n in range(3)]
    await store.write([start(1, primary=n == 0, label=label) for n, label in enumerate(labels)])
    first = [metric(s, {"loss": float(s)}, step=s, label=label) for label in labels for s in range(2, 1000)]
    await store.write(first)
    # Every label epoch due, as migration 8 leaves an old store's.
    await run_sql(any_store_url, f"UPDATE label_epochs SET head = {COMPACT_EVENTS}")

    async def write_more() -> None:
        for low in range(1000, 3000, 250):
            await store.write(
                [
                    metric(s, {"loss": float(s)}, step=s, label=label)
                    for label in labels
                    for s in range(low, low + 250)
                ]
            )

    async def compact() -> None:
        left = 1
        while left:
            left = await store.compact_due(1)

    await asyncio.gather(write_more(), compact(), compact())
    await compact()
    found = sorted((p.label, p.seq, p.value) for p in await store.metrics(RUN))
    assert found == sorted((label, s, float(s)) for label in labels for s in range(2, 3000))
    assert await store.compact_due() == 0
