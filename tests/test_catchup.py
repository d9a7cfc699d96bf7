"""Reads that store a run's events left waiting in Redis with no ingester running (query/catchup.py).

A script logs and exits with no ingester; `runbus show`, `metrics` and runbus.Api.run() then show
the run complete, on SQLite and PostgreSQL, with one line on stderr: stored once, acknowledged in
the store's own group (a worker started afterwards finds nothing to write), that run's streams
only. RUNBUS_CATCH_UP=0 and --no-catch-up leave them waiting and say what to run; a group
consumer busy with them (a running ingester) is left to its work.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

import runbus
from runbus import wire
from runbus.errors import StoreMissing
from runbus.query import catchup
from tests.helpers import QUIET, ingest_command, read_store, run_cli, store_group, wait_for
from tests.rank_processes import start_ranks

BUSY = catchup.Backlog("none", 0, 0)
RANKS = 2
STEPS = 40
# One rank of a job, as its own process: RANK and WORLD_SIZE as torchrun sets them.
RANK_SCRIPT = f"""
import runbus
with runbus.init(system_interval=None, hardware=False, console="off", config={{"lr": 0.1}}) as run:
    for step in range({STEPS}):
        run.log({{"loss": 1.0 / (step + 1)}}, step=step)
    run.log_text("done")
"""


def run_job(redis_url: str, run_id: str, ranks: int = RANKS) -> None:
    """The job's ranks, each a process that logs and exits; no ingester runs."""
    env = {"RUNBUS_RUN_ID": run_id, "RUNBUS_REDIS_URL": redis_url, "RUNBUS_QUIET": "1"}
    processes = start_ranks(RANK_SCRIPT, ranks, env, output=None)
    assert [p.wait(timeout=120) for p in processes] == [0] * ranks


def show_command(store_url: str, redis_url: str, run_id: str, *args: str) -> list[str]:
    """The argv of `runbus show RUN_ID ARGS` against this store and Redis, as its own process."""
    return [sys.executable, "-m", "runbus", "--store", store_url, "--redis", redis_url, "show", run_id, *args]


def unacknowledged(redis_url: str, run_id: str, group: str) -> int:
    """Entries of the run's streams that `group` has not acknowledged (pending, or never read)."""
    found = catchup.backlog(redis_url, run_id, group)
    assert found is not None
    return found.entries


def test_a_job_with_no_ingester_is_shown_complete(any_store_url: str, redis_url: str):
    run_job(redis_url, "job-a")
    run_job(redis_url, "job-b", ranks=1)
    shown = run_cli("--store", any_store_url, "--redis", redis_url, "show", "job-a", "--json")
    run = json.loads(shown.stdout)
    assert run["state"] == "finished" and sorted(lab["label"] for lab in run["labels"]) == ["rank0", "rank1"]
    assert all(lab["missing"] == 0 for lab in run["labels"]), run["labels"]
    # One line on stderr, nothing on stdout but the JSON.
    assert shown.stderr.count("\n") == 1 and "entries of run job-a that waited in Redis" in shown.stderr
    points = json.loads(
        run_cli("--store", any_store_url, "--redis", redis_url, "metrics", "job-a", "--json").stdout
    )
    for rank in ("rank0", "rank1"):
        assert [p["step"] for p in points if p["label"] == rank] == list(range(STEPS))
    # Acknowledged in the store's own group: nothing waits, the next read stores nothing and says
    # nothing, and a worker started now writes nothing twice.
    group = store_group(any_store_url)
    assert unacknowledged(redis_url, "job-a", group) == 0
    again = run_cli("--store", any_store_url, "--redis", redis_url, "show", "job-a")
    assert again.stderr == ""
    # Only that run: job-b still waits, unknown to the store.
    assert read_store(any_store_url, "run", "job-b") is None
    assert unacknowledged(redis_url, "job-b", group) > 0
    later = subprocess.run(
        ingest_command(redis_url, any_store_url, "--burst"),  # logs at INFO
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    stopped = next(line for line in later.stderr.splitlines() if "stopped after" in line)
    assert " 0 duplicates" in stopped, stopped
    assert read_store(any_store_url, "run", "job-b").state == "finished"


def test_a_store_not_there_yet_is_made_by_the_first_read(tmp_path: Path, redis_url: str, monkeypatch):
    run_job(redis_url, "job-new", ranks=1)
    url = f"sqlite:///{tmp_path / 'fresh' / 'runbus.db'}"
    (tmp_path / "fresh").mkdir()
    logs = run_cli("--store", url, "--redis", redis_url, "logs", "job-new")
    assert "done" in logs.stdout and "waited in Redis" in logs.stderr
    # runbus.Api of a store not there yet: run() makes it too.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    monkeypatch.setenv("RUNBUS_REDIS_URL", redis_url)
    with runbus.Api(other) as api:
        with pytest.raises(StoreMissing):
            api.runs()
        assert not (tmp_path / "other.db").exists()
        run = api.run("job-new")
        assert run.state == "finished" and list(run.history().step) == list(range(STEPS))
        assert list(api.runs().run_id) == ["job-new"]


def test_catching_up_can_be_turned_off(any_store_url: str, redis_url: str, monkeypatch):
    run_job(redis_url, "job-off", ranks=1)
    store_group(any_store_url)  # the store made, as an ingester that ran before leaves it
    off = run_cli(
        "--store", any_store_url, "--redis", redis_url, "show", "job-off", "--no-catch-up", check=False
    )
    assert off.returncode == 1 and off.stderr.count("\n") == 1
    assert "unknown run 'job-off'" in off.stderr and "its events wait in Redis" in off.stderr
    assert "`runbus ingest --burst --run job-off`" in off.stderr
    env = {"RUNBUS_CATCH_UP": "0"}
    metrics = run_cli(
        "--store", any_store_url, "--redis", redis_url, "metrics", "job-off", env=env, check=False
    )
    assert metrics.returncode == 1 and "`runbus ingest --burst --run job-off`" in metrics.stderr
    bad = run_cli(
        "--store",
        any_store_url,
        "--redis",
        redis_url,
        "show",
        "job-off",
        env={"RUNBUS_CATCH_UP": "maybe"},
        check=False,
    )
    assert bad.returncode == 1 and "RUNBUS_CATCH_UP='maybe'" in bad.stderr
    monkeypatch.setenv("RUNBUS_REDIS_URL", redis_url)
    monkeypatch.setenv("RUNBUS_CATCH_UP", "off")
    with runbus.Api(any_store_url) as api, pytest.raises(runbus.RunNotFound, match="--run job-off"):
        api.run("job-off")
    assert read_store(any_store_url, "run", "job-off") is None
    # What stores them, as said.
    run_cli("--store", any_store_url, "ingest", "--redis", redis_url, "--burst", "--run", "job-off")
    assert read_store(any_store_url, "run", "job-off").state == "finished"


def test_a_run_the_store_has_but_not_ended_gets_its_tail(store_url: str, redis_url: str):
    run = runbus.init(run_id="job-tail", label="rank0", redis_url=redis_url, **QUIET)
    run.log({"loss": 1.0}, step=0)
    with redis.Redis.from_url(redis_url) as client:
        key = wire.stream_key("job-tail", "rank0")
        wait_for("the start and the first metric in Redis", lambda: client.xlen(key) >= 2)
    run_cli("--store", store_url, "ingest", "--redis", redis_url, "--burst")
    assert read_store(store_url, "run", "job-tail").state == "running"
    # The ingester stopped; the job goes on and ends.
    for step in range(1, 30):
        run.log({"loss": 1.0 / step}, step=step)
    run.finish()
    shown = json.loads(
        run_cli("--store", store_url, "--redis", redis_url, "show", "job-tail", "--json").stdout
    )
    assert shown["state"] == "finished" and shown["counts"]["metric"] == 30


def test_a_busy_ingester_is_left_to_its_work(store_url: str, redis_url: str):
    with runbus.init(run_id="job-busy", label="rank0", redis_url=redis_url, **QUIET) as run:
        run.log({"loss": 1.0}, step=0)
    group = store_group(store_url)
    key = wire.stream_key("job-busy", "rank0")
    done = threading.Event()

    def busy_worker() -> None:
        # A worker of the store's group, handed the entries and writing them all along: each
        # read of its own pending ones shows Redis it is there.
        with redis.Redis.from_url(redis_url) as client:
            client.xgroup_create(key, group, id="0")
            assert client.xreadgroup(group, "busy-worker", {key: ">"}, count=1000)
            while not done.wait(0.5):
                client.xreadgroup(group, "busy-worker", {key: "0"}, count=1000)

    worker = threading.Thread(target=busy_worker)
    worker.start()
    try:
        wait_for("the busy worker", lambda: (catchup.backlog(redis_url, "job-busy", group) or BUSY).live)
        busy = run_cli("--store", store_url, "--redis", redis_url, "show", "job-busy", check=False)
    finally:
        done.set()
        worker.join()
    assert busy.returncode == 1 and busy.stderr.count("\n") == 1
    assert "an ingester (consumer busy-worker) is storing them" in busy.stderr
    assert read_store(store_url, "run", "job-busy") is None
    with redis.Redis.from_url(redis_url) as client:
        assert [c["name"] for c in client.xinfo_consumers(key, group)] == [b"busy-worker"]


def test_reads_and_an_ingester_at_once_store_the_run_once(store_url: str, redis_url: str):
    run_job(redis_url, "job-race")
    store_group(store_url)
    show = show_command(store_url, redis_url, "job-race", "--json")
    started = [
        subprocess.Popen(show, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    started.append(
        subprocess.Popen(ingest_command(redis_url, store_url, "--burst"), stderr=subprocess.PIPE, text=True)
    )
    outputs = [p.communicate(timeout=120) for p in started]
    assert [p.returncode for p in started] == [0, 0, 0], outputs
    for out, _ in outputs[:2]:
        assert json.loads(out)["run_id"] == "job-race"
    run = read_store(store_url, "run", "job-race")
    assert run.state == "finished" and run.counts["metric"] == RANKS * STEPS
    assert all(lab.missing == 0 and lab.events == STEPS + 3 for lab in run.labels), run.labels
    assert unacknowledged(redis_url, "job-race", store_group(store_url)) == 0


def test_a_running_run_beside_a_running_ingester_is_read_as_stored(store_url: str, redis_url: str):
    ingester = subprocess.Popen(ingest_command(redis_url, store_url), stderr=subprocess.DEVNULL)
    try:
        with runbus.init(run_id="job-live", label="rank0", redis_url=redis_url, **QUIET) as run:
            run.log({"loss": 1.0}, step=0)
            wait_for("the run stored", lambda: read_store(store_url, "run", "job-live"))
            show = show_command(store_url, redis_url, "job-live")
            reading = subprocess.Popen(show, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for step in itertools.count(1):  # the job logs all along: the ingester is never idle
                with contextlib.suppress(subprocess.TimeoutExpired):
                    reading.wait(timeout=0.02)
                    break
                run.log({"loss": 1.0 / step}, step=step)
            out, err = reading.communicate()
        assert reading.returncode == 0 and err == "", err
        assert "state    running" in out
        wait_for("the run finished", lambda: read_store(store_url, "run", "job-live").state == "finished")
    finally:
        ingester.terminate()
        assert ingester.wait(timeout=60) == 0
