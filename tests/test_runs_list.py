"""The runs list of a store with many runs: searched, filtered, sorted and paged alike by the
store (on both backends), `/api/runs`, `runbus runs` and runbus.Api, every run reachable."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

import runbus
from runbus.dashboard.api import create_app
from runbus.errors import BadQuery
from runbus.storage import Store
from runbus.storage.base import LabelBrief
from runbus.storage.dialect import SQLITE
from runbus.storage.reads import run_page_queries
from runbus.storage.runlist import RunQuery, moment, run_query
from runbus.wire import Event
from tests import run_seeds as seeds
from tests.helpers import get_json, run_cli

COUNT = 230
HOSTILE_NAME = "50%_off <img src=x onerror=alert(1)> Résumé"
HOSTILE_TAGS = ['q"t', "a,b", "100%"]
HOSTILE_CONFIG = {"lr": 0.30000000000000004, "a.b": "dotted", "k": 3, "opt": {"beta": [0.9, 0.99]}}


def hostile_events() -> list[Event]:
    return seeds.special_events("odd-run", 5.0, HOSTILE_NAME, HOSTILE_TAGS, HOSTILE_CONFIG)


async def seeded(store: Store) -> None:
    await seeds.seed_runs(store, COUNT, labels=2)
    await store.write(hostile_events())


async def ids(store: Store, **query) -> list[str]:
    return [run.run_id for run in (await store.run_page(RunQuery(**query))).runs]


# -- the store, on both backends ---------------------------------------------------------------------


async def test_pages_reach_every_run_once_with_the_total(store):
    await seeded(store)
    everyone = await ids(store)
    assert len(everyone) == COUNT + 1 and len(set(everyone)) == COUNT + 1
    # Newest first; the odd run started in 1970: last.
    assert everyone[0] == seeds.run_id(COUNT - 1) and everyone[-1] == "odd-run"
    paged: list[str] = []
    for offset in range(0, COUNT + 50, 50):
        page = await store.run_page(RunQuery(limit=50, offset=offset))
        assert page.total == COUNT + 1 and (page.offset, page.limit) == (offset, 50)
        paged += [run.run_id for run in page.runs]
    assert paged == everyone
    past = await store.run_page(RunQuery(limit=50, offset=10_000))
    assert (past.runs, past.total) == ([], COUNT + 1)
    nothing = await store.run_page(RunQuery(limit=0))
    assert (nothing.runs, nothing.total) == ([], COUNT + 1)


async def test_a_page_holds_its_runs_counts_and_asked_for_their_labels(store):
    await seeded(store)
    run = seeds.run_id(3)
    await store.write(
        [Event(run, "rank1", "metric", 1, 4, seeds.T0, {"loss": 1.0}, 1)]
        + [
            Event(run, "rank0", "log", 1, 4 + i, seeds.T0, {"stream": "stdout", "text": "hi"})
            for i in range(3)
        ]
    )
    page = await store.run_page(RunQuery(search=run, limit=10), labels=True)
    [listed] = page.runs
    assert listed.counts == {"metric": 1, "log": 3, "system": 0} == (await store.run(run)).counts
    assert listed.label_count == 2 and listed.labels == []
    assert page.labels == {
        run: [LabelBrief("rank0", "finished", True), LabelBrief("rank1", "finished", False)]
    }
    late = await store.run_page(RunQuery(sort="labels", order="asc", limit=2, offset=COUNT - 1), labels=True)
    assert [r.run_id for r in late.runs] == [seeds.run_id(COUNT - 2), seeds.run_id(COUNT - 1)]
    assert {run_id: len(labels) for run_id, labels in late.labels.items()} == {r.run_id: 2 for r in late.runs}
    assert (await store.run_page(RunQuery(limit=5))).labels == {}


async def test_search_any_case_in_id_name_tag_and_label_with_wildcards_literal(store):
    await seeded(store)
    assert await ids(store, search="RUN-00007") == [seeds.run_id(7)]
    # Names "sweep 1 trial 5" and "sweep 1 trial 50" .. "59".
    found = await ids(store, search="Sweep 1 TRIAL 5")
    assert found == [seeds.run_id(i) for i in range(159, 149, -1)] + [seeds.run_id(105)]
    assert len(await ids(store, search="batch-6")) == len([i for i in range(COUNT) if i % 7 == 6])
    assert len(await ids(store, search="rank1")) == COUNT  # a label of every seeded run
    # % and _ are characters like any other, not LIKE's wildcards.
    for text in ("%", "_", "50%_", "100%", 'q"t', "<img", "a,b"):
        assert await ids(store, search=text) == ["odd-run"], text
    assert await ids(store, search="%_%") == []
    assert await ids(store, search="résumé") == ["odd-run"]
    # ASCII letters in any case; others as they are, on both backends alike.
    assert await ids(store, search="RéSUMé") == ["odd-run"]
    assert await ids(store, search="RÉSUMÉ") == []
    assert await ids(store, search="'; DROP TABLE runs; --") == []
    assert await ids(store, search="\x00") == []
    assert len(await ids(store)) == COUNT + 1


async def test_filters_states_dates_tags_and_labels(store):
    await seeded(store)
    failed = await ids(store, states=("failed",), sort="id", order="asc")
    assert failed == [seeds.run_id(i) for i in range(COUNT) if i % 3 == 1]
    either = await ids(store, states=("failed", "running"))
    assert len(either) == len([i for i in range(COUNT) if i % 3])
    since, until = seeds.T0 + 10 * seeds.EVERY, seeds.T0 + 13 * seeds.EVERY
    assert await ids(store, since=since, until=until) == [seeds.run_id(i) for i in (12, 11, 10)]
    assert await ids(store, until=seeds.T0) == ["odd-run"]
    both = await ids(store, tags=("nightly", "batch-3"))
    assert both == [seeds.run_id(i) for i in reversed(range(COUNT)) if i % 2 and i % 7 == 3]
    assert await ids(store, tags=('q"t',)) == ["odd-run"]
    assert await ids(store, tags=("q",)) == []  # a tag is matched whole
    assert len(await ids(store, labels=("rank1",))) == COUNT
    assert await ids(store, labels=("rank",)) == []


async def test_config_values_as_json_or_strings(store):
    await seeded(store)
    vit = await ids(store, config=(("model", "vit"),))
    assert vit == [seeds.run_id(i) for i in reversed(range(COUNT)) if i % 3 == 1]
    assert await ids(store, config=(("model", '"vit"'),)) == vit  # JSON text of the same string
    assert await ids(store, config=(("lr", "0.01"),)) == vit
    assert await ids(store, config=(("lr", "1e-2"),)) == vit
    assert await ids(store, config=(("seed", "7"),)) == [seeds.run_id(7)]
    assert await ids(store, config=(("seed", "7.0"),)) == [seeds.run_id(7)]
    assert len(await ids(store, config=(("amp", "true"),))) == len(range(0, COUNT, 2))
    assert await ids(store, config=(("lr", "0.30000000000000004"),)) == ["odd-run"]
    assert await ids(store, config=(("a.b", "dotted"),)) == ["odd-run"]
    assert await ids(store, config=(("opt", '{"beta": [0.9, 0.99]}'),)) == ["odd-run"]
    assert await ids(store, config=(("k", "3"), ("lr", "0.3"))) == []
    assert await ids(store, config=(("nope", "1"),)) == []
    combined = await ids(
        store, search="sweep 0", states=("finished",), config=(("model", "resnet"),), limit=3
    )
    assert combined == [seeds.run_id(i) for i in (99, 96, 93)]


async def test_every_sort_in_both_orders(store):
    await seeded(store)
    page = (await store.run_page(RunQuery())).runs
    keys = {
        "started": lambda r: r.started_ts,
        "last": lambda r: r.last_ts,
        "id": lambda r: r.run_id,
        "name": lambda r: r.name,
        "state": lambda r: r.state,
        "labels": lambda r: r.label_count,
    }
    for sort, key in keys.items():
        for order in ("asc", "desc"):
            got = await ids(store, sort=sort, order=order)
            # Ties by run id, in the same direction.
            expected = sorted(page, key=lambda r: (key(r), r.run_id), reverse=order == "desc")
            assert got == [r.run_id for r in expected], (sort, order)
    # Runs not ended yet (no ended_ts) come last either way.
    ended = await ids(store, sort="ended", order="asc")
    running = {seeds.run_id(i) for i in range(COUNT) if i % 3 == 2}
    assert set(ended[-len(running) :]) == running
    assert await ids(store, sort="labels", limit=1) == [seeds.run_id(COUNT - 1)]


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ({"sort": "color"}, "cannot sort by 'color'"),
        ({"order": "up"}, "order must be 'asc' or 'desc'"),
        ({"limit": -1}, "limit must be a whole number"),
        ({"offset": -5}, "offset must be a whole number"),
        ({"states": ("paused",)}, "no state 'paused'"),
        ({"since": float("nan")}, "since must be a finite number"),
        ({"config": (("", "1"),)}, "needs a key before its '='"),
        ({"config": (('a"b', "1"),)}, "cannot hold a quote"),
        ({"search": "x" * 257}, "at most 256 characters"),
        ({"tags": tuple(str(i) for i in range(17))}, "at most 16 tags"),
    ],
)
def test_bad_queries_say_what_they_take(query, says):
    with pytest.raises(BadQuery, match=says):
        RunQuery(**query)


def test_a_sqlite_without_json_arrows_says_so_for_config_filters():
    old = dataclasses.replace(SQLITE, member="")
    assert run_page_queries(old, RunQuery(search="x", tags=("t",)))  # the other filters need no `->`
    with pytest.raises(BadQuery, match=r"needs SQLite 3\.38 or later"):
        run_page_queries(old, RunQuery(config=(("lr", "0.1"),)))


def test_texts_are_read_as_people_type_them():
    assert moment("1767225600") == 1767225600.0
    assert moment("2026-01-02") == datetime(2026, 1, 2).timestamp()
    assert moment("2026-01-02", end=True) == datetime(2026, 1, 3).timestamp()
    assert moment("2026-01-02T03:04:05+00:00") == 1767323045.0
    for bad in ("yesterday", "2026-13-01", "inf", "9999-12-31"):
        with pytest.raises(BadQuery, match="not a time"):
            moment(bad, end=True)
    query = run_query(states=["failed,crashed", "failed"], config=["lr=0.1", "eq==x"], since="")
    assert query.states == ("failed", "crashed") and query.since is None
    assert query.config == (("lr", "0.1"), ("eq", "=x"))
    with pytest.raises(BadQuery, match="a key, '=' and a value"):
        run_query(config=["lr"])


# -- /api/runs, `runbus runs`, runbus.Api ------------------------------------------------------------


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('runs') / 'runbus.db'}"
    asyncio.run(seeds.seed_url(url, COUNT, hostile_events(), labels=2))
    return url


@pytest.fixture
async def api(many: str):
    async with TestClient(TestServer(create_app(many))) as client:
        yield client


async def test_api_pages_searches_and_counts(api):
    first = await get_json(api, "/api/runs", limit=50)
    assert (first["total"], first["offset"], first["limit"], first["next_offset"]) == (COUNT + 1, 0, 50, 50)
    assert (first["sort"], first["order"]) == ("started", "desc")
    assert len(first["runs"]) == 50 and first["runs"][0]["labels"][0]["label"] == "rank0"
    last = await get_json(api, "/api/runs", limit=50, offset=200)
    assert last["next_offset"] is None and last["runs"][-1]["run_id"] == "odd-run"
    found = await get_json(api, "/api/runs", q="50%_off")
    assert [r["run_id"] for r in found["runs"]] == ["odd-run"] and found["total"] == 1
    assert found["runs"][0]["name"] == HOSTILE_NAME
    response = await api.get(
        "/api/runs",
        params=[
            ("state", "failed"),
            ("state", "crashed"),
            ("config", "model=vit"),
            ("sort", "id"),
            ("order", "asc"),
        ],
    )
    doc = orjson.loads(await response.read())
    assert [r["run_id"] for r in doc["runs"]][:2] == [seeds.run_id(1), seeds.run_id(4)]
    dated = await get_json(
        api, "/api/runs", since=str(seeds.T0 + 10 * seeds.EVERY), until="2026-01-01T13:00:00+00:00"
    )
    assert [r["run_id"] for r in dated["runs"]] == [seeds.run_id(i) for i in (12, 11, 10)]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"sort": "color"}, "cannot sort by 'color'"),
        ({"order": "sideways"}, "order must be"),
        ({"limit": "-1"}, "limit must be between 1 and 1000"),
        ({"limit": "many"}, "limit must be an integer"),
        ({"offset": "-1"}, "offset must be between"),
        ({"since": "last tuesday"}, "not a time"),
        ({"until": "2026-02-30"}, "not a time"),
        ({"state": "paused"}, "no state 'paused'"),
        ({"config": "lr"}, "a key, '=' and a value"),
        ({"q": "x" * 300}, "q must be at most 256 characters"),
    ],
)
async def test_api_bad_parameters_are_400_with_a_reason(api, params, says):
    doc = await get_json(api, "/api/runs", status=400, **params)
    assert says in doc["error"]


def test_cli_filters_sorts_and_pages(many):
    listed = run_cli("--store", many, "runs", "--json", "--limit", "5", "--offset", "10")
    assert [r["run_id"] for r in orjson.loads(listed.stdout)] == [
        seeds.run_id(COUNT - 1 - i) for i in range(10, 15)
    ]
    assert f"runs 11-15 of {COUNT + 1} that match; --offset 15 for the next" in listed.stderr
    every = run_cli("--store", many, "runs", "--json")
    assert len(orjson.loads(every.stdout)) == COUNT + 1 and every.stderr == ""
    table = run_cli(
        "--store", many, "runs", "--search", "TRIAL 7", "--state", "failed,crashed", "--since", "2026-01-01",
        "--until", "2026-01-05", "--sort", "id", "--order", "asc", env={"TZ": "UTC"},
    )  # fmt: skip
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["RUN", "NAME", "TAGS"]
    assert [line.split()[0] for line in lines[1:]] == [seeds.run_id(i) for i in (7, 70, 73, 76, 79)]
    config = run_cli(
        "--store", many, "runs", "--json", "--config", "seed=42", "--tag", "manual", "--label", "rank1"
    )
    assert [r["run_id"] for r in orjson.loads(config.stdout)] == [seeds.run_id(42)]
    nothing = run_cli("--store", many, "runs", "--search", "no such run")
    assert nothing.stdout.splitlines()[1:] == []


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--since", "soon"], 1, "not a time: 'soon'"),
        (["--config", "lr"], 1, "a key, '=' and a value (lr=0.1), got 'lr'"),
        (["--state", "paused"], 1, "no state 'paused'"),
        (["--sort", "color"], 2, "invalid choice: 'color'"),
        (["--limit", "-3"], 2, "must be at least 0"),
    ],
)
def test_cli_bad_input_is_one_line(many, args, code, says):
    result = run_cli("--store", many, "runs", *args, check=False)
    assert result.returncode == code and says in result.stderr and "Traceback" not in result.stderr


def test_api_runs_takes_the_same_filters(many):
    with runbus.Api(many) as api:
        everyone = api.runs()
        assert len(everyone) == COUNT + 1 and everyone.attrs["total"] == COUNT + 1
        page = api.runs("trial 7", state=["failed", "crashed"], sort="id", order="asc", limit=2, offset=1)
        assert list(page["run_id"]) == [seeds.run_id(i) for i in (70, 73)] and page.attrs["total"] == 8
        assert list(page["metric_events"]) == [0, 0] and list(page["labels"]) == [2, 2]
        dated = api.runs(
            since=datetime.fromtimestamp(seeds.T0 + 10 * seeds.EVERY), until=seeds.T0 + 13 * seeds.EVERY
        )
        assert list(dated["run_id"]) == [seeds.run_id(i) for i in (12, 11, 10)]
        assert list(api.runs(config={"lr": 0.30000000000000004, "a.b": "dotted"})["run_id"]) == ["odd-run"]
        assert list(api.runs(tag='q"t', label="rank0")["run_id"]) == ["odd-run"]
        with pytest.raises(runbus.BadQuery, match="cannot sort by"):
            api.runs(sort="colour")
        with pytest.raises(runbus.BadQuery, match="not a time"):
            api.runs(since="whenever")
        with pytest.raises(TypeError, match="a time must be"):
            api.runs(until=[2026])
