"""System samples' rollups (rollups.series_run, rollups.fold_system) and their chart reads
(storage/system_charts.py, the dashboard's /system/keys and /system/envelope), on SQLite and
PostgreSQL: checked against a recomputation from the stored samples (tests/test_rollups.py's),
batches in any order and redelivered, a store migrated from before them, the host filter.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from runbus.dashboard.api import create_app
from runbus.storage import Store, charts, open_store, rollups, system_charts
from runbus.storage import postgres as postgres_backend
from runbus.storage import sqlite as sqlite_backend
from runbus.storage.base import Envelope
from runbus.wire import Event
from tests.helpers import UNDO_CHUNKS, get_json, keep_values_in_rows, undo_migrations
from tests.test_rollups import T0, WIDEST, as_batches, expected_rows, same, start

RUN = "sys"
SAMPLES = 200  # every 15 s: 3,000 s, about 24 buckets of 128 s
HOSTS = {"rank0": "node0", "rank1": "node0", "rank2": "node1", "rank3": "node1"}
# The GPUs each label charts: rank0 owns two (one process for a whole host), the others one.
GPUS = {"rank0": (0, 1), "rank1": (1,), "rank2": (0,), "rank3": (1,)}


@pytest.fixture
async def store(any_store_url: str) -> AsyncIterator[Store]:
    opened = open_store(any_store_url)
    await opened.connect()
    yield opened
    await opened.close()


def samples(label: str, epoch: int, first: int, count: int, ts: float) -> list[Event]:
    """`count` system events of `label`, every 15 s from `ts`, seqs from `first`: dyadic values
    (every sum exact, in any order), a NaN and an inf among them."""
    n = int(label[-1])
    events = []
    for i in range(count):
        data: dict[str, float] = {"proc.rss_mb": 1000.0 + n * 10 + i / 4}
        for gpu in GPUS[label]:
            data[f"gpu.{gpu}.util"] = float((n * 7 + gpu * 13 + i * 3) % 100)
        if label in ("rank0", "rank2"):
            data["sys.cpu_percent"] = math.nan if i == 5 else math.inf if i == 9 else 12.5 + n
        events.append(Event(RUN, label, "system", epoch, first + i, ts + i * 15.0, data, None))
    return events


def system_run() -> list[Event]:
    """Four labels on two hosts sampling for 3,000 s; rank1 restarts (epoch 2, a later
    generation) an hour later; every label also logs a metric named like a system key."""
    events = []
    for label, host in HOSTS.items():
        first = start(RUN, label, 1, 0)
        first.data["host"] = host
        events.append(first)
        events += samples(label, 1, 2, SAMPLES, T0)
        events.append(Event(RUN, label, "metric", 1, SAMPLES + 2, T0, {"proc.rss_mb": 5.0, "loss": 1.0}, 0))
    again = start(RUN, "rank1", 2, 1, ts=T0 + 3600)
    again.data["host"] = "node0"
    events.append(again)
    events += samples("rank1", 2, 2, 40, T0 + 3600)
    return events


async def write(store: Store, events: list[Event], rnd: random.Random | None = None) -> None:
    batches = as_batches(events, rnd) if rnd else [events[i : i + 300] for i in range(0, len(events), 300)]
    for batch in batches:
        await store.write(batch)


async def stored_system_rows(store: Store, run: str) -> tuple[dict[tuple, list], dict[tuple, tuple]]:
    """The system rollups a store holds for `run`, each key's read as the chart reads read them."""
    labels: dict[tuple, list] = {}
    runs: dict[tuple, tuple[list, Counter]] = {}
    for key in await store.system_keys(run):
        reader = system_charts.FigureRollups(store, [key])
        suffix = system_charts.line_suffix(key)
        for width in rollups.WIDTHS:
            for row in await charts.label_rows(
                reader, run, key, rollups.TS_AXIS, width, -WIDEST, WIDEST, None
            ):
                name = row.label.removesuffix(suffix)
                labels[key, width, rollups.TS_AXIS, name, row.epoch, row.bucket] = row.part
            for bucket in await charts.run_rows(reader, run, key, rollups.TS_AXIS, width, -WIDEST, WIDEST):
                place = (key, width, rollups.TS_AXIS, bucket.generation, bucket.bucket)
                runs[place] = (bucket.part, Counter(bucket.bins))
    return labels, runs


async def assert_system_rollups_recompute(store: Store, run: str) -> None:
    points = await store.system(run)
    generation = {}
    for key in await store.system_keys(run):
        reader = system_charts.FigureRollups(store, [key])
        for row in await reader.open_buckets(run, key, rollups.TS_AXIS, None):
            generation[row.label.removesuffix(system_charts.line_suffix(key)), row.epoch] = row.generation
    want_labels, want_runs = expected_rows(points, generation)
    got_labels, got_runs = await stored_system_rows(store, run)
    assert got_labels.keys() == want_labels.keys()
    for place, want in want_labels.items():
        got = got_labels[place]
        assert all(same(g, w) for g, w in zip(got, want, strict=True)), (place, got, want)
    assert got_runs.keys() == want_runs.keys()
    for place, (want, bins) in want_runs.items():
        got, got_bins = got_runs[place]
        assert all(same(got[i], want[i]) for i in (0, 1, 2, 3, 4, 5, 8, 9, 10, 11)), (place, got, want)
        assert got_bins == +bins, place


# -- the rollups ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
async def test_system_rollups_equal_a_recomputation_from_the_stored_samples(store: Store, seed: int) -> None:
    await write(store, system_run(), random.Random(seed))
    await assert_system_rollups_recompute(store, RUN)
    assert await store.system_keys(RUN) == ["gpu.0.util", "gpu.1.util", "proc.rss_mb", "sys.cpu_percent"]
    # The metric of the same name is the metric's alone, and metric key lists hold no system key.
    assert await store.metric_keys(RUN) == ["loss", "proc.rss_mb"]
    assert (await store.key_page(RUN)).keys == ["loss", "proc.rss_mb"]
    metric = await store.envelope(RUN, "proc.rss_mb")
    assert metric is not None and {b.hi for s in metric.band for b in s.buckets} == {5.0}
    generations = {row.generation for row in await store.open_buckets(RUN, "proc.rss_mb", 1, None, "system")}
    assert generations == {1, 2}


async def make_before_system_rollups(url: str) -> None:
    """The store as runbus left it before system rollups: none of them, its version one lower."""
    system_series = "SELECT id FROM series WHERE run_id LIKE '%:system'"
    statements = [
        f"DELETE FROM label_open WHERE key_id IN ({system_series})",
        f"DELETE FROM label_blocks WHERE key_id IN ({system_series})",
        f"DELETE FROM run_rollups WHERE key_id IN ({system_series})",
        "DELETE FROM series WHERE run_id LIKE '%:system'",
        *UNDO_CHUNKS,
    ]
    before = sqlite_backend.MIGRATIONS.index(sqlite_backend.CHUNKS_SCHEMA) - 1
    await undo_migrations(url, statements, before)


async def test_an_old_store_gets_the_rollups_of_its_system_samples(
    any_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep_values_in_rows(monkeypatch)
    first = open_store(any_store_url)
    await first.connect()
    await write(first, system_run())
    want = await stored_system_rows(first, RUN)
    await first.close()
    await make_before_system_rollups(any_store_url)
    monkeypatch.undo()
    backend = sqlite_backend if any_store_url.startswith("sqlite") else postgres_backend
    monkeypatch.setattr(backend, "MIGRATION_PAGE", 97)  # pages that cut through labels and buckets
    migrated = open_store(any_store_url)
    await migrated.connect()
    try:
        assert await stored_system_rows(migrated, RUN) == want
        await assert_system_rollups_recompute(migrated, RUN)
    finally:
        await migrated.close()


# -- the envelope --------------------------------------------------------------------------------


def gpu_values(events: list[Event], labels: set[str] | None = None) -> list[float]:
    return [
        value
        for e in events
        if e.kind == "system" and (labels is None or e.label in labels)
        for key, value in e.data.items()
        if system_charts.figure_of(key) == "gpu.util"
    ]


def line_names(found: Envelope) -> set[str]:
    return {line.label for line in found.lines}


def band_of(found: Envelope) -> tuple[int, float, float]:
    """(values, min, max) over the band."""
    buckets = [b for s in found.band for b in s.buckets]
    return (
        sum(b.n for b in buckets),
        min(b.lo for b in buckets if b.lo is not None),
        max(b.hi for b in buckets if b.hi is not None),
    )


async def test_a_figure_s_envelope_holds_every_gpu_of_every_label(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = system_run()
    await write(store, events)
    every = {"rank0 · gpu0", "rank0 · gpu1", "rank1 · gpu1", "rank2 · gpu0", "rank3 · gpu1"}
    values = gpu_values(events)
    found = await system_charts.system_envelope(store, RUN, "gpu.util")
    assert found is not None and (found.x, found.exact, found.labels, found.all_lines) == (
        "ts",
        True,
        5,
        True,
    )
    assert line_names(found) == every
    assert band_of(found) == (len(values), min(values), max(values))
    assert [s.generation for s in found.band] == [1, 2]
    # One host: its labels' GPUs only, each a line.
    on_node0 = gpu_values(events, {"rank0", "rank1"})
    mine = await system_charts.system_envelope(store, RUN, "gpu.util", host="node0")
    assert (
        mine is not None
        and mine.labels == 3
        and line_names(mine) == {"rank0 · gpu0", "rank0 · gpu1", "rank1 · gpu1"}
    )
    assert band_of(mine) == (len(on_node0), min(on_node0), max(on_node0))
    # From the rollups: the same counts and extremes, 128-second buckets, quantiles in order.
    monkeypatch.setattr(charts, "RAW_POINTS", 10)
    for host, want, lines in ((None, values, every), ("node0", on_node0, None)):
        rolled = await system_charts.system_envelope(store, RUN, "gpu.util", host=host)
        assert rolled is not None and not rolled.exact and rolled.width == rollups.FINE_WIDTH
        assert band_of(rolled) == (len(want), min(want), max(want))
        for b in (b for s in rolled.band for b in s.buckets):
            assert b.lo <= b.p10 <= b.p50 <= b.p90 <= b.hi  # type: ignore[operator]
        if lines:
            assert line_names(rolled) == lines
    # Past all_lines_up_to: the band and its outlying lines.
    few = await system_charts.system_envelope(store, RUN, "gpu.util", all_lines_up_to=2, outliers=2)
    assert few is not None and not few.all_lines and len(few.lines) == 2 and line_names(few) <= every
    # Few values in view of many: read as stored, a page of each line at a time.
    monkeypatch.setattr(charts, "RAW_POINTS", 300)
    start, end = T0 + 600, T0 + 1200
    narrow = await system_charts.system_envelope(store, RUN, "gpu.util", start=start, end=end)
    assert narrow is not None and narrow.exact
    inside = [
        v
        for e in events
        if e.kind == "system" and start // 1 <= math.floor(e.ts) <= end // 1
        for k, v in e.data.items()
        if system_charts.figure_of(k) == "gpu.util"
    ]
    assert band_of(narrow) == (len(inside), min(inside), max(inside))
    assert await system_charts.system_envelope(store, RUN, "gpu.nope") is None
    assert await system_charts.system_envelope(store, RUN, "gpu.util", host="node9") is None


# -- the endpoints -------------------------------------------------------------------------------


@pytest.fixture
async def api(any_store_url: str) -> AsyncIterator[TestClient]:
    filled = open_store(any_store_url)
    await filled.connect()
    await write(filled, system_run())
    await filled.close()
    async with TestClient(TestServer(create_app(any_store_url))) as client:
        yield client


async def test_the_system_keys_and_envelope_endpoints(api: TestClient) -> None:
    keys = await get_json(api, f"/api/runs/{RUN}/system/keys")
    assert keys["keys"] == ["gpu.util", "proc.rss_mb", "sys.cpu_percent"]
    assert keys["figures"][0] == {"key": "gpu.util", "keys": ["gpu.0.util", "gpu.1.util"]}
    doc = await get_json(api, f"/api/runs/{RUN}/system/envelope", key="gpu.util", points="200")
    assert (doc["key"], doc["x"], doc["labels"], doc["all_lines"]) == ("gpu.util", "ts", 5, True)
    assert doc["band_columns"] == ["x0", "x1", "n", "nan", "inf", "min", "p10", "p50", "p90", "max", "mean"]
    assert len(doc["lines"]) == 5 and doc["lines"][0]["label"] == "rank0 · gpu0"
    host = await get_json(api, f"/api/runs/{RUN}/system/envelope", key="proc.rss_mb", host="node1")
    assert [line["label"] for line in host["lines"]] == ["rank2", "rank3"]
    cpu = await get_json(api, f"/api/runs/{RUN}/system/envelope", key="sys.cpu_percent")
    assert sum(row[3] for s in cpu["band"] for row in s["rows"]) == 2  # the NaNs, counted
    assert "Infinity" in {row[9] for s in cpu["band"] for row in s["rows"]}
    # The samples' own route is unchanged.
    raw = await get_json(api, f"/api/runs/{RUN}/system", key="gpu.0.util")
    assert [k["key"] for k in raw["keys"]] == ["gpu.0.util"]


@pytest.mark.parametrize(
    ("path", "params", "status", "reason"),
    [
        (f"/api/runs/{RUN}/system/envelope", {}, 400, "key is required"),
        (f"/api/runs/{RUN}/system/envelope", {"key": "gpu.util", "start": "nan"}, 400, "finite"),
        (
            f"/api/runs/{RUN}/system/envelope",
            {"key": "gpu.util", "start": "9", "end": "3"},
            400,
            "before start",
        ),
        (f"/api/runs/{RUN}/system/envelope", {"key": "gpu.util", "points": "1"}, 400, "points"),
        (f"/api/runs/{RUN}/system/envelope", {"key": "gpu.util", "outliers": "x"}, 400, "outliers"),
        (f"/api/runs/{RUN}/system/envelope", {"key": "gpu.util", "host": "h" * 300}, 400, "host must be"),
        (f"/api/runs/{RUN}/system/envelope", {"key": "gpu.nope"}, 404, "has no system figure 'gpu.nope'"),
        (f"/api/runs/{RUN}/system/envelope", {"key": "gpu.util", "host": "node9"}, 404, "on host 'node9'"),
        ("/api/runs/nope/system/envelope", {"key": "gpu.util"}, 404, "unknown run"),
        ("/api/runs/nope/system/keys", {}, 404, "unknown run"),
        ("/api/runs/bad%20id/system/envelope", {"key": "gpu.util"}, 400, "invalid run id"),
    ],
)
async def test_bad_system_envelope_requests_are_refused_with_the_reason(
    api: TestClient, path: str, params: dict, status: int, reason: str
) -> None:
    doc = await get_json(api, path, status=status, **params)
    assert reason in doc["error"]
