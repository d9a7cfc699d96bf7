"""Fault injection against real processes: killed ingesters and ranks, a killed Redis, outages
longer than the buffers, a locked store. The promise: nothing accepted is lost or stored twice,
and every gap is visible and explained."""

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

import redis

import runbus
from runbus import wire
from runbus.errors import StoreUnavailable
from runbus.ingester.worker import Worker, WorkerSettings
from tests.helpers import (
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

PRODUCER = textwrap.dedent(
    r"""
    import json, os, sys, time, runbus
    say = lambda text: os.write(1, (text + "\n").encode())  # the raw fd: never captured by runbus
    count, pace = int(os.environ["COUNT"]), float(os.environ.get("PACE", "0"))
    run = runbus.init(system_interval=None, hardware=False, max_backoff=0.2,
                        heartbeat_interval=float(os.environ.get("HEARTBEAT", "10")))
    say("ready")
    longest = 0.0
    for step in range(count):
        t0 = time.perf_counter()
        run.log({"loss": float(step)}, step=step)
        longest = max(longest, time.perf_counter() - t0)
        if pace:
            time.sleep(pace)
    if os.environ.get("HANG"):
        time.sleep(3600)
    done = run.finish(timeout=60)
    say(json.dumps({"longest_log_s": longest, "complete": done, "dropped": run.dropped}))
    """
)


def start_producer(redis_url: str, run_id: str, rank: int, count: int, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PRODUCER],
        env={
            **os.environ,
            "RUNBUS_REDIS_URL": redis_url,
            "RUNBUS_RUN_ID": run_id,
            "RANK": str(rank),
            "WORLD_SIZE": "8",
            "COUNT": str(count),
            **env,
        },
        stdout=subprocess.PIPE,
        text=True,
    )


def finish_producers(procs: list[subprocess.Popen]) -> list[dict]:
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        results.append(json.loads(out.splitlines()[-1]))
    return results


def start_ingester(redis_url: str, store_url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ingest_command(redis_url, store_url, *args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_every_event_once(store_url: str, run_id: str, ranks: int, count: int) -> None:
    run = read_store(store_url, "run", run_id)
    assert run.counts["metric"] == ranks * count
    for lab in run.labels:
        assert lab.missing == 0 and lab.state == "finished", lab
    for rank in range(ranks):
        points = read_store(store_url, "metrics", run_id, key="loss", label=f"rank{rank}")
        assert [p.step for p in points] == list(range(count))


def test_sigkilled_ingesters_lose_nothing_and_store_nothing_twice(redis_url, store_url):
    ranks, count = 3, 3000
    procs = [start_producer(redis_url, "kill-ingest", r, count, PACE="0.0005") for r in range(ranks)]
    kills = 0
    while any(p.poll() is None for p in procs) or kills < 3:
        worker = start_ingester(redis_url, store_url, "--claim-idle", "0.5")
        time.sleep(0.7)
        worker.send_signal(signal.SIGKILL)
        worker.communicate(timeout=30)
        kills += 1
    finish_producers(procs)
    stats = ingest(redis_url, store_url, claim_idle=0.0)
    assert stats.dead_lettered == 0
    assert_every_event_once(store_url, "kill-ingest", ranks, count)
    print(f"\nFIGURE ingester SIGKILLs: {kills}, events: {ranks * count}, lost: 0, duplicates stored: 0")


def hold_write_lock(store_url: str) -> sqlite3.Connection:
    """Another writer holding SQLite's write lock: the worker's commits wait behind it."""
    con = sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None, timeout=30)
    con.execute("BEGIN EXCLUSIVE")
    return con


def seed_stream(client: redis.Redis, redis_url: str, store_url: str, run: str, metrics: int) -> str:
    """A stream whose start is already stored (so the store and the group exist), followed by
    `metrics` unread metric entries; its key."""
    xadd_event(client, run, "rank0", "start", 1, 1, {"primary": True})
    ingest(redis_url, store_url)
    for seq in range(2, metrics + 2):
        xadd_event(client, run, "rank0", "metric", 1, seq, {"x": float(seq)}, step=seq)
    return wire.stream_key(run, "rank0")


def ingester_behind_lock(
    client: redis.Redis, redis_url: str, store_url: str, run: str, metrics: int, *args: str
) -> tuple[str, sqlite3.Connection, subprocess.Popen]:
    """seed_stream's stream, another writer holding SQLite's write lock, and an ingester (given
    `args`) whose commits wait behind it: (stream key, the lock's connection, the ingester)."""
    key = seed_stream(client, redis_url, store_url, run, metrics)
    lock = hold_write_lock(store_url)
    return key, lock, start_ingester(redis_url, store_url, *args)


def pending(client: redis.Redis, key: str) -> int:
    return pending_count(client, key)


def wait_pending(client: redis.Redis, key: str, count: int) -> None:
    """Until a worker has read (and not acknowledged) `count` entries of `key`."""
    wait_for(f"{count} entries of {key} read", lambda: pending(client, key) >= count, 20)


def idle_ms(client: redis.Redis, key: str) -> int:
    """The least time any entry of `key` read and not acknowledged has been idle, in ms."""
    group = client.xinfo_groups(key)[0]["name"]
    return min(entry["time_since_delivered"] for entry in client.xpending_range(key, group, "-", "+", 1000))


def test_a_killed_worker_s_entries_are_claimed_by_the_other(redis_url, store_url):
    with redis.Redis.from_url(redis_url) as client:
        key, lock, stuck = ingester_behind_lock(
            client, redis_url, store_url, "claim", 50, "--consumer", "doomed"
        )
        wait_pending(client, key, 50)
        stuck.send_signal(signal.SIGKILL)
        stuck.communicate(timeout=30)
        lock.rollback()
        lock.close()
        assert ingest(redis_url, store_url, claim_idle=60.0).claimed == 0  # not idle long enough yet
        wait_for("the entries idle for a second", lambda: idle_ms(client, key) >= 1000)
        stats = ingest(redis_url, store_url, claim_idle=1.0)
        assert stats.claimed == 50 and stats.stored == 50
        assert pending(client, key) == 0
    assert read_store(store_url, "run", "claim").counts["metric"] == 50


def test_a_slow_commit_is_kept_alive_and_not_stolen(redis_url, store_url, tmp_path):
    with redis.Redis.from_url(redis_url) as client:
        key, lock, slow = ingester_behind_lock(
            client,
            redis_url,
            store_url,
            "slow",
            15,
            "--consumer",
            "slow",
            "--claim-idle",
            "1",
            "--batch-size",
            "5",
        )
        # All read (no new entry for the other worker): a batch waiting for the store, the next
        # waiting for it, and the one read ahead after.
        wait_pending(client, key, 15)
    group = store_group(store_url)  # the slow worker's: another store's group would claim nothing

    async def watch_other_worker() -> int:
        other = Worker(
            WorkerSettings(
                redis_url=redis_url,
                store_url=f"sqlite:///{tmp_path / 'other.db'}",
                group=group,
                claim_idle=1.0,
                handle_signals=False,
                consumer="other",
            )
        )
        task = asyncio.create_task(other.async_run())
        await asyncio.sleep(3.5)  # more than three claim-idle periods while the commit waits
        lock.rollback()
        lock.close()
        other.request_stop()
        await task
        return other.stats.claimed

    assert asyncio.run(watch_other_worker()) == 0
    try:
        wait_for("all 15 stored", lambda: read_store(store_url, "run", "slow").counts["metric"] >= 15, 20)
    except AssertionError:
        slow.kill()
        raise AssertionError(slow.communicate()[1]) from None
    slow.send_signal(signal.SIGTERM)
    _, err = slow.communicate(timeout=30)
    assert slow.returncode == 0 and " 0 claimed" in err and "15 stored" in err


def test_sigterm_drains_within_the_timeout_and_leaves_the_rest_pending(redis_url, store_url):
    with redis.Redis.from_url(redis_url) as client:
        key, lock, worker = ingester_behind_lock(
            client, redis_url, store_url, "drain", 10, "--consumer", "draining", "--drain-timeout", "1"
        )
        wait_pending(client, key, 10)
        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
        assert worker.returncode == 0 and "stopping" in err
        assert time.monotonic() - started < 10
        # It could not commit, so it acknowledged nothing: the entries wait for another worker.
        assert pending(client, key) == 10
        lock.rollback()
        lock.close()
    assert ingest(redis_url, store_url, claim_idle=0.0).stored == 10


def test_sigterm_commits_the_batch_read_ahead_too(redis_url, store_url):
    with redis.Redis.from_url(redis_url) as client:
        key, lock, worker = ingester_behind_lock(
            client, redis_url, store_url, "ahead", 50, "--consumer", "ahead", "--batch-size", "10"
        )
        # The first batch waits for the lock; the next has been read meanwhile.
        wait_pending(client, key, 20)
        worker.send_signal(signal.SIGTERM)
        lock.rollback()
        lock.close()
        _, err = worker.communicate(timeout=30)
        assert worker.returncode == 0, err
        stored = int(re.search(r"(\d+) stored", err).group(1))
        assert stored >= 20
        assert pending(client, key) == 0  # all acknowledged: the stop leaves nothing to redeliver
    assert ingest(redis_url, store_url).stored == 50 - stored


def test_redis_killed_and_restarted_during_a_run_loses_nothing(local_redis, store_url):
    ranks, count = 3, 4000
    procs = [start_producer(local_redis.url, "redis-kill", r, count, PACE="0.0005") for r in range(ranks)]
    for proc in procs:
        assert proc.stdout.readline() == "ready\n"
    keys = [wire.stream_key("redis-kill", f"rank{r}") for r in range(ranks)]
    with redis.Redis.from_url(local_redis.url) as client:
        wait_for("every rank shipping", lambda: all(client.xlen(key) > 200 for key in keys))
    local_redis.kill()
    time.sleep(1.5)  # the outage: the ranks log on meanwhile
    local_redis.start()
    results = finish_producers(procs)
    assert all(r["complete"] and r["dropped"] == 0 for r in results)
    ingest(local_redis.url, store_url)
    assert_every_event_once(store_url, "redis-kill", ranks, count)
    longest = max(r["longest_log_s"] for r in results)
    stall_ms = longest * 1e3
    print(f"\nFIGURE redis SIGKILL+restart: events {ranks * count}, lost 0, longest log() {stall_ms:.2f} ms")


def log_while_down(local_redis, run_id: str, count: int, **options):
    local_redis.kill()
    run = runbus.init(
        run_id=run_id,
        label="rank0",
        redis_url=local_redis.url,
        system_interval=None,
        hardware=False,
        max_backoff=0.2,
        max_buffer_bytes=30_000,
        **options,
    )
    for step in range(count):
        run.log({"loss": float(step)}, step=step)
    wait_for("the queue encoded", lambda: not run._outbox, 10)
    local_redis.start()
    return run


def test_an_outage_longer_than_memory_is_spooled_to_disk(local_redis, store_url, tmp_path):
    run = log_while_down(local_redis, "spooled", 3000, spool_dir=str(tmp_path / "spool"))
    assert run.dropped == 0
    assert run.finish(timeout=30)
    assert list((tmp_path / "spool").iterdir()) == []  # shipped, then removed
    ingest(local_redis.url, store_url)
    stored = read_store(store_url, "run", "spooled")
    assert (stored.counts["metric"], stored.labels[0].missing) == (3000, 0)


def test_without_a_spool_drops_are_counted_and_explained(local_redis, store_url):
    run = log_while_down(local_redis, "dropping", 3000, spool_dir=False)
    dropped = run.dropped
    assert dropped > 0
    assert run.finish(timeout=30) is False  # shipped what was kept, but not everything
    ingest(local_redis.url, store_url)
    label = read_store(store_url, "run", "dropping").labels[0]
    assert label.missing == dropped
    assert sum(gap.dropped for gap in label.gaps) == dropped  # every missing seq is explained
    shown = json.loads(run_cli("--store", store_url, "show", "dropping", "--json").stdout)
    assert shown["labels"][0]["gaps"] and shown["labels"][0]["gaps"][0]["dropped"] > 0


def test_a_spool_left_by_a_dead_process_is_shipped_by_the_next_init(local_redis, store_url, tmp_path):
    spool = tmp_path / "spool"
    local_redis.kill()
    code = textwrap.dedent(
        f"""
        import os, time, runbus
        run = runbus.init(
            run_id="orphan", label="rank0", redis_url={local_redis.url!r}, system_interval=None,
            hardware=False, max_buffer_bytes=10_000, spool_dir={str(spool)!r}, finish_timeout=1,
        )
        for step in range(500):
            run.log({{"loss": float(step)}}, step=step)
        run.finish()  # Redis is down: gives up after 1 s and leaves the rest in the spool
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert len(list(spool.iterdir())) == 1
    local_redis.start()
    with runbus.init(
        run_id="orphan",
        label="rank0",
        redis_url=local_redis.url,
        system_interval=None,
        hardware=False,
        spool_dir=str(spool),
    ) as later:
        later.log({"after": 1.0})
    assert list(spool.iterdir()) == []
    ingest(local_redis.url, store_url)
    stored = read_store(store_url, "run", "orphan")
    assert stored.counts["metric"] == 501 and stored.labels[0].missing == 0
    # The dead process's events get an epoch of their own, ordered before the later process's:
    # the label's state is the later process's.
    assert stored.labels[0].epoch == later.epoch
    epochs = {p.key: p.epoch for p in read_store(store_url, "metrics", "orphan")}
    assert epochs["loss"] < epochs["after"] == later.epoch


def test_a_killed_rank_and_its_run_become_crashed(redis_url, store_url):
    primary = start_producer(redis_url, "crash", 0, 10, HANG="1", HEARTBEAT="0.2")
    worker = start_producer(redis_url, "crash", 1, 10, HANG="1", HEARTBEAT="0.2")

    async def scenario():
        w = Worker(
            WorkerSettings(
                redis_url=redis_url,
                store_url=store_url,
                crash_after=1.5,
                maintenance_interval=0.3,
                handle_signals=False,
            )
        )
        task = asyncio.create_task(w.async_run())

        async def stored(state: str, labels: int):
            try:
                run = await w.store.run("crash")
            except StoreUnavailable:  # not connected by the worker yet
                return None
            return run if run is not None and run.state == state and len(run.labels) == labels else None

        await wait_for_async("both ranks stored, running", lambda: stored("running", 2), 20)
        primary.send_signal(signal.SIGKILL)
        run = await wait_for_async("the run marked crashed", lambda: stored("crashed", 2), 20)
        w.request_stop()
        await task
        return run

    try:  # both hang until killed: never leave them behind, whatever fails
        for proc in (primary, worker):
            assert proc.stdout.readline() == "ready\n"
        run = asyncio.run(scenario())
    finally:
        for proc in (primary, worker):
            proc.kill()
            proc.communicate(timeout=30)
    states = {lab.label: lab.state for lab in run.labels}
    assert states == {"rank0": "crashed", "rank1": "running"}  # rank1 kept its heartbeats


def test_poison_entries_are_dead_lettered_after_max_deliveries_and_can_be_replayed(redis_url, store_url):
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "poison", "rank0", "start", 1, 1, {"primary": True})
        ingest(redis_url, store_url)
        key = wire.stream_key("poison", "rank0")
        xadd_event(client, "poison", "rank0", "metric", 1, 2, {"x": 1.0}, step=0)
        for _ in range(6):  # a consumer that keeps failing on it
            client.xreadgroup(store_group(store_url), "crashy", {key: "0" if _ else ">"})
        stats = ingest(redis_url, store_url, claim_idle=0.0, max_deliveries=5)
        assert stats.dead_lettered == 1 and stats.poison == 1
        dead = json.loads(run_cli("dead", "--json", "--redis", redis_url).stdout)
        assert (
            len(dead) == 1 and "over --max-deliveries 5" in dead[0]["reason"] and dead[0]["deliveries"] == 7
        )
        assert dead[0]["fields"]["kind"] == "metric"
        assert "replayed 1" in run_cli("dead", "--replay", "--redis", redis_url).stdout
        assert client.xlen(wire.DEAD_LETTER_KEY) == 0
    ingest(redis_url, store_url)
    assert read_store(store_url, "run", "poison").counts["metric"] == 1


def test_retention_trims_only_what_is_stored(redis_url, store_url):
    with redis.Redis.from_url(redis_url) as client:
        key = wire.stream_key("trim", "rank0")
        for seq in range(1, 1001):
            xadd_event(client, "trim", "rank0", "metric", 1, seq, {"x": 1.0}, step=seq)
        ingest(redis_url, store_url, retain=3600)
        assert client.xlen(key) == 1000  # younger than the retention: kept
        for seq in range(1001, 1301):
            xadd_event(client, "trim", "rank0", "metric", 1, seq, {"x": 1.0}, step=seq)
        # Someone else's reads stay pending: trimming must stop before them.
        pending = client.xreadgroup(store_group(store_url), "elsewhere", {key: ">"}, count=50)[0][1]
        stats = ingest(redis_url, store_url, retain=0.0)
        assert stats.trimmed > 0
        first_left = client.xrange(key, count=1)[0][0]
        assert first_left <= pending[0][0]
        assert 250 <= client.xlen(key) < 1300
    assert read_store(store_url, "run", "trim").counts["metric"] == 1250


def test_a_forked_child_does_not_share_the_parent_run(redis_url, store_url):
    run = runbus.init(run_id="fork", label="rank0", redis_url=redis_url, system_interval=None, hardware=False)
    run.log({"parent": 1.0})
    pid = os.fork()
    if pid == 0:  # the child: the parent's run is a no-op here; its own label works
        code = 0
        try:
            run.log({"child_via_parent": 1.0})
            assert run.finish() is False
            with runbus.init(
                run_id="fork",
                label="worker0",
                redis_url=redis_url,
                primary=False,
                system_interval=None,
                hardware=False,
            ) as own:
                own.log({"child": 1.0})
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    run.log({"parent": 2.0})
    assert run.finish()
    ingest(redis_url, store_url)
    keys = {(p.label, p.key) for p in read_store(store_url, "metrics", "fork")}
    assert keys == {("rank0", "parent"), ("worker0", "child")}
    assert read_store(store_url, "run", "fork").labels[0].missing == 0
