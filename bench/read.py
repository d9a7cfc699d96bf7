"""Reading one chart of a many-label run: a key's band and outliers from the rollups, against
today's series endpoint (every point of every label) and MLflow's get_metric_history.

Each size is a run of LABELS labels x STEPS steps x 4 keys (loss with one label running high,
lr, grad_norm, step_time). `full` sizes are written through Store.write as an ingester writes
batches (values and rollups); `rollups` sizes write the rollups alone, through the backend's own
roll-up path, from synthetic 128-step partials (a chart never reads the values of so big a
run: its cost is the rollup rows it reads, whatever the values table holds). One chart: the
envelope of `loss` over the whole run at up to 1,500 buckets, with 3 outliers, as the store
answers it and as the HTTP endpoint does (document encoded); median of 5 reads after a first.
Keys: a run of 100,000 metric keys, its first page, a prefix, a substring and a deep page.
Page (--page): the run page of the last size in Debian's Chromium (Playwright), from navigation
to its first chart drawn and to every chart in view drawn, cold (first load) and warm.

    python bench/read.py [--store sqlite|postgres] [--sizes full:64x20000,full:1024x2000,rollups:1024x100000]
                         [--keys 100000] [--mlflow 64x20000] [--page]

PostgreSQL is RUNBUS_BENCH_POSTGRES_DSN, else a throwaway cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson
from common import emit

from runbus.dashboard import api, envelopes
from runbus.storage import Store, open_store, rollups
from runbus.wire import Event

RUN = "bench-read"
KEYS_RUN = "bench-keys"
T0 = 1_700_000_000.0
OUTLIER = 7
BATCH = 8000


def loss(label: int, step: int, rnd: random.Random) -> float:
    return 2.0 + 5.0 / (step + 1) + rnd.gauss(0, 0.02) + (0.5 if label == OUTLIER else 0.0)


def step_events(labels: int, steps: int) -> Iterator[list[Event]]:
    """The run's events, a batch at a time: each label's start, then a step of every label in
    turn (as workers read many streams at once)."""
    rnd = random.Random(1)
    batch = [
        Event(RUN, f"rank{n:04d}", "start", 1, 1, T0, {"primary": n == 0, "restart_count": 0}, None)
        for n in range(labels)
    ]
    for step in range(steps):
        for n in range(labels):
            values = {
                "loss": loss(n, step, rnd),
                "lr": 3e-4,
                "grad_norm": 1.0 + rnd.random(),
                "step_time": 1.0 + 0.1 * (n == 3),
            }
            batch.append(Event(RUN, f"rank{n:04d}", "metric", 1, step + 2, T0 + step, values, step))
            if len(batch) >= BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


async def write_full(store: Store, labels: int, steps: int) -> float:
    started = time.perf_counter()
    for batch in step_events(labels, steps):
        await store.write(batch)
    return time.perf_counter() - started


def synthetic_partials(label_id: int, label: int, steps: int, rnd: random.Random) -> dict:
    """Each key's 128-step partials for one label, as a label logging every step would make them."""
    fine: dict = {}
    width = rollups.FINE_WIDTH
    for bucket in range((steps + width - 1) // width):
        lo_step, hi_step = bucket * width, min(steps, (bucket + 1) * width) - 1
        count = hi_step - lo_step + 1
        for key, mean, spread in (
            ("loss", loss(label, lo_step, rnd), 0.05),
            ("lr", 3e-4, 0.0),
            ("grad_norm", 1.5 + rnd.gauss(0, 0.01), 0.5),
            ("step_time", 1.0 + 0.1 * (label == 3), 0.0),
        ):
            fine[label_id, key, 1, 0, bucket] = [
                count,
                0,
                0,
                mean * count,
                mean - spread,
                mean + spread,
                mean,
                hi_step + 2,
                lo_step,
                hi_step,
                T0 + lo_step,
                T0 + hi_step,
                lo_step + 2,
            ]
    return fine


async def write_rollups_only(store: Store, labels: int, steps: int) -> float:
    """Each label's start through Store.write, then its rollups through the backend's roll-up."""
    started = time.perf_counter()
    await store.write(
        [
            Event(RUN, f"rank{n:04d}", "start", 1, 1, T0, {"primary": n == 0, "restart_count": 0}, None)
            for n in range(labels)
        ]
    )
    rnd = random.Random(2)
    ids = await label_ids(store, labels)
    for first in range(0, labels, 16):
        fine: dict = {}
        for n in range(first, min(labels, first + 16)):
            fine.update(synthetic_partials(ids[n], n, steps, rnd))
        run_of = dict.fromkeys((ids[n] for n in range(first, min(labels, first + 16))), RUN)
        starts = {label_id: (1, 0) for label_id in run_of}
        await roll_up(store, fine, run_of, starts)
    return time.perf_counter() - started


async def label_ids(store: Store, labels: int) -> dict[int, int]:
    names = {f"rank{n:04d}": n for n in range(labels)}
    if store.url.startswith("sqlite"):
        rows = store._db().execute("SELECT label, id FROM labels WHERE run_id = ?", (RUN,)).fetchall()  # type: ignore[attr-defined]
    else:
        rows = await store._call(lambda con: con.fetch("SELECT label, id FROM labels WHERE run_id = $1", RUN))  # type: ignore[attr-defined]
    return {names[label]: id_ for label, id_ in rows}


async def roll_up(store: Store, fine: dict, run_of: dict, starts: dict) -> None:
    """The backend's own roll-up of a batch's partials, in a transaction of its own."""
    if store.url.startswith("sqlite"):
        from runbus.storage import sqlite as backend

        await store._call(store._in_transaction, lambda con: backend._roll_up(con, fine, run_of, starts))  # type: ignore[attr-defined]
        return
    from runbus.storage import postgres as pg

    async def work(con: Any) -> None:
        async with con.transaction():
            await pg._roll_up(con, fine, run_of, starts, pg.Known(), pg.Known())

    await store._call(work)  # type: ignore[attr-defined]


async def timed(call: Callable[[], Awaitable[Any]], repeats: int = 5) -> tuple[float, float, Any]:
    """(first, median of `repeats` more) milliseconds of `call`, and its last result."""
    started = time.perf_counter()
    result = await call()
    first = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = await call()
        times.append((time.perf_counter() - started) * 1000)
    return round(first, 1), round(statistics.median(times), 1), result


async def chart(store: Store, url: str) -> dict:
    """One chart's data: the store's envelope, and the HTTP endpoint's whole answer."""

    async def from_store() -> bytes:
        found = await store.envelope(RUN, "loss", points=1500, outliers=3)
        assert found is not None
        return orjson.dumps(envelopes.envelope_document(found))

    first, median, body = await timed(from_store)
    document = orjson.loads(body)
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(api.create_app(url))) as client:

        async def over_http() -> bytes:
            response = await client.get(f"/api/runs/{RUN}/metrics/envelope", params={"key": "loss"})
            assert response.status == 200, await response.text()
            return await response.read()

        http_first, http_median, http_body = await timed(over_http)
    return {
        "store_ms": {"first": first, "median": median},
        "http_ms": {"first": http_first, "median": http_median},
        "bytes": len(http_body),
        "width": document["width"],
        "exact": document["exact"],
        "band_buckets": sum(len(s["rows"]) for s in document["band"]),
        "outliers": [line["label"] for line in document["lines"]],
    }


async def series_today(store: Store) -> dict:
    """Today's /metrics/series?key=loss: every point of every label, downsampled per label."""

    async def read() -> bytes:
        points = await store.metrics(RUN, key="loss")
        return orjson.dumps({"series": api._series(points, 2000, api._step)})

    started = time.perf_counter()
    body = await read()
    return {"ms": round((time.perf_counter() - started) * 1000, 1), "bytes": len(body)}


async def keys_run(store: Store, count: int) -> dict:
    """A run of `count` keys: its pages, searches, and today's list of every key."""
    await store.write([Event(KEYS_RUN, "rank0", "start", 1, 1, T0, {"primary": True}, None)])
    per_event = 1000
    for first in range(0, count, per_event * 8):
        batch = [
            Event(
                KEYS_RUN,
                "rank0",
                "metric",
                1,
                2 + n // per_event,
                T0,
                {
                    f"layers.{k // 1000:03d}.block{k % 1000:03d}.grad_norm": 1.0
                    for k in range(n, min(count, n + per_event))
                },
                0,
            )
            for n in range(first, min(count, first + per_event * 8), per_event)
        ]
        await store.write(batch)
    cases = {
        "first_page": lambda: store.key_page(KEYS_RUN, limit=100),
        "prefix": lambda: store.key_page(KEYS_RUN, prefix="layers.042.", limit=100),
        "substring": lambda: store.key_page(KEYS_RUN, contains="BLOCK999", limit=100),
        "deep_page": lambda: store.key_page(KEYS_RUN, offset=count - 100, limit=100),
        "every_key_today": lambda: store.metric_keys(KEYS_RUN),
    }
    found: dict[str, Any] = {"keys": count}
    for name, call in cases.items():
        first, median, result = await timed(call)
        found[name] = {"first_ms": first, "median_ms": median}
        if name == "substring":
            found[name]["total"] = result.total
    return found


def mlflow_history(labels: int, steps: int, directory: str) -> dict | None:
    """The same loss points logged to MLflow (a run per label, SQLite backend), then read back
    with get_metric_history, every label's: what a chart of the run costs there."""
    try:
        import mlflow
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient
    except ImportError:
        return None
    mlflow.set_tracking_uri(f"sqlite:///{directory}/mlflow.db")
    client = MlflowClient()
    experiment = client.create_experiment("bench-read")
    rnd = random.Random(1)
    runs = []
    started = time.perf_counter()
    for n in range(labels):
        run = client.create_run(experiment, run_name=f"rank{n:04d}")
        runs.append(run.info.run_id)
        points = [Metric("loss", loss(n, step, rnd), int((T0 + step) * 1000), step) for step in range(steps)]
        for i in range(0, len(points), 1000):
            client.log_batch(run.info.run_id, metrics=points[i : i + 1000])
    logged = time.perf_counter() - started
    started = time.perf_counter()
    total = 0
    for run_id in runs:
        total += len(client.get_metric_history(run_id, "loss"))
    read = time.perf_counter() - started
    return {
        "labels": labels,
        "points": total,
        "log_s": round(logged, 1),
        "get_metric_history_every_label_ms": round(read * 1000, 1),
    }


# True once the first chart of the metrics card holds its data (as the browser tests read it).
FIRST_CHART = """() => {
    const f = document.querySelector('#metrics .chart');
    return Boolean(f && f.chart && f.chart.u && f.chart.u.data[0].length > 0);
}"""
# True once every chart of the metrics card that is in the viewport holds its data.
CHARTS_IN_VIEW = """() => {
    const charts = [...document.querySelectorAll('#metrics .chart')].filter((f) => {
        const r = f.getBoundingClientRect();
        return r.bottom > 0 && r.top < window.innerHeight;
    });
    return charts.length > 0 && charts.every((f) => f.chart && f.chart.u && f.chart.u.data[0].length > 0);
}"""


def page_timing(url: str, loads: int = 5) -> dict | None:
    """The run page in Chromium: ms from navigation to the first chart drawn, and to every chart
    in view drawn; the first load cold, then the median of the rest (each in a new context)."""
    import shutil

    from tests.test_dashboard_api import serve

    chromium = os.environ.get("RUNBUS_TEST_CHROMIUM") or shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if not chromium:
        return None
    first_chart, in_view, requests = [], [], []
    with serve(url) as (base, _), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            for _ in range(loads):
                context = browser.new_context(viewport={"width": 1440, "height": 1000})
                page = context.new_page()
                sent: list[str] = []
                page.on("request", lambda request, sent=sent: sent.append(request.url))
                started = time.perf_counter()
                page.goto(f"{base}#/run/{RUN}")
                page.wait_for_function(FIRST_CHART, polling=10, timeout=60_000)
                first_chart.append((time.perf_counter() - started) * 1000)
                page.wait_for_function(CHARTS_IN_VIEW, polling=10, timeout=60_000)
                in_view.append((time.perf_counter() - started) * 1000)
                requests.append(len(sent))
                context.close()
        finally:
            browser.close()
    return {
        "first_chart_ms": {
            "cold": round(first_chart[0], 1),
            "warm_median": round(statistics.median(first_chart[1:]), 1),
        },
        "charts_in_view_ms": {
            "cold": round(in_view[0], 1),
            "warm_median": round(statistics.median(in_view[1:]), 1),
        },
        "requests": requests[0],
    }


@contextlib.contextmanager
def postgres_dsn(kind: str) -> Iterator[str | None]:
    """RUNBUS_BENCH_POSTGRES_DSN, else a throwaway cluster (in its own temp dir), for postgres."""
    if kind != "postgres":
        yield None
        return
    dsn = os.environ.get("RUNBUS_BENCH_POSTGRES_DSN")
    if dsn:
        yield dsn
        return
    from tests.pgserver import LocalPostgres

    with LocalPostgres(directory=tempfile.mkdtemp(prefix="runbus-bench-pg-")) as server:
        yield server.dsn


@contextlib.contextmanager
def store_url(dsn: str | None, directory: str, name: str) -> Iterator[str]:
    """A fresh store: a SQLite file in `directory`, or a new database on the server of `dsn`."""
    if dsn is None:
        yield f"sqlite:///{directory}/{name}.db"
        return
    from tests.pgserver import create_database, drop_database

    url = asyncio.run(create_database(dsn))
    try:
        yield url
    finally:
        asyncio.run(drop_database(dsn, url))


async def measure(url: str, how: str, labels: int, steps: int, today: bool) -> dict:
    store = open_store(url)
    await store.connect()
    try:
        write = write_full if how == "full" else write_rollups_only
        seconds = await write(store, labels, steps)
        found: dict[str, Any] = {
            "labels": labels,
            "steps": steps,
            "keys": 4,
            "values": labels * steps * 4,
            "written": how,
            "write_s": round(seconds, 1),
            "chart": await chart(store, url),
        }
        if how == "full" and today:
            found["series_today"] = await series_today(store)
        return found
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--sizes", default="full:64x20000,full:1024x2000,rollups:1024x100000")
    parser.add_argument("--keys", type=int, default=100_000, help="metric keys of the keys run (0: none)")
    parser.add_argument("--no-today", action="store_true", help="skip today's series endpoint")
    parser.add_argument("--mlflow", default="", help="LABELSxSTEPS logged to MLflow and read back")
    parser.add_argument("--page", action="store_true", help="time the last size's run page in Chromium")
    args = parser.parse_args()
    results: dict[str, Any] = {"store": args.store, "sizes": []}
    with (
        tempfile.TemporaryDirectory(prefix="runbus-bench-read-") as directory,
        postgres_dsn(args.store) as dsn,
    ):
        sizes = args.sizes.split(",")
        for n, size in enumerate(sizes):
            how, shape = size.split(":")
            labels, steps = map(int, shape.split("x"))
            with store_url(dsn, directory, f"size{n}") as url:
                found = asyncio.run(measure(url, how, labels, steps, not args.no_today))
                if args.page and n == len(sizes) - 1:
                    found["page"] = page_timing(url)
            print(orjson.dumps(found).decode(), flush=True, file=__import__("sys").stderr)
            results["sizes"].append(found)
        if args.keys:
            with store_url(dsn, directory, "keys") as url:

                async def run_keys() -> dict:
                    store = open_store(url)
                    await store.connect()
                    try:
                        return await keys_run(store, args.keys)
                    finally:
                        await store.close()

                results["key_list"] = asyncio.run(run_keys())
        if args.mlflow:
            labels, steps = map(int, args.mlflow.split("x"))
            results["mlflow"] = mlflow_history(labels, steps, directory)
    emit("read", results)


if __name__ == "__main__":
    _ = math
    main()
