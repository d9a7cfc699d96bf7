"""One live writer per run and label, children with labels of their own, re-used run ids, and
epochs that never repeat: attacked with real processes (fork, spawn, Pool workers that inherit a
rank's environment, SIGKILL), hand-written leases and counters, and a Redis restarted empty."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import redis

import runbus
from runbus import wire
from runbus.ingester.localredis import LocalRedis
from runbus.producer import environment
from runbus.producer.child import ChildLabel
from tests.conftest import private_redis
from tests.helpers import QUIET, ingest, read_store, run_cli, unset_runbus, wait_for

RANK = textwrap.dedent(
    """
    import json, os, sys, time, runbus
    say = lambda doc: os.write(1, (json.dumps(doc) + "\\n").encode())  # never captured by runbus
    options = json.loads(os.environ.get("OPTIONS", "{}"))
    try:
        run = runbus.init(config={"job": os.environ.get("JOB", "")}, system_interval=None,
                          hardware=False, console="off", **options)
    except runbus.RunbusError as exc:
        say({"error": type(exc).__name__, "message": str(exc)})
        sys.exit(3)
    say({"pid": os.getpid(), "primary": run.primary, "label": run.label})
    for step in range(int(os.environ.get("STEPS", "5"))):
        run.log({"loss": float(step)}, step=step)
    if os.environ.get("HANG"):
        while run.buffered:
            time.sleep(0.01)
        say({"shipped": True, "epoch": run.epoch})
        time.sleep(3600)
    done = run.finish(timeout=30)
    say({"finished": done, "epoch": run.epoch})
    """
)

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def clean_env(**env: str) -> dict[str, str]:
    """os.environ without any rank identity or RUNBUS_* setting, plus `env`."""
    base = {k: v for k, v in unset_runbus().items() if k not in RANK_VARIABLES}
    return {**base, **env}


def start_rank(redis_url: str, run_id: str, rank: int = 0, **env: str) -> subprocess.Popen:
    """One rank process; its lines are JSON documents on stdout."""
    return subprocess.Popen(
        [sys.executable, "-c", RANK],
        env=clean_env(RUNBUS_REDIS_URL=redis_url, RUNBUS_RUN_ID=run_id, RANK=str(rank), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def line(proc: subprocess.Popen) -> dict:
    text = proc.stdout.readline()
    assert text, f"the process ended: {proc.wait(30)}, {proc.stderr.read()[-2000:]}"
    return json.loads(text)


def outcome(proc: subprocess.Popen) -> tuple[int, list[dict], str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, [json.loads(x) for x in out.splitlines()], err


def entries(client: redis.Redis, run_id: str, label: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in client.xrange(wire.stream_key(run_id, label))]


def starts(client: redis.Redis, run_id: str, label: str) -> list[dict]:
    return [json.loads(f[b"data"]) for f in entries(client, run_id, label) if f[b"kind"] == b"start"]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as c:
        yield c


@pytest.fixture
def as_rank0(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """This process looks like torchrun's rank 0 of run `pooljob` (children inherit it)."""
    for name in (*RANK_VARIABLES, "RUNBUS_LABEL", "RUNBUS_RESUME", "RUNBUS_CONSOLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RUNBUS_RUN_ID", "pooljob")
    monkeypatch.setenv("RUNBUS_REDIS_URL", redis_url)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    return "pooljob"


# Run in Pool workers and spawned children (module level, so spawn can import them).
def init_here(label: str | None = None) -> tuple[str, object]:
    try:
        run = runbus.init(label=label, **QUIET)
    except runbus.RunbusError as exc:
        return type(exc).__name__, str(exc)
    run.log({"child": 1.0})
    return "ok", (run.label, run.primary, run.finish())


def init_handle(handle: ChildLabel) -> tuple[str, object]:
    run = handle.init(**QUIET)
    run.log({"child": 2.0})
    return "ok", (run.label, run.primary, run.finish())


# -- one live writer ------------------------------------------------------------------------------


def test_a_second_process_on_a_live_label_gets_label_in_use_and_ships_nothing(redis_url, client, store_url):
    holder = start_rank(redis_url, "twice", HANG="1")
    try:
        first = line(holder)
        shipped = line(holder)
        second = start_rank(redis_url, "twice")
        code, docs, _ = outcome(second)
        assert code == 3 and docs[0]["error"] == "LabelInUse"
        message = docs[0]["message"]
        assert f"pid {first['pid']} on {socket.gethostname()}" in message and "'rank0'" in message
        # The holder is untouched: its lease, its one epoch, its start event alone.
        lease = client.hgetall(wire.lease_key("twice", "rank0"))
        assert int(lease[b"pid"]) == first["pid"]
        assert [s["pid"] for s in starts(client, "twice", "rank0")] == [first["pid"]]
        assert {int(f[b"epoch"]) for f in entries(client, "twice", "rank0")} == {shipped["epoch"]}
    finally:
        holder.kill()
        holder.communicate(timeout=30)


def test_processes_racing_for_one_label_leave_exactly_one_writer(redis_url, client):
    racers = [start_rank(redis_url, "race", HANG="1") for _ in range(4)]
    try:
        first = [line(proc) for proc in racers]
        winners = [doc["pid"] for doc in first if "pid" in doc]
        assert len(winners) == 1 and sum(doc.get("error") == "LabelInUse" for doc in first) == 3
        assert f"pid {winners[0]} on" in next(doc["message"] for doc in first if "error" in doc)
        line(next(proc for proc in racers if proc.pid == winners[0]))  # it has shipped
        assert [s["pid"] for s in starts(client, "race", "rank0")] == winners
    finally:
        for proc in racers:
            proc.kill()
            proc.communicate(timeout=30)


def test_the_lease_is_renewed_by_heartbeats_and_given_back_at_finish(redis_url, client):
    run = runbus.init(
        run_id="renew", label="rank0", redis_url=redis_url, heartbeat_interval=0.2, lease_ttl=1.0, **QUIET
    )
    key = wire.lease_key("renew", "rank0")
    token = client.hget(key, "token")
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # three times the TTL: kept alive by the heartbeats
        assert client.hget(key, "token") == token and 0 < client.pttl(key) <= 1000
        time.sleep(0.1)
    assert run.finish()
    assert not client.exists(key) and not client.exists(wire.primary_key("renew"))
    marker = json.loads(client.get(wire.finished_key("renew")))
    assert (marker["label"], marker["exit_code"], marker["pid"]) == ("rank0", 0, os.getpid())
    assert client.ttl(wire.finished_key("renew")) > wire.FINISHED_TTL - 60


def test_init_again_in_the_same_process_returns_the_live_run(redis_url):
    run = runbus.init(run_id="same", label="rank0", redis_url=redis_url, **QUIET)
    assert runbus.init(run_id="same", label="rank0", redis_url=redis_url, **QUIET) is run
    assert run.finish()


def test_a_lease_taken_by_another_process_stops_the_old_holder(redis_url, client, store_url, caplog):
    run = runbus.init(
        run_id="stolen", label="rank0", redis_url=redis_url, heartbeat_interval=0.2, lease_ttl=5.0, **QUIET
    )
    run.log({"before": 1.0})
    wait_for("everything shipped", lambda: not run.buffered)
    key = wire.lease_key("stolen", "rank0")
    # As if this process had been away longer than its lease and a restart had taken the label.
    client.delete(key)
    client.hset(key, mapping={"token": "someone-else", "host": "elsewhere", "pid": 4242})
    wait_for("the heartbeat to notice", lambda: run._shipper.refused is not None, 10)
    run.log({"after": 1.0})  # still never raises into training code
    assert run.finish() is False
    assert "pid 4242 on elsewhere" in caplog.text and caplog.text.count("ships nothing more") == 1
    kinds = [f[b"kind"] for f in entries(client, "stolen", "rank0")]
    assert b"finish" not in kinds and kinds.count(b"metric") == 1
    assert client.hget(key, "token") == b"someone-else"  # not released: it is not ours


def test_a_conflict_found_after_an_outage_stops_shipping_with_one_error(local_redis, store_url):
    url = local_redis.url
    holder = start_rank(url, "late", HANG="1")
    try:
        holder_pid = line(holder)["pid"]
        line(holder)
        local_redis.kill()  # AOF, fsync always: the holder's lease survives the restart
        # No spool: its finish() waits for Redis to come back, as a spool's would not (it leaves
        # the events to `runbus sync` when Redis does not answer at once).
        options = {"max_backoff": 0.2, "spool_dir": False}
        late = start_rank(url, "late", OPTIONS=json.dumps(options), STEPS="50")
        assert "pid" in line(late)  # init() returned at once, Redis being away
        local_redis.start()
        code, docs, err = outcome(late)
        assert code == 0 and docs[-1]["finished"] is False and docs[-1]["epoch"] is None
        errors = [x for x in err.splitlines() if "ships nothing more" in x]
        assert len(errors) == 1 and f"pid {holder_pid} on" in errors[0], err
        with redis.Redis.from_url(url) as client:
            assert [s["pid"] for s in starts(client, "late", "rank0")] == [holder_pid]
            assert {int(f[b"epoch"]) for f in entries(client, "late", "rank0")} == {
                int(client.get(wire.epoch_key("late", "rank0")))
            }
    finally:
        holder.kill()
        holder.communicate(timeout=30)


# -- restarts: when a new epoch is allowed --------------------------------------------------------


def test_after_a_sigkill_the_restart_takes_the_label_at_once(redis_url, client, store_url):
    holder = start_rank(redis_url, "killed", HANG="1")
    line(holder)
    old_epoch = line(holder)["epoch"]
    holder.send_signal(signal.SIGKILL)
    # Not reaped yet: a zombie runs no more either.
    restart = start_rank(redis_url, "killed")
    code, docs, err = outcome(restart)
    holder.communicate(timeout=30)
    assert code == 0 and docs[-1]["finished"] is True, err
    assert docs[-1]["epoch"] > old_epoch
    ingest(redis_url, store_url)
    label = read_store(store_url, "run", "killed").labels[0]
    assert (label.state, label.epoch, label.missing) == ("finished", docs[-1]["epoch"], 0)


def test_this_process_takes_back_a_lease_it_could_not_give_back(local_redis):
    first = runbus.init(run_id="own", label="rank0", redis_url=local_redis.url, max_backoff=0.2, **QUIET)
    wait_for("the lease taken and everything shipped", lambda: first.epoch is not None and not first.buffered)
    local_redis.kill()  # AOF: the lease outlives the restart, still naming this process
    assert first.finish(timeout=0.5) is False
    local_redis.start()
    with redis.Redis.from_url(local_redis.url) as client:
        assert int(client.hget(wire.lease_key("own", "rank0"), "pid")) == os.getpid()
    with runbus.init(run_id="own", label="rank0", redis_url=local_redis.url, **QUIET) as again:
        assert again is not first and again.epoch > first.epoch


def hand_written_lease(client: redis.Redis, run_id: str, ttl_ms: int, restart: int = 0) -> None:
    """A lease held by a process on another machine, whose liveness cannot be checked here."""
    key = wire.lease_key(run_id, "rank0")
    fields = {"token": "far", "host": "far-away", "pid": 1, "started": time.time(), "restart": restart}
    client.hset(key, mapping=fields)
    client.pexpire(key, ttl_ms)


def test_a_holder_elsewhere_blocks_the_label_until_its_lease_lapses(redis_url, client):
    hand_written_lease(client, "far", 1500)
    with pytest.raises(runbus.LabelInUse, match="pid 1 on far-away"):
        runbus.init(run_id="far", label="rank0", redis_url=redis_url, **QUIET)
    wait_for("the lease to lapse", lambda: not client.exists(wire.lease_key("far", "rank0")))
    with runbus.init(run_id="far", label="rank0", redis_url=redis_url, **QUIET) as run:
        assert run.epoch is not None
    assert client.get(wire.epoch_key("far", "rank0")) == str(run.epoch).encode()


def test_an_elastic_restart_waits_for_the_earlier_round_s_lease(redis_url, client, monkeypatch):
    hand_written_lease(client, "elastic", 1500, restart=0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with runbus.init(run_id="elastic", label="rank0", redis_url=redis_url, **QUIET) as run:
        assert run.epoch is not None  # waited for the lapse instead of failing
        assert client.hget(wire.lease_key("elastic", "rank0"), "pid") == str(os.getpid()).encode()


# -- children ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_workers_inheriting_rank0_cannot_take_its_label(as_rank0, redis_url, client, store_url, method):
    run = runbus.init(**QUIET)
    assert (run.label, run.primary) == ("rank0", True)
    run.log({"parent": 1.0}, step=0)
    with multiprocessing.get_context(method).Pool(2) as pool:
        results = pool.map(init_here, [None, None])
        pool.terminate()  # SIGTERM to the workers: none of them may finish the run
    for kind, message in results:
        assert kind == "LabelInUse" and f"pid {os.getpid()} on {socket.gethostname()}" in str(message)
    run.log({"parent": 2.0}, step=1)
    assert run.finish()
    ingest(redis_url, store_url)
    stored = read_store(store_url, "run", as_rank0)
    assert (stored.state, stored.exit_code, [lab.label for lab in stored.labels]) == (
        "finished",
        0,
        ["rank0"],
    )
    assert {p.epoch for p in read_store(store_url, "metrics", as_rank0)} == {run.epoch}
    assert [s["pid"] for s in starts(client, as_rank0, "rank0")] == [os.getpid()]


def test_a_child_logs_under_its_own_label_without_touching_the_primary(
    as_rank0, redis_url, client, store_url
):
    run = runbus.init(**QUIET)
    run.log({"parent": 1.0})
    pid = os.fork()
    if pid == 0:  # a forked child: the inherited Run is a no-op, its own label just works
        code = 0
        try:
            run.log({"via_parent": 1.0})
            assert init_here("rank0-loader") == ("ok", ("rank0-loader", False, True))
        except BaseException:
            code = 1
        os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    handle = run.child("rank0-spawned")
    assert pickle.loads(pickle.dumps(handle)) == handle
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(init_handle, (handle,)) == ("ok", ("rank0-spawned", False, True))
    assert client.get(wire.primary_key(as_rank0)) == b"rank0" and run.primary
    run.log({"parent": 2.0})
    assert run.finish()
    ingest(redis_url, store_url)
    stored = read_store(store_url, "run", as_rank0)
    assert (stored.state, stored.primary) == ("finished", "rank0")
    labels = {lab.label: (lab.primary, lab.state, lab.missing) for lab in stored.labels}
    assert labels == {
        "rank0": (True, "finished", 0),
        "rank0-loader": (False, "finished", 0),
        "rank0-spawned": (False, "finished", 0),
    }
    keys = {(p.label, p.key) for p in read_store(store_url, "metrics", as_rank0)}
    assert keys == {("rank0", "parent"), ("rank0-loader", "child"), ("rank0-spawned", "child")}


def test_child_handles_refuse_the_parent_s_label_and_hide_the_password(redis_url):
    with runbus.init(run_id="handle", label="rank0", redis_url=redis_url, **QUIET) as run:
        with pytest.raises(ValueError, match="label of its own"):
            run.child("rank0")
        with pytest.raises(runbus.InvalidName):
            run.child("bad label")
        with pytest.raises(TypeError, match="primary"):
            run.child("loader", primary=True)
    secret = ChildLabel("r", "loader", "redis://:hunter2@127.0.0.1:6379/0")
    assert "hunter2" not in repr(secret)


def test_an_explicit_label_is_not_primary_unless_asked():
    rank0 = {"RANK": "0", "RUNBUS_RUN_ID": "r"}
    assert environment.resolve(env=rank0).primary is True
    assert environment.resolve(label="rank0", env=rank0).primary is True  # the launcher's own label
    assert environment.resolve(label="rank0-loader", env=rank0).primary is False
    assert environment.resolve(label="rank0-loader", primary=True, env=rank0).primary is True
    assert environment.resolve(label="rank1", env={"RUNBUS_RUN_ID": "r"}).primary is False
    assert environment.resolve(env={**rank0, "RUNBUS_LABEL": "trainer"}).primary is True
    assert environment.resolve(env={**rank0, "RANK": "1", "RUNBUS_LABEL": "trainer"}).primary is False
    assert environment.resolve(env={**rank0, "RUNBUS_RESUME": "allow"}).resume == "allow"
    assert environment.resolve(resume="must", env={**rank0, "RUNBUS_RESUME": "allow"}).resume == "must"
    with pytest.raises(ValueError, match="resume must be one of"):
        environment.resolve(resume="sometimes", env=rank0)
    with pytest.raises(ValueError, match="lease_ttl"):
        runbus.init(run_id="r", lease_ttl=5, heartbeat_interval=10)


# -- re-used run ids ---------------------------------------------------------------------------------


def test_a_finished_run_is_not_continued_unless_resume_allows(redis_url, client, store_url):
    assert outcome(start_rank(redis_url, "done", JOB="first"))[0] == 0
    code, docs, _ = outcome(start_rank(redis_url, "done", JOB="second"))
    assert code == 3 and docs[0]["error"] == "RunExists"
    assert "resume" in docs[0]["message"] and "exit code 0" in docs[0]["message"]
    code, docs, _ = outcome(start_rank(redis_url, "done", JOB="again", RUNBUS_RESUME="allow"))
    assert code == 0 and docs[-1]["finished"] is True
    ingest(redis_url, store_url)
    stored = read_store(store_url, "run", "done")
    points = read_store(store_url, "metrics", "done")
    assert len({p.epoch for p in points}) == 2 and max(p.epoch for p in points) == stored.labels[0].epoch
    assert (stored.state, stored.config) == ("finished", {"job": "again"})
    with pytest.raises(runbus.RunNotFound, match="must"):
        runbus.init(run_id="never-made", redis_url=redis_url, resume="must", **QUIET)
    with runbus.init(run_id="done", label="rank0", redis_url=redis_url, resume="must", **QUIET) as run:
        assert run.epoch is not None


def test_the_same_job_id_run_twice_keeps_the_first_job_alone(redis_url, store_url):
    def job(name: str) -> list[tuple[int, list[dict], str]]:
        env = {"TORCHELASTIC_RUN_ID": "myjob", "TORCHELASTIC_RESTART_COUNT": "0", "WORLD_SIZE": "2"}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK],
                env=clean_env(RUNBUS_REDIS_URL=redis_url, RANK=str(r), JOB=name, STEPS="20", **env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        return [outcome(p) for p in procs]

    assert [code for code, _, _ in job("first")] == [0, 0]
    second = job("second")
    assert [code for code, _, _ in second] == [3, 3]
    for _, docs, _ in second:
        assert docs[0]["error"] == "RunExists" and "'myjob' has already finished" in docs[0]["message"]
    ingest(redis_url, store_url)
    stored = read_store(store_url, "run", "myjob")
    assert (stored.state, stored.config) == ("finished", {"job": "first"})
    for label in stored.labels:
        points = read_store(store_url, "metrics", "myjob", label=label.label)
        assert [p.step for p in points] == list(range(20)) and {p.epoch for p in points} == {label.epoch}


def test_the_same_job_id_while_the_first_runs_is_label_in_use(redis_url, client):
    first = [start_rank(redis_url, "busy", r, WORLD_SIZE="2", HANG="1") for r in range(2)]
    try:
        pids = [line(p)["pid"] for p in first]
        second = [start_rank(redis_url, "busy", r, WORLD_SIZE="2") for r in range(2)]
        for rank, proc in enumerate(second):
            code, docs, _ = outcome(proc)
            assert code == 3 and docs[0]["error"] == "LabelInUse"
            assert f"pid {pids[rank]} on" in docs[0]["message"]
    finally:
        for proc in first:
            proc.kill()
            proc.communicate(timeout=30)


# -- epochs ---------------------------------------------------------------------------------------------


@pytest.fixture
def empty_on_restart() -> Iterator[LocalRedis]:
    """A private redis-server without persistence: restarted, it is empty."""
    yield from private_redis(appendonly=False)


def test_redis_restarted_empty_never_repeats_an_epoch(empty_on_restart, store_url):
    url = empty_on_restart.url
    code, docs, err = outcome(start_rank(url, "amnesia", STEPS="30"))
    assert code == 0, err
    first_epoch = docs[-1]["epoch"]
    key = wire.stream_key("amnesia", "rank0")
    with redis.Redis.from_url(url) as client:
        first_events = client.xlen(key)  # start, 30 metrics, finish (and any heartbeat)
    assert ingest(url, store_url).stored == first_events >= 32
    empty_on_restart.stop()
    empty_on_restart.start()
    with redis.Redis.from_url(url) as client:
        assert client.dbsize() == 0  # the counter, the finished marker, the streams: all gone
        code, docs, err = outcome(start_rank(url, "amnesia", STEPS="40", JOB="second"))
        assert code == 0, err
        second_events = client.xlen(key)
    second_epoch = docs[-1]["epoch"]
    assert first_epoch < second_epoch < 2**63
    stats = ingest(url, store_url)
    assert (stats.stored, stats.duplicates, stats.dead_lettered) == (second_events, 0, 0)
    shown = json.loads(run_cli("--store", store_url, "show", "amnesia", "--json").stdout)
    assert (shown["state"], shown["exit_code"]) == ("finished", 0)
    (label,) = shown["labels"]
    assert (label["lease_epoch"], label["missing"], label["state"]) == (second_epoch, 0, "finished")
    assert label["events"] == first_events + second_events
    points = read_store(store_url, "metrics", "amnesia")
    assert [(p.epoch, p.step) for p in points if p.epoch == second_epoch] == [
        (second_epoch, s) for s in range(40)
    ]


def test_a_hand_written_epoch_counter_is_replaced_or_respected(redis_url, client, caplog):
    key = wire.epoch_key("counted", "rank0")
    for junk in (b"abc", b"-5", b"1.5", str(2**62).encode()):
        client.set(key, junk)
        with runbus.init(
            run_id="counted", label="rank0", redis_url=redis_url, resume="allow", **QUIET
        ) as run:
            epoch = run.epoch
        assert epoch is not None and time.time() * 1000 - 600_000 < epoch < 2**53
        assert repr(junk.decode())[:20] in caplog.text
    client.delete(key)
    client.hset(key, "x", 1)  # not even a string
    with runbus.init(run_id="counted", label="rank0", redis_url=redis_url, resume="allow", **QUIET) as run:
        assert run.epoch is not None
    ahead = int(time.time() * 1000) + 10**9  # above the clock: respected, epochs only grow
    client.set(key, ahead)
    with runbus.init(run_id="counted", label="rank0", redis_url=redis_url, resume="allow", **QUIET) as run:
        assert run.epoch == ahead + 1
