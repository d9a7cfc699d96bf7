"""What a person reads back, on SQLite and PostgreSQL: labels in their natural order (rank2
before rank10) in `runbus show`, `metrics`, `logs`, runbus.Api and the dashboard's API; runs
named by a unique prefix of their id wherever an id is taken; an unknown run is RunNotFound,
saying so where its events wait in Redis.

Each store is written through the Store interface; the CLI runs as its own process.
"""

from __future__ import annotations

import json

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

import runbus
from runbus.dashboard.api import create_app
from runbus.errors import AmbiguousRun, CommandError
from runbus.storage import Store
from runbus.storage.lookup import run_id_of
from runbus.storage.rules import natural_key
from runbus.wire import Event
from tests.helpers import QUIET, get_json, run_cli

RUN = "natural-run"
T0 = 1_700_000_000.0
RANKS = 12
NATURAL = [f"rank{i}" for i in range(RANKS)]  # rank0, rank1, rank2, ..., rank10, rank11


def labelled_run(run: str = RUN, ranks: int = RANKS) -> list[Event]:
    """`ranks` labels, each a start, a metric at step 0, a log line and a finish."""
    events = []
    for rank in range(ranks):
        label = f"rank{rank}"
        events += [
            Event(run, label, "start", 1, 1, T0, {"primary": rank == 0, "config": {}}, None),
            Event(run, label, "metric", 1, 2, T0 + 1, {"loss": float(rank)}, 0),
            Event(run, label, "log", 1, 3, T0 + 2, {"stream": "stdout", "text": "hi", "level": "INFO"}, None),
            Event(run, label, "finish", 1, 4, T0 + 3, {"exit_code": 0}, None),
        ]
    return events


def test_the_natural_key_orders_numbers_as_numbers():
    shuffled = ["rank10", "rank2", "node10.rank0", "rank1", "node2.rank11", "node2.rank3", "rank01", "a"]
    assert sorted(shuffled, key=natural_key) == [
        "a",
        "node2.rank3",
        "node2.rank11",
        "node10.rank0",
        "rank01",
        "rank1",
        "rank2",
        "rank10",
    ]


async def test_a_run_lists_its_labels_in_natural_order(store: Store):
    await store.write(labelled_run())
    run = await store.run(RUN)
    assert run is not None and [lab.label for lab in run.labels] == NATURAL


async def test_show_metrics_and_logs_list_labels_in_natural_order(store: Store, any_store_url: str):
    await store.write(labelled_run())
    show = run_cli("--store", any_store_url, "show", RUN).stdout
    table = show.split("LABEL", 1)[1].splitlines()[1:]
    assert [line.split()[0] for line in table if line.startswith("rank")] == NATURAL
    shown = json.loads(run_cli("--store", any_store_url, "show", RUN, "--json").stdout)
    assert [lab["label"] for lab in shown["labels"]] == NATURAL
    metrics = json.loads(run_cli("--store", any_store_url, "metrics", RUN, "--json").stdout)
    assert [point["label"] for point in metrics] == NATURAL
    listed = run_cli("--store", any_store_url, "metrics", RUN).stdout.splitlines()[1:]
    assert [line.split()[0] for line in listed] == NATURAL
    logs = run_cli("--store", any_store_url, "logs", RUN).stdout.splitlines()
    assert [line.split(" | ")[0].strip() for line in logs] == NATURAL


async def test_the_api_lists_labels_in_natural_order(store: Store, any_store_url: str):
    await store.write(labelled_run())
    with runbus.Api(any_store_url) as api:
        run = api.run(RUN)
        assert run.labels == NATURAL
        assert list(dict.fromkeys(run.history()["label"])) == NATURAL
        assert list(dict.fromkeys(run.history(labels=["rank10", "rank2", "rank1"])["label"])) == [
            "rank1",
            "rank2",
            "rank10",
        ]


# -- run ids by unique prefix ------------------------------------------------------------------------

UUID = "42738683-5f0e-4c1b-9d51-0c7e4b0f6a11"  # what torchrun gives as its run id
TWIN = "42738699-0000-4000-8000-000000000000"
IDS = [UUID, TWIN, "abc", "abcd", "a_b", "axb"]


async def several_runs(store: Store) -> None:
    for run in IDS:
        await store.write(labelled_run(run, ranks=2))


async def test_a_run_is_found_by_its_id_or_a_unique_prefix_of_it(store: Store):
    await several_runs(store)
    assert await store.run_ids("4273", 10) == [UUID, TWIN]
    assert await run_id_of(store, "42738683") == UUID
    assert await run_id_of(store, UUID) == UUID
    assert await run_id_of(store, "abc") == "abc"  # the exact id wins over abcd
    assert await run_id_of(store, "abcd") == "abcd"
    assert await run_id_of(store, "a_") == "a_b"  # '_' is a character, not a wildcard
    assert await run_id_of(store, "A") is None  # ids are case-sensitive
    assert await run_id_of(store, "nope") is None
    assert await run_id_of(store, "ab%") is None  # no run id can hold it
    with pytest.raises(AmbiguousRun, match=f"'4273' starts the ids of several runs: {UUID}, {TWIN}"):
        await run_id_of(store, "4273")


async def test_the_cli_takes_a_unique_prefix_and_names_an_ambiguous_one(store: Store, any_store_url: str):
    await several_runs(store)
    shown = json.loads(run_cli("--store", any_store_url, "show", "42738683", "--json").stdout)
    assert shown["run_id"] == UUID
    metrics = json.loads(run_cli("--store", any_store_url, "metrics", "4273868", "--json").stdout)
    assert {point["label"] for point in metrics} == {"rank0", "rank1"} and len(metrics) == 2
    logs = run_cli("--store", any_store_url, "logs", "4273868").stdout
    assert logs.count("\n") == 2
    export = run_cli("--store", any_store_url, "export", "4273868", "--format", "jsonl").stdout
    assert len(export.splitlines()) == 2
    assert json.loads(run_cli("--store", any_store_url, "show", "abc", "--json").stdout)["run_id"] == "abc"
    ambiguous = run_cli("--store", any_store_url, "show", "4273", check=False)
    assert ambiguous.returncode == 1
    assert ambiguous.stderr == (
        f"runbus: '4273' starts the ids of several runs: {UUID}, {TWIN}; give more of the id\n"
    )


async def test_tail_finds_a_stored_run_by_a_prefix(store: Store, any_store_url: str, redis_url: str):
    await several_runs(store)
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    result = run_cli("tail", "4273868", "--redis", redis_url, "--store", any_store_url)
    assert f"run {UUID} is finished and has no streams left in Redis" in result.stderr


async def test_the_api_takes_a_unique_prefix(store: Store, any_store_url: str):
    await several_runs(store)
    with runbus.Api(any_store_url) as api:
        assert api.run("42738683").run_id == UUID
        assert len(api.run("4273868").history()) == 2
        with pytest.raises(AmbiguousRun):
            api.run("4273")


async def test_the_dashboard_takes_a_unique_prefix(store: Store, any_store_url: str):
    await several_runs(store)
    async with TestClient(TestServer(create_app(any_store_url))) as client:
        assert (await get_json(client, "/api/runs/42738683"))["run_id"] == UUID
        assert (await get_json(client, "/api/runs/4273868/labels"))["run_id"] == UUID
        series = await get_json(client, "/api/runs/4273868/metrics/series", key="loss")
        assert [line["label"] for line in series["series"]] == ["rank0", "rank1"]
        assert (await get_json(client, "/api/runs/abc"))["run_id"] == "abc"
        error = await get_json(client, "/api/runs/4273", status=404)
        assert UUID in error["error"] and TWIN in error["error"]
        await get_json(client, "/api/runs/nope", status=404)


# -- unknown runs and keys -------------------------------------------------------------------------


async def test_an_unknown_run_is_run_not_found_naming_the_store_s_runs(store: Store, any_store_url: str):
    await store.write(labelled_run(ranks=2))
    with runbus.Api(any_store_url) as api, pytest.raises(runbus.RunNotFound) as error:
        api.run("nope")
    assert not isinstance(error.value, CommandError)
    assert str(error.value).endswith(f"; its runs: {RUN}")
    shown = run_cli("--store", any_store_url, "show", "nope", check=False)
    assert shown.returncode == 1 and shown.stderr.startswith("runbus: unknown run 'nope' in ")


async def test_an_unknown_system_key_is_named_as_history_names_an_unknown_metric(store: Store, any_store_url):
    await store.write(
        [*labelled_run(ranks=1), Event(RUN, "rank0", "system", 1, 5, T0 + 4, {"gpu.0.util": 50.0}, None)]
    )
    with runbus.Api(any_store_url) as api:
        run = api.run(RUN)
        assert list(run.system(keys="gpu.0.util").value) == [50.0]
        with pytest.raises(CommandError) as error:
            run.system(keys="gpu0.util")
        assert str(error.value) == f"run {RUN!r} has no system key 'gpu0.util'; its system keys: gpu.0.util"
        with pytest.raises(CommandError, match=r"has no metric 'gpu\.0\.util'"):
            run.history(keys="gpu.0.util")


async def test_a_run_waiting_in_redis_says_what_to_run(
    store: Store, any_store_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
):
    # With catching up turned off (tests/test_catchup.py: on, the read stores them first).
    with runbus.init(run_id="waiting-run", label="rank0", redis_url=redis_url, **QUIET) as run:
        run.log({"loss": 1.0}, step=0)
    off = {"RUNBUS_CATCH_UP": "0"}
    shown = run_cli(
        "--store", any_store_url, "--redis", redis_url, "show", "waiting-run", env=off, check=False
    )
    assert shown.returncode == 1 and shown.stderr.count("\n") == 1
    assert "unknown run 'waiting-run'" in shown.stderr
    assert (
        "its events wait in Redis" in shown.stderr
        and "`runbus ingest --burst --run waiting-run`" in shown.stderr
    )
    metrics = run_cli(
        "--store", any_store_url, "metrics", "waiting-run", "--redis", redis_url, "--no-catch-up", check=False
    )
    assert "its events wait in Redis" in metrics.stderr
    monkeypatch.setenv("RUNBUS_REDIS_URL", redis_url)
    monkeypatch.setenv("RUNBUS_CATCH_UP", "0")
    with (
        runbus.Api(any_store_url) as api,
        pytest.raises(runbus.RunNotFound, match="`runbus ingest --burst --run"),
    ):
        api.run("waiting-run")
    # A run Redis knows nothing of is named as before.
    nowhere = run_cli("--store", any_store_url, "--redis", redis_url, "show", "other-run", check=False)
    assert "wait in Redis" not in nowhere.stderr and "it has no runs yet" in nowhere.stderr


# -- stragglers: only the labels behind the median ---------------------------------------------------


def step_seconds(rank: int, step: int) -> float:
    """rank0 at the median; rank1 8% slow for steps 8-15 and 8% fast for 40-47 (jitter, on time
    overall); rank2 1% faster than the median, 6% slow for steps 16-23; rank3 1.3x throughout;
    rank4 3x for steps 24-29 only."""
    if rank == 1:
        return 1.08 if 8 <= step < 16 else 0.92 if 40 <= step < 48 else 1.0
    if rank == 2:
        return 1.06 if 16 <= step < 24 else 0.99
    if rank == 3:
        return 1.3
    if rank == 4:
        return 3.0 if 24 <= step < 30 else 1.0
    return 1.0


def timed_run(steps: int = 64) -> list[Event]:
    """A loss logged at every step by five ranks, each step taking step_seconds."""
    events = []
    for rank in range(5):
        label, ts = f"rank{rank}", T0
        events.append(Event(RUN, label, "start", 1, 1, ts, {"primary": rank == 0, "config": {}}, None))
        for step in range(steps):
            ts += step_seconds(rank, step)
            events.append(Event(RUN, label, "metric", 1, step + 2, ts, {"loss": 1.0}, step))
    return events


async def test_only_labels_behind_the_median_are_stragglers(store: Store):
    await store.write(timed_run())
    found = await store.stragglers(RUN, "loss", buckets=8)
    assert found is not None
    kinds = {s.label: s.kind for s in found.labels}
    assert kinds == {
        "rank0": "normal",
        "rank1": "normal",
        "rank2": "normal",
        "rank3": "chronic",
        "rank4": "one-off",
    }
    assert [s.label for s in found.labels[:2]] == ["rank3", "rank4"]  # slowest first
