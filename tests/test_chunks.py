"""Values in column chunks (storage/chunking.py, storage/values.py), on every backend: what goes in
comes back bit for bit and in order, whether it is read from the head rows, from chunks or from
both, and whatever order its batches came in."""

from __future__ import annotations

import asyncio
import gzip
import math
import random
import signal
import sqlite3
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import cast

import asyncpg
import numpy as np
import pytest
import redis

from runbus.storage import Store, columns, open_store, reads, values
from runbus.storage.chunking import CLOCK, COMPACT_EVENTS, DIRECT_EVENTS
from runbus.storage.columns import bounds
from tests import old_stores
from tests.helpers import (
    T0,
    OpenStore,
    ingest,
    ingest_command,
    read_store,
    stderr_on_a_terminal,
    wait_for,
    xadd_event,
)
from tests.test_faults import start_ingester
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


async def test_keys_logged_at_every_event_or_some_keep_each_points_timestamp(store: Store) -> None:
    # "every" is logged at each event of its compaction: its chunks hold their clock chunks' seqs
    # and take their timestamps point for point; "odd" and "late" (a late event's chunk) look
    # theirs up by seq. Read alone, together and with other labels, every point keeps its own.
    ts = {s: 1_700_000_000.5 + s * 0.25 + random.Random(s).random() * 1e-3 for s in range(2, 900)}
    for label in ("rank0", "rank1"):
        await store.write([start(1, primary=label == "rank0", label=label)])
        await store.write(
            [
                metric(
                    s, {"every": float(s), **({"odd": -s} if s % 2 else {})}, step=s, ts=ts[s], label=label
                )
                for s in range(2, 800)
            ]
        )
        await store.write([finish(800, label=label)])
        await store.write([metric(850, {"late": 1.0, "every": 850.0}, step=850, ts=ts[850], label=label)])
    for keys, labels in (
        (None, None),
        (["every"], None),
        (["odd"], ["rank1"]),
        (["every", "late"], ["rank0"]),
    ):
        found = await store.values(RUN, keys=keys, labels=labels)
        assert len(found)
        expected = [bits(ts[s]) for s in found.seq.tolist()]
        assert [bits(t) for t in found.ts.tolist()] == expected, (keys, labels)
        if "every" in found.keys:
            every = found.key == found.keys.index("every")
            assert found.value[every].tolist() == [float(s) for s in found.seq[every].tolist()]


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


async def test_a_read_in_many_slices_on_threads_keeps_every_point_in_order(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slices of 50 points: a chunk of several hundred is never cut, chunks of three labels
    # overlap where late events were compacted after them, and slices decode side by side.
    monkeypatch.setattr(values, "SLICE_POINTS", 50)
    late = {300, 301, 450}
    for label in ("rank0", "rank1", "rank2"):
        await store.write([start(1, primary=label == "rank0", label=label)])
        await store.write(
            [
                metric(s, {"loss": noisy(s), "lr": float(s)}, step=s, label=label)
                for s in range(2, 600)
                if s not in late
            ]
        )
        await store.write([finish(600, label=label)])
        await store.write(
            [metric(s, {"loss": noisy(s), "lr": float(s)}, step=s, label=label) for s in sorted(late)]
        )
    found = await store.values(RUN)
    assert found.labels == ["rank0", "rank1", "rank2"] and found.keys == ["loss", "lr"]
    expected = [(lab, key, s) for lab in range(3) for key in range(2) for s in range(2, 600)]
    assert list(zip(found.label.tolist(), found.key.tolist(), found.seq.tolist(), strict=True)) == expected
    assert found.value[found.key == 1].tolist() == [float(s) for s in range(2, 600)] * 3
    assert not np.isnan(found.ts).any()


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


# -- a store written before chunks (tests/old_stores.py) -------------------------------------------

DATA = Path(__file__).parent / "data"


async def restore_old_store(any_store_url: str, schema: int = 7) -> str:
    """A store tests/old_stores.py wrote with the code of `schema` (7: the last before chunks),
    at a new URL of `any_store_url`'s backend."""
    if any_store_url.startswith("sqlite"):
        unpack(f"schema{schema}.sqlite.gz", Path(any_store_url.removeprefix("sqlite:///")))
        return any_store_url
    dump = unpack(f"schema{schema}.pg.sql.gz").decode()
    # pg_dump's \restrict lines are psql's, not SQL.
    script = "\n".join(line for line in dump.splitlines() if not line.startswith("\\"))
    con = await asyncpg.connect(any_store_url)
    try:
        await con.execute(script)
    finally:
        await con.close()
    return any_store_url


def unpack(name: str, into: Path | None = None) -> bytes:
    data = gzip.decompress((DATA / name).read_bytes())
    if into is not None:
        into.write_bytes(data)
    return data


def expected_points(table: str) -> set[tuple]:
    kind = "metric" if table == "metrics" else "system"
    return {
        (e.run, e.label, key, e.step if kind == "metric" else None, e.epoch, e.seq, bits(e.ts), plain(value))
        for e in old_stores.events()
        if e.kind == kind
        for key, value in e.data.items()
    }


def plain(value: float) -> float | str:
    return "nan" if math.isnan(value) else float(value)


async def stored_points(store: Store, table: str) -> set[tuple]:
    read = store.metrics if table == "metrics" else store.system
    return {
        (run, p.label, p.key, p.step, p.epoch, p.seq, bits(p.ts), plain(p.value))
        for run in ("done", "live")
        for p in await read(run)
    }


async def test_a_store_written_before_chunks_is_migrated_and_compacted_resumably_value_for_value(
    open_stores: OpenStore, any_store_url: str
) -> None:
    url = await restore_old_store(any_store_url)
    want = {table: expected_points(table) for table in ("metrics", "system")}
    assert len(want["metrics"]) > 15_000
    store = await open_stores(url)
    # Migrated: every value still read, from the rows, each label epoch due for compaction.
    assert {t: await stored_points(store, t) for t in want} == want
    assert await store.compact_due(0) == 5  # done: rank0 in two lease epochs, rank1, rank2; live: rank0
    assert await store.compact_due(2) == 3
    await store.close()
    store = await open_stores(url)  # the compaction goes on where it stopped
    left = await store.compact_due(0)
    while left:
        left = await store.compact_due(3)
    assert {t: await stored_points(store, t) for t in want} == want
    logs = await store.logs("done")
    assert len(logs) == sum(1 for e in old_stores.events() if e.kind == "log" and e.run == "done")
    # The live label goes on in its epoch: its new values join the compacted ones in order.
    last = max(e.seq for e in old_stores.events() if e.run == "live")
    await store.write([metric(last + 1, {"loss": 0.5}, step=last + 1, run="live")])
    loss = (await store.values("live", keys=["loss"])).seq.tolist()
    assert loss == sorted(loss) and loss[-1] == last + 1


async def chunk_formats(url: str) -> dict[str, set[int]]:
    """The chunk formats (their header's version byte) each run's stored chunks are in."""
    query = "SELECT l.run_id, c.data FROM chunks c JOIN labels l ON l.id = c.label_id"
    if url.startswith("sqlite"):
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as con:
            rows = con.execute(query).fetchall()
    else:
        con = await asyncpg.connect(url)
        try:
            rows = await con.fetch(query)
        finally:
            await con.close()
    found: dict[str, set[int]] = {}
    for run, data in rows:
        found.setdefault(run, set()).add(bytes(data)[0])
    return found


async def test_chunks_written_before_pcodec_read_as_they_were_and_beside_those_written_after(
    open_stores: OpenStore, any_store_url: str
) -> None:
    """A store of schema 10 (tests/data: its chunks in format 1, byte planes) read by this code:
    every value as its writer stored it; the live label's next values, written in format 2
    (pcodec), read in one read with the format 1 chunks before them, in order, bit for bit."""
    url = await restore_old_store(any_store_url, schema=10)
    want = {table: expected_points(table) for table in ("metrics", "system")}
    store = await open_stores(url)
    assert await chunk_formats(url) == {"done": {1}, "live": {1}}
    assert {t: await stored_points(store, t) for t in want} == want
    last = max(e.seq for e in old_stores.events() if e.run == "live")
    ts = max(e.ts for e in old_stores.events() if e.run == "live")
    new = [
        metric(last + n, {"loss": math.sin(n) / 3, "tokens": n * 4096}, step=last + n, run="live", ts=ts + n)
        for n in range(1, 400)  # a batch of its own chunks (chunking.DIRECT_EVENTS), with the head
    ]
    await store.write(new)
    assert await chunk_formats(url) == {"done": {1}, "live": {1, 2}}
    found = await store.values("live", keys=["loss"])
    old = sorted((p for p in want["metrics"] if p[0] == "live" and p[2] == "loss"), key=lambda p: p[5])
    expected = [(p[5], p[3], p[6], p[7]) for p in old] + [
        (e.seq, e.step, bits(e.ts), plain(e.data["loss"])) for e in new
    ]
    assert [(p.seq, p.step, bits(p.ts), plain(p.value)) for p in found.points()] == expected
    done = {t: {p for p in await stored_points(store, t) if p[0] == "done"} for t in want}
    assert done == {t: {p for p in want[t] if p[0] == "done"} for t in want}


def test_a_migration_shows_its_progress_on_a_terminal_and_logs_it_in_a_pipe(
    redis_url: str, tmp_path: Path
) -> None:
    on_terminal, in_pipe = (f"sqlite:///{tmp_path / name}.db" for name in ("terminal", "pipe"))
    for url in (on_terminal, in_pipe):
        asyncio.run(restore_old_store(url))
    drawn = stderr_on_a_terminal(ingest_command(redis_url, on_terminal, "--burst"))
    assert b"runbus migration: 5/5 label epochs compacted (100%)" in drawn and b"\r\x1b[K" in drawn
    piped = subprocess.run(
        ingest_command(redis_url, in_pipe, "--burst"), capture_output=True, timeout=300, check=True
    )
    assert b"\x1b[K" not in piped.stderr and b"compacted 5 label epochs into column chunks" in piped.stderr
    for url in (on_terminal, in_pipe):
        assert read_store(url, "compact_due", 0) == 0


# -- a worker killed while it writes ---------------------------------------------------------------

KILLED_LABELS, KILLED_EVENTS = 6, 7000


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as connection:
        yield connection


def killed_run_entries(client: redis.Redis) -> set[tuple]:
    """Write KILLED_LABELS streams of KILLED_EVENTS metric events each (a label epoch crosses
    COMPACT_EVENTS on the way, then ends), by hand; the points they hold."""
    want = set()
    rnd = random.Random(5)
    with client.pipeline(transaction=False) as pipe:
        for n in range(KILLED_LABELS):
            label = f"rank{n}"
            xadd_event(pipe, "killed", label, "start", 1, 1, {"primary": n == 0})
            for seq in range(2, KILLED_EVENTS + 2):
                data = {
                    "loss": rnd.gauss(1, 0.1),
                    "lr": 0.01,
                    "n": seq,
                    **({"rare": -0.0} if seq % 97 == 0 else {}),
                }
                ts = T0 + seq * 0.01 + rnd.random() * 1e-3
                xadd_event(pipe, "killed", label, "metric", 1, seq, data, step=seq // 2, ts=ts)
                want |= {(label, key, seq // 2, seq, bits(ts), bits(float(v))) for key, v in data.items()}
            xadd_event(pipe, "killed", label, "finish", 1, KILLED_EVENTS + 2, {"exit_code": 0})
        pipe.execute()
    return want


def stored_metrics(store_url: str) -> int:
    run = read_store(store_url, "run", "killed")
    return 0 if run is None else run.counts.get("metric", 0)


def test_workers_sigkilled_while_they_write_and_compact_lose_and_repeat_nothing(
    client: redis.Redis, redis_url: str, any_store_url: str
) -> None:
    want = killed_run_entries(client)
    kills, rnd = 0, random.Random(9)
    while kills < 6 and stored_metrics(any_store_url) < KILLED_LABELS * KILLED_EVENTS:
        before = stored_metrics(any_store_url)
        worker = start_ingester(redis_url, any_store_url, "--claim-idle", "0.2", "--batch-size", "50")
        # Killed once it has committed a batch, so while it writes the next ones, a little
        # later each time.
        wait_for("a commit", lambda: worker.poll() is not None or stored_metrics(any_store_url) > before)  # noqa: B023
        time.sleep(rnd.random() * 0.3)
        worker.send_signal(signal.SIGKILL)
        worker.communicate(timeout=30)
        kills += 1
    assert kills >= 3
    ingest(redis_url, any_store_url, claim_idle=0.0)
    run = read_store(any_store_url, "run", "killed")
    assert run.state == "finished" and all(lab.missing == 0 for lab in run.labels)
    values = read_store(any_store_url, "values", "killed")
    got = [(p.label, p.key, p.step, p.seq, bits(p.ts), bits(p.value)) for p in values.points()]
    assert len(got) == len(want)  # nothing stored twice
    assert set(got) == want  # nothing lost, every value and timestamp bit for bit
    # The rollups' open rows and blocks, rewritten whole by each batch, hold every value once too.
    asyncio.run(rollups_recompute(any_store_url, "killed"))
    print(f"\nFIGURE workers SIGKILLed while writing chunks: {kills}, points: {len(want)}, lost: 0, twice: 0")


async def rollups_recompute(store_url: str, run: str) -> None:
    from tests.test_rollups import assert_rollups_recompute  # it imports this module

    store = open_store(store_url)
    await store.connect()
    try:
        await assert_rollups_recompute(store, run, exact=False)
    finally:
        await store.close()


# -- compaction: crashes, and workers compacting while others write -------------------------------


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


async def test_a_crashed_labels_values_are_compacted(open_stores: OpenStore, any_store_url: str) -> None:
    store = await open_stores()
    made = labelled_values(2)
    for first in range(0, len(made), 100):  # batches too small to make chunks of their own
        await store.write(made[first : first + 100])
    want = (await point_rows(store), await point_rows(store, "system"))
    assert await head_and_chunks(any_store_url) == (2 * (2 * 298 + 40), 0)
    assert len(await store.mark_crashed(time.time() + 60)) == 2
    head, chunks = await head_and_chunks(any_store_url)
    assert head == 0 and chunks == 2 * 4  # per label: loss, zero, cpu and the clock
    assert (await point_rows(store), await point_rows(store, "system")) == want


async def test_a_batch_that_makes_its_own_chunks_takes_its_head_with_it_and_counts_none(
    open_stores: OpenStore, any_store_url: str
) -> None:
    """A batch that brings a label epoch DIRECT_EVENTS events or more writes them into chunks at
    once, its head count never grown (chunking.direct_heads): a fresh label epoch's count is
    never written (PostgreSQL: the index of the label epochs due never holds it), the head rows
    before such a batch go into the chunks with it, nothing is left due, and the next small
    batch's head counts from 0."""
    store = await open_stores()
    heads = "SELECT label_id, epoch, head FROM label_epochs ORDER BY label_id, epoch"
    burst = [metric(s, {"loss": noisy(s)}, step=s, label="rank1") for s in range(1, 1 + DIRECT_EVENTS)]
    await store.write(burst)
    assert await head_and_chunks(any_store_url) == (0, 2)  # the key's chunk and the clock's
    assert await run_sql(any_store_url, heads) == [(1, 1, 0)]
    if not any_store_url.startswith("sqlite"):
        # Its metapage alone: never given an entry.
        assert await run_sql(any_store_url, "SELECT pg_relation_size('label_epochs_due')") == [(8192,)]
    await store.write([start(1, primary=True)])
    first = [metric(s, {"loss": noisy(s)}, step=s) for s in range(2, 52)]
    await store.write(first)  # too few to make chunks: a head of 50 events
    assert (await head_and_chunks(any_store_url), (await run_sql(any_store_url, heads))[1:]) == (
        (50, 2),
        [(2, 1, 50)],
    )
    more = [metric(s, {"loss": noisy(s)}, step=s) for s in range(52, 52 + DIRECT_EVENTS)]
    await store.write(more)
    # One chunk of the key and the clock's, the head's 50 events in them.
    assert (await head_and_chunks(any_store_url), (await run_sql(any_store_url, heads))[1:]) == (
        (0, 4),
        [(2, 1, 0)],
    )
    assert await store.compact_due() == 0
    late = [metric(s, {"loss": noisy(s)}, step=s) for s in range(52 + DIRECT_EVENTS, 62 + DIRECT_EVENTS)]
    await store.write(late)
    assert (await run_sql(any_store_url, heads))[1:] == [(2, 1, 10)]
    loss = await store.metrics(RUN, key="loss")
    written = burst + first + more + late
    assert [(p.label, p.seq, bits(p.value)) for p in loss] == [
        (e.label, e.seq, bits(e.data["loss"])) for e in sorted(written, key=lambda e: (e.label, e.seq))
    ]


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


async def test_reads_during_compactions_see_each_value_once(
    open_stores: OpenStore, any_store_url: str
) -> None:
    """A reader of its own (another process's store, as the dashboard's) while a writer's batches
    move head rows into chunks: every read holds each value once, and never fewer than before."""
    writer, reader = await open_stores(), await open_stores()
    labels = [f"rank{n}" for n in range(8)]
    await writer.write([start(1, primary=n == 0, label=label) for n, label in enumerate(labels)])

    async def write() -> None:
        for label in labels:
            for low in range(2, 402, 40):  # small batches: head rows
                await writer.write(
                    [metric(s, {"a": 1.0, "b": 2.0}, step=s, label=label) for s in range(low, low + 40)]
                )
            await writer.write([finish(402, label=label)])  # compacted: rows become chunks

    async def read(done: asyncio.Event) -> int:
        reads, held = 0, 0
        while not done.is_set() or reads < 3:
            found = await reader.values(RUN)
            points = {
                (lab, key, seq)
                for lab, key, seq in zip(
                    found.label.tolist(), found.key.tolist(), found.seq.tolist(), strict=True
                )
            }
            assert len(points) == len(found) >= held  # none twice, none lost since the last read
            held, reads = len(found), reads + 1
        return reads

    done = asyncio.Event()
    reading = asyncio.create_task(read(done))
    await write()
    done.set()
    assert await reading >= 3
    assert len(await reader.values(RUN)) == len(labels) * 400 * 2


async def test_a_compaction_between_a_reads_statements_changes_nothing_it_sees(store_url: str) -> None:
    """SQLite: another process's compaction commits after a read has fetched its chunks and
    before it fetches the head rows (made to, from the reader's trace callback): the read
    still sees every value once, as the store stood when it began."""
    writer, reader = open_store(store_url), open_store(store_url, create=False)
    await writer.connect()
    await reader.connect()
    try:
        await writer.write([start(1, primary=True)])
        await writer.write([metric(s, {"a": float(s)}, step=s) for s in range(2, 102)])  # head rows

        def compact_now(statement: str) -> None:
            if "FROM labels l CROSS JOIN metrics" in statement and not compacted:
                compacted.append(statement)
                writer._in_transaction(writer._write_in_transaction, [finish(102)], {})

        compacted: list[str] = []
        reader._db().set_trace_callback(compact_now)
        found = await reader.values(RUN)
        reader._db().set_trace_callback(None)
        assert compacted, "the read's head statement never ran"
        assert found.seq.tolist() == list(range(2, 102))
        assert (await reader.values(RUN)).seq.tolist() == list(range(2, 102))  # now from chunks
    finally:
        await writer.close()
        await reader.close()


async def damage_chunks(url: str, key: str | None) -> int:
    """Each chunk of series `key` (None: each clock chunk) with the payload of the column a read
    decodes of it (a key's values, a clock's timestamps) replaced by as many bytes of garbage, as
    a store damaged on disk or by hand would hold it; how many."""
    of = f"= {CLOCK}" if key is None else "IN (SELECT id FROM series WHERE key = {})"
    chosen = f"SELECT label_id, series_id, epoch, first_seq, data FROM chunks WHERE series_id {of}"
    change = (
        "UPDATE chunks SET data = {} WHERE label_id = {} AND series_id = {} AND epoch = {} AND first_seq = {}"
    )

    def garbled(data: bytes) -> bytes:
        parts = columns.columns(data)[1]
        # The values column is the last; a clock's timestamps the one before it.
        end = len(data) if key is not None else len(data) - columns.COLUMN.size - len(parts[-1][1])
        size = len(parts[-1 if key is not None else -2][1])
        return data[: end - size] + (bytes(range(256)) * (size // 256 + 1))[:size] + data[end:]

    if url.startswith("sqlite"):
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as con:
            rows = con.execute(chosen.format("?"), () if key is None else (key,)).fetchall()
            for *where, data in rows:
                con.execute(change.format("?", "?", "?", "?", "?"), (garbled(data), *where))
            con.commit()
        return len(rows)
    con = await asyncpg.connect(url)
    try:
        rows = await con.fetch(chosen.format("$1"), *([] if key is None else [key]))
        for *where, data in rows:
            await con.execute(change.format("$1", "$2", "$3", "$4", "$5"), garbled(data), *where)
    finally:
        await con.close()
    return len(rows)


async def store_with_damaged(open_stores: OpenStore, url: str, key: str | None) -> Store:
    """A store of rank0's `loss` and `lr` over 598 steps, in chunks, whose chunks of `key` (None:
    its clock chunks) damage_chunks garbled."""
    store = await open_stores(url)
    await store.write([start(1, primary=True)])
    await store.write([metric(s, {"loss": noisy(s), "lr": 0.001}, step=s) for s in range(2, 600)])
    assert await damage_chunks(url, key) >= 1
    return store


async def test_a_damaged_chunk_is_a_format_error_that_names_its_label_and_key(
    open_stores: OpenStore, any_store_url: str
) -> None:
    store = await store_with_damaged(open_stores, any_store_url, "loss")
    with pytest.raises(columns.FormatError, match="label 'rank0', key 'loss', lease epoch 1"):
        await store.values(RUN, keys=["loss"])
    with pytest.raises(columns.FormatError, match="key 'loss'"):
        await store.metrics(RUN)
    lr = await store.metrics(RUN, key="lr")  # the other series reads as it was
    assert [p.seq for p in lr] == list(range(2, 600)) and {p.value for p in lr} == {0.001}


async def test_a_damaged_clock_chunk_is_a_format_error_that_names_its_label(
    open_stores: OpenStore, any_store_url: str
) -> None:
    store = await store_with_damaged(open_stores, any_store_url, None)
    with pytest.raises(columns.FormatError, match="the clock chunk of label 'rank0', lease epoch 1 does not"):
        await store.values(RUN, keys=["loss"])
    with pytest.raises(columns.FormatError, match="the clock chunk of label 'rank0'"):
        await store.metrics(RUN)


async def test_a_small_read_fetches_only_the_clock_chunks_that_time_its_values(store: Store) -> None:
    """Three labels of 10,000 events each (a clock chunk per 4,096), rank0 alone logging `rare`:
    a read of a few steps, of a label, of a key reads the clock chunks holding its values' seqs,
    not the run's, and its values and timestamps are the whole read's, bit for bit."""
    ts = {s: T0 + s * 0.37 + random.Random(s).random() * 1e-3 for s in range(2, 10_002)}
    for label in ("rank0", "rank1", "rank2"):
        await store.write([start(1, primary=label == "rank0", label=label)])
        await store.write(
            [
                metric(
                    s,
                    {"loss": float(s), **({"rare": 1.0} if label == "rank0" and s < 50 else {})},
                    step=s,
                    ts=ts[s],
                    label=label,
                )
                for s in range(2, 10_002)
            ]
        )
    everything = await store.values(RUN)
    fetcher = cast(reads.Fetcher, store)  # the store's statements, run as Store.values runs them
    every_clock = await fetcher._fetch(
        reads.values_queries(fetcher.dialect, RUN, "metrics", None, None, None)[1]
    )
    assert len(every_clock) == 9
    for keys, labels, steps in (
        (["loss"], None, (4000, 4200)),  # across a chunk's end
        (["loss"], ["rank1"], (9000, 9100)),
        (["rare"], None, None),
        (["loss", "rare"], ["rank2", "rank0"], (30, 60)),
    ):
        found = await store.values(RUN, keys=keys, labels=labels, steps=steps)
        step = everything.step
        wanted = np.isin(np.array(everything.keys)[everything.key], keys)
        wanted &= np.isin(np.array(everything.labels)[everything.label], labels or everything.labels)
        wanted &= (step >= steps[0]) & (step <= steps[1]) if steps else True
        whole = everything.take(wanted)
        assert len(found) == len(whole) > 0
        assert [list(map(bits, c.tolist())) for c in (found.ts, found.value)] == [
            list(map(bits, c.tolist())) for c in (whole.ts, whole.value)
        ]
        assert found.seq.tolist() == whole.seq.tolist() and found.step.tolist() == whole.step.tolist()
        spans: dict[str, tuple[int, int]] = {}
        for code, seq in zip(found.label.tolist(), found.seq.tolist(), strict=True):
            low, high = spans.get(found.labels[code], (seq, seq))
            spans[found.labels[code]] = (min(low, seq), max(high, seq))
        query = reads.values_queries(fetcher.dialect, RUN, "metrics", keys, labels, steps)[1]
        read = sorted((row[0], bounds(row[2]).first_seq) for row in await fetcher._fetch(query))
        needed = sorted(
            (label, head.first_seq)
            for label, _, data in every_clock
            for head in (bounds(data),)
            if label in spans and head.first_seq <= spans[label][1] and head.last_seq >= spans[label][0]
        )
        assert read == needed and len(read) < len(every_clock), (keys, labels, steps)


async def test_a_step_range_reads_the_values_at_those_steps_and_only_their_chunks(store: Store) -> None:
    await store.write([start(1, primary=True)])
    await store.write([metric(s, {"loss": float(s)}, step=s * 10 if s % 9 else None) for s in range(2, 3000)])
    await store.write([metric(s, {"loss": float(s)}, step=s * 10) for s in range(3000, 3100)])  # head rows
    found = await store.values(RUN, steps=(5000, 30500))
    want = [s for s in range(500, 3051) if s % 9 or s >= 3000]
    assert found.seq.tolist() == want and found.step.tolist() == [s * 10 for s in want]
    assert len(await store.values(RUN, steps=(None, 25))) == 1  # seq 2 at step 20
    assert len(await store.values(RUN, steps=(10**9, None))) == 0
    for bad in ((5, 1), (1.5, 2), "1-2", (1, 2, 3), (True, 2)):
        with pytest.raises(ValueError, match="steps"):
            await store.values(RUN, steps=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="system samples have no steps"):
        await store.values(RUN, "system", steps=(1, 2))


def test_a_batch_s_heads_grow_by_its_value_events_per_label_epoch() -> None:
    from runbus.storage.chunking import head_events
    from runbus.wire import Event

    def event(kind: str, epoch: int, seq: int) -> Event:
        return Event(RUN, "rank0", kind, epoch, seq, T0 + seq, {"x": 1.0}, None)

    first = [event("metric", 1, 1), event("log", 1, 2), event("system", 1, 3), event("metric", 2, 1)]
    second = [event("heartbeat", 1, 4), event("start", 3, 1)]
    assert head_events([(7, first), (8, second), (9, [])]) == {(7, 1): 2, (7, 2): 1}
