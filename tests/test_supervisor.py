"""`runbus ingest --workers N` against real processes: a SIGKILLed worker is restarted, SIGTERM
drains them all, and on SQLite as on PostgreSQL every event is stored exactly once."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import threading
import time
import urllib.request
from collections import Counter

import pytest
import redis

from runbus import wire
from runbus.ingester.localredis import free_port
from runbus.ingester.supervisor import Supervisor, SupervisorSettings
from runbus.ingester.worker import WorkerSettings, stream_share
from tests.helpers import ingest, ingest_command, read_store, run_cli, wait_for, xadd_event
from tests.test_faults import assert_every_event_once, finish_producers, start_producer


@pytest.fixture(params=["sqlite", "postgres"])
def any_store(request) -> str:
    return request.getfixturevalue("store_url" if request.param == "sqlite" else "postgres_url")


def free_ports(count: int) -> int:
    """A port P such that P … P+count-1 are all free on loopback right now."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


def healthz(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return json.loads(response.read())
    except OSError:
        return None


def groups(client: redis.Redis, key: bytes) -> list[dict]:
    """The consumer groups of stream `key`: none while it is registered and not yet written."""
    try:
        return client.xinfo_groups(key)
    except redis.ResponseError:  # no such key yet
        return []


def held_by(client: redis.Redis, key: bytes, group: bytes, consumer: str) -> bool:
    """Whether `consumer` of `group` has entries of `key` read and not yet acknowledged."""
    consumers = client.xpending(key, group)["consumers"]
    return any(c["name"].decode() == consumer and c["pending"] for c in consumers)


def holding_entries(redis_url: str, consumer: str, timeout: float) -> bool:
    """Wait (at most `timeout`) until `consumer` has entries read and not yet acknowledged."""
    deadline = time.monotonic() + timeout
    with redis.Redis.from_url(redis_url) as client:
        while time.monotonic() < deadline:
            for key in client.smembers(wire.REGISTRY_KEY):
                if any(held_by(client, key, group["name"], consumer) for group in groups(client, key)):
                    return True
            time.sleep(0.002)
    return False


def test_three_workers_one_sigkilled_store_every_event_once(redis_url, any_store, tmp_path):
    ranks, count, workers = 4, 3000, 3
    base = free_ports(workers)
    log_path = tmp_path / "supervisor.log"
    with (
        open(log_path, "w") as log_file,
        subprocess.Popen(
            ingest_command(
                redis_url,
                any_store,
                "--workers",
                str(workers),
                "--consumer",
                "sup",
                "--claim-idle",
                "2",
                "--http",
                f"127.0.0.1:{base}",
            ),
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        ) as supervisor,
    ):
        try:
            pids = [wait_for(f"worker {i}", lambda p=base + i: healthz(p), 60)["pid"] for i in range(workers)]
            assert [healthz(base + i)["consumer"] for i in range(workers)] == ["sup-0", "sup-1", "sup-2"]
            producers = [start_producer(redis_url, "scaled", r, count, PACE="0.0005") for r in range(ranks)]
            for proc in producers:
                assert proc.stdout.readline() == "ready\n"
            victim = pids[1]
            holding_entries(redis_url, "sup-1", timeout=3.0)  # best effort: kill it mid-batch
            os.kill(victim, signal.SIGKILL)
            restarted = wait_for(
                "the restarted worker", lambda: (h := healthz(base + 1)) and h["pid"] != victim and h, 60
            )
            assert restarted["consumer"] == "sup-1"
            finish_producers(producers)
            supervisor.send_signal(signal.SIGTERM)
            assert supervisor.wait(timeout=60) == 0
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
    log = log_path.read_text()
    assert "worker sup-1 exited with signal SIGKILL; restarting it" in log, log
    assert "supervisor stopped: 1 restarts; last exit codes [0, 0, 0]" in log, log
    stats = ingest(redis_url, any_store, claim_idle=0.0)  # whatever a drained worker left unread
    assert stats.dead_lettered == 0
    assert_every_event_once(any_store, "scaled", ranks, count)


def test_a_worker_that_keeps_failing_is_restarted_with_growing_delays(redis_url, tmp_path):
    # The store URL's scheme is unknown: every life of the worker ends with exit code 1.
    worker = WorkerSettings(redis_url=redis_url, store_url="nosuch:///x", consumer="failing")
    settings = SupervisorSettings(workers=1, restart_delay=0.1, max_restart_delay=0.5, handle_signals=False)
    supervisor = Supervisor(worker, settings)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(supervisor.run()))
    thread.start()
    try:
        wait_for("four restarts", lambda: supervisor.slots[0].restarts >= 4, 60)
    finally:
        supervisor.request_stop()
        thread.join(timeout=60)
    slot = supervisor.slots[0]
    assert slot.settings.consumer == "failing-0"
    assert slot.exit_codes[:4] == [1, 1, 1, 1]
    # At most 0.1, 0.2, 0.4, then capped at 0.5; at least half of that (jitter).
    assert slot.failures >= 4
    bound = min(0.5, 0.1 * 2 ** (slot.failures - 1))
    assert bound / 2 <= slot.delay <= bound
    # Stopped while waiting to restart, the last life failed: 1. Stopped while a life was
    # starting, that one got SIGTERM: 0.
    assert codes == [1 if slot.exit_codes[-1] == 1 else 0]
    assert slot.exit_codes[-1] in (1, -signal.SIGTERM)


def test_burst_workers_exit_zero_when_everything_is_stored(redis_url, store_url):
    with redis.Redis.from_url(redis_url) as client:
        for rank in range(3):
            xadd_event(client, "burst", f"rank{rank}", "start", 1, 1, {"primary": rank == 0})
            for seq in range(2, 202):
                xadd_event(client, "burst", f"rank{rank}", "metric", 1, seq, {"x": 1.0}, step=seq)
    result = run_cli("--store", store_url, "ingest", "--redis", redis_url, "--workers", "2", "--burst")
    assert "last exit codes [0, 0]" in result.stderr
    assert read_store(store_url, "run", "burst").counts["metric"] == 600


def test_workers_must_be_positive(redis_url, store_url):
    result = run_cli("--store", store_url, "ingest", "--redis", redis_url, "--workers", "0", check=False)
    assert result.returncode == 1 and "--workers must be at least 1" in result.stderr


def test_each_supervised_worker_has_a_share_of_the_streams(redis_url, store_url):
    worker = WorkerSettings(redis_url=redis_url, store_url=store_url, consumer="w")
    slots = Supervisor(worker, SupervisorSettings(workers=3)).slots
    assert [slot.settings.share for slot in slots] == [(0, 3), (1, 3), (2, 3)]
    assert Supervisor(worker, SupervisorSettings(workers=1)).slots[0].settings.share is None
    keys = [wire.stream_key("run", f"rank{n}") for n in range(64)]
    shares = Counter(stream_share(key, 3) for key in keys)
    assert set(shares) == {0, 1, 2} and min(shares.values()) >= 10  # a hash: roughly even
    assert all(stream_share(key, 3) == stream_share(key, 3) for key in keys)


def test_a_worker_reads_its_share_first_and_the_rest_when_its_own_have_nothing(redis_url, tmp_path):
    # Alone, with share 0 of 2: the other share's streams (no worker of their own here) are all
    # stored too, but only once its own have nothing new, so its own labels were written first.
    store_url = f"sqlite:///{tmp_path / 'runbus.db'}"
    labels = [f"rank{n}" for n in range(8)]
    mine = {label for label in labels if stream_share(wire.stream_key("shared", label), 2) == 0}
    assert 0 < len(mine) < len(labels)
    with redis.Redis.from_url(redis_url) as client:
        for label in labels:
            xadd_event(client, "shared", label, "start", 1, 1, {"primary": label == "rank0"})
            for seq in range(2, 42):
                xadd_event(client, "shared", label, "metric", 1, seq, {"x": 1.0}, step=seq)
    ingest(redis_url, store_url, share=(0, 2), batch_size=10)
    assert read_store(store_url, "run", "shared").counts["metric"] == 8 * 40
    with sqlite3.connect(tmp_path / "runbus.db") as db:
        last_write = dict(db.execute("SELECT label, seen_at FROM labels WHERE run_id = 'shared'"))
    assert max(last_write[label] for label in mine) < min(
        last_write[label] for label in labels if label not in mine
    )
