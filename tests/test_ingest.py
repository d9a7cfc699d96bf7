"""The ingester against raw entries written by hand: ordering, the finish rule, dead letters."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import orjson
import pytest
import redis

from runbus import wire
from runbus.config import DECODER_ENV
from tests.helpers import T0, ingest, pending_count, read_store, run_cli, wait_for_async, xadd_event


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(redis_url) as connection:
        yield connection


def test_workers_finishing_first_then_the_primary(client, redis_url, store_url):
    for label, primary in (("rank0", True), ("rank1", False), ("rank2", False)):
        xadd_event(client, "fin", label, "start", 1, 1, {"primary": primary})
    xadd_event(client, "fin", "rank1", "finish", 1, 2, {"exit_code": 0})
    xadd_event(client, "fin", "rank2", "finish", 1, 2, {"exit_code": 9})
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "fin")
    assert (run.state, run.primary, run.exit_code) == ("running", "rank0", None)
    assert {lab.label: (lab.state, lab.exit_code) for lab in run.labels} == {
        "rank0": ("running", None),
        "rank1": ("finished", 0),
        "rank2": ("failed", 9),
    }
    xadd_event(client, "fin", "rank0", "finish", 1, 2, {"exit_code": 0})
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "fin")
    assert (run.state, run.exit_code) == ("finished", 0)
    # Events after the run finished are still stored.
    xadd_event(client, "fin", "rank2", "metric", 1, 3, {"late": 1.0}, step=5)
    ingest(redis_url, store_url)
    assert [p.value for p in read_store(store_url, "metrics", "fin", key="late")] == [1.0]
    assert read_store(store_url, "run", "fin").state == "finished"


def test_shuffled_and_repeated_entries_with_finish_before_start(client, redis_url, store_url, decoder):
    rnd = random.Random(7)
    entries = []
    for label, primary in (("rank0", True), ("rank1", False)):
        entries.append((label, "start", 1, 1, {"primary": primary}, None))
        entries += [(label, "metric", 1, s + 2, {"loss": float(s)}, s) for s in range(20)]
        entries.append((label, "finish", 1, 22, {"exit_code": 0 if primary else 4}, None))
    shuffled = entries + rnd.sample(entries, 15)
    rnd.shuffle(shuffled)
    # Make sure the primary's finish arrives before its start.
    finish = next(e for e in shuffled if e[0] == "rank0" and e[1] == "finish")
    shuffled.remove(finish)
    shuffled.insert(0, finish)
    for label, kind, epoch, seq, data, step in shuffled:
        xadd_event(client, "shuf", label, kind, epoch, seq, data, step)
    stats = ingest(redis_url, store_url, batch_size=7)
    assert stats.entries == len(shuffled) and stats.stored == len(entries)
    assert stats.duplicates == len(shuffled) - len(entries)
    run = read_store(store_url, "run", "shuf")
    assert (run.state, run.primary, run.exit_code) == ("finished", "rank0", 0)
    assert {lab.label: (lab.state, lab.events, lab.missing) for lab in run.labels} == {
        "rank0": ("finished", 22, 0),
        "rank1": ("failed", 22, 0),
    }
    assert run.counts == {"metric": 40, "log": 0, "system": 0}
    points = read_store(store_url, "metrics", "shuf", key="loss", label="rank1")
    assert [(p.step, p.value) for p in points] == [(s, float(s)) for s in range(20)]


def good_fields(**overrides):
    fields = wire.encode_fields("metric", "bad", "rank0", 1, 1, 1_700_000_000.0, b'{"x": 1}', 3)
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


BAD_ENTRIES = {
    "not JSON": good_fields(data=b"{nope"),
    "unknown wire version": good_fields(v="9"),
    "unknown kind": good_fields(kind="banana"),
    "missing field 'seq'": good_fields(seq=None),
    "field 'epoch' is not an integer": good_fields(epoch="one"),
    "must be >= 1": good_fields(seq=0),
    "do not match key": good_fields(label="rank7"),
    "not a number": good_fields(data=b'{"x": "high"}'),
    "must be a JSON object": good_fields(data=b"[1, 2]"),
    "only for metric events": {**good_fields(kind="log", data=b'{"stream":"stdout","text":"a"}'), "step": 1},
    "needs an integer 'exit_code'": good_fields(kind="finish", data=b'{"exit_code": "0"}', step=None),
    # Values no store can hold or show: refused at the wire, not by the store (or its readers).
    "exit_code 9223372036854775808 does not fit in 64 bits": good_fields(
        kind="finish", data=b'{"exit_code": 9223372036854775808}', step=None
    ),
    "from year 2000 to 2200, got 1e300": good_fields(ts="1e300"),
    "from year 2000 to 2200, got 1700000000000": good_fields(ts="1700000000000"),  # milliseconds
    "from year 2000 to 2200, got 12.5": good_fields(ts="12.5"),  # a monotonic clock
    "over the limit": good_fields(data=b'{"x": 1, "pad": "' + b"a" * wire.MAX_DATA_BYTES + b'"}'),
    "not UTF-8": good_fields(kind=b"\xff\xfe"),
    # Unhashable where the contract looks a name up: once a TypeError that stopped the worker.
    "log stream must be one of": good_fields(
        kind="log", data=b'{"stream": ["stdout"], "text": "a"}', step=None
    ),
}


def test_each_kind_of_bad_entry_is_dead_lettered_with_a_reason(client, redis_url, store_url, decoder):
    key = wire.stream_key("bad", "rank0")
    ids = {reason: client.xadd(key, fields) for reason, fields in BAD_ENTRIES.items()}
    xadd_event(client, "bad", "rank0", "metric", 1, 2, {"ok": 2.0}, step=1)
    # A stream whose name is not valid at all (found by the keyspace scan) is dead-lettered too.
    odd_key = "runbus:{bad run!}:rank0"
    client.xadd(odd_key, good_fields())
    stats = ingest(redis_url, store_url)
    assert stats.stored == 1 and stats.dead_lettered == len(BAD_ENTRIES) + 1
    dead = client.xrange(wire.DEAD_LETTER_KEY)
    # Entry ids are only unique within a stream: index by both.
    by_source = {(fields[b"source_stream"].decode(), fields[b"source_id"]): fields for _, fields in dead}
    for reason, entry_id in ids.items():
        assert reason in by_source[key, entry_id][b"reason"].decode(), reason
    odd = [f for _, f in dead if f[b"source_stream"] == odd_key.encode()]
    assert len(odd) == 1 and b"not a runbus stream" in odd[0][b"reason"]
    # The original fields travel with the dead letter, so it can be read and replayed.
    assert by_source[key, ids["unknown kind"]][b"kind"] == b"banana"
    # Everything was acknowledged: nothing stays pending.
    assert pending_count(client, key) == 0
    assert [p.value for p in read_store(store_url, "metrics", "bad", key="ok")] == [2.0]


@pytest.fixture(params=["sqlite", "postgres"])
def any_store(request) -> str:
    return request.getfixturevalue("store_url" if request.param == "sqlite" else "postgres_url")


def test_entries_no_store_can_hold_are_dead_lettered_and_the_rest_of_their_batch_stored(
    client, redis_url, any_store
):
    # Two runs read in one batch, each with one entry the store cannot hold, written as
    # redis-cli would: a seq the wire accepts (its neighbour overflows in the store's integers),
    # and an exit code beyond 64 bits, which the wire refuses before the store sees it.
    for run in ("far", "big"):
        xadd_event(client, run, "rank0", "start", 1, 1, {"primary": True})
        for seq in range(2, 42):
            xadd_event(client, run, "rank0", "metric", 1, seq, {"x": float(seq)}, step=seq)
    far = xadd_event(client, "far", "rank0", "metric", 1, 2**63 - 1, {"x": 1.0}, step=99, ts=T0)
    xadd_event(client, "far", "rank0", "finish", 1, 42, {"exit_code": 0})
    big = xadd_event(client, "big", "rank0", "finish", 1, 42, {"exit_code": 2**63})
    xadd_event(client, "big", "rank1", "start", 1, 1, {"primary": False})

    result = run_cli("--store", any_store, "ingest", "--redis", redis_url, "--burst")  # exit 0

    dead = {
        (fields[b"source_stream"].decode(), fields[b"source_id"]): fields[b"reason"].decode()
        for _, fields in client.xrange(wire.DEAD_LETTER_KEY)
    }
    assert set(dead) == {(wire.stream_key("far", "rank0"), far), (wire.stream_key("big", "rank0"), big)}
    # The store refuses the seq as no producer's (storage.rules.out_of_reach) before its
    # integers overflow on it.
    reason = dead[wire.stream_key("far", "rank0"), far]
    assert "beyond the label's highest stored or reported seq 41" in reason, reason
    assert (
        dead[wire.stream_key("big", "rank0"), big]
        == "finish exit_code 9223372036854775808 does not fit in 64 bits"
    )
    assert result.stderr.count("the store rejected") == 1, result.stderr
    assert "retrying" not in result.stderr, result.stderr
    # Everything else of the batch is stored, in both runs.
    far_run, big_run = read_store(any_store, "run", "far"), read_store(any_store, "run", "big")
    assert (far_run.state, far_run.exit_code, far_run.counts["metric"]) == ("finished", 0, 40)
    assert (big_run.state, big_run.label_count, big_run.counts["metric"]) == ("running", 2, 40)
    for run in ("far", "big"):
        assert pending_count(client, wire.stream_key(run, "rank0")) == 0


def test_non_finite_values_round_trip(client, redis_url, store_url, decoder):
    data = {"nan": "NaN", "inf": "Infinity", "ninf": "-Infinity", "big": 1e308, "int": 7}
    xadd_event(client, "nf", "rank0", "metric", 1, 1, data, step=0)
    ingest(redis_url, store_url)
    values = {p.key: p.value for p in read_store(store_url, "metrics", "nf")}
    assert values["nan"] != values["nan"]
    assert values["inf"] == float("inf") and values["ninf"] == float("-inf")
    assert values["big"] == 1e308 and values["int"] == 7


def write_every_kind(client) -> None:
    """Two labels of every kind of event (metrics at steps, without, with "NaN"; system figures;
    logs), enough of each for the fast path's columns, and every kind of bad entry."""
    for label, primary in (("rank0", True), ("rank1", False)):
        xadd_event(client, "both", label, "start", 1, 1, {"primary": primary, "config": {"lr": 0.1}})
        for seq in range(2, 62):
            data = {"loss": 1 / seq, "n": seq, **({"odd": "NaN"} if seq % 17 == 0 else {})}
            xadd_event(client, "both", label, "metric", 1, seq, data, step=seq if seq % 5 else None)
        for seq in range(62, 72):
            xadd_event(client, "both", label, "system", 1, seq, {"proc.rss_mb": seq + 0.5, "gpu.0.util": 7})
        xadd_event(client, "both", label, "log", 1, 72, {"stream": "stderr", "level": "ERROR", "text": "x"})
        xadd_event(client, "both", label, "heartbeat", 1, 73, {"dropped": 0})
        xadd_event(client, "both", label, "finish", 1, 74, {"exit_code": 0 if primary else 3})
    for fields in BAD_ENTRIES.values():
        client.xadd(wire.stream_key("bad", "rank0"), fields)


def nan_as_text(points: list) -> list:
    """Points whose NaN values compare equal (NaN is unequal to itself, even in lists of points)."""
    return [dataclasses.replace(p, value="nan") if p.value != p.value else p for p in points]


def test_the_worker_ingests_identically_with_the_reference_decoder(client, redis_url, tmp_path):
    """`runbus ingest --burst` with RUNBUS_DECODER=reference stores and dead-letters exactly what
    the default fast path does."""
    stored = {}
    for decoder in ("fast", "reference"):
        client.flushdb()
        write_every_kind(client)
        store_url = f"sqlite:///{tmp_path / decoder}.db"
        result = run_cli(
            "--store", store_url, "ingest", "--redis", redis_url, "--burst", env={DECODER_ENV: decoder}
        )
        assert ("reference decoder" in result.stderr) == (decoder == "reference"), result.stderr
        dead = [(f[b"source_stream"], f[b"reason"]) for _, f in client.xrange(wire.DEAD_LETTER_KEY)]
        stored[decoder] = (
            read_store(store_url, "run", "both"),
            nan_as_text(read_store(store_url, "metrics", "both")),
            nan_as_text(read_store(store_url, "system", "both")),
            read_store(store_url, "logs", "both"),
            dead,
        )
    run, metrics, system, logs, dead = stored["reference"]
    assert (run.state, run.counts) == ("finished", {"metric": 120, "log": 2, "system": 20})
    assert len(metrics) == 2 * (60 * 2 + 3) and len(system) == 2 * 10 * 2 and len(logs) == 2
    assert len(dead) == len(BAD_ENTRIES)
    assert stored["fast"] == stored["reference"]


def test_an_unknown_decoder_is_one_line_and_exit_1(redis_url, store_url):
    result = run_cli(
        "--store",
        store_url,
        "ingest",
        "--redis",
        redis_url,
        "--burst",
        env={DECODER_ENV: "turbo"},
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr == "runbus: RUNBUS_DECODER='turbo' is not one of: fast, reference\n"


def test_a_stream_written_by_redis_cli_is_found_without_a_registry(client, redis_url, store_url):
    client.execute_command(
        "XADD",
        "runbus:{cli}:rank0",
        "*",
        "v",
        "1",
        "kind",
        "metric",
        "run",
        "cli",
        "label",
        "rank0",
        "epoch",
        "1",
        "seq",
        "1",
        "ts",
        "1700000000.5",
        "step",
        "0",
        "data",
        orjson.dumps({"loss": 0.5}),
    )
    assert not client.exists(wire.REGISTRY_KEY)
    ingest(redis_url, store_url)
    assert [(p.label, p.key, p.value) for p in read_store(store_url, "metrics", "cli")] == [
        ("rank0", "loss", 0.5)
    ]


async def test_the_asyncio_client_packs_commands_with_hiredis(redis_url):
    from redis.exceptions import DataError

    from runbus.redis import async_client

    client = async_client(redis_url)
    try:
        assert "HiredisPacking" in repr(client.connection_pool.connection_class.pack_command)
        ids = [await client.xadd("packed", {"n": i, "f": 0.1, "b": bytearray(b"x")}) for i in range(3)]
        await client.xgroup_create("packed", "g", id="0")
        await client.xreadgroup("g", "c", {"packed": ">"})
        assert await client.xack("packed", "g", *ids, memoryview(b"0-1")) == 3
        assert (await client.xrange("packed"))[0][1] == {b"n": b"0", b"f": b"0.1", b"b": b"x"}
        assert "maxmemory" in await client.execute_command("CONFIG GET", "maxmemory")
        with pytest.raises(DataError):
            await client.set("packed-none", None)
    finally:
        await client.aclose()


def test_a_batch_is_written_while_the_one_before_is_acknowledged_and_no_more_overlap():
    from runbus.ingester.worker import Commits

    log: list[str] = []
    acks = {n: asyncio.Event() for n in (1, 2, 3)}

    def commit(n: int):
        async def run(written: asyncio.Future) -> None:
            log.append(f"write {n}")
            await asyncio.sleep(0)
            written.set_result(None)
            await acks[n].wait()
            log.append(f"acked {n}")

        return run

    async def main() -> None:
        commits = Commits()
        await commits.start(commit(1))
        await commits.start(commit(2))  # waits for 1's write only
        assert log == ["write 1"]
        third = asyncio.create_task(commits.start(commit(3)))
        await wait_for_async("2's write", lambda: log == ["write 1", "write 2"], 5)
        assert not third.done()  # 1 is still acknowledging
        acks[1].set()
        await third
        acks[2].set()
        acks[3].set()
        await commits.settle()

    asyncio.run(main())
    assert log[:4] == ["write 1", "write 2", "acked 1", "write 3"]
    assert sorted(log[4:]) == ["acked 2", "acked 3"]  # acknowledgements may overlap


def test_a_failed_write_stops_the_next_batch_from_starting():
    from runbus.ingester.worker import Commits

    async def failing(written: asyncio.Future) -> None:
        written.set_result(None)
        raise RuntimeError("the store broke")

    async def never(written: asyncio.Future) -> None:
        raise AssertionError("started after a failed batch")

    async def main() -> None:
        commits = Commits()
        await commits.start(failing)
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="the store broke"):
            await commits.start(never)

    asyncio.run(main())


def test_entries_in_flight_are_let_go_read_by_read(tmp_path):
    from runbus.ingester.worker import Worker, WorkerSettings

    worker = Worker(WorkerSettings(store_url=f"sqlite:///{tmp_path}/runbus.db"))
    first = [(b"1-0", [b"v", b"1"]), (b"2-0", [b"v", b"1"])]
    again = [(b"2-0", [b"v", b"1"])]  # the same entry delivered again (claimed), in a read of its own
    worker._hold([("s", first), ("t", [(b"5-0", None)])])
    worker._hold([("s", again)])
    assert worker._held_ids("s") == {b"1-0", b"2-0"}
    worker._let_go([("s", first)])
    assert worker._held_ids("s") == {b"2-0"}  # still in flight in the other read
    worker._let_go([("s", list(again))])  # an equal list, not the one held: nothing let go
    assert worker._held_ids("s") == {b"2-0"}
    worker._let_go([("s", again), ("t", [])])
    assert worker._held_ids("s") == set() and worker._held_ids("t") == {b"5-0"}


def _events(label: str, count: int, keys: int) -> list[wire.Event]:
    data = {f"k{n}": 1.0 for n in range(keys)}
    return [wire.Event("r", label, "metric", 1, seq, 0.0, data, seq) for seq in range(count)]


def test_row_slices_keep_a_labels_events_of_one_read_together():
    from runbus.ingester.worker import row_slices

    # 3 labels of 40 events of 4 keys (200 rows each) under a limit of 450 rows: the slices end
    # where a label's events begin, not inside them.
    events = _events("a", 40, 4) + _events("b", 40, 4) + _events("c", 40, 4)
    assert row_slices(events, 450) == [(0, 80), (80, 120)]
    # A label wider than the limit is cut inside, as before; every event is in exactly one slice.
    events = _events("a", 10, 4) + _events("b", 200, 4) + _events("c", 5, 4)
    slices = row_slices(events, 450)
    assert slices[0] == (0, 10) and all(end - start > 0 for start, end in slices)
    assert [i for start, end in slices for i in range(start, end)] == list(range(len(events)))
    assert all(sum(len(e.data) + 1 for e in events[start:end]) <= 450 for start, end in slices)
    # Under the limit, one slice.
    assert row_slices(events[:10], 450) == [(0, 10)]


def test_sources_give_each_events_stream_id_and_fields_as_a_list_would():
    from runbus.ingester.batch import Sources

    sources, listed = Sources(), []
    for key, count in (("s1", 3), ("s2", 0), ("s3", 5)):
        ids = [f"{key}-{n}".encode() for n in range(count)]
        fieldses = [[b"n", str(n).encode()] for n in range(count)]
        sources.add(key, ids, fieldses)
        listed += zip([key] * count, ids, fieldses, strict=True)
    assert len(sources) == len(listed) == 8
    assert list(sources) == listed
    assert [sources[i] for i in range(-8, 8)] == listed + listed
    for start, end, step in ((0, 8, 1), (2, 5, 1), (3, 3, 1), (5, 100, 1), (-3, None, 1), (1, 7, 2)):
        part = sources[start:end:step]
        assert list(part) == listed[start:end:step] and len(part) == len(listed[start:end:step])
        assert part[:] is not part and list(part[1:][1:]) == listed[start:end:step][2:]
    with pytest.raises(IndexError):
        sources[8]
