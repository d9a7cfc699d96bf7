"""Entries fenced by their epoch's lease: hand-written entries, with the live epoch read from Redis,
seals copied from real entries or forged into another label's stream, never decide a run. Real
Redis, live producer processes, and a real ingester (`runbus ingest --burst`)."""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

import runbus
from runbus import config, wire
from runbus.errors import CommandError
from runbus.ingester import decoding
from runbus.ingester.batch import Stretch
from runbus.ingester.fence import Fences
from runbus.ingester.localredis import LocalRedis
from tests.conftest import private_redis
from tests.helpers import QUIET, T0, read_store, run_cli, unset_runbus, xadd_event
from tests.helpers import ingest as ingest_here

# A rank that logs, says when everything is in Redis, then finishes when told (a line on stdin).
RANK = textwrap.dedent(
    """
    import json, os, sys, time, runbus
    say = lambda doc: os.write(1, (json.dumps(doc) + "\\n").encode())  # never captured by runbus
    run = runbus.init(system_interval=None, hardware=False, console="off")
    for step in range(5):
        run.log({"loss": float(step)}, step=step)
    while run.buffered:
        time.sleep(0.01)
    say({"shipped": True, "epoch": run.epoch, "label": run.label, "primary": run.primary})
    sys.stdin.readline()
    say({"finished": run.finish(timeout=30)})
    """
)


def start_rank(redis_url: str, run_id: str, rank: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    variables = {k: v for k, v in unset_runbus().items() if k != "RANK"}
    return subprocess.Popen(
        [sys.executable, "-c", RANK],
        env={
            **variables,
            "RUNBUS_REDIS_URL": redis_url,
            "RUNBUS_RUN_ID": run_id,
            "RANK": str(rank),
            **(env or {}),
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def said(proc: subprocess.Popen) -> dict:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    assert text, f"the rank ended: {proc.wait(30)}, {proc.stderr.read()[-2000:] if proc.stderr else ''}"
    return json.loads(text)


def finish(proc: subprocess.Popen) -> bool:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    done = said(proc)["finished"]
    assert proc.wait(60) == 0
    return done


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as c:
        yield c


@pytest.fixture
def ranks() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def ingest(redis_url: str, store_url: str) -> None:
    run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst")


def dead_letters(client: redis.Redis, run_id: str, label: str) -> dict[bytes, str]:
    """The dead letters of one label's stream by their source entry id: the reason (ids of two
    streams may be equal)."""
    key = wire.stream_key(run_id, label).encode()
    return {
        f[b"source_id"]: f[b"reason"].decode()
        for _, f in client.xrange(wire.DEAD_LETTER_KEY)
        if f[b"source_stream"] == key
    }


def live_epoch(client: redis.Redis, run_id: str, label: str) -> int:
    """The label's epoch as anyone reading Redis finds it."""
    return int(client.get(wire.epoch_key(run_id, label)))


def test_a_hand_written_finish_of_the_live_epoch_is_dead_lettered_and_the_real_finish_decides(
    redis_url, client, store_url, ranks
):
    ranks.append(rank := start_rank(redis_url, "forged", 0))
    shipped = said(rank)
    epoch = live_epoch(client, "forged", "rank0")
    assert epoch == shipped["epoch"]
    real = client.xrange(wire.stream_key("forged", "rank0"))[-1][1]
    # The attack: one XADD of a finish (exit code 7, seq 10**9) with the live epoch.
    plain = xadd_event(client, "forged", "rank0", "finish", epoch, 10**9, {"exit_code": 7})
    # The same with the seal of a real entry copied onto it, and at the seq right after the last.
    copied = client.xadd(
        wire.stream_key("forged", "rank0"),
        {
            **wire.encode_fields(
                "finish", "forged", "rank0", epoch, 7, T0, orjson.dumps({"exit_code": 7}), None
            ),
            "seal": real.get(b"seal", b"0" * 32),
        },
    )
    ingest(redis_url, store_url)

    dead = dead_letters(client, "forged", "rank0")
    assert "carries no seal: not written by its lease holder" in dead[plain]
    assert "seal does not match epoch" in dead[copied]
    run = read_store(store_url, "run", "forged")
    assert (run.state, run.exit_code, run.labels[0].missing) == ("running", None, 0)

    # The real finish(0), which returns True, decides, and leaves no gap.
    assert finish(rank) is True
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "forged")
    (label,) = run.labels
    assert (run.state, run.exit_code) == ("finished", 0)
    assert (label.state, label.epoch, label.missing, label.gaps) == ("finished", epoch, 0, [])


def test_a_hand_written_start_of_a_far_epoch_does_not_revive_a_finished_run(
    redis_url, client, store_url, ranks
):
    ranks.append(rank := start_rank(redis_url, "revived", 0))
    epoch = said(rank)["epoch"]
    assert finish(rank) is True
    ingest(redis_url, store_url)
    assert read_store(store_url, "run", "revived").state == "finished"

    forged = xadd_event(client, "revived", "rank0", "start", 99999999999999, 1, {"primary": True})
    ingest(redis_url, store_url)

    assert (
        "epoch 99999999999999 was never issued to this label"
        in dead_letters(client, "revived", "rank0")[forged]
    )
    run = read_store(store_url, "run", "revived")
    assert (run.state, run.exit_code, run.labels[0].epoch) == ("finished", 0, epoch)


def test_entries_forged_into_another_label_s_stream_are_dead_lettered(redis_url, client, store_url, ranks):
    ranks.append(primary := start_rank(redis_url, "other", 0))
    ranks.append(worker := start_rank(redis_url, "other", 1))
    said(primary)
    said(worker)
    # rank1's real, sealed entries written again into rank0's stream as rank0's, with rank0's
    # live epoch: a finish, and one copied unchanged (its seal is rank1's epoch's).
    epoch0 = live_epoch(client, "other", "rank0")
    sealed = client.xrange(wire.stream_key("other", "rank1"))[-1][1]
    as_rank0 = {**sealed, b"label": b"rank0", b"epoch": str(epoch0).encode()}
    moved = client.xadd(wire.stream_key("other", "rank0"), as_rank0)
    as_finish = {k: v for k, v in as_rank0.items() if k != b"step"}
    ended = client.xadd(
        wire.stream_key("other", "rank0"), {**as_finish, b"kind": b"finish", b"data": b'{"exit_code": 7}'}
    )
    # And a finish of rank1's own live epoch, by hand, into rank1's stream.
    epoch1 = live_epoch(client, "other", "rank1")
    worker_end = xadd_event(client, "other", "rank1", "finish", epoch1, 6, {"exit_code": 3})
    ingest(redis_url, store_url)

    dead = dead_letters(client, "other", "rank0")
    assert all("seal does not match" in dead[entry] for entry in (moved, ended)), dead
    assert "carries no seal" in dead_letters(client, "other", "rank1")[worker_end]
    run = read_store(store_url, "run", "other")
    assert run.state == "running"
    assert {lab.label: (lab.state, lab.missing) for lab in run.labels} == {
        "rank0": ("running", 0),
        "rank1": ("running", 0),
    }
    assert finish(worker) is True and finish(primary) is True
    ingest(redis_url, store_url)
    run = read_store(store_url, "run", "other")
    assert (run.state, run.exit_code) == ("finished", 0)
    assert {lab.label: lab.state for lab in run.labels} == {"rank0": "finished", "rank1": "finished"}


# -- the documented Redis ACLs (docs/operations.md) ------------------------------------------------


def readme_acl(passwords: dict[str, str]) -> list[list[str]]:
    """docs/operations.md's ACL SETUSER lines, with these passwords, as argv lists."""
    readme = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    lines = [text for text in readme.splitlines() if text.startswith("ACL SETUSER runbus-")]
    assert [shlex.split(text)[2] for text in lines] == ["runbus-producer", "runbus-ingester"]
    for placeholder, password in passwords.items():
        lines = [text.replace(placeholder, password) for text in lines]
    return [shlex.split(text) for text in lines]


@pytest.fixture
def acl_redis() -> Iterator[LocalRedis]:
    yield from private_redis()


def test_the_readme_s_acl_users_run_a_producer_and_an_ingester(acl_redis, store_url, ranks):
    passwords = {"PRODUCER_PASSWORD": secrets.token_hex(8), "INGESTER_PASSWORD": secrets.token_hex(8)}
    with redis.Redis.from_url(acl_redis.url) as admin:
        for argv in readme_acl(passwords):
            assert admin.execute_command(*argv) in (b"OK", "OK", True)
    host = acl_redis.url.removeprefix("redis://")
    producer_url = f"redis://runbus-producer:{passwords['PRODUCER_PASSWORD']}@{host}"
    ingester_url = f"redis://runbus-ingester:{passwords['INGESTER_PASSWORD']}@{host}"

    ranks.append(rank := start_rank(producer_url, "acl", 0))
    epoch = said(rank)["epoch"]
    with redis.Redis.from_url(producer_url) as producer:
        # A producer's password writes seals but reads none, and no other dangerous command.
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.hgetall(wire.seal_key("acl", "rank0"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.keys("*")
        forged = xadd_event(producer, "acl", "rank0", "finish", epoch, 6, {"exit_code": 7})
    assert finish(rank) is True
    ingest(ingester_url, store_url)
    # `--from now` reads Redis's clock (TIME) and the group starts (runbus:group-starts).
    run_cli(
        "--store",
        store_url.replace("runbus.db", "now.db"),
        "ingest",
        "--redis",
        ingester_url,
        "--burst",
        "--from",
        "now",
    )

    run = read_store(store_url, "run", "acl")
    assert (run.state, run.exit_code, run.counts["metric"], run.labels[0].missing) == ("finished", 0, 5, 0)
    with redis.Redis.from_url(ingester_url) as ingester:
        assert "carries no seal" in dead_letters(ingester, "acl", "rank0")[forged]
        assert set(ingester.hgetall(wire.seal_key("acl", "rank0"))) == {str(epoch).encode()}
        with pytest.raises(redis.exceptions.NoPermissionError):
            ingester.eval("return 1", 0)


# -- spools: a dead process's entries sealed by the process that ships them ---------------------

DIES_IN_AN_OUTAGE = textwrap.dedent(
    """
    import os, sys, time, runbus
    run = runbus.init(run_id="spooled", label="rank0", system_interval=None, hardware=False,
                      console="off", max_buffer_bytes=10_000, spool_dir=sys.argv[1], finish_timeout=1)
    run.log({"before": 1.0})
    while run.buffered:
        time.sleep(0.01)
    os.write(1, f"{run.epoch}\\n".encode())
    sys.stdin.readline()  # Redis is killed meanwhile
    for step in range(300):
        run.log({"loss": float(step)}, step=step)
    run.finish()  # Redis is down: gives up after 1 s and leaves the rest in the spool
    os._exit(0)
    """
)


def test_a_dead_process_s_spool_is_shipped_with_its_own_epoch_s_seals(local_redis, store_url, tmp_path):
    spool = tmp_path / "spool"
    env = {k: v for k, v in unset_runbus().items() if k != "RANK"}
    dying = subprocess.Popen(
        [sys.executable, "-c", DIES_IN_AN_OUTAGE, str(spool)],
        env={**env, "RUNBUS_REDIS_URL": local_redis.url},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    epoch = int(dying.stdout.readline())
    local_redis.kill()
    dying.communicate("\n", timeout=60)
    (left,) = spool.iterdir()
    assert left.stat().st_mode & 0o777 == 0o600  # it holds the process's seal secret
    local_redis.start()
    with runbus.init(
        run_id="spooled", label="rank0", redis_url=local_redis.url, spool_dir=str(spool), **QUIET
    ):
        pass
    ingest(local_redis.url, store_url)

    with redis.Redis.from_url(local_redis.url) as client:
        assert dead_letters(client, "spooled", "rank0") == {}
    stored = read_store(store_url, "run", "spooled")
    assert (stored.state, stored.counts["metric"], stored.labels[0].missing) == ("finished", 301, 0)
    assert {p.epoch for p in read_store(store_url, "metrics", "spooled", key="loss")} == {epoch}


# -- the ingester's two ways of checking seals ---------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 30),
    st.booleans(),
    st.sampled_from(["none", "data", "seq", "seal", "kind", "ts", "short seal", "not hex"]),
    st.data(),
)
def test_seals_checked_a_column_at_a_time_agree_with_one_by_one(count, with_step, hazard, draw):
    """A stream's entries all sealed are taken a column at a time; one entry changed after it was
    sealed (same fields, same widths) makes the columns refuse, and one by one finds it alone."""
    secret, epoch = wire.new_seal_secret(), 1795725326806
    key = wire.stream_key("cols", "rank0")
    with_step = with_step and hazard != "kind"  # a system figure has no step
    flats = []
    for seq in range(1, count + 1):
        data = orjson.dumps({"loss": seq / 7})
        step = seq if with_step else None
        fields = wire.encode_fields("metric", "cols", "rank0", epoch, seq, T0 + seq, data, step)
        stamp = wire.seal_event(secret, "metric", epoch, seq, T0 + seq, step, data)
        flats.append(
            [
                p
                for k, v in fields.items()
                for p in (k.encode(), v if isinstance(v, bytes) else str(v).encode())
            ]
        )
        flats[-1] += [wire.SEAL_FIELD, stamp]
    changed = draw.draw(st.integers(0, count - 1))
    at = {"data": -3, "seq": 11, "seal": -1, "kind": 3, "ts": 13, "short seal": -1, "not hex": -1}.get(hazard)
    if at is not None:
        value = {
            "data": b'{"loss":7.0}',
            "seq": str(count + 5).encode(),
            "kind": b"system",
            "ts": b"1700000000.25",
        }
        value |= {"seal": b"0" * 32, "short seal": flats[changed][-1][:31], "not hex": b"z" * 32}
        flats[changed][at] = value[hazard]
    events = decoding.decode_stream_fast(key, flats)
    assert all(isinstance(e, wire.Event) for e in events)
    sources = [(key, b"%d-0" % n, flat) for n, flat in enumerate(flats)]
    fences = Fences()
    fences._known[("cols", "rank0")] = wire.Fence({epoch: secret}, epoch)
    one_by_one = [fences._reason(e, s) for e, s in zip(events, sources, strict=True)]
    assert fences._all_sealed(events, sources, Stretch(slice(0, count), None)) == (hazard == "none")
    # On the cells the decoder read (a stream of COLUMNS_FROM entries or more), alike.
    decoded, columns = decoding.decode_with_columns_fast(key, flats)
    assert decoded == events and (columns is not None) == (count >= decoding.COLUMNS_FROM)
    if columns is not None:
        assert fences._all_sealed(events, sources, Stretch(slice(0, count), columns)) == (hazard == "none")
    assert [n for n, why in enumerate(one_by_one) if why] == ([] if hazard == "none" else [changed])


def test_require_seal_refuses_the_unsealed_entries_of_labels_no_producer_sealed(redis_url, client, store_url):
    # Written by hand (no claim, no seal): taken as before, unless the ingester requires seals.
    by_hand = [xadd_event(client, run, "rank0", "metric", 1, 1, {"x": 1.0}) for run in ("taken", "strict")]
    ingest_here(redis_url, store_url, only_runs=frozenset({"taken"}))
    ingest_here(redis_url, store_url, only_runs=frozenset({"strict"}), require_seal=True)

    assert read_store(store_url, "run", "taken").counts["metric"] == 1
    assert read_store(store_url, "run", "strict") is None
    assert dead_letters(client, "taken", "rank0") == {}
    reason = dead_letters(client, "strict", "rank0")[by_hand[1]]
    assert reason == "entry of epoch 1 carries no seal (the ingester requires seals)"
    with pytest.raises(CommandError, match="RUNBUS_REQUIRE_SEAL='maybe'"):
        config.require_seal({"RUNBUS_REQUIRE_SEAL": "maybe"})
