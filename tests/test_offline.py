"""Offline runs: ranks that never reach Redis exit promptly, their events in spool files, and
`runbus sync` brings them into the store, in order, exactly once, however often it runs, and
after being killed midway."""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import runbus
from runbus import wire
from runbus.ingester.localredis import free_port
from runbus.progress import Progress
from tests.helpers import QUIET, ingest, read_store, run_cli, stderr_on_a_terminal, wait_for

RUN = "offline-job"
# One rank of a job: logs `steps` losses (rank * 1e6 + step), a summary, and finishes; prints
# how long finish() took, what it returned and its epoch.
RANK = """
import json, os, sys, time, runbus
steps, buffer_bytes = int(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ["RANK"])
run = runbus.init(
    system_interval=None, hardware=False, git=False, console="off", max_buffer_bytes=buffer_bytes
)
for step in range(steps):
    run.log({"loss": float(rank * 1_000_000 + step)}, step=step)
run.summary["final"] = float(rank)
began = time.monotonic()
complete = run.finish(exit_code=int(os.environ.get("EXIT_CODE", "0")))
print(json.dumps({"finish_s": time.monotonic() - began, "complete": complete, "epoch": run.epoch}))
"""


def offline_ranks(spool: Path, ranks: int, steps: int, buffer_bytes: dict[int, int] | None = None):
    """Run `ranks` rank processes against a Redis port where nothing listens: each one's
    (result, stderr)."""
    absent = f"redis://127.0.0.1:{free_port()}/0"
    env = {
        **os.environ,
        "RUNBUS_RUN_ID": RUN,
        "RUNBUS_REDIS_URL": absent,
        "RUNBUS_SPOOL_DIR": str(spool),
        "WORLD_SIZE": str(ranks),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(steps), str((buffer_bytes or {}).get(rank, 128 << 20))],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outcomes.append((json.loads(out.splitlines()[-1]), err))
    return outcomes


def sync(redis_url: str, spool: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_cli("sync", "--redis", redis_url, "--spool-dir", str(spool), *args, check=check)


def assert_stored_once_in_order(store_url: str, ranks: int, steps: int) -> None:
    run = read_store(store_url, "run", RUN)
    assert (run.state, run.primary, run.exit_code, run.label_count) == ("finished", "rank0", 0, ranks)
    assert run.counts["metric"] == ranks * steps
    for rank in range(ranks):
        label = f"rank{rank}"
        points = read_store(store_url, "metrics", RUN, key="loss", label=label)
        assert [p.value for p in points] == [float(rank * 1_000_000 + s) for s in range(steps)]
        assert [p.step for p in points] == list(range(steps))
        assert len({p.epoch for p in points}) == 1  # one process, one epoch
        assert [p.seq for p in points] == sorted({p.seq for p in points})  # in order, once each
    assert all(label.missing == 0 and label.state == "finished" for label in run.labels)


def test_ranks_without_redis_exit_promptly_and_sync_stores_every_event_once(redis_url, store_url, tmp_path):
    spool = tmp_path / "spool"
    ranks, steps = 3, 3000
    # rank1's memory bound is small: most of its events were spooled while it ran, the rest
    # at its exit.
    outcomes = offline_ranks(spool, ranks, steps, buffer_bytes={1: 20_000})
    for result, _ in outcomes:
        assert result["complete"] is False and result["epoch"] is None
        assert result["finish_s"] < 5, result  # not finish_timeout (30 s)
    primary_err = outcomes[0][1]
    # RUNBUS_SPOOL_DIR is the default directory, which the command then needs not name.
    assert f"waits on this machine in {spool} " in primary_err
    assert primary_err.endswith(f"bring it in with: runbus sync {RUN}\n")
    assert "was not reachable" in primary_err and "and each other rank's in a file of its own" in primary_err
    assert all("runbus sync" not in err for _, err in outcomes[1:])  # the primary speaks for the run
    files = sorted(spool.iterdir())
    assert len(files) == ranks
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}

    first = sync(redis_url, spool)
    assert f"shipped {ranks * (steps + 3):,} events of {ranks} label(s) from {ranks} file(s)" in first.stdout
    assert list(spool.iterdir()) == []
    again = sync(redis_url, spool)  # nothing left to ship: nothing doubled
    assert "shipped 0 events" in again.stdout
    ingest(redis_url, store_url)
    assert_stored_once_in_order(store_url, ranks, steps)
    ingest(redis_url, store_url)  # the next ingest stores nothing twice
    assert_stored_once_in_order(store_url, ranks, steps)


@pytest.mark.parametrize("then", ["sync", "init"])
def test_a_sync_killed_midway_then_shipped_again_stores_each_event_once(redis_url, store_url, tmp_path, then):
    spool = tmp_path / "spool"
    steps = 200_000
    offline_ranks(spool, 1, steps)
    (left,) = spool.iterdir()
    key = wire.stream_key(RUN, "rank0")
    client = redis.Redis.from_url(redis_url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runbus", "sync", "--redis", redis_url, "--spool-dir", str(spool)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for("a first batch in Redis", lambda: client.xlen(key) >= 2000, timeout=60)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert left.exists(), "the sync finished before it could be killed"
    partial = client.xlen(key)
    assert 0 < partial < steps
    assert b'["epoch",' in left.read_bytes()  # the epoch it took, for whoever ships the file next
    if then == "sync":
        sync(redis_url, spool)
        assert "shipped 0 events" in sync(redis_url, spool).stdout
    else:  # the next process of the label ships what the dead one (the killed sync) left
        with runbus.init(run_id=RUN, label="rank0", redis_url=redis_url, spool_dir=str(spool), **QUIET):
            pass
    assert list(spool.iterdir()) == []
    ingest(redis_url, store_url)
    points = read_store(store_url, "metrics", RUN, key="loss", label="rank0")
    assert [p.value for p in points] == [float(s) for s in range(steps)]
    assert len({p.epoch for p in points}) == 1
    assert read_store(store_url, "run", RUN).labels[0].missing == 0
    client.close()


def test_sync_ships_what_it_can_and_says_what_it_cannot(redis_url, store_url, tmp_path):
    spool = tmp_path / "spool"
    offline_ranks(spool, 1, 100)
    (good,) = spool.iterdir()
    lines = good.read_bytes().splitlines(keepends=True)
    # Lines that are no record, in the middle: said, skipped, never fatal.
    odd = [b'{"not": "a record"}\n', b"\x00garbage\n", b"[1, 2]\n"]
    good.write_bytes(b"".join([*lines[:3], *odd, *lines[3:]]))
    junk = spool / "notes.spool"
    junk.write_text("written by hand\n")
    locked = spool / "other-run.rank0.4242.spool"
    locked.write_bytes(b'["spool", "other-run", "rank0"]\n')
    with open(locked, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live process, or another sync
        result = sync(redis_url, spool, check=False)
    assert result.returncode == 1
    assert "3 line(s)" in result.stderr and "were no runbus record" in result.stderr
    assert "notes.spool names no run and label" in result.stderr
    assert "other-run.rank0.4242.spool is in use" in result.stderr
    assert "Traceback" not in result.stderr
    assert "shipped 103 events of 1 label(s) from 1 file(s)" in result.stdout
    assert sorted(p.name for p in spool.iterdir()) == ["notes.spool", "other-run.rank0.4242.spool"]
    ingest(redis_url, store_url)
    points = read_store(store_url, "metrics", RUN, key="loss")
    assert [p.value for p in points] == [float(s) for s in range(100)]


def test_sync_of_one_run_leaves_the_others(redis_url, tmp_path):
    spool = tmp_path / "spool"
    offline_ranks(spool, 1, 10)
    other = spool / "another.rank0.7.spool"
    record = b'["metric", 0, 1, 1700000000.0, null, "{\\"x\\":1}"]\n'
    other.write_bytes(b'["spool", "another", "rank0"]\n' + record)
    result = sync(redis_url, spool, "another")
    assert "shipped 1 events of 1 label(s) from 1 file(s)" in result.stdout
    assert len(list(spool.iterdir())) == 1  # offline-job's, not named


def test_sync_shows_progress_on_a_terminal_and_stays_quiet_in_a_pipe(redis_url, tmp_path):
    spool = tmp_path / "spool"
    offline_ranks(spool, 2, 10)
    drawn = stderr_on_a_terminal(
        [sys.executable, "-m", "runbus", "sync", "--redis", redis_url, "--spool-dir", str(spool)], timeout=120
    )
    assert b"runbus sync: 0/2 files (0%)" in drawn and b"\r\x1b[K" in drawn
    offline_ranks(spool, 2, 10)
    piped = sync(redis_url, spool)
    assert piped.stderr == ""
    assert "shipped 26 events" in piped.stdout


def test_progress_is_drawn_on_a_terminal_only():
    piped = io.StringIO()
    with Progress("sync", total=4, unit="files", stream=piped) as progress:
        progress.advance(note="run/rank0")
    assert piped.getvalue() == ""
    shown = io.StringIO()
    with Progress("sync", total=4, unit="files", stream=shown, show=True) as progress:
        progress.advance(note="run/rank0")
    assert "runbus sync: 1/4 files (25%) run/rank0" in shown.getvalue()
    assert shown.getvalue().endswith("\r\x1b[K")  # erased at the end


def test_runbus_spool_dir_off_means_no_spool(monkeypatch):
    from runbus import config

    monkeypatch.setenv("RUNBUS_SPOOL_DIR", "off")
    assert config.spool_dir() is None
    monkeypatch.delenv("RUNBUS_SPOOL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert config.spool_dir() == "/somewhere/runbus/spool"


def test_sync_leaves_a_label_a_live_process_holds(redis_url, tmp_path):
    spool = tmp_path / "spool"
    offline_ranks(spool, 1, 10)
    client = redis.Redis.from_url(redis_url)
    client.hset(wire.lease_key(RUN, "rank0"), mapping={"token": "live", "host": "elsewhere", "pid": 1})
    held = sync(redis_url, spool, check=False)
    assert held.returncode == 1 and f"{RUN}/rank0 is being logged by a live process now" in held.stderr
    assert len(list(spool.iterdir())) == 1 and not client.exists(wire.stream_key(RUN, "rank0"))
    client.delete(wire.lease_key(RUN, "rank0"))  # it finished
    assert "shipped 13 events" in sync(redis_url, spool).stdout
    client.close()


def test_a_spool_is_shipped_only_as_the_run_and_label_it_names(redis_url, store_url, tmp_path):
    # Run "a", label "b.c" and run "a.b", label "c" both make files named a.b.c.PID.spool.
    spool = tmp_path / "spool"
    code = (
        "import os, runbus\n"
        "run = runbus.init(run_id='a', label='b.c', redis_url=os.environ['ABSENT'], system_interval=None,"
        " hardware=False, git=False, console='off')\n"
        "run.log({'x': 1.0})\n"
        "run.finish()\n"
    )
    absent = f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, "ABSENT": absent, "RUNBUS_SPOOL_DIR": str(spool)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    (left,) = spool.iterdir()
    assert left.name.startswith("a.b.c.")
    with runbus.init(run_id="a.b", label="c", redis_url=redis_url, spool_dir=str(spool), **QUIET):
        pass
    assert list(spool.iterdir()) == [left]  # not a.b/c's to ship
    assert "shipped 3 events of 1 label(s)" in sync(redis_url, spool).stdout
    ingest(redis_url, store_url)
    assert [p.label for p in read_store(store_url, "metrics", "a", key="x")] == ["b.c"]


def test_an_unwritable_spool_directory_loses_the_events_but_never_hangs_or_crashes(tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a directory\n")
    code = (
        "import json, os, sys, time, runbus\n"
        "run = runbus.init(run_id='nowhere', label='rank0', redis_url=os.environ['ABSENT'],"
        " system_interval=None, hardware=False, git=False, console='off')\n"
        "run.log({'x': 1.0})\n"
        "began = time.monotonic()\n"
        "print(json.dumps([run.finish(), time.monotonic() - began]))\n"
    )
    env = {
        **os.environ,
        "ABSENT": f"redis://127.0.0.1:{free_port()}/0",
        "RUNBUS_SPOOL_DIR": str(in_the_way / "spool"),
    }
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    complete, took = json.loads(result.stdout)
    assert complete is False and took < 5
    assert "cannot write the spool" in result.stderr and "Traceback" not in result.stderr
    assert "gave up with 3 events not shipped" in result.stderr


def test_two_syncs_at_once_ship_each_file_once(redis_url, store_url, tmp_path):
    spool = tmp_path / "spool"
    ranks, steps = 2, 100_000
    offline_ranks(spool, ranks, steps)
    command = [sys.executable, "-m", "runbus", "sync", "--redis", redis_url, "--spool-dir", str(spool)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    both = [subprocess.Popen(command, **pipes) for _ in "ab"]
    outputs = [proc.communicate(timeout=300) for proc in both]
    assert all("Traceback" not in err for _, err in outputs)
    shipped = sum(int(out.split("shipped ")[1].split(" events")[0].replace(",", "")) for out, _ in outputs)
    assert shipped == ranks * (steps + 3)  # each file by one of them
    assert list(spool.iterdir()) == []
    ingest(redis_url, store_url)
    assert_stored_once_in_order(store_url, ranks, steps)


def test_sync_of_a_run_ignores_the_files_of_others_even_in_use(redis_url, tmp_path):
    spool = tmp_path / "spool"
    offline_ranks(spool, 1, 10)
    busy = spool / "a.b.c.4242.spool"  # an ambiguous name: its first line says whose it is
    busy.write_bytes(b'["spool", "a.b", "c"]\n')
    with open(busy, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = sync(redis_url, spool, RUN)
    assert result.stderr == ""
    assert "shipped 13 events of 1 label(s) from 1 file(s)" in result.stdout
    assert [p.name for p in spool.iterdir()] == ["a.b.c.4242.spool"]
