"""The storage conformance suite: every behaviour is tested once and must hold on every backend."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator

import asyncpg
import pytest

from runbus.errors import AccessDenied, StoreError, StoreMissing, StoreRejected, StoreUnavailable
from runbus.ingester.localredis import free_port
from runbus.storage import LogLine, RunSummary, Store, open_store
from runbus.storage import postgres as postgres_backend
from runbus.storage import sqlite as sqlite_backend
from runbus.storage.rules import SEQ_REACH
from runbus.wire import Event
from tests.helpers import OpenStore, wait_for_async
from tests.pgserver import LocalPostgres, create_database, public_tables

RUN = "run-1"
T0 = 1_700_000_000.0


# -- events --------------------------------------------------------------------------------------


def event(
    kind: str,
    seq: int,
    data: dict | None = None,
    *,
    run: str = RUN,
    label: str = "rank0",
    epoch: int = 1,
    ts: float | None = None,
    step: int | None = None,
) -> Event:
    ts = T0 + epoch * 1000 + seq if ts is None else ts
    return Event(run, label, kind, epoch, seq, ts, data or {}, step)


def start(seq: int = 1, *, primary: bool = False, config: dict | None = None, **kw) -> Event:
    return event("start", seq, {"primary": primary, "config": config or {}}, **kw)


def finish(seq: int, exit_code: int = 0, **kw) -> Event:
    return event("finish", seq, {"exit_code": exit_code}, **kw)


def metric(seq: int, values: dict, step: int | None = None, **kw) -> Event:
    return event("metric", seq, values, step=step, **kw)


def system(seq: int, values: dict, **kw) -> Event:
    return event("system", seq, values, **kw)


def log(seq: int, text: str, level: str = "INFO", stream: str = "stdout", **kw) -> Event:
    return event("log", seq, {"stream": stream, "text": text, "level": level}, **kw)


def heartbeat(seq: int, **kw) -> Event:
    return event("heartbeat", seq, {"dropped": 0}, **kw)


def history(run: str, labels: int = 3, steps: int = 12) -> list[Event]:
    """A run's whole life: primary rank0 fails in epoch 1 and finishes in epoch 2; rank1
    finishes, rank2 fails with 3; rank1 never sent seq 5 (one missing)."""
    events = []
    for n in range(labels):
        label = f"rank{n}"
        for epoch in (1, 2) if n == 0 else (1,):
            config = {"lr": 0.1, "rank": n, "epoch": epoch}
            body: list[tuple[str, dict, int | None]] = [
                ("start", {"primary": n == 0, "config": config}, None)
            ]
            for step in range(steps):
                body.append(("metric", {"loss": 1 / (step + 1), "acc": step / steps}, step))
                if step % 4 == 0:
                    text = f"{label} epoch {epoch} step {step}"
                    body.append(("log", {"stream": "stdout", "text": text, "level": "INFO"}, None))
                if step % 5 == 0:
                    body.append(("system", {"gpu.util": float(step), "mem": 0.5}, None))
                if step % 3 == 0:
                    body.append(("heartbeat", {}, None))
            code = 1 if (n == 0 and epoch == 1) else 3 if n == 2 else 0
            body.append(("finish", {"exit_code": code}, None))
            for seq, (kind, data, step) in enumerate(body, start=1):
                if label == "rank1" and seq == 5:
                    continue
                ts = T0 + epoch * 100 + seq * 0.5 + n * 0.01
                events.append(Event(run, label, kind, epoch, seq, ts, data, step))
    return events


def scrambled(events: list[Event], rng: random.Random) -> list[list[Event]]:
    """`events` with a fifth of them repeated, shuffled, cut into batches of random sizes."""
    mixed = events + rng.sample(events, len(events) // 5)
    rng.shuffle(mixed)
    batches = []
    while mixed:
        size = rng.randint(1, 40)
        batches.append(mixed[:size])
        mixed = mixed[size:]
    return batches


async def snapshot(store: Store, run: str) -> tuple:
    """Everything a store says about `run`, with the run id blanked so two runs compare."""
    summary = await store.run(run)
    assert summary is not None
    return (
        dataclasses.replace(summary, run_id=""),
        await store.metrics(run),
        await store.system(run),
        await store.logs(run),
        await store.metric_keys(run),
    )


def texts(lines: list[LogLine]) -> list[str]:
    return [line.text for line in lines]


def labels_of(run: RunSummary) -> dict[str, tuple]:
    return {lab.label: (lab.state, lab.exit_code, lab.epoch, lab.last_seq) for lab in run.labels}


# -- exactly once --------------------------------------------------------------------------------


async def test_duplicates_are_stored_once(store: Store) -> None:
    loss, hello = metric(2, {"loss": 0.5}, step=0), log(3, "hello")
    first = [start(1, primary=True), loss, loss, hello, hello]
    assert await store.write(first) == 3
    assert await store.write([loss, hello, system(4, {"cpu": 1})]) == 1
    assert await store.write([]) == 0
    assert await store.write(first) == 0

    run = await store.run(RUN)
    assert run is not None
    assert run.counts == {"metric": 1, "log": 1, "system": 1}
    (label,) = run.labels
    assert (label.events, label.missing, label.last_seq) == (4, 0, 4)
    assert [(p.key, p.step, p.value) for p in await store.metrics(RUN)] == [("loss", 0, 0.5)]
    assert [line.text for line in await store.logs(RUN)] == ["hello"]
    assert [(p.key, p.value) for p in await store.system(RUN)] == [("cpu", 1.0)]


async def test_write_counts_only_new_events_across_labels_and_runs(store: Store) -> None:
    batch = [start(1, label="a"), start(1, label="b"), start(1, label="a", run="other")]
    assert await store.write(batch) == 3
    assert await store.write([*batch, heartbeat(2, label="b"), heartbeat(2, label="b")]) == 1
    run = await store.run(RUN)
    assert run is not None
    assert [(lab.label, lab.events) for lab in run.labels] == [("a", 1), ("b", 2)]
    other = await store.run("other")
    assert other is not None
    assert [(lab.label, lab.events) for lab in other.labels] == [("a", 1)]


async def test_a_batch_bigger_than_one_insert_statement_is_stored_whole(store: Store) -> None:
    # 1,500 metric events of 2 keys: 3,000 metric rows, several multi-row statements in SQLite.
    many = [metric(seq, {"loss": 1.0 / seq, "acc": float(seq)}, step=seq) for seq in range(1, 1501)]
    assert await store.write([start(1, primary=True), *many[1:]]) == 1500
    assert await store.write(many[1:700]) == 0
    points = await store.metrics(RUN, key="acc")
    assert [p.step for p in points] == list(range(2, 1501))
    assert [p.value for p in points] == [float(seq) for seq in range(2, 1501)]
    run = await store.run(RUN)
    assert run is not None and run.counts["metric"] == 1499


def test_sqlite_splits_rows_into_cached_statement_sizes() -> None:
    limit = sqlite_backend.MAX_ROWS_PER_INSERT
    assert sqlite_backend._statement_sizes(0) == []
    assert sqlite_backend._statement_sizes(1) == [1]
    assert sqlite_backend._statement_sizes(2 * limit + 11) == [limit, limit, 8, 2, 1]
    for count in range(3 * limit):
        sizes = sqlite_backend._statement_sizes(count)
        assert sum(sizes) == count and len(set(sizes) - {limit}) == len(sizes) - sizes.count(limit)


@pytest.mark.parametrize(
    "statement",
    [sqlite_backend._near_ranges_sql, sqlite_backend._delete_ranges_sql, sqlite_backend._update_labels_sql],
)
def test_sqlite_batch_statements_search_by_key(tmp_path, statement) -> None:
    # One statement for all of a batch's labels must still find each by its key, not scan the table.
    store = sqlite_backend.SQLiteStore(f"sqlite:///{tmp_path}/plan.db")
    asyncio.run(store.connect())
    sql = statement(3)
    plan = [row[3] for row in store._con.execute("EXPLAIN QUERY PLAN " + sql, [0] * sql.count("?"))]
    asyncio.run(store.close())
    assert any(step.startswith("SEARCH") for step in plan), plan
    assert not any(step.startswith(("SCAN seen", "SCAN labels")) for step in plan), plan


# -- ordering by (epoch, seq) --------------------------------------------------------------------


async def test_finish_arriving_before_start_still_finishes(store: Store) -> None:
    done = finish(9, 0, ts=T0 + 9)
    assert await store.write([done]) == 1
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary) == ("finished", None)  # no primary known: it follows its labels
    assert labels_of(run) == {"rank0": ("finished", 0, 1, 9)}

    assert await store.write([start(1, primary=True, ts=T0 + 1), heartbeat(5, ts=T0 + 5)]) == 2
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary, run.exit_code, run.ended_ts) == ("finished", "rank0", 0, T0 + 9)
    assert (run.started_ts, run.last_ts) == (T0 + 1, T0 + 9)
    assert labels_of(run) == {"rank0": ("finished", 0, 1, 9)}
    assert run.labels[0].missing == 6  # seqs 2-4 and 6-8 never came


async def test_start_arriving_again_after_finish_does_not_undo_it(store: Store) -> None:
    await store.write([start(1, primary=True), finish(4, 4)])
    # A redelivered start and late arrivals from before the finish.
    assert await store.write([start(1, primary=True), heartbeat(2), metric(3, {"loss": 1.0})]) == 2
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code) == ("failed", 4)
    assert labels_of(run) == {"rank0": ("failed", 4, 1, 4)}
    assert (run.labels[0].events, run.labels[0].missing) == (4, 0)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_shuffled_split_batches_give_the_same_result(store: Store, seed: int) -> None:
    rng = random.Random(seed)
    ordered = history("ordered")
    assert await store.write(ordered) == len(ordered)
    new = 0
    for batch in scrambled(history("shuffled"), rng):
        new += await store.write(batch)
    assert new == len(ordered)

    assert await snapshot(store, "shuffled") == await snapshot(store, "ordered")
    run = await store.run("shuffled")
    assert run is not None
    assert (run.state, run.primary, run.exit_code) == ("finished", "rank0", 0)
    assert labels_of(run) == {
        "rank0": ("finished", 0, 2, 24),
        "rank1": ("finished", 0, 1, 24),
        "rank2": ("failed", 3, 1, 24),
    }
    assert [lab.missing for lab in run.labels] == [0, 1, 0]
    assert run.config == {"lr": 0.1, "rank": 0, "epoch": 2}
    assert run.counts == {"metric": 48, "log": 12, "system": 12}


# -- the finish rule -----------------------------------------------------------------------------


async def test_only_the_primary_finishing_ends_the_run(store: Store) -> None:
    await store.write([start(1, primary=True, label="rank0"), start(1, label="rank1")])
    await store.write([start(1, label="rank2"), finish(2, 7, label="rank1")])
    await store.write([finish(2, 0, label="rank2")])
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary, run.exit_code, run.ended_ts) == ("running", "rank0", None, None)
    assert labels_of(run) == {
        "rank0": ("running", None, 1, 1),
        "rank1": ("failed", 7, 1, 2),
        "rank2": ("finished", 0, 1, 2),
    }

    end = finish(2, 0, label="rank0", ts=T0 + 50)
    await store.write([end])
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary, run.exit_code, run.ended_ts) == ("finished", "rank0", 0, T0 + 50)
    assert run.label_count == 3


async def test_primary_failing_fails_the_run(store: Store) -> None:
    await store.write([start(1, label="rank1"), start(1, primary=True, label="rank0")])
    await store.write([finish(2, 137, label="rank0", ts=T0 + 7)])
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary, run.exit_code, run.ended_ts) == ("failed", "rank0", 137, T0 + 7)
    assert [listed.state for listed in await store.runs()] == ["failed"]


async def test_restart_with_a_higher_epoch_runs_again(store: Store) -> None:
    epoch1 = [start(1, primary=True), metric(2, {"loss": 2.0}, step=0)]
    epoch1 += [metric(4, {"loss": 1.5}, step=1), finish(5, 1)]  # seq 3 lost
    await store.write(epoch1)
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code) == ("failed", 1)

    await store.write([start(1, primary=True, epoch=2), metric(2, {"loss": 1.4}, step=1, epoch=2)])
    # Late arrivals of the old epoch change nothing: (1, 7) comes before (2, 1).
    await store.write([finish(7, 1, epoch=1), metric(4, {"loss": 1.3}, step=2, epoch=2)])
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code, run.ended_ts) == ("running", None, None)
    (label,) = run.labels
    assert (label.state, label.epoch, label.last_seq) == ("running", 2, 4)
    assert (label.events, label.missing) == (8, 1 + 1 + 1)  # epoch 1: seqs 3, 6; epoch 2: seq 3
    assert [(p.epoch, p.seq, p.step) for p in await store.metrics(RUN)] == [
        (1, 2, 0),
        (1, 4, 1),
        (2, 2, 1),
        (2, 4, 2),
    ]

    await store.write([finish(5, 0, epoch=2, ts=T0 + 99)])
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code, run.ended_ts) == ("finished", 0, T0 + 99)


async def test_gaps_are_reported_with_the_drops_that_explain_them(store: Store) -> None:
    await store.write([start(1, primary=True), metric(2, {"loss": 1.0}), metric(6, {"loss": 0.5})])
    report = event("heartbeat", 5, {"dropped": 2, "dropped_ranges": [[3, 4]]})
    await store.write([report, finish(9, 0), start(1, primary=True, epoch=2), heartbeat(3, epoch=2)])
    run = await store.run(RUN)
    assert run is not None
    (label,) = run.labels
    assert [(g.epoch, g.first, g.last, g.dropped) for g in label.gaps] == [
        (1, 3, 4, 2),
        (1, 7, 8, 0),
        (2, 2, 2, 0),
    ]
    assert label.missing == 5


async def test_silent_running_labels_are_marked_crashed(store: Store) -> None:
    await store.write([start(1, primary=True, label="rank0"), start(1, label="rank1")])
    await store.write([start(1, label="rank2"), finish(2, 0, label="rank2", ts=T0 + 2)])
    assert await store.mark_crashed(time.time() - 3600) == []  # all heard from just now

    marked = await store.mark_crashed(time.time() + 1)
    assert sorted(marked) == [(RUN, "rank0"), (RUN, "rank1")]
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary, run.exit_code) == ("crashed", "rank0", None)
    assert labels_of(run) == {
        "rank0": ("crashed", None, 1, 1),
        "rank1": ("crashed", None, 1, 1),
        "rank2": ("finished", 0, 1, 2),
    }
    assert await store.mark_crashed(time.time() + 1) == []  # crashed already

    await store.write([metric(2, {"loss": 1.0}, label="rank0")])  # a sign of life revives it
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.ended_ts) == ("running", None)
    assert labels_of(run)["rank0"] == ("running", None, 1, 2)
    assert labels_of(run)["rank1"] == ("crashed", None, 1, 1)


async def test_a_finished_label_stays_finished_until_a_new_epoch_starts(store: Store) -> None:
    await store.write([start(1, primary=True), finish(4, 0, ts=T0 + 4)])
    # The producer's last heartbeat, metrics and logs after its finish (higher seqs, same epoch).
    late = [heartbeat(5), metric(6, {"loss": 1.0}), log(7, "bye"), system(8, {"cpu": 1.0})]
    assert await store.write(late) == 4
    assert await store.mark_crashed(time.time() + 1) == []  # not running: not crashed either
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code, run.ended_ts) == ("finished", 0, T0 + 4)
    assert labels_of(run) == {"rank0": ("finished", 0, 1, 8)}
    await store.write([heartbeat(1, epoch=2)])  # a new epoch's heartbeat alone is no new life
    assert (await store.run(RUN) or run).state == "finished"
    await store.write([start(2, primary=True, epoch=2)])  # its start is
    assert (await store.run(RUN) or run).state == "running"


async def test_a_stray_primary_claim_is_refused_and_changes_nothing(store: Store) -> None:
    # rank0 holds the live claim; a stray script's bare start says primary too, then finishes 0.
    stray = [start(1, primary=True, label="stray", ts=T0 + 1), finish(2, 0, label="stray", ts=T0 + 2)]
    assert await store.write(stray, holders={RUN: "rank0"}) == 2
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary) == ("running", "rank0")  # decided by the live claim
    assert [(lab.label, lab.primary, lab.primary_refused_ts) for lab in run.labels] == [
        ("stray", False, T0 + 1)
    ]
    await store.write([start(1, primary=True, label="rank0"), start(1, label="rank1")])
    await store.write([start(3, primary=True, label="stray", epoch=1, ts=T0 + 30)], holders={RUN: "stray"})
    await store.write([finish(9, 3, label="rank0", ts=T0 + 50)])
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary, run.exit_code, run.ended_ts) == ("failed", "rank0", 3, T0 + 50)
    refused = {lab.label: (lab.primary, lab.primary_refused_ts) for lab in run.labels}
    assert refused == {"rank0": (True, None), "rank1": (False, None), "stray": (False, T0 + 30)}
    assert [(r.run_id, r.state, r.primary) for r in await store.runs()] == [(RUN, "failed", "rank0")]


async def test_without_a_live_claim_the_first_primary_start_is_the_run_s(store: Store) -> None:
    # Written by hand: no claim key. The first claim seen wins; one in the same batch by ts.
    await store.write(
        [start(1, primary=True, label="b", ts=T0 + 2), start(1, primary=True, label="a", ts=T0 + 3)]
    )
    await store.write([start(1, primary=True, label="c", ts=T0)])  # earlier, but seen later
    run = await store.run(RUN)
    assert run is not None
    assert run.primary == "b"
    assert {lab.label: lab.primary_refused_ts for lab in run.labels} == {"a": T0 + 3, "b": None, "c": T0}
    assert run.config == {}


async def test_concurrent_writers_decide_one_primary(open_stores: OpenStore) -> None:
    writers = [await open_stores() for _ in range(6)]
    claims = [start(1, primary=True, label=f"rank{n}", ts=T0 + n) for n in range(len(writers))]
    await asyncio.gather(*(w.write([claim]) for w, claim in zip(writers, claims, strict=True)))
    run = await writers[0].run(RUN)
    assert run is not None
    winners = [lab.label for lab in run.labels if lab.primary]
    assert winners == [run.primary]
    refused = [lab.label for lab in run.labels if lab.primary_refused_ts is not None]
    assert sorted(refused + winners) == [f"rank{n}" for n in range(len(writers))]


async def test_a_run_whose_starts_were_lost_still_ends(store: Store) -> None:
    await store.write([heartbeat(1, label="rank0"), heartbeat(1, label="rank1"), metric(2, {"x": 1.0})])
    run = await store.run(RUN)
    assert run is not None and (run.state, run.primary) == ("running", None)
    await store.write([finish(3, 0, label="rank0", ts=T0 + 3)])
    assert (await store.run(RUN) or run).state == "running"  # rank1 still runs
    assert await store.mark_crashed(time.time() + 1) == [(RUN, "rank1")]
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code, run.primary) == ("crashed", None, None)
    await store.write([finish(2, 4, label="rank1", ts=T0 + 9)])  # its finish, late
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code, run.ended_ts) == ("failed", 4, T0 + 9)


# -- values and reads ----------------------------------------------------------------------------


async def test_non_finite_values_round_trip(store: Store) -> None:
    values = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "zero": -0.0, "int": 3}
    await store.write([metric(1, values, step=5), system(2, values)])
    for points in (await store.metrics(RUN), await store.system(RUN)):
        got = {p.key: p.value for p in points}
        assert sorted(got) == ["inf", "int", "nan", "ninf", "zero"]
        assert math.isnan(got["nan"])
        assert got["inf"] == math.inf
        assert got["ninf"] == -math.inf
        assert got["zero"] == 0.0
        assert got["int"] == 3.0
        assert all(type(value) is float for value in got.values())
    assert [p.step for p in await store.metrics(RUN)] == [5] * 5
    assert [p.step for p in await store.system(RUN)] == [None] * 5


async def test_metrics_are_ordered_by_label_key_step(store: Store) -> None:
    await store.write(
        [
            metric(5, {"loss": 0.5}, step=2, label="rank1"),
            metric(6, {"loss": 0.6}, label="rank1"),
            metric(7, {"loss": 0.7}, step=1, label="rank1"),
            metric(1, {"loss": 0.1}, step=1, label="rank0", epoch=2),
            metric(3, {"loss": 0.3, "Acc": 0.03}, step=1, label="rank0"),
            metric(2, {"acc": 0.2}, step=0, label="rank0"),
            metric(4, {"loss": 0.4}, step=0, label="rank0"),
        ]
    )
    got = [(p.label, p.key, p.step, p.epoch, p.seq, p.value) for p in await store.metrics(RUN)]
    assert got == [
        ("rank0", "Acc", 1, 1, 3, 0.03),  # code-point order: capitals first
        ("rank0", "acc", 0, 1, 2, 0.2),
        ("rank0", "loss", 0, 1, 4, 0.4),
        ("rank0", "loss", 1, 1, 3, 0.3),
        ("rank0", "loss", 1, 2, 1, 0.1),
        ("rank1", "loss", None, 1, 6, 0.6),
        ("rank1", "loss", 1, 1, 7, 0.7),
        ("rank1", "loss", 2, 1, 5, 0.5),
    ]
    loss = await store.metrics(RUN, key="loss", label="rank1")
    assert [(p.step, p.value) for p in loss] == [(None, 0.6), (1, 0.7), (2, 0.5)]
    assert [p.label for p in await store.metrics(RUN, key="acc")] == ["rank0"]
    point = (await store.metrics(RUN, key="Acc"))[0]
    assert point.ts == T0 + 1000 + 3
    assert await store.metrics(RUN, key="missing") == []
    assert await store.metrics("no-such-run") == []
    assert await store.metric_keys(RUN) == ["Acc", "acc", "loss"]
    assert await store.metric_keys("no-such-run") == []


async def test_system_points_are_ordered_by_label_key_ts(store: Store) -> None:
    await store.write(
        [
            system(1, {"gpu": 90.0, "cpu": 10.0}, label="rank1", ts=T0 + 30),
            system(2, {"gpu": 80.0}, label="rank1", ts=T0 + 10),
            system(1, {"gpu": 70.0}, label="rank0", ts=T0 + 20),
            heartbeat(3, label="rank0"),
        ]
    )
    got = [(p.label, p.key, p.ts, p.value, p.step) for p in await store.system(RUN)]
    assert got == [
        ("rank0", "gpu", T0 + 20, 70.0, None),
        ("rank1", "cpu", T0 + 30, 10.0, None),
        ("rank1", "gpu", T0 + 10, 80.0, None),
        ("rank1", "gpu", T0 + 30, 90.0, None),
    ]
    assert [p.value for p in await store.system(RUN, key="gpu", label="rank1")] == [80.0, 90.0]
    assert await store.metric_keys(RUN) == []


async def test_logs_filter_and_page(store: Store) -> None:
    await store.write(
        [
            log(1, "Step 1 begins", "DEBUG", label="rank0", ts=T0 + 1),
            log(2, "step 2", "INFO", label="rank0", ts=T0 + 2),
            log(1, "disk 100% full", "warn", stream="stderr", label="rank1", ts=T0 + 2),
            log(3, "loss is NaN", "ERROR", label="rank0", ts=T0 + 4),
            log(2, "custom level", "NOTICE", label="rank1", ts=T0 + 3),
            log(3, "careful", "WARNING", stream="logging", label="rank1", ts=T0 + 5),
            log(4, "bye", "CRITICAL", label="rank0", ts=T0 + 6),
            metric(5, {"loss": 1.0}, label="rank0"),
        ]
    )
    every = await store.logs(RUN)
    assert [(x.label, x.seq, x.text) for x in every] == [
        ("rank0", 1, "Step 1 begins"),
        ("rank0", 2, "step 2"),
        ("rank1", 1, "disk 100% full"),  # same ts as rank0's seq 2: ordered by label
        ("rank1", 2, "custom level"),
        ("rank0", 3, "loss is NaN"),
        ("rank1", 3, "careful"),
        ("rank0", 4, "bye"),
    ]
    line = every[2]
    assert (line.epoch, line.ts, line.stream, line.level) == (1, T0 + 2, "stderr", "warn")

    assert texts(await store.logs(RUN, label="rank1")) == ["disk 100% full", "custom level", "careful"]
    warnings = ["disk 100% full", "loss is NaN", "careful", "bye"]
    assert texts(await store.logs(RUN, level="WARNING")) == warnings
    assert texts(await store.logs(RUN, level="warning")) == warnings
    assert texts(await store.logs(RUN, level="INFO", label="rank1")) == [
        "disk 100% full",
        "custom level",  # unknown level names count as INFO
        "careful",
    ]
    assert texts(await store.logs(RUN, level="CRITICAL")) == ["bye"]
    assert texts(await store.logs(RUN, grep="Step")) == ["Step 1 begins"]  # case-sensitive
    assert texts(await store.logs(RUN, grep="step")) == ["step 2"]
    assert texts(await store.logs(RUN, grep="%")) == ["disk 100% full"]  # no LIKE wildcards
    assert texts(await store.logs(RUN, grep="_")) == []
    assert texts(await store.logs(RUN, grep="")) == texts(every)
    assert texts(await store.logs(RUN, limit=2, offset=1)) == ["step 2", "disk 100% full"]
    assert texts(await store.logs(RUN, limit=2)) == ["Step 1 begins", "step 2"]
    assert texts(await store.logs(RUN, offset=5)) == ["careful", "bye"]
    assert await store.logs(RUN, limit=0) == []
    assert await store.logs(RUN, offset=7) == []
    assert texts(await store.logs(RUN, level="WARNING", grep="e", limit=1, offset=1)) == ["bye"]
    assert await store.logs("no-such-run") == []


async def test_runs_newest_first(store: Store) -> None:
    assert await store.runs() == []
    await store.write([start(1, primary=True, run="old", ts=T0 + 1)])
    await store.write([start(1, primary=True, run="new", ts=T0 + 3), finish(2, 0, run="new")])
    await store.write([start(1, run="mid-b", ts=T0 + 2), start(1, run="mid-a", ts=T0 + 2)])
    await store.write([start(1, label="rank1", run="mid-a", ts=T0 + 9)])
    runs = await store.runs()
    assert [r.run_id for r in runs] == ["new", "mid-a", "mid-b", "old"]
    assert [r.state for r in runs] == ["finished", "running", "running", "running"]
    assert [r.label_count for r in runs] == [1, 2, 1, 1]
    assert [r.started_ts for r in runs] == [T0 + 3, T0 + 2, T0 + 2, T0 + 1]
    assert runs[1].last_ts == T0 + 9
    assert all(r.labels == [] for r in runs)
    assert [r.primary for r in runs] == ["rank0", None, None, "rank0"]


async def test_unknown_run_is_none(store: Store) -> None:
    assert await store.run("no-such-run") is None
    await store.write([start(1)])
    assert await store.run("no-such-run") is None
    assert await store.run(RUN) is not None


async def test_counts_per_kind(store: Store) -> None:
    await store.write(
        [
            start(1, primary=True),
            metric(2, {"a": 1, "b": 2}),
            metric(3, {"a": 1}),
            heartbeat(4),
            log(5, "x"),
            system(6, {"cpu": 1}),
            log(7, "y"),
            heartbeat(8),
            metric(9, {"a": 3}, label="rank1"),
        ]
    )
    run = await store.run(RUN)
    assert run is not None
    assert run.counts == {"metric": 3, "log": 2, "system": 1}
    assert [(lab.label, lab.events) for lab in run.labels] == [("rank0", 8), ("rank1", 1)]


async def test_config_comes_from_the_labels_starts_the_primary_s_first(store: Store) -> None:
    await store.write([start(1, label="rank1", config={"from": "rank1", "lr": 1.0})])
    run = await store.run(RUN)
    assert run is not None
    # No primary yet: the run shows what its labels set (see test_storage_metadata.py).
    assert (run.config, run.primary) == ({"from": "rank1", "lr": 1.0}, None)

    config = {"lr": 0.001, "layers": [1, 2, 3], "nested": {"name": "ünï", "on": True}}
    await store.write([start(1, primary=True, label="rank0", config=config)])
    run = await store.run(RUN)
    assert run is not None
    assert (run.config, run.primary) == ({**config, "from": "rank1"}, "rank0")
    assert run.set_by.config == {"lr": "rank0", "layers": "rank0", "nested": "rank0", "from": "rank1"}
    by_label = {lab.label: lab for lab in run.labels}
    assert by_label["rank0"].start == {"primary": True, "config": config}
    assert by_label["rank0"].primary is True
    assert by_label["rank1"].start == {"primary": False, "config": {"from": "rank1", "lr": 1.0}}
    assert by_label["rank1"].primary is False
    assert (await store.runs())[0].config == run.config

    # A restarted primary's config is its new start's: nothing of its earlier one stays.
    await store.write([start(1, primary=True, label="rank0", epoch=2, config={"lr": 0.01})])
    run = await store.run(RUN)
    assert run is not None
    assert run.config == {"lr": 0.01, "from": "rank1"}


# -- lifecycle -----------------------------------------------------------------------------------


async def schema_version(url: str) -> int:
    """The schema version a store's migrations have reached (read behind the store's back)."""
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            return con.execute("PRAGMA user_version").fetchone()[0]
        finally:
            con.close()
    con = await asyncpg.connect(url)
    try:
        return await con.fetchval("SELECT max(version) FROM schema_version")
    finally:
        await con.close()


async def test_migrations_are_idempotent(open_stores: OpenStore, any_store_url: str) -> None:
    migrations = sqlite_backend.MIGRATIONS
    if not any_store_url.startswith("sqlite"):
        migrations = postgres_backend.MIGRATIONS
    first = await open_stores()
    assert await first.write([start(1, primary=True), finish(2, 0)]) == 2
    await first.close()

    again = await open_stores()
    assert await schema_version(any_store_url) == len(migrations)
    run = await again.run(RUN)
    assert run is not None
    assert (run.state, run.labels[0].events) == ("finished", 2)
    assert await again.write([start(1, primary=True), heartbeat(3)]) == 1


async def make_version_2_store(url: str) -> None:
    """A store at schema version 2, as runbus 0.1 left it: one `events` row per event.

    rank0 of RUN holds start 1, metrics 2-5 and log 8 of epoch 1 (6 and 7 never arrived) and
    heartbeat 1 of epoch 2; rank1 holds system 1.
    """
    events = [(1, 1, 1, "start"), *[(1, 1, seq, "metric") for seq in range(2, 6)], (1, 1, 8, "log")]
    events += [(1, 2, 1, "heartbeat"), (2, 1, 1, "system")]
    inserts = [  # (table, columns, rows)
        ("runs", "run_id", [(RUN,)]),
        ("labels", "id, run_id, label, epoch, last_seq", [(1, RUN, "rank0", 2, 1), (2, RUN, "rank1", 1, 1)]),
        ("events", "label_id, epoch, seq, kind, ts", [(*e, T0 + n) for n, e in enumerate(events)]),
        (
            "metrics",
            "label_id, key, epoch, seq, step, ts, value",
            [(1, "loss", 1, seq, seq, T0 + seq, 1.0 / seq) for seq in range(2, 6)],
        ),
    ]

    def insert_sql(table: str, columns: str, marks: list[str]) -> str:
        return f"INSERT INTO {table} ({columns}) VALUES ({', '.join(marks[: columns.count(',') + 1])})"

    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        for script in sqlite_backend.MIGRATIONS[:2]:
            for statement in script.split(";"):
                if statement.strip():
                    con.execute(statement)
        for table, columns, values in inserts:
            con.executemany(insert_sql(table, columns, ["?"] * 8), values)
        con.execute("PRAGMA user_version = 2")
        con.close()
        return
    pg = await asyncpg.connect(url)
    try:
        await pg.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ)")
        for number, script in enumerate(postgres_backend.MIGRATIONS[:2], start=1):
            await pg.execute(script)
            await pg.execute("INSERT INTO schema_version (version) VALUES ($1)", number)
        for table, columns, values in inserts:
            await pg.executemany(insert_sql(table, columns, [f"${n}" for n in range(1, 9)]), values)
    finally:
        await pg.close()


async def test_version_2_events_become_seen_ranges_and_counts(
    open_stores: OpenStore, any_store_url: str
) -> None:
    await make_version_2_store(any_store_url)
    store = await open_stores()
    run = await store.run(RUN)
    assert run is not None
    assert run.counts == {"metric": 4, "log": 1, "system": 1}
    rank0, rank1 = run.labels
    assert (rank0.events, rank0.missing, [(g.epoch, g.first, g.last) for g in rank0.gaps]) == (
        7,
        2,
        [(1, 6, 7)],
    )
    assert (rank1.events, rank1.missing) == (1, 0)

    # Stored events stay stored once; the gap fills, and the counters go on from the old counts.
    assert (
        await store.write(
            [metric(3, {"loss": 9.0}), metric(6, {"loss": 0.25}, step=6), heartbeat(1, epoch=2)]
        )
        == 1
    )
    run = await store.run(RUN)
    assert run is not None
    assert run.counts["metric"] == 5
    assert (run.labels[0].events, run.labels[0].missing) == (8, 1)
    assert [p.value for p in await store.metrics(RUN, key="loss")] == [0.5, 1 / 3, 0.25, 0.2, 0.25]


async def make_version_3_store(url: str) -> None:
    """A store at schema version 3 (before primaries were decided once and stores had ids): run
    RUN with primary rank0 running and rank1 finished, as that runbus left them."""
    runs = [(RUN, "running", "rank0", T0 + 1, T0 + 5)]
    labels = [
        (1, RUN, "rank0", "running", None, 1, 1, True, 1, 1, 1, 5),
        (2, RUN, "rank1", "finished", 0, 1, 2, False, 1, 1, 1, 2),
    ]
    run_sql = "INSERT INTO runs (run_id, state, primary_label, started_ts, last_ts) VALUES ({})"
    label_sql = (
        "INSERT INTO labels (id, run_id, label, state, exit_code, state_epoch, state_seq, is_primary, "
        "start_epoch, start_seq, epoch, last_seq) VALUES ({})"
    )
    seen = [(1, 1, 1, 5), (2, 1, 1, 2)]
    seen_sql = "INSERT INTO seen (label_id, epoch, first_seq, last_seq) VALUES ({})"
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        for script in sqlite_backend.MIGRATIONS[:3]:
            for statement in script.split(";"):
                if statement.strip():
                    con.execute(statement)
        for sql, values in ((run_sql, runs), (label_sql, labels), (seen_sql, seen)):
            con.executemany(sql.format(", ".join("?" * len(values[0]))), values)
        con.execute("PRAGMA user_version = 3")
        con.close()
        return
    pg = await asyncpg.connect(url)
    try:
        await pg.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ)")
        for number, script in enumerate(postgres_backend.MIGRATIONS[:3], start=1):
            await pg.execute(script)
            await pg.execute("INSERT INTO schema_version (version) VALUES ($1)", number)
        for sql, values in ((run_sql, runs), (label_sql, labels), (seen_sql, seen)):
            marks = ", ".join(f"${n}" for n in range(1, len(values[0]) + 1))
            await pg.executemany(sql.format(marks), values)
        await pg.execute("SELECT setval(pg_get_serial_sequence('labels', 'id'), 2)")
    finally:
        await pg.close()


async def test_a_version_3_store_keeps_its_primary_and_gets_an_id(
    open_stores: OpenStore, any_store_url: str
) -> None:
    await make_version_3_store(any_store_url)
    store = await open_stores()
    backend = sqlite_backend if any_store_url.startswith("sqlite") else postgres_backend
    assert await schema_version(any_store_url) == len(backend.MIGRATIONS)
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary) == ("running", "rank0")
    assert [(lab.label, lab.primary, lab.primary_refused_ts) for lab in run.labels] == [
        ("rank0", True, None),
        ("rank1", False, None),
    ]
    identity = await store.identity()
    assert len(identity) == 16 and int(identity, 16) >= 0
    # The decision the old store holds stays: a new claim is refused, rank0's finish ends the run.
    await store.write([start(1, primary=True, label="rank2", ts=T0 + 6)], holders={RUN: "rank2"})
    await store.write([heartbeat(6), finish(7, 0, label="rank0", ts=T0 + 7)])
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.primary, run.exit_code) == ("finished", "rank0", 0)
    assert {lab.label: lab.primary_refused_ts for lab in run.labels}["rank2"] == T0 + 6
    assert (run.labels[0].events, run.labels[0].missing) == (7, 0)


async def test_a_store_s_id_is_its_own_through_any_url(open_stores: OpenStore, any_store_url: str) -> None:
    first = await open_stores()
    identity = await first.identity()
    again = await open_stores()
    assert await again.identity() == identity
    reader = open_store(any_store_url, create=False)
    await reader.connect()
    try:
        assert await reader.identity() == identity
    finally:
        await reader.close()
    if any_store_url.startswith("sqlite"):  # another spelling of the same file
        path = any_store_url.removeprefix("sqlite:///")
        same = await open_stores("sqlite:///" + os.path.relpath(path))  # noqa: ASYNC240
        assert await same.identity() == identity
        other = await open_stores(any_store_url.replace("runbus.db", "other.db"))
        assert await other.identity() != identity


async def test_stores_starting_together_migrate_once(open_stores: OpenStore) -> None:
    stores = await asyncio.gather(*(open_stores() for _ in range(4)))
    news = await asyncio.gather(*(s.write([start(1, label=f"rank{n}")]) for n, s in enumerate(stores)))
    assert news == [1, 1, 1, 1]
    run = await stores[0].run(RUN)
    assert run is not None
    assert run.label_count == 4


async def test_a_store_must_be_connected(any_store_url: str) -> None:
    store = open_store(any_store_url)
    with pytest.raises(StoreUnavailable, match="not connected"):
        await store.write([start(1)])
    with pytest.raises(StoreUnavailable, match="not connected"):
        await store.runs()
    await store.close()


@pytest.mark.parametrize(
    "refused",
    [
        finish(9, exit_code=2**63),
        finish(9, exit_code=-(2**63) - 1),
        metric(9, {"x": 1.0}, step=2**63),  # the wire refuses it; the store must too (COPY)
    ],
    ids=["exit code 2**63", "exit code -2**63-1", "step 2**63"],
)
async def test_data_beyond_the_store_s_integers_is_rejected_and_the_batch_left_out(
    store: Store, refused: Event
) -> None:
    # Each is valid on the wire (JSON and stream fields have no 64-bit limit); the store's
    # integer columns are 64-bit, and storing the seq's neighbour (seq + 1) would overflow.
    await store.write([start(1, primary=True)])
    with pytest.raises(StoreRejected, match="rejected the data") as caught:
        await store.write([metric(2, {"x": 2.0}, step=2), refused])
    assert "int64" in str(caught.value) or "too large" in str(caught.value)
    # The batch was one transaction: none of it stayed, and the store goes on as before.
    assert await store.metrics(RUN) == []
    assert await store.write([metric(2, {"x": 2.0}, step=2), finish(3)]) == 2
    run = await store.run(RUN)
    assert run is not None
    assert (run.state, run.exit_code, run.counts["metric"]) == ("finished", 0, 1)


@pytest.mark.parametrize("seq", [3 + SEQ_REACH, 2**63 - 1])
async def test_a_seq_far_beyond_the_label_s_is_rejected_and_the_batch_left_out(
    store: Store, seq: int
) -> None:
    # No producer numbers an event that far ahead (it reports what it drops): stored, it would
    # leave a gap of that many missing events forever. (At 2**63-1 the store's integers would
    # also overflow on its neighbour.)
    await store.write([start(1, primary=True)])
    with pytest.raises(StoreRejected, match="beyond the label's highest stored or reported seq 2 "):
        await store.write([metric(2, {"x": 2.0}, step=2), metric(seq, {"x": 1.0})])
    assert await store.metrics(RUN) == []
    # One SEQ_REACH ahead is within reach, and further as far as the producer reports dropping.
    assert await store.write([metric(1 + SEQ_REACH, {"x": 2.0})]) == 1
    far = 5 * SEQ_REACH
    report = event("heartbeat", far - 1, {"dropped_ranges": [[2 + SEQ_REACH, far - 2]]})
    assert await store.write([report, metric(far, {"x": 3.0}), finish(far + 1)]) == 3
    run = await store.run(RUN)
    assert run is not None
    gap = run.labels[0].gaps[-1]
    assert (run.state, run.exit_code) == ("finished", 0)
    assert (gap.first, gap.last, gap.dropped) == (2 + SEQ_REACH, far - 2, far - 3 - SEQ_REACH)


@pytest.fixture(params=["sqlite", "postgres"])
def store_and_outage(request: pytest.FixtureRequest, store_url: str) -> Iterator[tuple[str, Callable]]:
    """A store URL of each backend, and what makes its store unavailable: on SQLite, another
    connection's write transaction (locked); on PostgreSQL, its server stopped (a private one,
    whose URL carries a password that trust auth ignores and no message may show)."""
    if request.param == "sqlite":
        held: list[sqlite3.Connection] = []

        def lock() -> None:
            path = store_url.removeprefix("sqlite:///")
            con = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            con.execute("BEGIN EXCLUSIVE")
            held.append(con)

        yield store_url, lock
        for con in held:
            con.rollback()
            con.close()
        return
    server: LocalPostgres = request.getfixturevalue("local_postgres")
    url = asyncio.run(create_database(server.dsn)).replace("postgres@", "postgres:s3cret@")
    yield url, server.stop


async def test_a_store_that_is_gone_is_unavailable(store_and_outage: tuple[str, Callable]) -> None:
    url, outage = store_and_outage
    store = open_store(url)
    await store.connect()
    try:
        assert await store.write([start(1, primary=True)]) == 1
        await asyncio.to_thread(outage)
        with pytest.raises(StoreUnavailable) as caught:
            await store.write([metric(2, {"x": 1.0})])
        if url.startswith("postgres"):
            with pytest.raises(StoreUnavailable):
                await store.runs()
            assert "s3cret" not in str(caught.value) and ":***@" in str(caught.value)
        else:
            assert "locked" in str(caught.value)
    finally:
        await store.close()
    if url.startswith("postgres"):  # connecting to a server that is gone: retried too
        with pytest.raises(StoreUnavailable):
            await open_store(url).connect()


async def test_concurrent_writers_agree_with_one_writer(open_stores: OpenStore) -> None:
    solo = await open_stores()
    writers = [await open_stores() for _ in range(4)]
    ordered = history("solo", labels=8)
    for batch in scrambled(ordered, random.Random(7)):
        await solo.write(batch)

    batches = scrambled(history("shared", labels=8), random.Random(11))
    shares = [batches[n :: len(writers)] for n in range(len(writers))]

    async def write_all(store: Store, mine: list[list[Event]]) -> int:
        return sum([await store.write(batch) for batch in mine])

    news = await asyncio.gather(*(write_all(w, s) for w, s in zip(writers, shares, strict=True)))
    assert sum(news) == len(ordered)  # every event counted new exactly once, by one writer
    assert await snapshot(solo, "shared") == await snapshot(solo, "solo")
    run = await solo.run("shared")
    assert run is not None
    assert (run.state, run.primary, run.exit_code, run.label_count) == ("finished", "rank0", 0, 8)


async def test_concurrent_writers_of_one_run_leave_no_stale_run_row(open_stores: OpenStore) -> None:
    writers = [await open_stores() for _ in range(6)]
    await writers[0].write([start(1, primary=True, label="rank0", ts=T0)])
    for seq in range(2, 12):
        # Each writer reports a different label; the run row must end up reflecting all of them.
        await asyncio.gather(
            *(
                w.write([heartbeat(seq, label=f"rank{n}", ts=T0 + seq * 10 + n)])
                for n, w in enumerate(writers)
            )
        )
        run = await writers[0].run(RUN)
        assert run is not None
        assert (run.last_ts, run.label_count) == (T0 + seq * 10 + 5, 6)
    await asyncio.gather(*(w.write([finish(12, n, label=f"rank{n}")]) for n, w in enumerate(writers)))
    run = await writers[0].run(RUN)
    assert run is not None
    assert (run.state, run.exit_code, run.primary) == ("finished", 0, "rank0")


async def test_a_reader_creates_nothing_and_reads_what_the_ingester_made(any_store_url: str) -> None:
    reader = open_store(any_store_url, create=False)
    with pytest.raises(StoreMissing, match=r"^no runbus store at .*; `runbus ingest` creates it$"):
        await reader.connect()
    await reader.close()
    if any_store_url.startswith("sqlite"):
        assert not await asyncio.to_thread(os.path.exists, any_store_url.removeprefix("sqlite:///"))
    else:
        assert await public_tables(any_store_url) == []

    writer = open_store(any_store_url)
    await writer.connect()
    try:
        await writer.write([start(1, primary=True), finish(2, 0)])
    finally:
        await writer.close()
    reader = open_store(any_store_url, create=False)
    await reader.connect()
    try:
        assert [(run.run_id, run.state) for run in await reader.runs()] == [(RUN, "finished")]
    finally:
        await reader.close()


async def test_a_reader_leaves_an_older_schema_for_the_ingester_to_upgrade(any_store_url: str) -> None:
    await make_version_2_store(any_store_url)
    reader = open_store(any_store_url, create=False)
    with pytest.raises(
        StoreError, match=r"schema version 2 .*older than this runbus.*`runbus ingest` upgrades it"
    ):
        await reader.connect()
    await reader.close()
    assert await schema_version(any_store_url) == 2


# -- backend specifics ----------------------------------------------------------------------------


async def test_postgres_errors_are_store_errors_without_the_password() -> None:
    store = open_store(f"postgresql://runbus:s3cret@127.0.0.1:{free_port()}/runbus")
    with pytest.raises(StoreUnavailable) as caught:
        await store.connect()
    assert "s3cret" not in str(caught.value)
    assert "runbus:***@127.0.0.1" in str(caught.value)
    await store.close()


async def test_text_holding_nul_does_not_fail_a_write(store: Store) -> None:
    assert await store.write([log(1, "a\x00b"), metric(2, {"k\x00": 1.0})]) == 2
    # PostgreSQL text cannot hold NUL: every backend keeps U+FFFD in its place.
    assert texts(await store.logs(RUN, grep="a\x00b")) == ["a\ufffdb"]
    assert await store.metric_keys(RUN) == ["k\ufffd"]
    assert [p.value for p in await store.metrics(RUN, key="k\x00")] == [1.0]


async def test_a_wrong_postgres_password_is_access_denied(local_postgres: LocalPostgres) -> None:
    dsn = await local_postgres.password_user("runbus_writer", "right horse")
    store = open_store(dsn.replace("runbus_writer@", "runbus_writer:wrong%20staple@"))
    with pytest.raises(AccessDenied, match="refused access") as caught:
        await store.connect()
    assert "InvalidPasswordError" in str(caught.value)
    assert "wrong" not in str(caught.value) and "runbus_writer:***@" in str(caught.value)
    assert not isinstance(caught.value, StoreUnavailable)  # retrying cannot help
    await store.close()
    # The right password logs in: the refusal was the password's.
    con = await asyncpg.connect(dsn, password="right horse")
    await con.close()


async def test_a_full_sqlite_disk_is_unavailable_and_says_so(store_url: str) -> None:
    store = sqlite_backend.SQLiteStore(store_url)
    await store.connect()
    try:
        assert await store.write([start(1, primary=True)]) == 1
        # The file may not grow past its size now: what a full disk does to a write.
        pages = store._con.execute("PRAGMA page_count").fetchone()[0]
        store._con.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(StoreUnavailable, match="the disk is full") as caught:
            await store.write([log(seq, "x" * 4000) for seq in range(2, 200)])
        # SQLite rolled the transaction back itself: the error is the one that ended it, not the
        # "cannot rollback - no transaction is active" of a second ROLLBACK.
        assert "cannot rollback" not in str(caught.value)
        store._con.execute("PRAGMA max_page_count = 1073741823")
        assert await store.write([log(seq, "x" * 4000) for seq in range(2, 200)]) == 198
    finally:
        await store.close()


async def test_sessions_ended_by_an_administrator_are_unavailable_then_reconnected(postgres_url: str) -> None:
    store = open_store(postgres_url)
    await store.connect()
    try:
        assert await store.write([start(1, primary=True)]) == 1
        admin = await asyncpg.connect(postgres_url)
        try:
            # The store's write waits on the run's row, held here; then its session is ended, as
            # pg_terminate_backend, a failover or a restart does (SQLSTATE 57P01), mid-statement.
            # (An idle pooled session ended the same way is replaced by the pool unnoticed.)
            holder = admin.transaction()
            await holder.start()
            await admin.execute("SELECT 1 FROM runs FOR UPDATE")
            blocked = asyncio.create_task(store.write([metric(2, {"x": 1.0})]))
            waiting = await wait_for_async(
                "the store's write waiting on the held row",
                lambda: admin.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                ),
                10,
            )
            await admin.execute("SELECT pg_terminate_backend($1)", waiting[0]["pid"])
            with pytest.raises(StoreUnavailable):
                await blocked
            await holder.rollback()
        finally:
            await admin.close()
        assert await store.write([metric(2, {"x": 1.0})]) == 1  # the pool connects anew
    finally:
        await store.close()


async def test_a_postgres_read_cancelled_inside_its_snapshot_leaves_its_connection_clean(
    postgres_url: str,
) -> None:
    # The pool hands connections back without asyncpg's reset query (postgres._kept_session):
    # a read cancelled while its snapshot transaction is open must still leave the one
    # connection of the pool out of that transaction, its snapshot gone, for the next caller.
    store = postgres_backend.PostgresStore(postgres_url, min_size=1, max_size=1)
    await store.connect()
    admin = await asyncpg.connect(postgres_url)
    try:
        assert await store.write([start(1, primary=True), metric(2, {"x": 1.0}, step=2)]) == 2
        slow = asyncio.create_task(
            store._fetch_together(
                [
                    postgres_backend.reads.Query("SELECT pg_sleep(30)", []),
                    postgres_backend.reads.Query("SELECT 1", []),
                ]
            )
        )
        await wait_for_async(
            "the read sleeping inside its snapshot",
            lambda: admin.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'SELECT pg_sleep%' AND state = 'active'"
            ),
            10,
        )
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        # The same connection (the pool holds one) reads what a later write commits: a snapshot
        # left open would not see it, and an aborted transaction would refuse the read.
        assert await store.write([metric(3, {"x": 2.0}, step=3)]) == 1
        assert [p.value for p in await store.metrics(RUN, key="x")] == [1.0, 2.0]

        async def idle(con: asyncpg.Connection) -> bool:
            await con.fetchval("SELECT 1")
            return not con.is_in_transaction()  # the server's own word, in its ReadyForQuery

        assert await store._call(idle)
    finally:
        await admin.close()
        await store.close()
