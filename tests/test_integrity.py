"""Nothing dropped, nothing misattributed: attacks on the promises that a label's finish stands,
that only the run's primary decides the run, that bad keys and values never stop ingest, that a
stop while the store fails is clean, that dead letters replay once, and that every store on one
Redis receives every event. Real Redis, real stores, real processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from runbus import wire
from runbus.ingester import demo
from runbus.ingester.localredis import free_port
from runbus.ingester.worker import Worker, WorkerSettings
from runbus.wire import Event
from tests.helpers import (
    T0,
    ingest,
    ingest_command,
    pending_count,
    read_store,
    run_cli,
    store_group,
    wait_for,
    wait_for_async,
    xadd_event,
)
from tests.test_ops_http import scrape

# The consumer group every store's ingesters shared before each store had its own (wire.store_group).
LEGACY_GROUP = "runbus"


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(redis_url) as connection:
        yield connection


def stored_run(store_url: str, run_id: str) -> tuple[str, int] | None:
    """(state, label count) of a run in a store an ingester may be writing, or None."""
    if not os.path.exists(store_url.removeprefix("sqlite:///")):
        return None
    con = sqlite3.connect(store_url.removeprefix("sqlite:///"), timeout=10)
    try:
        row = con.execute(
            "SELECT state, (SELECT count(*) FROM labels WHERE run_id = ?) FROM runs WHERE run_id = ?",
            (run_id, run_id),
        ).fetchone()
    except sqlite3.OperationalError:  # no schema yet
        return None
    finally:
        con.close()
    return None if row is None else (row[0], row[1])


# -- a label's finish stands -----------------------------------------------------------------------


def test_a_heartbeat_after_the_finish_neither_revives_nor_crashes_the_label(client, redis_url, store_url):
    xadd_event(client, "after", "rank0", "start", 1, 1, {"primary": True})
    xadd_event(client, "after", "rank0", "finish", 1, 2, {"exit_code": 0})
    # The shipper's last heartbeat, and a metric, after the finish: higher seqs of the same epoch.
    xadd_event(client, "after", "rank0", "heartbeat", 1, 3, {"buffered": 0})
    xadd_event(client, "after", "rank0", "metric", 1, 4, {"late": 1.0})
    ingest(redis_url, store_url, crash_after=0.0)  # a burst ends with crash detection
    run = read_store(store_url, "run", "after")
    assert (run.state, run.exit_code) == ("finished", 0)
    assert [(lab.state, lab.last_seq, lab.events) for lab in run.labels] == [("finished", 4, 4)]


# -- only the run's primary decides the run --------------------------------------------------------

PRIMARY = textwrap.dedent(
    """
    import os, sys, runbus
    run = runbus.init(system_interval=None, hardware=False, heartbeat_interval=0.2)
    run.log({"loss": 1.0}, step=0)
    os.write(1, b"ready\\n")
    sys.stdin.readline()  # until the test has written the stray entries
    run.finish(exit_code=3, timeout=30)
    """
)


def test_a_stray_primary_claim_does_not_take_over_the_run(client, redis_url, store_url):
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url, "RUNBUS_RUN_ID": "claimed", "RANK": "0"}
    primary = subprocess.Popen(
        [sys.executable, "-c", PRIMARY], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert primary.stdout.readline() == "ready\n"
    assert client.get(wire.primary_key("claimed")) == b"rank0"
    # A stray script (or a bug) says it is the primary and finishes well, before the real one.
    xadd_event(client, "claimed", "stray", "start", 1, 1, {"primary": True}, ts=T0 + 1)
    xadd_event(client, "claimed", "stray", "finish", 1, 2, {"exit_code": 0}, ts=T0 + 2)
    # Without the live claim, the stray's start (the earliest claim) would have won.
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "claimed")
    assert (run.state, run.primary) == ("running", "rank0")
    primary.communicate("go\n", timeout=60)
    assert primary.returncode == 0
    ingest(redis_url, store_url)

    shown = json.loads(run_cli("--store", store_url, "show", "claimed", "--json").stdout)
    assert (shown["state"], shown["primary"], shown["exit_code"]) == ("failed", "rank0", 3)
    assert shown["primary_refused"] == [{"label": "stray", "ts": T0 + 1}]
    assert {lab["label"]: lab["primary"] for lab in shown["labels"]} == {"rank0": True, "stray": False}
    text = run_cli("--store", store_url, "show", "claimed").stdout
    assert "state    failed (exit 3)" in text
    assert "refused  stray claimed the primary role at " in text and "; rank0 holds it" in text
    assert [r["primary"] for r in json.loads(run_cli("--store", store_url, "runs", "--json").stdout)] == [
        "rank0"
    ]


def test_a_run_written_by_hand_takes_its_first_primary_start(client, redis_url, store_url):
    assert not client.exists(wire.primary_key("byhand"))
    xadd_event(client, "byhand", "rank0", "start", 1, 1, {"primary": True})
    ingest(redis_url, store_url)
    xadd_event(client, "byhand", "other", "start", 1, 1, {"primary": True}, ts=T0 + 5)
    xadd_event(client, "byhand", "other", "finish", 1, 2, {"exit_code": 0})
    xadd_event(client, "byhand", "rank0", "finish", 1, 2, {"exit_code": 1})
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "byhand")
    assert (run.state, run.primary, run.exit_code) == ("failed", "rank0", 1)
    assert {lab.label: lab.primary_refused_ts for lab in run.labels} == {"other": T0 + 5, "rank0": None}


async def test_the_dashboard_s_run_document_shows_the_refused_claim(redis_url, store_url):
    from aiohttp.test_utils import TestClient, TestServer

    from runbus.dashboard.api import create_app

    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "dash", "rank0", "start", 1, 1, {"primary": True})
        await asyncio.to_thread(ingest, redis_url, store_url)
        xadd_event(client, "dash", "rogue", "start", 1, 1, {"primary": True}, ts=T0 + 7)
        await asyncio.to_thread(ingest, redis_url, store_url)
    async with TestClient(TestServer(create_app(store_url, redis_url=redis_url))) as api:
        response = await api.get("/api/runs/dash")
        document = await response.json()
    assert (document["primary"], document["primary_refused"]) == ("rank0", [{"label": "rogue", "ts": T0 + 7}])
    labels = {lab["label"]: (lab["primary"], lab["primary_refused_ts"]) for lab in document["labels"]}
    assert labels == {"rank0": (True, None), "rogue": (False, T0 + 7)}


# -- bad input never stops ingest ------------------------------------------------------------------


def test_unreadable_keys_are_skipped_and_logged_once(client, redis_url, store_url):
    client.execute_command("XADD", b"runbus:{caf\xe9}:rank0", "*", "v", "1")  # a stream key not UTF-8
    client.sadd(wire.REGISTRY_KEY, b"runbus:{r}:\xff\xfe")  # a member not UTF-8
    client.set("runbus:{str}:rank0", "x")  # a member that is not a stream
    client.hset("runbus:{hash}:rank0", "a", "b")  # nor this
    client.sadd(wire.REGISTRY_KEY, "runbus:{str}:rank0", "runbus:{hash}:rank0", "elsewhere")
    xadd_event(client, "good", "rank0", "start", 1, 1, {"primary": True})
    client.sadd(wire.REGISTRY_KEY, wire.stream_key("good", "rank0"))
    worker = subprocess.Popen(
        ingest_command(redis_url, store_url, "--consumer", "robust"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for("the good run", lambda: stored_run(store_url, "good"))
        # New registry members make the worker read the registry again, many times over.
        for n in range(20):
            client.sadd(wire.REGISTRY_KEY, f"elsewhere-{n}")
            time.sleep(0.05)
        xadd_event(client, "good", "rank1", "finish", 1, 2, {"exit_code": 0})
        client.sadd(wire.REGISTRY_KEY, wire.stream_key("good", "rank1"))
        wait_for("the later stream", lambda: (stored_run(store_url, "good") or (0, 0))[1] == 2)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    assert "Traceback" not in err, err
    for shown in (
        "runbus:{caf\\xe9}:rank0",
        "runbus:{r}:\\xff\\xfe",
        "runbus:{str}:rank0",
        "runbus:{hash}:rank0",
        "'elsewhere'",
    ):
        assert sum(shown in line and "skipping key" in line for line in err.splitlines()) == 1, (shown, err)
    assert read_store(store_url, "run", "good").label_count == 2


async def test_discovery_logs_each_unreadable_key_once_however_often_it_polls(redis_url, caplog):
    from runbus.ingester.discovery import Discovery
    from runbus.redis import async_client

    client = async_client(redis_url)
    try:
        await client.execute_command("XADD", b"runbus:{caf\xe9}:rank0", "*", "v", "1")
        await client.xadd(wire.stream_key("ok", "rank0"), {"v": "1"})
        await client.set("runbus:{str}:rank0", "x")
        await client.sadd(wire.REGISTRY_KEY, b"\xff", "runbus:{str}:rank0", wire.stream_key("ok", "rank0"))
        discovery = Discovery(client, "g", registry_interval=0.0, scan_interval=0.0)
        with caplog.at_level("WARNING", logger="runbus.ingester"):
            for n in range(5):
                await client.sadd(wire.REGISTRY_KEY, f"not-a-stream-{n}")  # the registry changes each time
                await discovery.refresh()
        assert discovery.streams == [wire.stream_key("ok", "rank0")]
        skipped = [r.getMessage() for r in caplog.records if "skipping key" in r.getMessage()]
        assert len(skipped) == 3 + 5, skipped
        # A key that becomes a stream is read after all; the registry itself of another type is
        # logged once, and streams are still found by scan.
        await client.delete("runbus:{str}:rank0")
        await client.xadd("runbus:{str}:rank0", {"v": "1"})
        await client.delete(wire.REGISTRY_KEY)
        await client.set(wire.REGISTRY_KEY, "oops")
        caplog.clear()
        with caplog.at_level("WARNING", logger="runbus.ingester"):
            for _ in range(3):
                await discovery.refresh()
        assert "runbus:{str}:rank0" in discovery.streams
        assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1
    finally:
        await client.aclose()


async def test_a_registered_stream_is_never_created_by_discovery(redis_url):
    # A producer registers its stream before its first entry, and the demo deletes its streams
    # while workers may be discovering them: making the group must not create the key (which
    # left an empty stream of a removed run behind), and the stream is read once it exists.
    from runbus.ingester.discovery import Discovery
    from runbus.redis import async_client

    client = async_client(redis_url)
    key = wire.stream_key("announced", "rank0")
    try:
        await client.sadd(wire.REGISTRY_KEY, key)
        discovery = Discovery(client, "g", registry_interval=0.0, scan_interval=3600.0)
        await discovery.refresh(force=True)
        assert (discovery.streams, await client.exists(key)) == ([], 0)
        await discovery.refresh()  # the registry has not changed: it is read again all the same
        assert await client.exists(key) == 0
        await client.xadd(key, {"v": "1"})
        assert await discovery.refresh() == [key]
        assert await client.xinfo_groups(key) != []
    finally:
        await client.delete(key)
        await client.srem(wire.REGISTRY_KEY, key)
        await client.aclose()


async def blocked_in_xreadgroup(client: redis.asyncio.Redis) -> bool:
    """Whether a connection to this Redis waits in a blocking XREADGROUP."""
    return any(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in await client.client_list())


async def test_a_stream_deleted_or_replaced_while_read_is_let_go(redis_url, store_url):
    client = redis.asyncio.Redis.from_url(redis_url)
    worker = Worker(
        WorkerSettings(redis_url=redis_url, store_url=store_url, handle_signals=False, claim_idle=0.5)
    )
    running = asyncio.create_task(worker.async_run())
    swapped, gone, later = (wire.stream_key("swap", label) for label in ("rank0", "rank1", "rank2"))
    try:
        for key in (swapped, gone):
            await client.xadd(key, {"v": "1"})
            await client.sadd(wire.REGISTRY_KEY, key)
        await wait_for_async(
            "both streams found",
            lambda: worker.discovery is not None and {swapped, gone} <= set(worker.discovery.streams),
        )
        await wait_for_async("a read blocked on both", lambda: blocked_in_xreadgroup(client))
        await client.delete(swapped, gone)  # unblocks the read with an error
        await client.set(swapped, "not a stream any more")
        await wait_for_async(
            "both streams let go",
            lambda: worker.discovery is not None and not {swapped, gone} & set(worker.discovery.streams),
        )
        fields = wire.encode_fields("start", "swap", "rank2", 1, 1, T0, b'{"primary": true}', None)
        await client.xadd(later, fields)
        await client.sadd(wire.REGISTRY_KEY, later)
        await wait_for_async("the later stream stored", lambda: running.done() or worker.stats.stored >= 1)
        assert not running.done(), running.exception()
        assert worker.discovery is not None
        # The registry still names both: the deleted one is not made again, the other is skipped.
        assert sorted(worker.discovery.streams) == [later]
        assert await client.exists(gone) == 0
    finally:
        worker.request_stop()
        await running
        await client.aclose()


def test_a_ts_no_date_can_show_does_not_break_the_listing(store_url):
    # Written before the wire refused such values: straight into the store, as an old one holds it.
    events = [
        Event("far", "rank0", "start", 1, 1, 1e300, {"primary": True}),
        Event("far", "rank0", "finish", 1, 2, 1e300, {"exit_code": 0}),
    ]
    assert read_store(store_url, "write", events) == 2
    listing = run_cli("--store", store_url, "runs")
    assert "far" in listing.stdout and "1e+300" in listing.stdout
    assert "1e+300" in run_cli("--store", store_url, "show", "far").stdout
    assert json.loads(run_cli("--store", store_url, "runs", "--json").stdout)[0]["started_ts"] == 1e300


# -- a stop while the store fails --------------------------------------------------------------------


def test_sigterm_while_store_writes_fail_exits_cleanly_leaving_the_batches_pending(
    client, redis_url, store_url
):
    xadd_event(client, "locked", "rank0", "start", 1, 1, {"primary": True})
    ingest(redis_url, store_url)  # the store and its group exist
    for seq in range(2, 52):
        xadd_event(client, "locked", "rank0", "metric", 1, seq, {"x": float(seq)}, step=seq)
    lock = sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None, timeout=30)
    lock.execute("BEGIN EXCLUSIVE")  # another connection holds the write lock: every write fails
    port = free_port()
    worker = subprocess.Popen(
        ingest_command(
            redis_url, store_url, "--batch-size", "10", "--drain-timeout", "1", "--http", f"127.0.0.1:{port}"
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    key = wire.stream_key("locked", "rank0")
    try:
        wait_for("batches read and failing", lambda: pending_count(client, key) >= 20)
        # Failed writes are retried after longer and longer waits (up to 5 s): from the sixth on
        # they outlast the drain timeout, which then runs out in a wait, and the loop is
        # cancelled before the write gives up.
        wait_for(
            "waits longer than the drain timeout",
            lambda: (m := scrape(port)) and m["runbus_store_retries_total"] >= 6,
            timeout=60,
            running=worker,
        )
        stopped = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
        took = time.monotonic() - stopped
    finally:
        if worker.poll() is None:
            worker.kill()
        lock.rollback()
        lock.close()
    assert worker.returncode == 0, err
    assert "Traceback" not in err and "InvalidStateError" not in err, err
    assert "store write failed, retrying without acknowledging" in err
    assert took < 1 + 2.5, took  # the drain timeout, and a store write's second of waiting
    assert pending_count(client, key) >= 20  # nothing acknowledged that was not stored
    assert ingest(redis_url, store_url, claim_idle=0.0).stored == 50
    assert read_store(store_url, "run", "locked").counts["metric"] == 50


# -- dead letters replay once ------------------------------------------------------------------------


def test_two_replays_at_once_put_each_dead_letter_back_once(client, redis_url, store_url):
    key = wire.stream_key("dl", "rank0")
    for seq in range(1, 201):
        client.xadd(key, {"v": "1", "kind": "bogus", "run": "dl", "label": "rank0", "seq": str(seq)})
    ingest(redis_url, store_url)
    assert client.xlen(wire.DEAD_LETTER_KEY) == 200
    replays = [
        subprocess.Popen(
            [sys.executable, "-m", "runbus", "dead", "--replay", "--redis", redis_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in replays]
    assert [p.returncode for p in replays] == [0, 0], outs
    replayed = [int(out.split()[1]) for out, _ in outs]
    assert sum(replayed) == 200, outs
    assert client.xlen(wire.DEAD_LETTER_KEY) == 0
    assert client.xlen(key) == 400  # the 200 originals and one copy of each
    ingest(redis_url, store_url)
    assert client.xlen(wire.DEAD_LETTER_KEY) == 200  # dead again, once each


def test_a_dead_letter_that_cannot_go_back_is_left_with_a_note(client, redis_url):
    client.xadd(wire.DEAD_LETTER_KEY, {"reason": "no fields", "source_stream": wire.stream_key("x", "r")})
    client.xadd(wire.DEAD_LETTER_KEY, {"junk": b"\xff", "deliveries": "many"})
    client.xadd(wire.DEAD_LETTER_KEY, {"source_stream": "runbus:streams", "v": "1"})
    client.xadd(wire.DEAD_LETTER_KEY, {"source_stream": b"runbus:{\xff}:r", "v": "1"})
    client.set(wire.stream_key("str", "r"), "x")
    client.xadd(wire.DEAD_LETTER_KEY, {"source_stream": wire.stream_key("str", "r"), "v": "1"})
    good = client.xadd(
        wire.DEAD_LETTER_KEY, {"source_stream": wire.stream_key("ok", "r"), "v": "1", "kind": "x"}
    )
    for _ in range(2):  # a later replay is not jammed by them either
        result = run_cli("dead", "--replay", "--redis", redis_url)
        assert "Traceback" not in result.stderr
    assert result.stdout.startswith("replayed 0 ")
    notes = result.stderr.splitlines()
    assert len(notes) == 5, notes
    for why in (
        "names no source stream",
        "holds no fields of the original entry",
        "is not a runbus stream",
        "is not UTF-8",
        "its source stream refused it",
    ):
        assert sum(why in note for note in notes) == 1, (why, notes)
    assert client.xrange(wire.stream_key("ok", "r"))[0][1] == {b"v": b"1", b"kind": b"x"}
    assert good not in [entry_id for entry_id, _ in client.xrange(wire.DEAD_LETTER_KEY)]
    assert client.xlen(wire.DEAD_LETTER_KEY) == 5
    listed = json.loads(run_cli("dead", "--json", "--redis", redis_url).stdout)
    assert len(listed) == 5 and {letter["deliveries"] for letter in listed} == {1}


# -- every store receives every event ----------------------------------------------------------------


def write_runs(client: redis.Redis, runs: list[str], metrics: int) -> int:
    """Runs written by hand: a primary start, `metrics` metrics and a finish each; how many entries."""
    for run in runs:
        xadd_event(client, run, "rank0", "start", 1, 1, {"primary": True})
        pipe = client.pipeline(transaction=False)
        for seq in range(2, metrics + 2):
            xadd_event(pipe, run, "rank0", "metric", 1, seq, {"x": float(seq)}, step=seq)
        pipe.execute()
        xadd_event(client, run, "rank0", "finish", 1, metrics + 2, {"exit_code": 0})
    return len(runs) * (metrics + 2)


def entries_read(stderr: str) -> int:
    """The entries a worker read, from its stop line."""
    match = re.search(r"stopped after [\d.]+s: \d+ batches, (\d+) entries", stderr)
    assert match, stderr
    return int(match.group(1))


def test_two_stores_on_one_redis_each_receive_every_event(client, redis_url, tmp_path):
    total = write_runs(client, ["split-a", "split-b", "split-c"], 400)
    one, other = f"sqlite:///{tmp_path / 'one.db'}", f"sqlite:///{tmp_path / 'other.db'}"
    assert store_group(one) != store_group(other)
    # Two workers of one store and one of the other, all at once, as a real ingester beside a demo.
    workers = [
        subprocess.Popen(
            ingest_command(redis_url, url, "--burst", "--batch-size", "50", "--consumer", f"w{n}"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n, url in enumerate([one, one, other])
    ]
    errs = [w.communicate(timeout=120)[1] for w in workers]
    assert [w.returncode for w in workers] == [0, 0, 0], errs
    # The store's own workers shared its events, each read once; the other store read them all.
    assert entries_read(errs[0]) + entries_read(errs[1]) == total
    assert entries_read(errs[2]) == total
    for url in (one, other):
        for run in ("split-a", "split-b", "split-c"):
            summary = read_store(url, "run", run)
            assert (summary.state, summary.counts["metric"], summary.labels[0].missing) == (
                "finished",
                400,
                0,
            )
    groups = {g["name"].decode() for g in client.xinfo_groups(wire.stream_key("split-a", "rank0"))}
    assert groups == {store_group(one), store_group(other)}


def test_group_overrides_and_the_old_shared_group_on_upgrade(client, redis_url, store_url):
    key = wire.stream_key("upgrade", "rank0")
    total = write_runs(client, ["upgrade"], 20)
    # An older ingester left the shared `runbus` group with entries read but not acknowledged.
    client.xgroup_create(key, LEGACY_GROUP, id="0")
    client.xreadgroup(LEGACY_GROUP, "old-worker", {key: ">"}, count=5)
    stats = ingest(redis_url, store_url)
    # The store's own group starts at the stream's first entry: it reads them all, those included.
    assert stats.entries == total and stats.stored == total
    assert read_store(store_url, "run", "upgrade").state == "finished"
    assert client.xpending(key, LEGACY_GROUP)["pending"] == 5  # left as it was
    run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst", "--group", "pinned")
    groups = {g["name"].decode(): g["pending"] for g in client.xinfo_groups(key)}
    assert groups == {LEGACY_GROUP: 5, store_group(store_url): 0, "pinned": 0}


def test_the_demo_beside_a_real_ingester_leaves_the_real_run_whole(client, redis_url, tmp_path, monkeypatch):
    real_store, demo_store = f"sqlite:///{tmp_path / 'real.db'}", f"sqlite:///{tmp_path / 'demo.db'}"
    real = subprocess.Popen(
        ingest_command(redis_url, real_store, "--consumer", "real"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        total = write_runs(client, ["real-run"], 300)
        monkeypatch.setattr(demo, "torch_job", lambda ranks, steps: None)  # plain processes: quicker
        assert asyncio.run(demo._demo(redis_url, demo_store, ranks=2, steps=5)) == 0
        wait_for("the real run", lambda: stored_run(real_store, "real-run") == ("finished", 1))
    finally:
        real.send_signal(signal.SIGTERM)
        _, err = real.communicate(timeout=30)
    assert real.returncode == 0, err
    summary = read_store(real_store, "run", "real-run")
    assert (summary.primary, summary.counts["metric"], summary.labels[0].missing) == ("rank0", 300, 0)
    demo_runs = read_store(demo_store, "runs")
    assert len(demo_runs) == 1 and demo_runs[0].run_id.startswith("demo-")
    assert demo_runs[0].state == "finished" and demo_runs[0].label_count == 2
    # The demo run's keys are gone from Redis; the real run's stream is as it was.
    demo_id = demo_runs[0].run_id
    assert list(client.scan_iter(match=f"runbus:{{{demo_id}}}:*")) == []
    assert not any(demo_id.encode() in member for member in client.smembers(wire.REGISTRY_KEY))
    assert client.xlen(wire.stream_key("real-run", "rank0")) == total
