"""runbus.Api and `runbus export`: a run's tables, complete, in order and typed, on SQLite and
PostgreSQL, from a script and from inside a running event loop, read back from every format.

The stores are filled by a real `runbus ingest --burst` from entries written to a real Redis.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import redis

import runbus
from runbus import wire
from runbus.errors import CommandError, StoreMissing
from runbus.query.documents import json_value
from runbus.storage import Store, open_store
from runbus.storage.base import LogLine, Point
from runbus.wire import Event
from tests.helpers import read_store, run_cli, xadd_event
from tests.pgserver import create_database, drop_database
from tests.test_cli import fails, missing, pipe_to_head, without

RUN = "nb-run"
T0 = 1_700_000_000.0
TEXT = str(pd.Series(["text"], dtype="str").dtype)  # pandas' text dtype: 'str' from pandas 3, else 'object'
HISTORY = ["label", "key", "step", "lease_epoch", "life", "seq", "ts", "value"]
HISTORY_TYPES = ["category", "category", "Int64", "int64", "int64", "int64", "datetime64[us, UTC]", "float64"]
SYSTEM = ["label", "key", "lease_epoch", "life", "seq", "ts", "value"]
LOGS = ["label", "lease_epoch", "life", "seq", "ts", "stream", "level", "text"]
LOG_TYPES = [TEXT, "int64", "int64", "int64", "datetime64[us, UTC]", TEXT, TEXT, TEXT]
RUNS = [
    "run_id",
    "name",
    "tags",
    "state",
    "primary",
    "exit_code",
    "labels",
    "started",
    "ended",
    "last_event",
    "metric_events",
    "log_events",
    "system_events",
    "config",
    "summary",
]
UNICODE_KEY = "gpu/κ-ünï"
# rank0's loss at these seqs of epoch 1, as the wire writes them.
NON_FINITE = {3: "NaN", 4: "Infinity", 5: "-Infinity"}
METRIC_VALUES = 40 * 3 + 20 * 3 + 30 * 3 + 1
LEVELS = ["INFO", "WARNING", "ERROR", "DEBUG"]


def seed(client: redis.Redis) -> None:
    """rank0: 40 metric events of three keys, logs and system samples, then restarted (epoch 2):
    20 more and a finish. rank1: 30 metric events of three keys (two named like the wide table's
    own columns), logs at the same times as rank0's, a seq never sent, one more value."""

    def put(label: str, kind: str, epoch: int, seq: int, data: dict, step=None, ts=None) -> None:
        xadd_event(client, RUN, label, kind, epoch, seq, data, step=step, ts=T0 + seq if ts is None else ts)

    put("rank0", "start", 1, 1, {"primary": True, "config": {"lr": 0.1, "layers": [64, 64]}})
    for seq in range(2, 42):
        loss = NON_FINITE.get(seq, 1.0 / seq)
        put("rank0", "metric", 1, seq, {"loss": loss, "acc": seq / 100, "epoch": seq // 10}, step=_step(seq))
    for seq in range(42, 52):
        text = f'rank0 line {seq}, "quoted"\nand a second line ü' if seq % 3 else ""
        data = {"stream": "stdout" if seq % 2 else "stderr", "level": LEVELS[seq % 4], "text": text}
        put("rank0", "log", 1, seq, data, ts=T0 + 100 + (seq - 42))
    for seq in range(52, 57):
        put("rank0", "system", 1, seq, {"cpu": seq * 1.5, "mem": 100.0 + seq})
    put("rank0", "start", 2, 1, {"primary": True, "config": {"lr": 0.1, "layers": [64, 64]}}, ts=T0 + 500)
    for seq in range(2, 22):
        put(
            "rank0",
            "metric",
            2,
            seq,
            {"loss": 0.01 * seq, "acc": 0.5, "epoch": 5},
            step=500 + seq,
            ts=T0 + 500 + seq,
        )
    for seq in range(22, 26):
        put(
            "rank0",
            "log",
            2,
            seq,
            {"stream": "stdout", "level": "INFO", "text": f"again {seq}"},
            ts=T0 + 50 + seq,
        )
    put("rank0", "finish", 2, 26, {"exit_code": 0}, ts=T0 + 600)
    put("rank1", "start", 1, 1, {"primary": False})
    for seq in range(2, 32):
        put(
            "rank1",
            "metric",
            1,
            seq,
            {"loss": 2.0 / seq, UNICODE_KEY: seq * 1.0, "step": float(seq)},
            step=seq * 10,
        )
    for seq in range(32, 42):
        data = {"stream": "logging", "level": LEVELS[seq % 4], "text": f"rank1 line {seq}"}
        put("rank1", "log", 1, seq, data, ts=T0 + 100 + (seq - 32))  # the same times as rank0's
    for seq in range(42, 45):
        put("rank1", "system", 1, seq, {"cpu": seq * 2.0})
    put("rank1", "metric", 1, 46, {"loss": 0.5}, step=460)  # seq 45 never sent


def _step(seq: int) -> int | None:
    return None if seq % 7 == 0 else seq * 10


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def seeded(request: pytest.FixtureRequest, redis_server_url: str, tmp_path_factory) -> Iterator[str]:
    """A store of each backend holding RUN, ingested once for the module's tests, which only read."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('notebook') / 'runbus.db'}"
    else:
        dsn = request.getfixturevalue("postgres_dsn")
        url = asyncio.run(create_database(dsn))
    with redis.Redis.from_url(redis_server_url) as client:
        client.flushdb()
        seed(client)
    run_cli("--store", url, "ingest", "--redis", redis_server_url, "--burst")
    yield url
    if request.param == "postgres":
        asyncio.run(drop_database(dsn, url))


@pytest.fixture
def api(seeded: str) -> Iterator[runbus.Api]:
    with runbus.Api(seeded) as opened:
        yield opened


def micros(ts: float) -> int:
    return round(ts * 1e6)


def history_rows(history: pd.DataFrame) -> list[tuple]:
    """(label, key, step, epoch, seq, ts in µs, value as JSON writes it) of each row."""
    return [
        (label, key, None if pd.isna(step) else int(step), epoch, seq, ts, json_value(value))
        for label, key, step, epoch, seq, ts, value in zip(
            history.label,
            history.key,
            history.step,
            history.lease_epoch,
            history.seq,
            history.ts.astype("int64"),
            history.value,
            strict=True,
        )
    ]


def types(frame: pd.DataFrame) -> list[str]:
    return [str(dtype) for dtype in frame.dtypes]


# -- the API ---------------------------------------------------------------------------------------


def test_history_is_every_stored_value_as_runbus_metrics_lists_them(api, seeded):
    listed = json.loads(run_cli("--store", seeded, "metrics", RUN, "--json").stdout)
    history = api.run(RUN).history()
    assert list(history.columns) == HISTORY
    assert types(history) == HISTORY_TYPES
    assert len(history) == len(listed) == METRIC_VALUES
    expected = [
        (p["label"], p["key"], p["step"], p["lease_epoch"], p["seq"], micros(p["ts"]), p["value"])
        for p in listed
    ]
    assert sorted(history_rows(history), key=repr) == sorted(expected, key=repr)
    # In (label, key, epoch, seq) order, both epochs of rank0 there.
    order = list(zip(history.label, history.key, history.lease_epoch, history.seq, strict=True))
    assert order == sorted(order)
    rank0 = history[history.label == "rank0"]
    assert set(zip(rank0.lease_epoch, rank0.life, strict=True)) == {(1, 1), (2, 2)}
    assert set(history[history.label != "rank0"].life) == {1}
    loss = history[(history.label == "rank0") & (history.key == "loss") & (history.lease_epoch == 1)]
    assert [json_value(v) for v in loss.value[:4]] == [0.5, "NaN", "Infinity", "-Infinity"]
    assert history.step.isna().sum() == 3 * len([s for s in range(2, 42) if _step(s) is None])
    assert str(history.ts.iloc[0]) == "2023-11-14 22:13:22+00:00"


def test_every_page_size_reads_the_same_tables(seeded):
    with runbus.Api(seeded) as whole:
        run = whole.run(RUN)
        tables = (run.history(), run.history(wide=True), run.system(), run.logs(), run.logs(level="error"))
    for page_rows in (1, 2, 7, 89):
        with runbus.Api(seeded, page_rows=page_rows) as paged:
            run = paged.run(RUN)
            again = (run.history(), run.history(wide=True), run.system(), run.logs(), run.logs(level="error"))
        for table, paged_table in zip(tables, again, strict=True):
            pd.testing.assert_frame_equal(table, paged_table)


def test_a_step_range_chooses_rows_in_the_table_and_the_arrow_table(api):
    run = api.run(RUN)
    history = run.history()
    chosen = run.history(steps=(100, 300))
    expected = history[history.step.notna() & (history.step >= 100) & (history.step <= 300)]
    pd.testing.assert_frame_equal(chosen, expected.reset_index(drop=True))
    assert len(chosen) and len(run.history(steps=(None, 300))) > len(chosen)
    table = run.arrow(keys="loss", steps=(100, 300))
    assert table.num_rows == len(chosen[chosen.key == "loss"])
    assert table.column("step").null_count == 0
    with pytest.raises(ValueError, match="first is past the last"):
        run.history(steps=(300, 100))


def test_keys_and_labels_choose_rows_and_unknown_ones_are_named(api):
    run = api.run(RUN)
    history = run.history()
    loss = run.history(keys="loss")
    expected = history[history.key == "loss"].reset_index(drop=True)
    pd.testing.assert_frame_equal(loss, expected)
    rank1 = run.history(keys=["loss", "acc", "loss"], labels=("rank1",))
    expected = history[history.key.isin(["loss", "acc"]) & (history.label == "rank1")].reset_index(drop=True)
    pd.testing.assert_frame_equal(rank1, expected)
    assert len(rank1) == 31
    assert len(run.history(keys=UNICODE_KEY)) == 30
    pd.testing.assert_frame_equal(run.history(labels=["rank1", "rank0"]), history)
    nothing = run.history(keys=[])
    assert len(nothing) == 0 and types(nothing) == HISTORY_TYPES
    with pytest.raises(CommandError) as error:
        run.history(keys=["loss", "los"])
    assert (
        str(error.value)
        == f"run {RUN!r} has no metric 'los'; its metrics: acc, epoch, {UNICODE_KEY}, loss, step"
    )
    with pytest.raises(CommandError) as error:
        run.logs(labels="rank7")
    assert str(error.value) == f"run {RUN!r} has no label 'rank7'; its labels: rank0, rank1"
    with pytest.raises(TypeError):
        run.history(keys=[1])


def test_wide_history_is_a_row_per_logged_event_and_a_column_per_key(api):
    run = api.run(RUN)
    history = run.history()
    wide = run.history(wide=True)
    assert list(wide.columns) == [
        "label",
        "lease_epoch",
        "life",
        "seq",
        "step",
        "ts",
        "acc",
        "epoch",
        UNICODE_KEY,
        "loss",
        "metric:step",
    ]
    assert (
        types(wide)
        == ["category", "int64", "int64", "int64", "Int64", "datetime64[us, UTC]"] + ["float64"] * 5
    )
    assert len(wide) == 40 + 20 + 31  # every metric event, once
    events = list(zip(wide.label, wide.lease_epoch, wide.seq, strict=True))
    assert events == sorted(events) and len(set(events)) == len(events)
    # Every value of the long table is in its event's row, and nothing else is there.
    long = history.rename(columns={"value": "long"})
    melted = wide.melt(
        id_vars=["label", "lease_epoch", "life", "seq", "step", "ts"], var_name="column", value_name="wide"
    )
    melted["key"] = melted.column.map(lambda name: name.removeprefix("metric:"))
    both = melted.merge(
        long, on=["label", "lease_epoch", "life", "seq", "key"], how="left", suffixes=("", "_long")
    )
    logged = both.long.notna() | both.step_long.notna() | both.ts_long.notna()
    assert logged.sum() == len(history)
    assert np.array_equal(both.wide[logged], both.long[logged], equal_nan=True)
    assert both.wide[~logged].isna().all()
    assert (both.step[logged].fillna(-1) == both.step_long[logged].fillna(-1)).all()
    assert (both.ts[logged] == both.ts_long[logged]).all()
    first = wide.iloc[1]  # rank0, epoch 1, seq 3
    assert (first.label, first.lease_epoch, first.life, first.seq, first.step) == ("rank0", 1, 1, 3, 30)
    assert math.isnan(first["loss"]) and first["acc"] == 0.03 and math.isnan(first[UNICODE_KEY])
    restarted = wide[(wide.label == "rank0") & (wide.lease_epoch == 2)]
    assert set(restarted.life) == {2}
    assert list(restarted.seq) == list(range(2, 22)) and list(restarted["epoch"]) == [5.0] * 20


def test_runs_are_a_row_each_with_what_runbus_show_says(api, seeded):
    runs = api.runs()
    assert list(runs.columns) == RUNS
    assert types(runs) == [
        TEXT,
        TEXT,
        "object",
        TEXT,
        TEXT,
        "Int64",
        "int64",
        "datetime64[us, UTC]",
        "datetime64[us, UTC]",
        "datetime64[us, UTC]",
        "int64",
        "int64",
        "int64",
        "object",
        "object",
    ]
    shown = json.loads(run_cli("--store", seeded, "show", RUN, "--json").stdout)
    [row] = runs.itertuples(index=False)
    assert (row.run_id, row.state, row.primary, row.exit_code) == (
        RUN,
        shown["state"],
        shown["primary"],
        shown["exit_code"],
    )
    assert row.labels == 2 == shown["label_count"]
    assert (row.metric_events, row.log_events, row.system_events) == (91, 24, 8)
    assert shown["counts"] == {"metric": 91, "log": 24, "system": 8}
    for column, field in (("started", "started_ts"), ("ended", "ended_ts"), ("last_event", "last_ts")):
        assert getattr(row, column) == pd.Timestamp(micros(shown[field]), unit="us", tz="UTC"), column
    assert row.config == {"lr": 0.1, "layers": [64, 64]} == shown["config"]
    run = api.run(RUN)
    assert (run.run_id, run.state, run.primary, run.labels) == (RUN, row.state, "rank0", ["rank0", "rank1"])
    assert run.counts == shown["counts"] and run.config == shown["config"]
    assert run.started == row.started.to_pydatetime()


def test_logs_are_every_line_by_time_as_runbus_logs_lists_them(api, seeded):
    run = api.run(RUN)
    for options, argv in (
        ({}, []),
        ({"level": "warning"}, ["--level", "warning"]),
        ({"grep": "line 3"}, ["--grep", "line 3"]),
        ({"labels": "rank1", "level": "ERROR"}, ["--label", "rank1", "--level", "error"]),
    ):
        logs = run.logs(**options)
        assert list(logs.columns) == LOGS and types(logs) == LOG_TYPES
        listed = json.loads(run_cli("--store", seeded, "logs", RUN, *argv, "--json").stdout)
        assert [
            (
                line["label"],
                line["lease_epoch"],
                line["seq"],
                micros(line["ts"]),
                line["stream"],
                line["level"],
                line["text"],
            )
            for line in listed
        ] == list(
            zip(
                logs.label,
                logs.lease_epoch,
                logs.seq,
                logs.ts.astype("int64"),
                *(logs[c] for c in LOGS[5:]),
                strict=True,
            )
        )
    everything = run.logs()
    assert len(everything) == 24
    assert list(everything.label[:6]) == ["rank0"] * 4 + [
        "rank0",
        "rank1",
    ]  # epoch 2's came first; then ties by label
    assert "" in set(everything.text)
    with pytest.raises(ValueError, match="unknown level 'LOUD'"):
        run.logs(level="LOUD")


def test_system_is_every_sample_in_label_key_order(api, seeded):
    system = api.run(RUN).system()
    assert list(system.columns) == SYSTEM
    assert types(system) == [
        "category",
        "category",
        "int64",
        "int64",
        "int64",
        "datetime64[us, UTC]",
        "float64",
    ]
    stored = read_store(seeded, "system", RUN)
    assert len(system) == len(stored) == 13
    rows = list(
        zip(
            system.label,
            system.key,
            system.lease_epoch,
            system.seq,
            system.ts.astype("int64"),
            system.value,
            strict=True,
        )
    )
    assert rows == sorted((p.label, p.key, p.epoch, p.seq, micros(p.ts), p.value) for p in stored)
    cpu = api.run(RUN).system(keys="cpu", labels="rank1")
    assert list(cpu.value) == [84.0, 86.0, 88.0]


async def test_the_api_works_inside_a_running_event_loop(seeded):
    asyncio.get_running_loop()  # as in Jupyter: a loop runs in this thread, where asyncio.run() fails
    with runbus.Api(seeded) as api:
        history = api.run(RUN).history()
        assert len(history) == METRIC_VALUES
        assert len(api.runs()) == 1
    # And from another thread, beside the running loop.
    with runbus.Api(seeded) as api:
        logs = await asyncio.to_thread(lambda: api.run(RUN).logs())
    assert len(logs) == 24


def test_a_script_uses_the_api_and_exits_without_closing_it(seeded):
    script = (
        "import runbus; api = runbus.Api(); run = api.run('nb-run'); "
        "print(len(run.history()), len(run.history(wide=True)), len(api.runs()))"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_environ(), "RUNBUS_STORE": seeded},
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{METRIC_VALUES} 91 1\n", "")


def test_an_api_is_closed_when_collected_and_refuses_reads_once_closed(seeded):
    def helpers() -> int:
        return sum(thread.name == "runbus-api" for thread in threading.enumerate())

    before = helpers()
    api = runbus.Api(seeded)
    assert helpers() == before + 1
    del api
    gc.collect()
    assert helpers() == before
    api = runbus.Api(seeded)
    api.close()
    api.close()
    with pytest.raises(runbus.StoreUnavailable, match="is closed"):
        api.runs()


def test_a_missing_store_or_an_unknown_run_is_a_clear_error(tmp_path, postgres_url, seeded):
    url = f"sqlite:///{tmp_path / 'no' / 'runbus.db'}"
    # Each call says so (run() of a run waiting in Redis would make it: tests/test_catchup.py).
    api = runbus.Api(url)
    with pytest.raises(StoreMissing) as error:
        api.runs()
    assert f"runbus: {error.value}" == missing(url)
    with pytest.raises(StoreMissing):
        api.run("nope")
    api.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(StoreMissing), runbus.Api(postgres_url) as unmade:
        unmade.runs()  # a database without the runbus schema, left as it is
    with pytest.raises(ValueError, match="unsupported store URL"):
        runbus.Api("mysql://u:secret@h/db")
    with runbus.Api(seeded) as api, pytest.raises(runbus.RunNotFound) as error:
        api.run("nope")
    assert str(error.value).startswith(
        f"unknown run 'nope' in {runbus.storage.safe_url(seeded)}; its runs: {RUN}"
    )


def test_a_run_without_values_has_empty_tables_of_the_same_columns(store_url):
    write(
        store_url,
        [
            Event("quiet", "rank0", "start", 1, 1, T0, {"primary": True}),
            Event("headless", "rank3", "start", 1, 1, T0 + 1, {"primary": False}),
        ],
    )
    with runbus.Api(store_url) as api:
        run = api.run("quiet")
        history, wide = run.history(), run.history(wide=True)
        assert (len(history), list(history.columns), types(history)) == (0, HISTORY, HISTORY_TYPES)
        assert (len(wide), list(wide.columns)) == (0, ["label", "lease_epoch", "life", "seq", "step", "ts"])
        assert types(wide) == ["category", "int64", "int64", "int64", "Int64", "datetime64[us, UTC]"]
        assert (len(run.logs()), types(run.logs())) == (0, LOG_TYPES)
        assert len(run.system()) == 0
        runs = api.runs()
        assert types(runs)[:6] == [TEXT, TEXT, "object", TEXT, TEXT, "Int64"]
        assert list(runs.run_id) == ["headless", "quiet"]  # newest first
        assert runs.primary.isna().tolist() == [True, False]  # no primary heard from
        assert runs.exit_code.isna().all() and runs.ended.isna().all()
        # A run's config is its labels' merged: None until one has started.
        assert runs.config.tolist() == [{}, {}]
        assert runs.name.isna().all() and runs.tags.tolist() == [[], []] and runs.summary.tolist() == [{}, {}]


def test_without_pandas_the_tables_name_the_extra_to_install(seeded, tmp_path):
    script = (
        "import runbus\n"
        "api = runbus.Api()\n"  # reaching the store needs no pandas
        "run = api.run('nb-run')\n"
        "for read in (api.runs, run.history, run.logs, run.system):\n"
        "    try:\n"
        "        read()\n"
        "    except runbus.MissingDependency as exc:\n"
        "        print(exc)\n"
    )
    env = {**_environ(), **without(tmp_path, "pandas"), "RUNBUS_STORE": seeded}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    line = "runbus's tables need pandas, which is not installed: pip install 'runbus[pandas]'"
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{line}\n" * 4, "")
    out = tmp_path / "run.csv"
    assert fails(run_cli("export", RUN, "--out", str(out), env=env, check=False)) == f"runbus: {line}"
    assert not out.exists()


def test_without_pyarrow_parquet_names_its_extra_and_csv_still_works(seeded, tmp_path):
    env = {**without(tmp_path, "pyarrow"), "RUNBUS_STORE": seeded}
    out = tmp_path / "run.parquet"
    assert fails(run_cli("export", RUN, "--out", str(out), env=env, check=False)) == (
        "runbus: parquet files need pyarrow, which is not installed: pip install 'runbus[parquet]'"
    )
    assert list(tmp_path.glob("*run*")) == []
    assert len(run_cli("export", RUN, env=env).stdout.splitlines()) == 1 + METRIC_VALUES


def _environ() -> dict[str, str]:
    import os

    return {name: value for name, value in os.environ.items() if name != "RUNBUS_STORE"}


# -- runbus export ---------------------------------------------------------------------------------

TABLES = {"metrics": "history", "logs": "logs", "system": "system"}


def read_csv(path: Path, what: str) -> pd.DataFrame:
    typed = {
        "label": "str",
        "key": "str",
        "step": "Int64",
        "lease_epoch": "int64",
        "life": "int64",
        "seq": "int64",
        "value": "float64",
    }
    columns = {"metrics": HISTORY, "logs": LOGS, "system": SYSTEM}[what]
    table = pd.read_csv(
        path,
        dtype={name: kind for name, kind in typed.items() if name in columns}
        | {"stream": "str", "level": "str", "text": "str"},
        keep_default_na=False,  # an empty log line stays ""
        na_values={"step": [""], "value": [""]},
    )
    table["ts"] = pd.to_datetime(table.ts, utc=True).astype("datetime64[us, UTC]")
    return table


def read_jsonl(path: Path, what: str) -> pd.DataFrame:
    table = pd.read_json(path, lines=True, dtype=False)
    table["ts"] = pd.to_datetime(table.ts, utc=True, format="ISO8601").astype("datetime64[us, UTC]")
    if "value" in table:
        table["value"] = table.value.map(lambda v: wire.WIRE_TO_NON_FINITE.get(v, v)).astype("float64")
    if "step" in table:
        table["step"] = table.step.astype("Int64")
    for name in ("label", "key", "stream", "level", "text"):
        if name in table:
            table[name] = table[name].astype("str")
    return table


def as_text(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with its categoricals (label, key) as text: what a CSV or JSON file gives back."""
    return table.astype({name: "str" for name in table.columns if str(table[name].dtype) == "category"})


READERS = {"csv": read_csv, "jsonl": read_jsonl, "parquet": lambda path, what: pd.read_parquet(path)}


@pytest.mark.parametrize("form", ["csv", "jsonl", "parquet"])
def test_export_writes_the_api_tables_in_every_format(api, seeded, tmp_path, form):
    run = api.run(RUN)
    for what, method in TABLES.items():
        out = tmp_path / f"{what}.{form}"
        run_cli("--store", seeded, "export", RUN, "--what", what, "--format", form, "--out", str(out))
        back = READERS[form](out, what)
        table = getattr(run, method)()
        pd.testing.assert_frame_equal(
            back, table if form == "parquet" else as_text(table), check_dtype=form != "csv" or what != "logs"
        )


def test_export_defaults_to_metrics_as_csv_on_stdout(api, seeded, tmp_path):
    history = api.run(RUN).history()
    printed = run_cli("export", RUN, "--store", seeded).stdout
    assert printed == run_cli("--store", seeded, "export", RUN, "--format", "csv", "--what", "metrics").stdout
    assert printed.splitlines()[0] == ",".join(HISTORY)
    assert printed.splitlines()[1].startswith("rank0,acc,20,1,1,2,2023-11-14 22:13:22+00:00,0.02")
    back = pd.read_csv(io.StringIO(printed), dtype={"step": "Int64"})
    assert len(back) == len(history) == METRIC_VALUES
    jsonl = run_cli("--store", seeded, "export", RUN, "--format", "jsonl", "--out", "-").stdout.splitlines()
    assert len(jsonl) == METRIC_VALUES
    nan = json.loads(next(line for line in jsonl if '"key":"loss"' in line and '"seq":3,' in line))
    assert nan == {
        "label": "rank0",
        "key": "loss",
        "step": 30,
        "lease_epoch": 1,
        "life": 1,
        "seq": 3,
        "ts": "2023-11-14T22:13:23+00:00",
        "value": "NaN",
    }
    # The format from the file's name.
    for name, reader in (("run.parquet", pd.read_parquet), ("run.jsonl", lambda p: read_jsonl(p, "metrics"))):
        run_cli("--store", seeded, "export", RUN, "--out", str(tmp_path / name))
        pd.testing.assert_frame_equal(
            reader(tmp_path / name), history if name.endswith("parquet") else as_text(history)
        )


def test_export_errors_are_one_line_and_leave_no_file(seeded, tmp_path):
    def export(*argv: str) -> str:
        return fails(run_cli("--store", seeded, "export", *argv, check=False))

    assert (
        export(RUN, "--format", "parquet") == "runbus: parquet is written to a file: name one with --out PATH"
    )
    assert export("nope").startswith(
        f"runbus: unknown run 'nope' in {runbus.storage.safe_url(seeded)}; its runs: {RUN}"
    )
    assert export(RUN, "--out", str(tmp_path / "no" / "x.csv")).startswith(
        f"runbus: cannot write {tmp_path / 'no' / 'x.csv'}: "
    )
    usage = fails(run_cli("export", RUN, "--format", "xml", check=False), code=2)
    assert "invalid choice: 'xml'" in usage
    # A file already there is replaced whole, or left as it was when the export fails.
    out = tmp_path / "run.csv"
    out.write_text("old")
    export("nope", "--out", str(out))
    assert out.read_text() == "old"
    run_cli("--store", seeded, "export", RUN, "--out", str(out))
    assert out.read_text().startswith("label,key,") and [p.name for p in tmp_path.iterdir()] == ["run.csv"]
    url = f"sqlite:///{tmp_path / 'none.db'}"
    assert fails(run_cli("--store", url, "export", RUN, check=False)) == missing(url)
    assert not (tmp_path / "none.db").exists()


def test_export_to_a_reader_that_leaves_early_ends_quietly(store_url):
    write(
        store_url,
        [Event("long", "rank0", "start", 1, 1, T0, {"primary": True})]
        + [
            Event("long", "rank0", "metric", 1, seq, T0 + seq, {"loss": seq / 7, "acc": 0.5}, seq)
            for seq in range(2, 10002)
        ],
    )
    for form in ("csv", "jsonl"):
        code, out, err = pipe_to_head(["--store", store_url, "export", "long", "--format", form], 3)
        assert (code, err, len(out.splitlines())) == (0, "", 3)


# -- the store's page reads ------------------------------------------------------------------------


def write(url: str, events: list[Event]) -> None:
    async def writing() -> None:
        store = open_store(url)
        await store.connect()
        try:
            await store.write(events)
        finally:
            await store.close()

    asyncio.run(writing())


async def pages(store: Store, read, after_of, size: int) -> list:
    found, after = [], None
    while True:
        page = await read(after, size)
        assert len(page) <= size
        found += page
        if len(page) < size:
            return found
        after = after_of(page[-1])


async def test_page_reads_continue_where_the_last_page_ended_on_every_backend(any_store_url):
    events = [Event("p", "a", "start", 1, 1, T0, {"primary": True})]
    events += [
        Event("p", "a", "metric", 1, s, T0 + s, {"x": s, "y\x00z": -s, "w": math.nan}, s)
        for s in range(2, 12)
    ]
    events += [Event("p", "a", "metric", 2, s, T0 + 99 + s, {"x": 100 + s}) for s in range(1, 4)]
    events += [Event("p", "b", "metric", 1, s, T0 + s, {"x": 7.0}, s) for s in range(1, 3)]
    events += [Event("p", "a", "system", 1, s, T0 + s, {"cpu": s}) for s in range(12, 15)]
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    events += [
        Event("p", "a", "log", 2, s, T0 - s, {"stream": "stdout", "level": levels[s % 4], "text": f"t{s}"})
        for s in range(4, 14)
    ]
    store = open_store(any_store_url)
    await store.connect()
    try:
        await store.write(events)
        whole = await store.point_page("metrics", "p", "a", None, 1000)
        assert len(whole) == 10 * 3 + 3
        assert [(p.key, p.epoch, p.seq) for p in whole] == sorted((p.key, p.epoch, p.seq) for p in whole)
        assert {p.label for p in whole} == {"a"} and {p.key for p in whole} == {"w", "x", "y\ufffdz"}
        assert all(math.isnan(p.value) for p in whole if p.key == "w")
        assert whole[10] == Point("a", "x", 2, 1, 2, T0 + 2, 2.0)
        assert [p.step for p in whole if p.epoch == 2] == [None] * 3
        for size in (1, 3, 32):

            def points(after, limit):
                return store.point_page("metrics", "p", "a", after, limit)

            got = await pages(store, points, lambda p: (p.key, p.epoch, p.seq), size)
            assert list(map(repr, got)) == list(map(repr, whole))  # NaN is no NaN's equal
            for key in ("x", "y\x00z"):  # NUL is stored as U+FFFD, and found as it was logged
                chosen = await pages(
                    store,
                    lambda after, limit, key=key: store.point_page("metrics", "p", "a", after, limit, key),
                    lambda p: (p.key, p.epoch, p.seq),
                    size,
                )
                assert chosen == [p for p in whole if p.key == key.replace("\x00", "\ufffd")]
        assert await store.point_page("metrics", "p", "a", None, 5, "v") == []
        assert await store.point_page("metrics", "p", "nobody", None, 5) == []
        assert (
            await store.point_page("metrics", "p", "a", ("x", 2, 3), 5)
            == [p for p in whole if p.key == "y\ufffdz"][:5]
        )
        system = await store.point_page("system", "p", "a", None, 10)
        assert [(p.key, p.step, p.seq, p.value) for p in system] == [
            ("cpu", None, s, float(s)) for s in range(12, 15)
        ]
        with pytest.raises(ValueError, match="no table of values named 'logs'"):
            await store.point_page("logs", "p", "a", None, 10)  # type: ignore[arg-type]

        lines = await store.log_page("p", "a", None, 100)
        assert [(line.epoch, line.seq) for line in lines] == [(2, s) for s in range(4, 14)]
        assert lines[0] == LogLine("a", 2, 4, T0 - 4, "stdout", "DEBUG", "t4")
        for size in (1, 4):
            got = await pages(
                store,
                lambda after, limit: store.log_page("p", "a", after, limit),
                lambda x: (x.epoch, x.seq),
                size,
            )
            assert got == lines
        loud = await store.log_page("p", "a", (2, 6), 100, level="warning")
        assert [line.seq for line in loud] == [7, 10, 11]
        assert [line.seq for line in await store.log_page("p", "a", None, 100, grep="t1")] == [10, 11, 12, 13]
    finally:
        await store.close()
