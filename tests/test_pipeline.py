"""End to end: several real rank processes log into one run; the stored run is checked."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

from runbus.storage import sqlite as sqlite_backend
from tests.helpers import ingest, ingest_command, read_store, run_cli, wait_for

RANK = textwrap.dedent(
    """
    import os, runbus
    steps = int(os.environ["STEPS"])
    run = runbus.init(config={"lr": 0.1, "rank_seen": os.environ["RANK"]}, system_interval=None)
    rank = run.identity.rank
    for step in range(steps):
        run.log({"loss": 1.0 / (step + 1) + rank, "acc": step / steps}, step=step)
        if step % 10 == 0:
            run.log_text(f"rank {rank} at step {step}")
    exit_code = int(os.environ.get("EXIT_CODE", "0"))
    assert run.finish(exit_code=exit_code), "finish did not ship everything"
    """
)


def store_opened(store_url: str) -> bool:
    """Whether a worker has created and migrated the SQLite store at `store_url` (read behind
    its back, never creating it)."""
    path = store_url.removeprefix("sqlite:///")
    if not os.path.exists(path):
        return False
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return con.execute("PRAGMA user_version").fetchone()[0] >= len(sqlite_backend.MIGRATIONS)
        finally:
            con.close()
    except sqlite3.Error:  # being created: not yet
        return False


def start_ranks(
    redis_url: str, run_id: str, world: int, steps: int, exit_codes: dict[int, int] | None = None
):
    env = {
        **os.environ,
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": run_id,
        "WORLD_SIZE": str(world),
        "STEPS": str(steps),
    }
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "EXIT_CODE": str((exit_codes or {}).get(rank, 0)),
            },
        )
        for rank in range(world)
    ]


def check_run(store_url: str, run_id: str, world: int, steps: int) -> None:
    run = read_store(store_url, "run", run_id)
    assert run.state == "finished" and run.primary == "rank0" and run.exit_code == 0
    assert run.counts == {"metric": world * steps, "log": world * ((steps + 9) // 10), "system": 0}
    assert [lab.label for lab in run.labels] == [f"rank{r}" for r in range(world)]
    logs_per_rank = (steps + 9) // 10
    for lab in run.labels:
        assert lab.state == "finished" and lab.missing == 0
        # start + metrics + logs + finish, numbered without gaps
        assert lab.events == lab.last_seq == 1 + steps + logs_per_rank + 1
        assert lab.primary == (lab.label == "rank0")
    assert run.config == {"lr": 0.1, "rank_seen": "0"}
    points = read_store(store_url, "metrics", run_id, key="loss")
    assert len(points) == world * steps
    for rank in range(world):
        mine = [p for p in points if p.label == f"rank{rank}"]
        assert [p.step for p in mine] == list(range(steps))
        assert {p.epoch for p in mine} == {run.labels[rank].epoch}  # one process, one epoch
        assert [p.value for p in mine] == [1.0 / (s + 1) + rank for s in range(steps)]


def test_ranks_log_into_one_run_then_burst_ingest(redis_url, store_url):
    world, steps = 4, 200
    ranks = start_ranks(redis_url, "e2e-burst", world, steps)
    assert [p.wait(60) for p in ranks] == [0] * world
    stats = ingest(redis_url, store_url)
    assert stats.dead_lettered == 0 and stats.duplicates == 0
    check_run(store_url, "e2e-burst", world, steps)
    # A second pass finds nothing new: every entry was acknowledged.
    assert ingest(redis_url, store_url).entries == 0


def test_ranks_log_while_an_ingester_runs(redis_url, store_url):
    world, steps = 4, 300
    worker = subprocess.Popen(
        ingest_command(redis_url, store_url),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Its SIGTERM handler is in place once it has opened the store: a stop sent while the
        # interpreter still imports would end it as the default action does, with -15.
        wait_for("the worker to open its store", lambda: store_opened(store_url) or worker.poll() is not None)
        ranks = start_ranks(redis_url, "e2e-live", world, steps)
        assert [p.wait(60) for p in ranks] == [0] * world
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    assert "stopped after" in err
    ingest(redis_url, store_url)  # whatever came after the live worker's last read
    check_run(store_url, "e2e-live", world, steps)


def test_workers_failing_do_not_end_the_run_but_the_primary_does(redis_url, store_url):
    ranks = start_ranks(redis_url, "e2e-fail", 3, 5, exit_codes={2: 7})
    assert [p.wait(60) for p in ranks] == [0, 0, 0]
    ingest(redis_url, store_url)
    shown = run_cli("--store", store_url, "show", "e2e-fail", "--json")
    doc = json.loads(shown.stdout)
    assert doc["state"] == "finished" and doc["exit_code"] == 0
    states = {lab["label"]: (lab["state"], lab["primary"]) for lab in doc["labels"]}
    assert states == {"rank0": ("finished", True), "rank1": ("finished", False), "rank2": ("failed", False)}
