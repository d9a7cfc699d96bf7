"""The producer API: names, validation, the primary claim, outages, and how a process ends."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import redis

import runbus
from runbus.ingester.localredis import free_port
from runbus.producer import environment
from tests.helpers import ingest, read_store, run_cli, wait_for


def init(redis_url, run_id, label, **kw):
    kw.setdefault("system_interval", None)
    kw.setdefault("hardware", False)
    return runbus.init(run_id=run_id, label=label, redis_url=redis_url, **kw)


@pytest.mark.parametrize("run_id", ["bad name", "-lead", "x" * 129, "a/b", "", "ünïcode", "{tag}"])
def test_invalid_run_ids_are_refused(redis_url, run_id):
    with pytest.raises(ValueError, match="invalid run id"):
        init(redis_url, run_id, "rank0")


@pytest.mark.parametrize("label", ["rank 0", "rank:0", ".hidden", "x" * 200])
def test_invalid_labels_are_refused(redis_url, label):
    with pytest.raises(ValueError, match="invalid label"):
        init(redis_url, "ok-run", label)


def test_identity_from_torchrun_environment():
    env = {
        "TORCHELASTIC_RUN_ID": "job42",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    ident = environment.resolve(env=env)
    assert (
        ident.run_id,
        ident.label,
        ident.primary,
        ident.world_size,
        ident.local_rank,
        ident.restart_count,
    ) == ("job42", "rank3", False, 8, 1, 2)
    assert environment.resolve(env={**env, "RANK": "0"}).primary is True
    assert environment.resolve(env={**env, "RUNBUS_RUN_ID": "mine"}).run_id == "mine"
    assert environment.resolve(env={"TORCHELASTIC_RUN_ID": "none"}).run_id.startswith("run-")
    with pytest.raises(ValueError, match="no run id"):
        environment.resolve(env={"WORLD_SIZE": "4", "RANK": "1"})
    with pytest.raises(ValueError, match="RANK"):
        environment.resolve(env={"RANK": "zero"})


def test_a_second_live_primary_is_refused(redis_url):
    first = init(redis_url, "prim", "rank0", primary=True)
    try:
        with pytest.raises(runbus.PrimaryConflict, match="rank0"):
            init(redis_url, "prim", "rank1", primary=True)
        worker = init(redis_url, "prim", "rank1", primary=False)
        worker.finish()
    finally:
        assert first.finish()
    # Once the primary has finished, its claim is released; the run is finished, so taking it up
    # again is a resume.
    with pytest.raises(runbus.RunExists, match="resume"):
        init(redis_url, "prim", "rank0", primary=True)
    again = init(redis_url, "prim", "rank0", primary=True, resume="allow")
    assert again.primary
    again.finish()


def test_log_checks_its_arguments(redis_url):
    class Scalar:  # numpy scalars look like this: .item() and ndim 0
        ndim = 0

        def item(self):
            return 2.5

    with init(redis_url, "args", "rank0") as run:
        with pytest.raises(TypeError, match="not a number"):
            run.log({"loss": "low"})
        with pytest.raises(TypeError, match="must be strings"):
            run.log({1: 2.0})
        with pytest.raises(ValueError, match="at least one"):
            run.log({})
        with pytest.raises(TypeError, match="dict"):
            run.log([("loss", 1.0)])
        with pytest.raises(ValueError, match="step must be >= 0"):
            run.log({"loss": 1.0}, step=-1)
        with pytest.raises(TypeError, match="step must be an int"):
            run.log({"loss": 1.0}, step=1.5)
        with pytest.raises(ValueError, match="1 to 256"):
            run.log({"x" * 300: 1.0})
        with pytest.raises(ValueError, match="stream must be"):
            run.log_text("hi", stream="tty")
        run.log({"np": Scalar(), "flag": True, "nan": float("nan")}, step=0)
    with pytest.raises(runbus.RunFinished):
        run.log({"loss": 1.0})
    assert run.finish() is True  # idempotent


def test_values_round_trip_through_the_pipeline(redis_url, store_url):
    with init(redis_url, "vals", "rank0") as run:
        run.log(
            {
                "nan": float("nan"),
                "inf": float("inf"),
                "ninf": -float("inf"),
                "flag": True,
                "big": 2**63 - 1,
                "small": -(2**63),
                "huge": float(2**70),
            },
            step=1,
        )
        run.log_text("a warning", level="WARNING")
        logging.getLogger("tests.train").addHandler(handler := run.logging_handler())
        try:
            logging.getLogger("tests.train").error("from logging")
        finally:
            logging.getLogger("tests.train").removeHandler(handler)
    ingest(redis_url, store_url)
    values = {p.key: p.value for p in read_store(store_url, "metrics", "vals")}
    assert (
        values["nan"] != values["nan"] and values["inf"] == float("inf") and values["ninf"] == -float("inf")
    )
    assert values["flag"] == 1 and values["huge"] == float(2**70)
    assert (values["big"], values["small"]) == (float(2**63 - 1), float(-(2**63)))  # stored as floats
    out = run_cli("--store", store_url, "metrics", "vals", "--key", "nan", "--json").stdout
    assert '"value": "NaN"' in out
    logs = read_store(store_url, "logs", "vals")
    assert [(line.level, line.text) for line in logs] == [("WARNING", "a warning"), ("ERROR", "from logging")]


def test_log_never_waits_for_an_absent_redis():
    url = f"redis://127.0.0.1:{free_port()}/0"
    run = runbus.init(
        run_id="down",
        label="rank0",
        redis_url=url,
        system_interval=None,
        hardware=False,
        max_buffer_events=100,
        max_buffer_bytes=5_000,
        finish_timeout=0.5,
        spool_dir=False,  # no spool: what passes the memory bound is dropped
    )
    for step in range(250):
        run.log({"loss": 1.0}, step=step)
    wait_for("the queue encoded", lambda: not run._outbox, 10)
    assert run.dropped > 0 and run.buffered < 251  # bounded
    assert run.buffered + run.dropped == 251  # start + 250 metrics: every one kept or counted
    assert run.epoch is None
    assert run.finish() is False  # gave up after its timeout instead of hanging


def test_buffered_events_ship_in_order_once_redis_is_back(local_redis, store_url):
    local_redis.kill()
    run = runbus.init(
        run_id="later",
        label="rank0",
        redis_url=local_redis.url,
        system_interval=None,
        hardware=False,
        max_backoff=0.2,
    )
    for step in range(300):
        run.log({"loss": float(step)}, step=step)
    local_redis.start()
    assert run.finish(timeout=30)
    ingest(local_redis.url, store_url)
    stored = read_store(store_url, "run", "later")
    assert (stored.state, stored.labels[0].missing, stored.labels[0].events) == ("finished", 0, 302)
    points = read_store(store_url, "metrics", "later")
    assert [p.value for p in points] == [float(s) for s in range(300)]


EXITING = textwrap.dedent(
    """
    import os, sys, time, runbus
    run = runbus.init(
        run_id="exits", label=sys.argv[1], primary=False, system_interval=None, hardware=False
    )
    run.log({"x": 1.0})
    how = sys.argv[2]
    if how == "raise":
        raise RuntimeError("training blew up")
    if how == "sigterm":
        print("ready", flush=True)
        time.sleep(60)
    if how == "context":
        with run:
            sys.exit(3)
    """
)


def test_how_a_process_ends_finishes_its_label(redis_url, store_url):
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url}
    outcomes = {"normal": "", "raise": "", "context": ""}
    for label in outcomes:
        subprocess.run(
            [sys.executable, "-c", EXITING, label, label], env=env, capture_output=True, timeout=60
        )
    with subprocess.Popen(
        [sys.executable, "-c", EXITING, "sigterm", "sigterm"], env=env, stdout=subprocess.PIPE
    ) as slow:
        assert slow.stdout.readline() == b"ready\n"
        slow.send_signal(signal.SIGTERM)
        assert slow.wait(30) == -signal.SIGTERM
    ingest(redis_url, store_url)
    labels = {lab.label: (lab.state, lab.exit_code) for lab in read_store(store_url, "run", "exits").labels}
    assert labels == {
        "normal": ("finished", 0),
        "raise": ("failed", 1),
        "context": ("failed", 3),
        "sigterm": ("failed", 143),
    }


def test_importing_runbus_and_the_producer_is_cheap():
    code = (
        "import sys, runbus; runbus.init; runbus.Run; runbus.RunbusError; runbus.Api; "
        "heavy = {'redis', 'torch', 'pynvml', 'asyncio', 'numpy', 'psutil', 'pandas'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def system_sampled(client: redis.Redis, key: str) -> bool:
    """Whether stream `key` holds a system sample."""
    return any(fields[b"kind"] == b"system" for _, fields in client.xrange(key))


def test_start_event_describes_the_host(redis_url, store_url):
    with (
        runbus.init(run_id="hw", label="rank0", redis_url=redis_url, system_interval=0.5) as run,
        redis.Redis.from_url(redis_url) as client,
    ):
        wait_for("a system sample in Redis", lambda: system_sampled(client, run.stream), 10)
    ingest(redis_url, store_url)
    stored = read_store(store_url, "run", "hw")
    start = stored.labels[0].start
    assert start["hardware"]["cpu_count"] == os.cpu_count() and start["pid"] == os.getpid()
    assert stored.counts["system"] >= 1
    keys = {p.key for p in read_store(store_url, "system", "hw")}
    assert {"proc.cpu_percent", "proc.rss_mb"} <= keys
