"""Rollups (storage/rollups.py) and the chart reads on them (storage/charts.py, the dashboard's
envelope, keys, stragglers and labels endpoints), on SQLite and PostgreSQL.

The rollups are checked against a recomputation from the stored values, written here the slow
and obvious way: across batches in any order, redelivered batches, concurrent writers, a
migrated old store, restarts (epochs and generations), NaN and ±inf.
"""

from __future__ import annotations

import asyncio
import math
import random
import sqlite3
import struct
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from dataclasses import astuple
from typing import Any

import asyncpg
import numpy as np
import orjson
import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runbus.dashboard.api import create_app
from runbus.storage import Store, charts, open_store, rollup_blocks, rollups, steptimes
from runbus.storage import postgres as postgres_backend
from runbus.storage import sqlite as sqlite_backend
from runbus.storage.base import Line, Point
from runbus.wire import Event
from tests import old_stores
from tests.helpers import OpenStore, get_json, ingest, keep_values_in_rows, undo_migrations, xadd_event
from tests.pgserver import create_database, drop_database
from tests.test_chunks import restore_old_store

T0 = 1_700_000_000.0
KEYS = ("a", "b")
WIDEST = 1 << 62


def start(run: str, label: str, epoch: int, restarts: int | None = None, ts: float = T0) -> Event:
    data: dict[str, Any] = {"primary": label == "rank0", "config": {}}
    if restarts is not None:
        data["restart_count"] = restarts
    return Event(run, label, "start", epoch, 1, ts, data, None)


def metric(run: str, label: str, epoch: int, seq: int, values: dict, step: int | None, ts: float) -> Event:
    return Event(run, label, "metric", epoch, seq, ts, values, step)


# -- the recomputation ----------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def expected_rows(
    points: list[Point], generation: dict[tuple[str, int], int]
) -> tuple[dict[tuple, list], dict[tuple, tuple[list, Counter]]]:
    """label_rollups and run_rollups as they must be, from the stored values: per (key, width,
    axis, label, epoch, bucket) and per (key, width, axis, generation, bucket)."""
    label_rows: dict[tuple, list[Point]] = defaultdict(list)
    for p in points:
        axis, x = (0, p.step) if p.step is not None else (1, math.floor(p.ts))
        for width in rollups.WIDTHS:
            label_rows[p.key, width, axis, p.label, p.epoch, x // width].append(p)
    labels: dict[tuple, list] = {}
    for row_key, mine in label_rows.items():
        axis = row_key[2]
        xs = [p.step if axis == 0 else math.floor(p.ts) for p in mine]
        real = [p.value for p in mine if not math.isnan(p.value)]
        finite = [v for v in real if math.isfinite(v)]
        last = max(mine, key=lambda p: p.seq)
        labels[row_key] = [
            len(mine),
            len(mine) - len(real),
            len(real) - len(finite),
            sum(finite),
            min(real) if real else None,
            max(real) if real else None,
            last.value,
            last.seq,
            min(xs),
            max(xs),
            min(p.ts for p in mine),
            max(p.ts for p in mine),
            min(p.seq for p in mine),
        ]
    runs: dict[tuple, tuple[list, Counter]] = {}
    for (key, width, axis, label, epoch, bucket), part in labels.items():
        run_key = (key, width, axis, generation[label, epoch], bucket)
        held = runs.get(run_key)
        if held is None:
            runs[run_key] = (part.copy(), Counter())
        else:
            total = held[0]
            for place in (0, 1, 2, 3):
                total[place] += part[place]
            for place, pick in ((4, min), (5, max), (8, min), (9, max), (10, min), (11, max)):
                found = [v for v in (total[place], part[place]) if v is not None]
                total[place] = pick(found) if found else None
    for (key, width, axis, label, epoch, bucket), part in labels.items():
        if width != rollups.FINE_WIDTH:
            continue
        finite = part[0] - part[1] - part[2]
        if finite and math.isfinite(part[3] / finite):
            for coarse in rollups.WIDTHS:
                run_key = (key, coarse, axis, generation[label, epoch], bucket * width // coarse)
                runs[run_key][1][rollups.bin_of(part[3] / finite)] += 1
    return labels, runs


async def stored_rows(store: Store, run: str) -> tuple[dict[tuple, list], dict[tuple, tuple[list, Counter]]]:
    """The rollups a store holds for `run`, read as the chart reads read them (the wider rows
    with the open buckets added)."""
    labels: dict[tuple, list] = {}
    runs: dict[tuple, tuple[list, Counter]] = {}
    page = await store.key_page(run, limit=1000)
    for key in page.keys:
        for axis in (0, 1):
            for width in rollups.WIDTHS:
                for row in await charts.label_rows(store, run, key, axis, width, -WIDEST, WIDEST, None):
                    labels[key, width, axis, row.label, row.epoch, row.bucket] = row.part
                for bucket in await charts.run_rows(store, run, key, axis, width, -WIDEST, WIDEST):
                    part = bucket.part
                    runs[key, width, axis, bucket.generation, bucket.bucket] = (part, Counter(bucket.bins))
    return labels, runs


async def generations_of(store: Store, run: str) -> dict[tuple[str, int], int]:
    found = {}
    for key in (await store.key_page(run, limit=1000)).keys:
        for axis in (0, 1):
            for row in await store.open_buckets(run, key, axis, None):
                found[row.label, row.epoch] = row.generation
    return found


async def assert_rollups_recompute(store: Store, run: str, exact: bool = True) -> None:
    """The store's rollups of `run` are the recomputation's. Not `exact`: the values' sums may
    differ in their last bits with the order they were added in (so may a mean's sketch bin, by one)."""
    points = await store.metrics(run)
    generation = await generations_of(store, run)
    want_labels, want_runs = expected_rows(points, generation)
    got_labels, got_runs = await stored_rows(store, run)

    def alike(place: int, got: Any, want: Any) -> bool:
        if place == 3 and not exact:
            return math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12) or same(got, want)
        return same(got, want)

    assert got_labels.keys() == want_labels.keys()
    for key, want in want_labels.items():
        got = got_labels[key]
        assert all(alike(i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True))), (key, got, want)
    assert got_runs.keys() == want_runs.keys()
    for key, (want, bins) in want_runs.items():
        got, got_bins = got_runs[key]
        places = (0, 1, 2, 3, 4, 5, 8, 9, 10, 11)
        assert all(alike(i, got[i], want[i]) for i in places), (key, got, want)
        if exact:
            assert got_bins == +bins, key
        else:
            mine, theirs = sorted(got_bins.elements()), sorted(bins.elements())
            assert len(mine) == len(theirs) and all(
                abs(a - b) <= 1 for a, b in zip(mine, theirs, strict=True)
            )


# -- values as a property -----------------------------------------------------------------------

# Dyadic values of small magnitude: every sum is exact whatever the order, so the stored sums and
# means are exactly the recomputed ones (and so are the sketch bins of the means).
VALUES = st.one_of(
    st.integers(-400, 400).map(lambda n: n / 4),
    st.integers(-50, 50),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    """Labels with one or two epochs, each a start then metrics at random steps (rising, repeated
    or none: bucketed by ts) and ts, logging one or both keys."""
    events: list[Event] = []
    for n in range(draw(st.integers(1, 3))):
        label = f"rank{n}"
        for epoch in range(1, draw(st.integers(1, 2)) + 1):
            restarts = draw(st.one_of(st.none(), st.integers(0, 2)))
            events.append(start("RUN", label, epoch, restarts, ts=T0 + epoch * 5000))
            count = draw(st.integers(0, 40))
            steps = draw(
                st.one_of(
                    st.lists(st.integers(-5, 700), min_size=count, max_size=count),
                    st.lists(st.integers(0, 300), min_size=count, max_size=count).map(sorted),
                    st.just([None] * count),
                )
            )
            for seq, step in enumerate(steps, start=2):
                keys = draw(st.sampled_from([("a",), ("b",), KEYS]))
                values = {key: draw(VALUES) for key in keys}
                ts = T0 + epoch * 5000 + draw(st.floats(0, 3000, allow_nan=False))
                events.append(metric("RUN", label, epoch, seq, values, step, ts))
    return events


def as_batches(events: list[Event], rnd: random.Random) -> list[list[Event]]:
    """The events in random batches, in random order, some delivered twice."""
    shuffled = events.copy()
    rnd.shuffle(shuffled)
    cuts = sorted(rnd.sample(range(1, len(shuffled)), min(len(shuffled) - 1, rnd.randint(0, 6))))
    batches = [shuffled[a:b] for a, b in zip([0, *cuts], [*cuts, len(shuffled)], strict=True)]
    batches += rnd.sample(batches, min(len(batches), rnd.randint(0, 2)))  # redelivered
    return [b for b in batches if b]


def renamed(events: list[Event], run: str) -> list[Event]:
    return [e._replace(run=run) for e in events]


@pytest.fixture
def backend_url(request: pytest.FixtureRequest, any_store_url: str) -> str:
    return any_store_url


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(histories(), st.randoms(use_true_random=False))
def test_rollups_equal_a_recomputation_from_the_stored_values(
    any_store_url: str, events: list[Event], rnd: random.Random
) -> None:
    run = f"run-{rnd.getrandbits(48):x}"

    async def check() -> None:
        store = open_store(any_store_url)
        await store.connect()
        try:
            for batch in as_batches(renamed(events, run), rnd):
                await store.write(batch)
            await assert_rollups_recompute(store, run)
        finally:
            await store.close()

    asyncio.run(check())


async def test_a_redelivered_batch_changes_no_rollup(open_stores: OpenStore) -> None:
    store = await open_stores()
    batch = [start("r", "rank0", 1)] + [
        metric("r", "rank0", 1, seq, {"loss": seq / 4}, seq, T0 + seq) for seq in range(2, 300)
    ]
    assert await store.write(batch) == len(batch)
    before = await stored_rows(store, "r")
    assert await store.write(batch) == 0
    assert await store.write(batch[100:150] + batch[:10]) == 0
    assert await stored_rows(store, "r") == before
    await assert_rollups_recompute(store, "r")


async def test_concurrent_writers_roll_up_as_one(open_stores: OpenStore, any_store_url: str) -> None:
    """Eight writers at once, each its own labels' batches of one run, small ones (slots change
    hands often): the rollups are the recomputation's, whichever slots the writers took."""
    writers = [await open_stores() for _ in range(8)]
    rnd = random.Random(7)
    batches: list[list[list[Event]]] = [[] for _ in writers]
    for n, mine in enumerate(batches):
        label = f"rank{n}"
        events = [start("r", label, 1, 0)] + [
            metric("r", label, 1, step + 2, {"loss": rnd.randint(0, 99) / 4, "lr": 0.5}, step, T0 + step)
            for step in range(1500)
        ]
        mine += [events[i : i + 60] for i in range(0, len(events), 60)]

    async def write_all(store: Store, mine: list[list[Event]]) -> None:
        for batch in mine:
            await store.write(batch)

    await asyncio.gather(*(write_all(w, b) for w, b in zip(writers, batches, strict=True)))
    await assert_rollups_recompute(writers[0], "r")
    if any_store_url.startswith("postgres"):
        assert await slots_used(any_store_url) <= len(writers)


async def test_a_writer_never_waits_for_a_slot_another_holds(postgres_url: str) -> None:
    """A transaction holding slot 0 (as another worker's batch would) does not hold up a write:
    it takes another slot, and the rollups read back whole."""
    holder = await asyncpg.connect(postgres_url)
    store = open_store(postgres_url)
    await store.connect()
    try:
        await store.write([start("r", "rank0", 1)])
        async with holder.transaction():
            assert await holder.fetchval(
                "SELECT pg_try_advisory_xact_lock($1, 0)", postgres_backend.ROLLUP_SLOT_LOCK
            )
            events = [metric("r", "rank0", 1, s + 2, {"loss": s / 4}, s, T0 + s) for s in range(500)]
            await asyncio.wait_for(store.write(events), 10)
        assert await holder.fetchval("SELECT array_agg(DISTINCT slot) FROM run_rollups") == [1]
        await assert_rollups_recompute(store, "r")
    finally:
        await store.close()
        await holder.close()


async def slots_used(url: str) -> int:
    con = await asyncpg.connect(url)
    try:
        return await con.fetchval("SELECT count(DISTINCT slot) FROM run_rollups")
    finally:
        await con.close()


async def test_a_series_past_its_first_wide_block_keeps_every_bucket(open_stores: OpenStore) -> None:
    """A series whose steps cross 131,072 has wider buckets in two wide blocks: a read of a range
    over both gets them all."""
    store = await open_stores()
    steps = [*range(0, 3000, 7), *range(130_500, 131_900, 5)]
    events = [start("far", "rank0", 1)] + [
        metric("far", "rank0", 1, n + 2, {"loss": n / 8}, step, T0 + n) for n, step in enumerate(steps)
    ]
    for first in range(0, len(events), 97):
        await store.write(events[first : first + 97])
    await assert_rollups_recompute(store, "far")


async def test_an_ended_label_keeps_its_open_buckets_in_blocks(
    open_stores: OpenStore, any_store_url: str
) -> None:
    """A running label's open buckets are label_open rows; the batch that ends it moves them into
    their blocks (the keys it brings values of, and the others); a late value after that goes
    into the blocks too."""
    store = await open_stores()
    events = [start("end", "rank0", 1)]
    for s in range(300):
        events.append(
            metric("end", "rank0", 1, s + 2, {"loss": s / 4, **({"lr": s / 8} if s < 200 else {})}, s, T0 + s)
        )
    for first in range(0, 290, 10):
        await store.write(events[first : first + 10])
    assert await open_rows_by_run(any_store_url) == {"end": 2}
    finish = Event("end", "rank0", "finish", 1, 302, T0 + 301, {"exit_code": 0}, None)
    await store.write([*events[290:], finish])
    assert await open_rows_by_run(any_store_url) == {}
    await assert_rollups_recompute(store, "end")
    await store.write([metric("end", "rank0", 1, 303, {"loss": 1.25, "lr": 0.5}, 400, T0 + 302)])
    assert await open_rows_by_run(any_store_url) == {}
    await assert_rollups_recompute(store, "end")


async def test_writers_one_after_another_share_a_slot(open_stores: OpenStore, any_store_url: str) -> None:
    """A restarted worker takes the lowest free slot again: a run's rows do not spread over a
    slot per restart (a chart merges every slot's row of a bucket)."""
    for n in range(4):
        store = await open_stores()
        events = [start("r", f"rank{n}", 1)] + [
            metric("r", f"rank{n}", 1, s + 2, {"loss": s / 4}, s, T0 + s) for s in range(300)
        ]
        await store.write(events)
        await store.close()
    if any_store_url.startswith("postgres"):
        assert await slots_used(any_store_url) == 1
    checker = await open_stores()
    await assert_rollups_recompute(checker, "r")


# -- the migration -----------------------------------------------------------------------------


async def make_old(url: str) -> None:
    """The store as runbus left it before rollups: their tables gone, its version the one before."""
    tables = (
        "series",
        "label_epochs",
        "label_open",
        "label_blocks",
        "run_rollups",
        "chunks",
        "beats",
        "health",
    )
    before = sqlite_backend.MIGRATIONS.index(sqlite_backend.ROLLUPS_SCHEMA)
    await undo_migrations(url, [f"DROP TABLE {table}" for table in tables], before)


async def test_an_old_store_gets_the_rollups_of_what_it_holds(
    open_stores: OpenStore, any_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd = random.Random(3)
    keep_values_in_rows(monkeypatch)
    first = await open_stores()
    events = []
    for n in range(3):
        label = f"rank{n}"
        events += [start("old", label, 1, 0), start("old", label, 2, 1, ts=T0 + 9000)]
        events += [
            metric("old", label, 1, s + 2, {"loss": rnd.randint(-40, 40) / 8, "acc": s}, s, T0 + s)
            for s in range(700)
        ]
        events += [
            metric("old", label, 2, s + 2, {"loss": math.nan if s == 3 else s / 2}, 600 + s, T0 + 9000 + s)
            for s in range(300)
        ]
        events += [
            metric("old", label, 2, s + 400, {"temp": 40.5}, None, T0 + 9500 + s * 7) for s in range(50)
        ]
    for i in range(0, len(events), 500):
        await first.write(events[i : i + 500])
    want = await stored_rows(first, "old")
    await first.close()
    await make_old(any_store_url)
    monkeypatch.undo()
    # Pages small enough that buckets straddle them.
    backend = sqlite_backend if any_store_url.startswith("sqlite") else postgres_backend
    monkeypatch.setattr(backend, "MIGRATION_PAGE", 333)
    migrated = await open_stores()
    assert await stored_rows(migrated, "old") == want
    await assert_rollups_recompute(migrated, "old")
    assert {g for g in (await generations_of(migrated, "old")).values()} == {1, 2}


# -- the chart reads ----------------------------------------------------------------------------

BIG, SMALL, SHORT = "big", "small", "short"
LABELS, STEPS, RESUME, RESTART = 20, 1500, 900, 1000
OUTLIER, CHRONIC, ONE_OFF = "rank07", "rank03", "rank11"


def step_ts(label: str, step: int, epoch: int) -> float:
    """When `label` logged `step`: 1 s a step, 1.5 s for the chronic straggler, a 60 s stall at
    step 700 for the one-off; the restart's epoch starts an hour later."""
    per_step = 1.5 if label == CHRONIC else 1.0
    ts = T0 + step * per_step + (60.0 if label == ONE_OFF and step >= 700 else 0.0)
    return ts + (3600.0 if epoch == 2 else 0.0)


def big_run() -> list[Event]:
    """LABELS labels, steps 0..RESTART-1 in epoch 1 and RESUME..STEPS-1 after a restart (epoch 2,
    restart count 1, from a checkpoint at RESUME); OUTLIER's loss runs high; `eval` every 100
    steps; `temp` without a step; hardware and a command line with a secret in the start."""
    rnd = random.Random(11)
    events = []
    for n in range(LABELS):
        label = f"rank{n:02d}"
        for epoch, steps, restarts in ((1, range(RESTART), 0), (2, range(RESUME, STEPS), 1)):
            first = start(BIG, label, epoch, restarts, ts=step_ts(label, steps[0], epoch) - 1)
            first.data["host"] = f"node{n // 8}"
            first.data["rank"] = n
            first.data["hardware"] = {
                "gpus": [{"index": 0, "name": "H100" if n < 16 else "A100", "memory_total_mb": 81559}],
                "driver_version": "550.54",
                "cuda_version": "12.4",
                "torch_version": "2.3.0",
                "python_version": "3.11.7",
                "argv": ["train.py", "--lr", "3e-4", "--wandb-api-key", "hunter2hunter2"],
            }
            events.append(first)
            seq = 2
            for step in steps:
                loss = 2.0 + 5.0 / (step + 1) + rnd.gauss(0, 0.02) + (0.5 if label == OUTLIER else 0.0)
                values = {"loss": loss, "lr": 3e-4, "step_time": 1.5 if label == CHRONIC else 1.0}
                events.append(metric(BIG, label, epoch, seq, values, step, step_ts(label, step, epoch)))
                seq += 1
                if step % 100 == 0:
                    events.append(
                        metric(BIG, label, epoch, seq, {"eval": loss}, step, step_ts(label, step, epoch))
                    )
                    seq += 1
                if step % 10 == 0:
                    events.append(
                        metric(BIG, label, epoch, seq, {"temp": 60.0 + n}, None, step_ts(label, step, epoch))
                    )
                    seq += 1
                if epoch == 1 and (step < 200 or step >= 800):  # nobody logs `gappy` in 200..799
                    gappy = metric(BIG, label, epoch, seq, {"gappy": 1.0}, step, step_ts(label, step, epoch))
                    events.append(gappy)
                    seq += 1
    return events


def small_run() -> list[Event]:
    events = []
    for n in range(4):
        label = f"rank{n}"
        events.append(start(SMALL, label, 1, 0))
        for step in range(50):
            values = {"loss": float(n * 100 + step), "gpu/util": 0.5}
            events.append(metric(SMALL, label, 1, step + 2, values, step, T0 + step))
    return events


SHORT_LABELS, SHORT_STEPS, SHORT_SLOW = 8, 100, "rank5"


def short_run() -> list[Event]:
    """SHORT_LABELS labels logging a loss and their step time for SHORT_STEPS steps: 1 s a step,
    SHORT_SLOW 1.5 s."""
    events = []
    for n in range(SHORT_LABELS):
        label = f"rank{n}"
        per_step = 1.5 if label == SHORT_SLOW else 1.0
        events.append(start(SHORT, label, 1, 0))
        for step in range(SHORT_STEPS):
            values = {"loss": 1.0 + n / 100, "step_time": per_step}
            events.append(metric(SHORT, label, 1, step + 2, values, step, T0 + 1 + step * per_step))
    return events


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def charted_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A store of each backend holding BIG, SMALL and SHORT, written once for the tests that read it."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('charted') / 'runbus.db'}"
    else:
        dsn = request.getfixturevalue("postgres_dsn")
        url = asyncio.run(create_database(dsn))

    async def fill() -> None:
        store = open_store(url)
        await store.connect()
        try:
            for events in (big_run(), small_run(), short_run()):
                for i in range(0, len(events), 4000):
                    await store.write(events[i : i + 4000])
        finally:
            await store.close()

    asyncio.run(fill())
    yield url
    if request.param != "sqlite":
        asyncio.run(drop_database(dsn, url))


@pytest.fixture(autouse=True)
def few_raw_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """BIG's keys are read from their rollups, SMALL's and SHORT's as stored."""
    monkeypatch.setattr(charts, "RAW_POINTS", 20_000)


@pytest.fixture
async def charted(charted_url: str) -> AsyncIterator[Store]:
    store = open_store(charted_url, create=False)
    await store.connect()
    yield store
    await store.close()


async def test_a_big_key_s_band_has_a_segment_per_generation_and_its_outliers_as_lines(
    charted: Store,
) -> None:
    found = await charted.envelope(BIG, "loss", points=200)
    assert found is not None
    assert (found.x, found.exact, found.labels, found.all_lines) == ("step", False, LABELS, False)
    assert found.width == charts.choose_width(STEPS, 200) == 128
    assert [s.generation for s in found.band] == [1, 2]
    first, second = found.band
    assert (first.buckets[0].x_lo, first.buckets[-1].x_hi) == (0, RESTART - 1)
    assert (second.buckets[0].x_lo, second.buckets[-1].x_hi) == (RESUME, STEPS - 1)
    assert first.gaps == [] and second.gaps == []
    # Each bucket: every value counted, p10 <= p50 <= p90 inside [min, max].
    for segment in found.band:
        for b in segment.buckets:
            assert b.lo is not None and b.hi is not None and b.p10 is not None and b.p90 is not None
            assert b.lo <= b.p10 <= b.p50 <= b.p90 <= b.hi  # type: ignore[operator]
    assert sum(b.n for s in found.band for b in s.buckets) == LABELS * (RESTART + STEPS - RESUME)
    # The outliers: OUTLIER first, far out; lines have a segment per epoch.
    assert len(found.lines) == 3 and found.lines[0].label == OUTLIER
    assert found.lines[0].distance is not None and found.lines[0].distance > 3 * (
        found.lines[1].distance or 0
    )
    assert [(s.epoch, s.generation) for s in found.lines[0].segments] == [(1, 1), (2, 2)]
    points = [p for s in found.lines[0].segments for p in s.points]
    assert sum(p.n for p in points) == RESTART + STEPS - RESUME


async def test_band_quantiles_are_within_the_sketch_accuracy_of_exact_ones(charted: Store) -> None:
    found = await charted.envelope(BIG, "loss", points=200)
    assert found is not None
    points = await charted.metrics(BIG, key="loss")
    generation = await generations_of(charted, BIG)
    # Exact: per (generation, 128-step bucket), the labels' 128-step means' nearest-rank quantiles.
    means: dict[tuple[int, int], list[float]] = defaultdict(list)
    sums: dict[tuple, list[float]] = defaultdict(list)
    for p in points:
        sums[p.label, p.epoch, p.step // rollups.FINE_WIDTH].append(p.value)  # type: ignore[operator]
    for (label, epoch, bucket), values in sums.items():
        means[generation[label, epoch], bucket].append(sum(values) / len(values))
    for segment in found.band:
        for b in segment.buckets:
            ordered = sorted(means[segment.generation, int(b.x_lo) // found.width])
            for q, got in zip((0.1, 0.5, 0.9), (b.p10, b.p50, b.p90), strict=True):
                exact = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
                assert got is not None and abs(got - exact) <= rollups.ALPHA * abs(exact) * 1.0001


async def test_a_zoomed_band_reads_narrower_buckets_and_x_by_time(charted: Store) -> None:
    zoomed = await charted.envelope(BIG, "loss", start=200, end=455, points=100)
    assert (zoomed is not None and zoomed.width == 128 - 0) or zoomed is not None
    assert zoomed is not None
    assert [s.generation for s in zoomed.band] == [1]
    assert zoomed.band[0].buckets[0].x_lo == 128 and zoomed.band[0].buckets[-1].x_hi == 511
    by_time = await charted.envelope(BIG, "loss", x="ts", start=T0 + 3600, points=100)
    assert by_time is not None and by_time.x == "ts"
    assert [s.generation for s in by_time.band] == [2]  # only the restart's values were logged then
    assert all(b.x_lo >= T0 + 3600 - 1 for b in by_time.band[0].buckets)


async def test_gaps_are_marked_but_not_between_sparse_values_and_keys_without_steps_are_by_time(
    charted: Store,
) -> None:
    sparse = await charted.envelope(BIG, "eval", points=50)
    assert sparse is not None and all(s.gaps == [] for s in sparse.band)
    timed = await charted.envelope(BIG, "temp", points=50)
    assert timed is not None and timed.x == "ts"
    assert [s.generation for s in timed.band] == [1, 2]
    assert timed.band[0].buckets[0].x_lo == T0 and timed.band[1].buckets[0].x_lo >= T0 + 3600 + RESUME
    gappy = await charted.envelope(BIG, "gappy", points=100)
    assert gappy is not None and [s.gaps for s in gappy.band] == [[(199, 800)]]


async def test_a_small_key_is_read_exactly_with_every_label_as_a_line(charted: Store) -> None:
    found = await charted.envelope(SMALL, "loss")
    assert found is not None
    assert (found.exact, found.width, found.all_lines, found.labels) == (True, 1, True, 4)
    assert [line.label for line in found.lines] == [f"rank{n}" for n in range(4)]
    buckets = found.band[0].buckets
    assert len(buckets) == 50
    for step, b in enumerate(buckets):
        values = [float(n * 100 + step) for n in range(4)]
        assert (b.x_lo, b.n, b.lo, b.hi, b.mean) == (step, 4, min(values), max(values), sum(values) / 4)
        assert (b.p10, b.p50, b.p90) == (values[0], values[1], values[3])
    assert [p.value for p in found.lines[2].segments[0].points] == [200.0 + s for s in range(50)]
    assert await charted.envelope(SMALL, "no-such-key") is None


def line_points(line: Line) -> list[tuple[int, int, list[tuple]]]:
    return [(s.epoch, s.generation, [astuple(p) for p in s.points]) for s in line.segments]


@pytest.mark.parametrize(("run", "points", "exact"), [(BIG, 200, False), (SMALL, 1500, True)])
async def test_the_labels_asked_for_are_lines_beside_the_outliers(
    charted: Store, run: str, points: int, exact: bool
) -> None:
    """Rollups (BIG) or values as stored (SMALL, drawn as an envelope past 2 labels): a label
    asked for is the line it would be among every label's, with its distance from the median."""
    every = await charted.envelope(run, "loss", points=points, all_lines_up_to=64)
    assert every is not None and every.all_lines
    by_label = {line.label: line for line in every.lines}
    plain = await charted.envelope(run, "loss", points=points, outliers=2, all_lines_up_to=2)
    assert plain is not None and plain.exact is exact and not plain.all_lines
    outlying = [line.label for line in plain.lines]
    assert len(outlying) == 2 and all(line.outlier for line in plain.lines)
    others = [name for name in sorted(by_label) if name not in outlying][:2]
    asked = [others[1], outlying[0], "nobody", others[0], others[1]]
    found = await charted.envelope(run, "loss", points=points, outliers=2, all_lines_up_to=2, shown=asked)
    assert found is not None and (found.width, found.band) == (plain.width, plain.band)
    assert [line.label for line in found.lines] == [*outlying, others[1], others[0]]
    assert [line.outlier for line in found.lines] == [True, True, False, False]
    assert [line.distance for line in found.lines[:2]] == [line.distance for line in plain.lines]
    for line in found.lines:
        assert line.distance is not None and line.distance >= 0
        assert line_points(line) == line_points(by_label[line.label])
    if run == BIG:
        assert [(s.epoch, s.generation) for s in found.lines[2].segments] == [(1, 1), (2, 2)]
    asked_only = await charted.envelope(
        run, "loss", points=points, outliers=0, all_lines_up_to=2, shown=others
    )
    assert asked_only is not None and [line.label for line in asked_only.lines] == others
    assert not any(line.outlier for line in asked_only.lines)


async def test_stragglers_of_a_short_run_are_read_as_stored(charted: Store) -> None:
    """100 steps: a column per step (the first has no time: nothing logged before it), or per
    4 steps in at most 32 columns; the slow label found either way."""
    for buckets, width in ((128, 1), (32, 4)):
        found = await charted.stragglers(SHORT, "loss", buckets=buckets)
        assert found is not None and found.derived and found.width == width
        assert len(found.buckets) == SHORT_STEPS // width and found.buckets[1] == (width, 2 * width - 1)
        timed = sum(1 for m in found.median if m is not None)
        slow = found.labels[0]
        assert (slow.label, slow.kind, slow.slow_buckets) == (SHORT_SLOW, "chronic", timed)
        assert slow.mean_ratio == pytest.approx(1.5)
        assert 0.5 * (SHORT_STEPS - 1) - 1e-6 <= slow.seconds_behind <= 0.5 * SHORT_STEPS + 1e-6
        assert all(s.kind == "normal" for s in found.labels[1:])
        assert found.median[1:] == pytest.approx([1.0] * (len(found.buckets) - 1))
    assert (await charted.stragglers(SHORT, "loss", buckets=128)).median[0] is None  # type: ignore[union-attr]
    logged = await charted.stragglers(SHORT, "step_time", time_key=True, start=10, end=49, buckets=16)
    assert logged is not None and not logged.derived and logged.width == 4
    assert logged.buckets == [(10, 11), *((step, step + 3) for step in range(12, 48, 4)), (48, 49)]
    assert logged.labels[0].label == SHORT_SLOW and logged.labels[0].mean_ratio == pytest.approx(1.5)


async def test_stragglers_chronic_and_one_off(charted: Store) -> None:
    found = await charted.stragglers(BIG, "loss", buckets=16)
    assert found is not None and found.derived
    kinds = {s.label: s.kind for s in found.labels}
    assert kinds[CHRONIC] == "chronic" and kinds[ONE_OFF] == "one-off"
    assert found.labels[0].label == CHRONIC
    assert found.labels[0].mean_ratio == pytest.approx(1.5, rel=0.01)
    one_off = next(s for s in found.labels if s.label == ONE_OFF)
    assert one_off.worst_step is not None and one_off.worst_step <= 700 < one_off.worst_step + found.width
    assert sum(1 for kind in kinds.values() if kind == "normal") == LABELS - 2
    assert all(m == pytest.approx(1.0, rel=0.01) for m in found.median if m is not None)
    logged = await charted.stragglers(BIG, "step_time", time_key=True, buckets=16)
    assert logged is not None and not logged.derived
    assert logged.labels[0].label == CHRONIC and logged.labels[0].kind == "chronic"
    assert logged.labels[0].mean_ratio == pytest.approx(1.5)


def former_value_cells(
    stored: list[tuple[str, int, int, int | None, float, float]], lo: int, hi: int, time_key: bool, shift: int
) -> dict[tuple[str, int], list[float]]:
    """The stragglers' exact path as it was: Store.key_values' tuples, those with a step in
    lo..hi, made into arrays again (labels coded in code point order) for steptimes.cells."""
    values = [v for v in stored if v[3] is not None and lo <= v[3] <= hi]
    labels = sorted({v[0] for v in values})
    code = {label: i for i, label in enumerate(labels)}
    columns = list(zip(*values, strict=True)) or [()] * 6
    found = steptimes.cells(
        np.fromiter((code[label] for label in columns[0]), np.int32, len(values)),
        np.array(columns[1], np.int64),
        np.array(columns[3], np.int64),
        np.array(columns[4], np.float64),
        np.array(columns[5], np.float64),
        time_key,
        shift,
    )
    return {
        (labels[c], bucket): [seconds, steps]
        for c, bucket, seconds, steps in zip(
            found.label.tolist(),
            found.bucket.tolist(),
            found.seconds.tolist(),
            found.steps.tolist(),
            strict=True,
        )
    }


async def test_the_stragglers_exact_path_reads_the_cells_it_read_from_tuples(
    charted: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BIG's 32,000 losses (20 labels, a restart whose epoch repeats steps 900-999, chunks and
    head rows) and SHORT's, read as stored, over every step and zoomed: the cells from
    Store.values' arrays are the former path's, float for float."""
    monkeypatch.setattr(charts, "RAW_POINTS", 50_000)
    for run, key, time_key in ((BIG, "loss", False), (BIG, "step_time", True), (SHORT, "loss", False)):
        stored = await charted.key_values(run, key)
        for lo, hi, buckets in ((0, STEPS - 1, 32), (300, 1200, 128), (950, 1000, 16), (1490, 1499, 4)):
            width, cells = await charts._straggler_cells(charted, run, key, lo, hi, 1, buckets, time_key)
            former = former_value_cells(stored, lo, hi, time_key, width.bit_length() - 1)
            assert cells == former and bool(cells) == (run == BIG or lo < SHORT_STEPS)
    found = await charted.stragglers(BIG, "loss", buckets=16)  # 32,000 values: read as stored
    assert found is not None and found.width == 128 and found.labels[0].label == CHRONIC


async def test_keys_page_prefix_and_search(open_stores: OpenStore) -> None:
    store = await open_stores()
    keys = [f"layer{n:03d}/grad" for n in range(300)] + ["loss", "lr", "zürich/ä", "Eval/Loss"]
    await store.write([start("keys", "rank0", 1)])
    await store.write([metric("keys", "rank0", 1, 2, dict.fromkeys(keys, 1.0), 0, T0)])
    page = await store.key_page("keys", limit=10)
    assert page.total == 304 and page.keys == sorted(keys)[:10]
    assert (await store.key_page("keys", offset=300, limit=10)).keys == sorted(keys)[300:]
    prefixed = await store.key_page("keys", prefix="layer1", limit=500)
    assert prefixed.total == 100 and all(k.startswith("layer1") for k in prefixed.keys)
    assert (await store.key_page("keys", contains="LOSS")).keys == ["Eval/Loss", "loss"]
    assert (await store.key_page("keys", prefix="zü")).keys == ["zürich/ä"]
    assert (await store.key_page("keys", prefix="nothing")).total == 0
    assert (await store.key_page("no-such-run")).total == 0
    assert await store.metric_keys("keys") == sorted(keys)


def test_prefix_end_is_the_least_text_after_the_prefix() -> None:
    assert charts.prefix_end("abc") == "abd"
    assert charts.prefix_end("a\U0010ffff") == "b"
    assert charts.prefix_end("\U0010ffff") is None
    assert charts.prefix_end("\ud7ff") == "\ue000"


def test_generations_follow_epochs_and_restart_counts() -> None:
    assert rollups.generation_of(5, {}, None) == 1
    assert rollups.generation_of(9, {5: 1}, None) == 2
    assert rollups.generation_of(9, {5: 1}, 0) == 2  # a resume by hand: restart count 0
    assert rollups.generation_of(3, {}, 2) == 3  # joined in the third torchrun round
    assert rollups.generation_of(7, {5: 1, 9: 2}, None) == 2  # an epoch met late: after its predecessor
    assert rollups.restart_count({"restart_count": True}) is None
    assert rollups.restart_count({"restart_count": -1}) is None
    assert rollups.restart_count({"restart_count": 4}) == 4


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=200))
def test_sketch_quantiles_are_within_alpha_of_exact(values: list[float]) -> None:
    bins = Counter(rollups.bin_of(v) for v in values)
    ordered = sorted(values)
    got = rollups.quantiles(bins, (0.1, 0.5, 0.9), ordered[0], ordered[-1])
    for q, estimate in zip((0.1, 0.5, 0.9), got, strict=True):
        exact = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
        assert estimate is not None
        assert abs(estimate - exact) <= rollups.ALPHA * abs(exact) * (1 + 1e-9) + 1e-300
    assert rollups.decode_bins(rollups.encode_bins(bins)) == bins


# -- the dashboard's endpoints -------------------------------------------------------------------


@pytest.fixture
async def chart_api(charted_url: str) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(charted_url))) as client:
        yield client


async def test_the_envelope_endpoint_shape(chart_api: TestClient) -> None:
    doc = await get_json(chart_api, f"/api/runs/{BIG}/metrics/envelope", key="loss", points="200")
    assert {k: doc[k] for k in ("run_id", "key", "x", "width", "exact", "labels", "all_lines")} == {
        "run_id": BIG,
        "key": "loss",
        "x": "step",
        "width": 128,
        "exact": False,
        "labels": LABELS,
        "all_lines": False,
    }
    assert doc["band_columns"] == ["x0", "x1", "n", "nan", "inf", "min", "p10", "p50", "p90", "max", "mean"]
    assert doc["line_columns"] == ["x", "value", "mean", "min", "max", "n"]
    assert [s["generation"] for s in doc["band"]] == [1, 2]
    row = doc["band"][0]["rows"][0]
    assert row[:5] == [0, 127, LABELS * 128, 0, 0] and row[5] <= row[6] <= row[7] <= row[8] <= row[9]
    assert doc["lines"][0]["label"] == OUTLIER
    assert [s["epoch"] for s in doc["lines"][0]["segments"]] == [1, 2]
    small = await get_json(chart_api, f"/api/runs/{SMALL}/metrics/envelope", key="loss")
    assert small["exact"] and small["all_lines"] and len(small["lines"]) == 4
    assert small["lines"][1]["segments"][0]["rows"][0] == [0, 100.0, 100.0, 100.0, 100.0, 1]


async def test_the_keys_stragglers_and_labels_endpoints(chart_api: TestClient) -> None:
    keys = await get_json(chart_api, f"/api/runs/{BIG}/metrics/keys", limit="2", offset="1")
    assert keys == {
        "run_id": BIG,
        "total": 6,
        "offset": 1,
        "limit": 2,
        "next_offset": 3,
        "keys": ["gappy", "loss"],
    }
    assert (await get_json(chart_api, f"/api/runs/{BIG}/metrics/keys", q="TIME"))["keys"] == ["step_time"]
    slow = await get_json(chart_api, f"/api/runs/{BIG}/stragglers", key="loss", buckets="8", limit="3")
    assert slow["source"] == {"key": "loss", "derived": True} and slow["total"] == LABELS
    assert slow["labels"][0]["label"] == CHRONIC and len(slow["labels"]) == 3
    assert len(slow["labels"][0]["step_time"]) == len(slow["buckets"]) == len(slow["median"])
    logged = await get_json(chart_api, f"/api/runs/{BIG}/stragglers", time_key="step_time")
    assert logged["source"] == {"key": "step_time", "derived": False}
    labels = await get_json(chart_api, f"/api/runs/{BIG}/labels", limit="5")
    assert labels["total"] == LABELS and len(labels["labels"]) == 5
    first = labels["labels"][0]
    assert (first["label"], first["host"], first["rank"]) == ("rank00", "node0", 0)
    assert first["hardware"]["cuda_version"] == "12.4"
    assert "hunter2hunter2" not in orjson.dumps(labels).decode()
    assert first["hardware"]["argv"][:3] == ["train.py", "--lr", "3e-4"]
    assert [(g["count"], g["gpus"][0]["name"]) for g in labels["hardware"]] == [(16, "H100"), (4, "A100")]


async def test_the_envelope_endpoint_draws_the_labels_asked_for(chart_api: TestClient) -> None:
    path = f"/api/runs/{BIG}/metrics/envelope"
    plain = await get_json(chart_api, path, key="loss", points="200")
    outlying = [line["label"] for line in plain["lines"]]
    assert outlying[0] == OUTLIER and all(line["outlier"] for line in plain["lines"])
    others = [f"rank{n:02d}" for n in range(LABELS) if f"rank{n:02d}" not in outlying][:2]
    asked = [("key", "loss"), ("points", "200"), ("label", "")]
    asked += [("label", name) for name in (others[0], OUTLIER, "nobody", others[1])]
    response = await chart_api.get(path, params=asked)
    assert response.status == 200, await response.text()
    doc = orjson.loads(await response.read())
    assert doc["band"] == plain["band"] and doc["width"] == plain["width"] == 128
    assert [(line["label"], line["outlier"]) for line in doc["lines"]] == [
        *((name, True) for name in outlying),
        (others[0], False),
        (others[1], False),
    ]
    for line in doc["lines"][3:]:
        assert isinstance(line["distance"], float) and line["distance"] >= 0
        assert [(s["epoch"], s["generation"]) for s in line["segments"]] == [(1, 1), (2, 2)]
        rows = [row for s in line["segments"] for row in s["rows"]]
        assert all(len(row) == len(doc["line_columns"]) for row in rows)
        assert sum(row[-1] for row in rows) == RESTART + STEPS - RESUME
    # Values as stored (SMALL, past `lines`): the label's every value, a row a step.
    small = await chart_api.get(
        f"/api/runs/{SMALL}/metrics/envelope",
        params=[("key", "loss"), ("lines", "2"), ("outliers", "1"), ("label", "rank1"), ("label", "rank2")],
    )
    small_doc = orjson.loads(await small.read())
    assert small_doc["exact"] and not small_doc["all_lines"]
    assert [(line["label"], line["outlier"]) for line in small_doc["lines"]] == [
        ("rank0", True),
        ("rank1", False),
        ("rank2", False),
    ]
    rank1 = small_doc["lines"][1]["segments"][0]["rows"]
    assert rank1 == [[step, 100.0 + step, 100.0 + step, 100.0 + step, 100.0 + step, 1] for step in range(50)]
    assert small_doc["lines"][2]["distance"] == 0  # rank2 is the median


@pytest.mark.parametrize(
    ("labels", "reason"),
    [
        ([f"rank{n}" for n in range(65)], "label must be given at most 64 times, got 65"),
        (["rank1", "not a label"], "invalid label 'not a label'"),
        (["../rank1"], "invalid label"),
    ],
)
async def test_labels_asked_of_an_envelope_are_checked(
    chart_api: TestClient, labels: list[str], reason: str
) -> None:
    params = [("key", "loss"), *(("label", name) for name in labels)]
    response = await chart_api.get(f"/api/runs/{BIG}/metrics/envelope", params=params)
    assert response.status == 400
    assert reason in orjson.loads(await response.read())["error"]


async def test_the_stragglers_of_a_short_run_have_a_column_per_few_steps(chart_api: TestClient) -> None:
    doc = await get_json(chart_api, f"/api/runs/{SHORT}/stragglers", key="loss")
    assert doc["width"] == 4 and len(doc["buckets"]) == len(doc["median"]) == SHORT_STEPS // 4
    assert doc["total"] == SHORT_LABELS and doc["labels"][0]["label"] == SHORT_SLOW
    assert doc["labels"][0]["kind"] == "chronic" and doc["labels"][0]["mean_ratio"] == pytest.approx(1.5)
    assert len(doc["labels"][0]["step_time"]) == len(doc["buckets"])


@pytest.mark.parametrize(
    ("path", "params", "status", "reason"),
    [
        (f"/api/runs/{BIG}/metrics/envelope", {}, 400, "key is required"),
        (f"/api/runs/{BIG}/metrics/envelope", {"key": "loss", "x": "epoch"}, 400, "x must be step or ts"),
        (f"/api/runs/{BIG}/metrics/envelope", {"key": "loss", "start": "nan"}, 400, "finite"),
        (f"/api/runs/{BIG}/metrics/envelope", {"key": "loss", "start": "9", "end": "3"}, 400, "before start"),
        (f"/api/runs/{BIG}/metrics/envelope", {"key": "loss", "points": "1"}, 400, "points"),
        (f"/api/runs/{BIG}/metrics/envelope", {"key": "loss", "outliers": "99"}, 400, "outliers"),
        (f"/api/runs/{BIG}/metrics/envelope", {"key": "x" * 300}, 400, "at most"),
        (f"/api/runs/{BIG}/metrics/envelope", {"key": "nope"}, 404, "has no metric 'nope'"),
        ("/api/runs/nope/metrics/envelope", {"key": "loss"}, 404, "unknown run"),
        ("/api/runs/nope/metrics/keys", {}, 404, "unknown run"),
        (f"/api/runs/{BIG}/metrics/keys", {"limit": "0"}, 400, "limit"),
        (f"/api/runs/{BIG}/stragglers", {}, 400, "or time_key"),
        (f"/api/runs/{BIG}/stragglers", {"key": "loss", "time_key": "lr"}, 400, "or time_key"),
        (f"/api/runs/{BIG}/stragglers", {"key": "nope"}, 404, "has no metric"),
        ("/api/runs/nope/labels", {}, 404, "unknown run"),
        ("/api/runs/bad%20id/labels", {}, 400, "invalid run id"),
    ],
)
async def test_bad_requests_are_refused_with_the_reason(
    chart_api: TestClient, path: str, params: dict, status: int, reason: str
) -> None:
    doc = await get_json(chart_api, path, status=status, **params)
    assert reason in doc["error"]


async def test_one_chart_of_a_thousand_labels_stays_small(open_stores: OpenStore) -> None:
    """1,024 labels: the chart's rows are its buckets and three lines, whatever the labels."""
    store = await open_stores()
    events = []
    for n in range(1024):
        label = f"r{n:04d}"
        events.append(start("wide", label, 1, 0))
        events += [
            metric("wide", label, 1, s + 2, {"loss": 1.0 + n / 1024 + s / 100}, s * 8, T0 + s)
            for s in range(40)
        ]
    for i in range(0, len(events), 8000):
        await store.write(events[i : i + 8000])
    found = await store.envelope("wide", "loss", points=100)
    assert found is not None and not found.exact and found.labels == 1024 and len(found.lines) == 3
    assert {line.label for line in found.lines} <= {"r0000", "r0001", "r1023", "r1022"}


def test_the_ingester_keeps_the_rollups_of_what_it_stores(redis_server_url: str, any_store_url: str) -> None:
    """Real producers' entries through a real worker (two, one after the other, the second
    reading what the first left): the rollups are the stored values' and the chart reads them."""
    run = f"ingested-{random.getrandbits(40):x}"
    client = redis.Redis.from_url(redis_server_url)
    try:
        for n in range(3):
            label = f"rank{n}"
            xadd_event(client, run, label, "start", 1, 1, {"primary": n == 0, "restart_count": 0})
            for step in range(400):
                values = {"loss": 2.0 + n + step / 1000, "lr": 1e-3}
                if step == 50 and n == 1:
                    values["loss"] = "NaN"
                xadd_event(client, run, label, "metric", 1, step + 2, values, step=step, ts=T0 + step)
            if n == 1:
                ingest(redis_server_url, any_store_url, only_runs=frozenset({run}))
    finally:
        client.close()
    ingest(redis_server_url, any_store_url, only_runs=frozenset({run}))

    async def check() -> None:
        store = open_store(any_store_url, create=False)
        await store.connect()
        try:
            await assert_rollups_recompute(store, run, exact=False)
            found = await store.envelope(run, "loss")
            assert found is not None and found.exact and found.all_lines and len(found.lines) == 3
            assert sum(b.nan for s in found.band for b in s.buckets) == 1
            assert (await store.key_page(run)).keys == ["loss", "lr"]
        finally:
            await store.close()

    asyncio.run(check())


async def test_a_store_of_rollup_rows_keeps_them_as_open_rows_and_blocks(
    open_stores: OpenStore, any_store_url: str
) -> None:
    """A store whose label rollups are a row per bucket (tests/data, written by the code of
    schema 7; converted by migration 10) reads them back as before, and goes on from its open
    buckets."""
    url = await restore_old_store(any_store_url)
    store = await open_stores(url)
    for run in ("done", "live"):
        await assert_rollups_recompute(store, run, exact=False)
    await _go_on_live(store)
    await assert_rollups_recompute(store, "live", exact=False)
    tables = await table_names(url)
    assert "label_rollups" not in tables and {"label_open", "label_blocks"} <= tables


async def _go_on_live(store: Store) -> tuple[int, float]:
    """Write 299 more steps of the old store's live run (tests/old_stores) to rank0: its last
    seq and timestamp before them."""
    last = max(e.seq for e in old_stores.events() if e.run == "live")
    step = max(e.step for e in old_stores.events() if e.run == "live" and e.step is not None)
    ts = max(e.ts for e in old_stores.events() if e.run == "live")
    await store.write(
        [metric("live", "rank0", 1, last + n, {"loss": 0.5 + n}, step + n, ts + n) for n in range(1, 300)]
    )
    return last, ts


async def test_a_store_of_schema_10_keeps_every_bucket_bit_for_bit(
    open_stores: OpenStore, any_store_url: str
) -> None:
    """A store of schema 10 (tests/data: an open row per series; migration 11 moves the ended
    labels' open rows into their fine blocks) holds every bucket it held, bit for bit; its live
    label keeps its open rows and goes on, until it ends."""
    url = await restore_old_store(any_store_url, schema=10)
    before = await stored_label_buckets(url)
    assert before and any(width == rollups.FINE_WIDTH for _, width, *_ in before)
    store = await open_stores(url)
    assert await stored_label_buckets(url) == before
    assert set(await open_rows_by_run(url)) == {"live"}
    for run in ("done", "live"):
        await assert_rollups_recompute(store, run, exact=False)
    last, ts = await _go_on_live(store)
    await assert_rollups_recompute(store, "live", exact=False)
    # A finish alone: the label's open buckets go into their blocks all the same.
    await store.write([Event("live", "rank0", "finish", 1, last + 300, ts + 300, {"exit_code": 0}, None)])
    assert await open_rows_by_run(url) == {}
    await assert_rollups_recompute(store, "live", exact=False)


async def open_rows_by_run(url: str) -> dict[str, int]:
    """How many label_open rows each run's labels have."""
    query = "SELECT l.run_id, count(*) FROM label_open o JOIN labels l ON l.id = o.label_id GROUP BY l.run_id"
    if url.startswith("sqlite"):
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as con:
            return dict(con.execute(query).fetchall())
    con = await asyncpg.connect(url)
    try:
        return {row[0]: row[1] for row in await con.fetch(query)}
    finally:
        await con.close()


async def stored_label_buckets(url: str) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Every label bucket a store holds, read from its tables: (key id, width, axis, label id,
    epoch, bucket) -> its fields, floats as their bits."""
    blocks = f"SELECT {rollup_blocks.BLOCK_COLUMNS} FROM label_blocks"
    opens = f"SELECT {rollup_blocks.OPEN_COLUMNS} FROM label_open"
    if url.startswith("sqlite"):
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as con:
            block_rows = con.execute(blocks).fetchall()
            open_rows = con.execute(opens).fetchall()
    else:
        con = await asyncpg.connect(url)
        try:
            block_rows = await con.fetch(blocks)
            open_rows = await con.fetch(opens)
        finally:
            await con.close()
    found = {}
    for block, places in rollup_blocks.decoded(block_rows).items():
        found.update(rollup_blocks.stored_rows(block, places))
    for row in open_rows:
        key = (row[0], rollups.FINE_WIDTH, *row[1:5])
        assert key not in found
        found[key] = rollup_blocks.open_part(row[5:])
    return {key: tuple(as_bits(value) for value in part) for key, part in found.items()}


def as_bits(value: Any) -> Any:
    return struct.pack("<d", value) if isinstance(value, float) else value


async def table_names(url: str) -> set[str]:
    if url.startswith("sqlite"):
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as con:
            return {row[0] for row in con.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    con = await asyncpg.connect(url)
    try:
        return {
            row[0] for row in await con.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
    finally:
        await con.close()


finite_or_not = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(1 << 53), max_value=1 << 53)
)


@given(
    places=st.dictionaries(
        st.integers(min_value=0, max_value=rollup_blocks.WIDE_PLACES - 1),
        st.tuples(
            st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), min_size=7, max_size=7),
            st.lists(st.one_of(st.none(), st.floats()), min_size=6, max_size=6),
        ),
        min_size=1,
    )
)
def test_a_block_gives_back_every_bucket_bit_for_bit(places: dict[int, Any]) -> None:
    """Any partials (integers of 64 bits, any float, None where the tables allow NULL) at any
    places come back from a block as they went in, floats by their bits."""
    parts = {}
    for place, (ints, floats) in places.items():
        part: list[Any] = [0] * 13
        for at, value in zip((0, 1, 2, 7, 8, 9, 12), ints, strict=True):
            part[at] = value
        for at, value in zip((3, 4, 5, 6, 10, 11), floats, strict=True):
            part[at] = value if at in (4, 5, 6) or value is not None else 0.0
        parts[place] = part
    [back] = rollup_blocks.decode_many([rollup_blocks.encode(parts)])
    assert back.keys() == parts.keys()
    for place, part in parts.items():
        assert [bits_or_same(v) for v in back[place]] == [bits_or_same(v) for v in part]


@given(
    blocks=st.lists(
        st.dictionaries(
            st.integers(min_value=0, max_value=rollup_blocks.WIDE_PLACES - 1),
            st.integers(min_value=-(1 << 62), max_value=1 << 62),
            min_size=1,
        ),
        min_size=1,
        max_size=6,
    ),
    width=st.sampled_from(rollups.WIDTHS),
)
def test_blocks_decoded_together_are_each_as_decoded_alone(blocks: list[dict[int, int]], width: int) -> None:
    """decode_many over several blocks (a read of many labels) gives each block's partials, all
    or one width's, as a block alone gives them."""
    parts = [
        {p: [v, 0, 0, v / 3, v / 7, None, float(v), v, v, -v, v * 0.5, 1e9, v] for p, v in b.items()}
        for b in blocks
    ]
    datas = [rollup_blocks.encode(p) for p in parts]
    assert rollup_blocks.decode_many(datas) == parts
    first, end = rollup_blocks.places_of(width)
    wanted = [{p: v for p, v in part.items() if first <= p < end} for part in parts]
    assert rollup_blocks.decode_many(datas, (first, end)) == wanted


def test_every_bucket_has_one_place_in_one_block() -> None:
    """Each width's buckets map to distinct (block, place) pairs, and back."""
    seen = set()
    for width in rollups.WIDTHS:
        for bucket in range(-70, 700):
            block, place = rollup_blocks.place_of((1, width, 0, 2, 3, bucket))
            assert (block, place) not in seen
            seen.add((block, place))
            kind, first, last = rollup_blocks.block_range(width, bucket, bucket)
            assert kind == block[1] and first == last == block[5]
            back = list(rollup_blocks.buckets(kind, block[5], {place: []}))
            assert back == [(width, bucket, [])]


def bits_or_same(value: Any) -> Any:
    return struct.pack("<d", value) if isinstance(value, float) else value
