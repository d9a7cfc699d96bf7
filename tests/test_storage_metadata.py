"""Run metadata in the store, on every backend: each label's config, summary, name and tags kept
apart, in the label's (epoch, seq) order whatever order they arrive in, and merged into the
run's view (the primary's value wins, else the latest any other label set), through writers
racing each other and a store migrated from the schema before run metadata."""

from __future__ import annotations

import asyncio
import random
import sqlite3

import asyncpg
import orjson

from runbus.redact import MARKER
from runbus.storage import Store
from runbus.storage import postgres as postgres_backend
from runbus.storage import sqlite as sqlite_backend
from runbus.storage.base import SetBy
from runbus.wire import Event
from tests.helpers import OpenStore
from tests.test_storage import (
    RUN,
    T0,
    event,
    finish,
    metric,
    schema_version,
    scrambled,
    start,
)


def meta(seq: int, data: dict, **kw) -> Event:
    return event("meta", seq, data, **kw)


async def shown(store: Store, run: str = RUN):
    found = await store.run(run)
    assert found is not None
    return found


async def test_config_updates_are_kept_per_label_and_shown_merged(store: Store) -> None:
    await store.write(
        [
            start(1, primary=True, config={"lr": 0.1, "batch": 32}),
            meta(2, {"config": {"lr": 0.2, "epochs": 3}}),
            start(1, label="rank1", config={"lr": 0.1, "batch": 32}),
            meta(2, {"config": {"lr": 0.5, "workers": 4}}, label="rank1"),
            meta(3, {"config": {"workers": 8}}, label="rank1"),
        ]
    )
    run = await shown(store)
    # Two labels set lr: the primary's wins; workers only rank1 set.
    assert run.config == {"lr": 0.2, "batch": 32, "epochs": 3, "workers": 8}
    assert run.set_by.config == {"lr": "rank0", "batch": "rank0", "epochs": "rank0", "workers": "rank1"}
    rank0, rank1 = run.labels
    assert rank0.config == {"lr": 0.2, "batch": 32, "epochs": 3}
    assert rank1.config == {"lr": 0.5, "batch": 32, "workers": 8}
    assert (await store.runs())[0].config == run.config
    assert (await store.runs())[0].set_by == run.set_by


async def test_the_latest_value_of_a_key_is_the_label_s_whatever_the_arrival_order(store: Store) -> None:
    await store.write([meta(5, {"config": {"lr": 0.5}, "summary": {"loss": 0.5}})])
    await store.write([meta(3, {"config": {"lr": 0.3}, "summary": {"loss": 0.3, "acc": 0.3}})])
    await store.write([meta(5, {"config": {"lr": 0.5}, "summary": {"loss": 0.5}})])  # redelivered
    await store.write([start(1, primary=True, config={"lr": 0.1})])
    run = await shown(store)
    assert (run.config, run.summary) == ({"lr": 0.5}, {"loss": 0.5, "acc": 0.3})
    # One batch holding several values of a key: the latest in seq order, not batch order.
    await store.write([meta(9, {"summary": {"acc": 0.9}}), meta(7, {"summary": {"acc": 0.7}})])
    assert (await shown(store)).summary == {"loss": 0.5, "acc": 0.9}


async def test_shuffled_split_batches_give_the_same_metadata(open_stores: OpenStore) -> None:
    def story(run: str) -> list[Event]:
        events = [start(1, primary=True, run=run, config={"lr": 0.1})]
        events += [start(1, label="rank1", run=run, config={"lr": 9.0, "rank": 1})]
        for seq in range(2, 40):
            events.append(meta(seq, {"summary": {"loss": 1 / seq, f"k{seq % 5}": seq}}, run=run))
            events.append(meta(seq, {"config": {"rank": seq, "lr": seq / 100}}, run=run, label="rank1"))
            if seq % 7 == 0:
                events.append(meta(seq + 100, {"name": f"name-{seq}", "tags": [f"t{seq}"]}, run=run))
        return events

    ordered, shuffled = await open_stores(), await open_stores()
    await ordered.write(story("ordered"))
    for batch in scrambled(story("shuffled"), random.Random(3)):
        await shuffled.write(batch)
    a, b = await shown(ordered, "ordered"), await shown(shuffled, "shuffled")
    assert (a.config, a.summary, a.name, a.tags, a.set_by) == (b.config, b.summary, b.name, b.tags, b.set_by)
    assert [(lab.config, lab.summary) for lab in a.labels] == [(lab.config, lab.summary) for lab in b.labels]
    assert a.config == {"lr": 0.1, "rank": 39}
    assert (a.name, a.tags, a.summary["loss"]) == ("name-35", ["t35"], 1 / 39)


async def test_summary_is_kept_per_label_and_merged(store: Store) -> None:
    await store.write(
        [
            start(1, primary=True),
            meta(2, {"summary": {"best_acc": 0.8, "loss": 0.3}}),
            meta(3, {"summary": {"best_acc": 0.9}}),
            start(1, label="rank1"),
            meta(2, {"summary": {"best_acc": 0.99, "rank1_only": "yes"}}, label="rank1"),
        ]
    )
    run = await shown(store)
    assert run.summary == {"best_acc": 0.9, "loss": 0.3, "rank1_only": "yes"}
    assert run.set_by.summary == {"best_acc": "rank0", "loss": "rank0", "rank1_only": "rank1"}
    assert [lab.summary for lab in run.labels] == [
        {"best_acc": 0.9, "loss": 0.3},
        {"best_acc": 0.99, "rank1_only": "yes"},
    ]
    assert (await store.runs())[0].summary == run.summary


async def test_name_and_tags_the_primary_s_win_else_the_latest(store: Store) -> None:
    # No primary yet: the latest any label set (by ts).
    await store.write([meta(1, {"name": "from rank1", "tags": ["a"]}, label="rank1", ts=T0 + 5)])
    await store.write([meta(1, {"name": "from rank2"}, label="rank2", ts=T0 + 6)])
    run = await shown(store)
    assert (run.name, run.tags, run.set_by.name, run.set_by.tags) == ("from rank2", ["a"], "rank2", "rank1")

    # The primary's start decides the primary, whose values win even when set earlier.
    await store.write([start(1, primary=True, ts=T0), meta(2, {"tags": ["x", "y"]}, ts=T0 + 1)])
    run = await shown(store)
    assert (run.name, run.tags, run.set_by.name, run.set_by.tags) == (
        "from rank2",
        ["x", "y"],
        "rank2",
        "rank0",
    )
    await store.write([meta(3, {"name": "the run"}, ts=T0 + 2)])
    await store.write([meta(2, {"name": "later, not primary"}, label="rank2", ts=T0 + 9)])
    run = await shown(store)
    assert (run.name, run.set_by.name) == ("the run", "rank0")
    assert {lab.label: (lab.name, lab.tags) for lab in run.labels} == {
        "rank0": ("the run", ["x", "y"]),
        "rank1": ("from rank1", ["a"]),
        "rank2": ("later, not primary", None),
    }
    # Tags set to [] clear the primary's tags: an empty list is a value too.
    await store.write([meta(4, {"tags": []}, ts=T0 + 3)])
    run = await shown(store)
    assert (run.tags, run.set_by.tags) == ([], "rank0")
    listed = (await store.runs())[0]
    assert (listed.name, listed.tags) == ("the run", [])


async def test_a_restarted_label_s_config_begins_afresh_its_summary_stays(store: Store) -> None:
    await store.write(
        [
            start(1, primary=True, config={"lr": 0.1, "old": True}),
            meta(2, {"config": {"epochs": 3}, "summary": {"best": 0.5}, "name": "first"}),
        ]
    )
    await store.write([start(1, primary=True, epoch=2, config={"lr": 0.2})])
    run = await shown(store)
    assert (run.config, run.summary, run.name) == ({"lr": 0.2}, {"best": 0.5}, "first")
    # An update of the earlier life arriving late changes nothing: its config is over.
    await store.write([meta(3, {"config": {"late": 1}, "summary": {"late": 1}})])
    run = await shown(store)
    assert (run.config, run.summary) == ({"lr": 0.2}, {"best": 0.5, "late": 1})
    await store.write([meta(2, {"config": {"epochs": 4}}, epoch=2)])
    assert (await shown(store)).config == {"lr": 0.2, "epochs": 4}


async def test_metadata_after_finish_is_stored_and_changes_no_state(store: Store) -> None:
    await store.write([start(1, primary=True), finish(2, 0), meta(3, {"summary": {"after": 1}})])
    run = await shown(store)
    assert (run.state, run.exit_code, run.summary) == ("finished", 0, {"after": 1})
    assert run.labels[0].events == 3


async def test_metadata_events_count_as_events_not_as_metrics(store: Store) -> None:
    await store.write([start(1, primary=True), metric(2, {"loss": 1.0}), meta(3, {"summary": {"a": 1}})])
    run = await shown(store)
    assert run.counts == {"metric": 1, "log": 0, "system": 0}
    assert (run.labels[0].events, run.labels[0].last_seq, run.labels[0].missing) == (3, 3, 0)


async def test_hand_written_secrets_and_nul_are_stored_redacted_and_storable(store: Store) -> None:
    token = "hf_" + "SeKrIt" * 6
    await store.write(
        [
            start(1, primary=True, config={"api_key": "sekrit-1", token: 1}),
            meta(
                2,
                {
                    "config": {
                        "db": {"password": "sekrit-2"},
                        "url": "redis://u:sekrit-3@h/0",
                        "k\x00": "\x00",
                    },
                    "summary": {"note": f"token {token}", "auth_token": "sekrit-4"},
                    "name": "run sekrit",
                    "tags": [token],
                },
            ),
        ]
    )
    run = await shown(store)
    assert run.config == {
        "api_key": MARKER,
        MARKER: 1,
        "db": {"password": MARKER},
        "url": "redis://u:***@h/0",
        "k\ufffd": "\x00",
    }
    assert run.summary == {"note": f"token {MARKER}", "auth_token": MARKER}
    assert (run.name, run.tags) == ("run sekrit", [MARKER])
    assert run.labels[0].config == run.config


async def test_concurrent_writers_merge_every_label_s_metadata(open_stores: OpenStore) -> None:
    writers = [await open_stores() for _ in range(6)]
    await writers[0].write([start(1, primary=True, ts=T0, config={"lr": 0.1})])
    for seq in range(2, 8):
        await asyncio.gather(
            *(
                w.write(
                    [
                        meta(
                            seq,
                            {"config": {f"rank{n}": seq}, "summary": {"seq": seq * 10 + n}},
                            label=f"rank{n}",
                        )
                    ]
                )
                for n, w in enumerate(writers)
            )
        )
    run = await shown(writers[0])
    assert run.config == {"lr": 0.1, **{f"rank{n}": 7 for n in range(6)}}
    assert run.summary == {"seq": 70}  # the primary's
    assert [lab.summary for lab in run.labels] == [{"seq": 70 + n} for n in range(6)]


# -- a store made before run metadata --------------------------------------------------------------


async def make_version_4_store(url: str) -> None:
    """A store at schema version 4, as the runbus before run metadata left it: run RUN with
    primary rank0 (config lr, layers; restarted once) and rank1 (config lr, extra), a finished
    run `other` whose primary never started, and a run with no start at all."""
    start_data = {
        1: {"primary": True, "config": {"lr": 0.1, "layers": [64, 64]}},
        2: {"primary": False, "config": {"lr": 9.0, "extra": "rank1 only"}},
        3: {"primary": False, "config": {"only": "worker"}},
    }
    runs = [
        (RUN, "running", "rank0", T0 + 1, T0 + 5, orjson.dumps(start_data[1]["config"]).decode()),
        ("other", "finished", None, T0, T0 + 2, None),
        ("empty", "running", None, T0, T0, None),
    ]
    labels = [
        (1, RUN, "rank0", True, 2, 1, orjson.dumps(start_data[1]).decode(), 2, 1, T0 + 1),
        (2, RUN, "rank1", False, 1, 1, orjson.dumps(start_data[2]).decode(), 1, 1, T0 + 2),
        (3, "other", "w", False, 1, 1, orjson.dumps(start_data[3]).decode(), 1, 1, T0),
        (4, "empty", "x", False, 0, 0, None, 1, 1, T0),
    ]
    run_sql = "INSERT INTO runs (run_id, state, primary_label, started_ts, last_ts, config) VALUES ({})"
    label_sql = (
        "INSERT INTO labels (id, run_id, label, is_primary, start_epoch, start_seq, start_data, "
        "epoch, last_seq, first_ts) VALUES ({})"
    )
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        for script in sqlite_backend.MIGRATIONS[:4]:
            for statement in script.split(";"):
                if statement.strip():
                    con.execute(statement)
        for sql, values in ((run_sql, runs), (label_sql, labels)):
            con.executemany(sql.format(", ".join("?" * len(values[0]))), values)
        con.execute("PRAGMA user_version = 4")
        con.close()
        return
    pg = await asyncpg.connect(url)
    try:
        await pg.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ)")
        for number, script in enumerate(postgres_backend.MIGRATIONS[:4], start=1):
            await pg.execute(script)
            await pg.execute("INSERT INTO schema_version (version) VALUES ($1)", number)
        for sql, values in ((run_sql, runs), (label_sql, labels)):
            marks = ", ".join(f"${n}" for n in range(1, len(values[0]) + 1))
            await pg.executemany(sql.format(marks), values)
        await pg.execute("SELECT setval(pg_get_serial_sequence('labels', 'id'), 4)")
    finally:
        await pg.close()


async def test_a_version_4_store_migrates_its_configs_in_place(
    open_stores: OpenStore, any_store_url: str
) -> None:
    await make_version_4_store(any_store_url)
    store = await open_stores()
    backend = sqlite_backend if any_store_url.startswith("sqlite") else postgres_backend
    assert await schema_version(any_store_url) == len(backend.MIGRATIONS) >= 5
    run = await shown(store)
    assert run.config == {"lr": 0.1, "layers": [64, 64], "extra": "rank1 only"}
    assert run.set_by == SetBy(config={"lr": "rank0", "layers": "rank0", "extra": "rank1"})
    assert (run.name, run.tags, run.summary) == (None, [], {})
    assert [lab.config for lab in run.labels] == [
        {"lr": 0.1, "layers": [64, 64]},
        {"lr": 9.0, "extra": "rank1 only"},
    ]
    listed = {r.run_id: r for r in await store.runs()}
    assert listed[RUN].config == run.config and listed[RUN].set_by == run.set_by
    assert (listed["other"].config, listed["other"].set_by.config) == ({"only": "worker"}, {"only": "w"})
    assert (listed["empty"].config, listed["empty"].name, listed["empty"].tags) == (None, None, [])

    # Writing goes on where the old store left off: the old start's position still orders.
    await store.write(
        [
            meta(2, {"config": {"lr": 0.2}, "name": "migrated"}, epoch=2),
            meta(5, {"config": {"lr": 0.05}}, epoch=1),  # rank0's earlier life: over
        ]
    )
    run = await shown(store)
    assert (run.config["lr"], run.name) == (0.2, "migrated")
    again = await open_stores()  # connecting again migrates nothing more
    assert (await shown(again)).config == run.config
