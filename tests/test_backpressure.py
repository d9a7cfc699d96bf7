"""The producer's promises under pressure: a tight loop that outruns the shipper loses nothing
while Redis answers, start and finish survive full buffers, nothing follows the finish, and
what the ingester would refuse is refused at log()."""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import orjson
import pytest
import redis

import runbus
from runbus import wire
from tests.helpers import ingest, read_store, wait_for


def init(redis_url: str, run_id: str, **options) -> runbus.Run:
    quiet = {"label": "rank0", "system_interval": None, "hardware": False, "console": "off"}
    return runbus.init(run_id=run_id, redis_url=redis_url, **{**quiet, **options})


# One rank: a tight loop of log() calls with a small outbox and small batches, so the training
# thread outruns the shipper and meets back-pressure many times.
TIGHT_LOOP = textwrap.dedent(
    """
    import json, os, sys, runbus
    rank, calls = int(sys.argv[1]), int(sys.argv[2])
    run = runbus.init(
        label=f"rank{rank}", primary=rank == 0, system_interval=None, hardware=False, console="off",
        max_buffer_events=200, batch_size=100,
    )
    print("ready", flush=True)
    sys.stdin.readline()
    for step in range(calls):
        run.log({"loss": 1.0 / (step + 1), "acc": step}, step=step)
    finished = run.finish(timeout=120)
    print(json.dumps({"finish": finished, "dropped": run.dropped, "waits": run._outbox.waits}), flush=True)
    """
)


def test_a_tight_loop_that_outruns_the_shipper_loses_nothing(redis_url, store_url):
    ranks, calls = 4, 25_000
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url, "RUNBUS_RUN_ID": "burst", "WORLD_SIZE": "4"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TIGHT_LOOP, str(rank), str(calls)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    for proc in procs:
        assert proc.stdout.readline() == "ready\n"
    for proc in procs:  # all at once
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0
        results.append(json.loads(out))
    assert [(r["finish"], r["dropped"]) for r in results] == [(True, 0)] * ranks
    assert sum(r["waits"] for r in results) > 0  # the loops did outrun the shipper
    ingest(redis_url, store_url)
    stored = read_store(store_url, "run", "burst")
    assert stored.state == "finished"
    assert sorted((lab.label, lab.state, lab.missing) for lab in stored.labels) == [
        (f"rank{r}", "finished", 0) for r in range(ranks)
    ]
    assert stored.counts["metric"] == ranks * calls


ENDLESS_LOOP = textwrap.dedent(
    """
    import sys, runbus
    run = runbus.init(
        system_interval=None, hardware=False, console="off", max_buffer_events=100, batch_size=50,
        max_backoff=0.2,
    )
    print("ready", flush=True)
    step = 0
    while True:
        run.log({"loss": 1.0}, step=step)
        step += 1
    """
)


def start_endless_loop(redis_url: str, run_id: str) -> subprocess.Popen:
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url, "RUNBUS_RUN_ID": run_id}
    proc = subprocess.Popen([sys.executable, "-c", ENDLESS_LOOP], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def stopped_within(proc: subprocess.Popen, seconds: float) -> int:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the process did not end within {seconds}s of its SIGTERM") from None
    finally:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def test_sigterm_during_back_pressure_finishes_the_label_without_a_gap(redis_url, store_url):
    # torchrun stops a rank with SIGTERM, most likely while log() waits for room: the handler
    # finishes the label at once (the interrupted call never took a seq), then the rank dies.
    proc = start_endless_loop(redis_url, "stopped")
    key = wire.stream_key("stopped", "rank0")
    with redis.Redis.from_url(redis_url) as client:  # twenty times its buffer: waiting for room by now
        wait_for("the loop under back pressure", lambda: client.xlen(key) > 2000)
    proc.send_signal(signal.SIGTERM)
    assert stopped_within(proc, 60) == -signal.SIGTERM
    client = redis.Redis.from_url(redis_url)
    last = client.xrevrange(wire.stream_key("stopped", "rank0"), count=1)[0][1]
    client.close()
    assert last[b"kind"] == b"finish"
    ingest(redis_url, store_url)
    stored = read_store(store_url, "run", "stopped")
    label = stored.labels[0]
    assert (label.state, label.exit_code, label.missing) == ("failed", 143, 0)
    assert stored.counts["metric"] > 0


# SIGTERM at a chosen bytecode: a tracer sends it on reaching `line` of `function` called
# from `caller`, so the handler runs while the main thread holds that function's lock (an
# Event's, the outbox's, the finish's). Nothing is mocked: the real handler, locks and shipper.
SIGTERM_INSIDE = textwrap.dedent(
    """
    import inspect, os, signal, sys, threading, runbus
    from runbus.producer.outbox import Outbox
    from runbus.producer.run import Run
    name, caller, text, first_call = sys.argv[1:5]
    function = {
        "Event.set": threading.Event.set, "Event.clear": threading.Event.clear,
        "Event.wait": threading.Event.wait, "Outbox._drop": Outbox._drop, "Run._finish": Run._finish,
    }[name]
    lines, first = inspect.getsourcelines(function)
    fire_at = first + next(i for i, line in enumerate(lines) if line.strip() == text)
    run = runbus.init(
        system_interval=None, hardware=False, console="off", max_buffer_events=100, batch_size=50,
        max_backoff=0.2, finish_timeout=5, quiet=True,
        max_buffer_bytes=int(os.environ.get("TEST_BUFFER_BYTES", 128 << 20)),
        spool_dir=False,  # past the byte buffer, events are dropped (where the SIGTERM lands)
    )
    fired = False

    def on_call(frame, event, arg):
        if fired or frame.f_code is not function.__code__ or frame.f_back.f_code.co_name != caller:
            return None
        return on_line

    def on_line(frame, event, arg):
        global fired
        if event == "line" and frame.f_lineno == fire_at and not fired:
            fired = True
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: the lock is held
        return on_line

    print("ready", flush=True)
    sys.stdin.readline()
    sys.settrace(on_call)
    if first_call == "finish":
        run.finish()
    step = 0
    while True:
        run.log({"loss": 1.0}, step=step)
        step += 1
    """
)


def sigterm_inside(
    redis_url: str, run_id: str, *where: str, buffer_bytes: int = 128 << 20
) -> subprocess.Popen:
    env = {
        **os.environ,
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": run_id,
        "TEST_BUFFER_BYTES": str(buffer_bytes),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_INSIDE, *where],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("Event.set", "self._flag = True"),  # a full outbox wakes the shipper (demand.set)
        ("Event.clear", "self._flag = False"),  # a full outbox arms its wait (room.clear)
        ("Event.wait", "signaled = self._flag"),  # a full outbox waits for room
    ],
)
def test_sigterm_while_log_holds_a_lock_finishes_the_label(redis_url, store_url, where, line):
    # The handler finishes the Run, which takes the same locks: handled where it lands, it
    # waited for itself forever (a CI run hung on it). It is handled at the next safe point.
    run_id = f"held-{where.lower().replace('.', '-')}"
    proc = sigterm_inside(redis_url, run_id, where, "_put_when_room", line, "log")
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert stopped_within(proc, 60) == -signal.SIGTERM
    ingest(redis_url, store_url)
    label = read_store(store_url, "run", run_id).labels[0]
    assert (label.state, label.exit_code, label.missing) == ("failed", 143, 0)


def test_sigterm_during_finish_lets_the_finish_complete_then_ends(redis_url, store_url):
    proc = sigterm_inside(
        redis_url, "held-finish", "Run._finish", "finish", "self._finished = True", "finish"
    )
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert stopped_within(proc, 60) == -signal.SIGTERM
    ingest(redis_url, store_url)
    label = read_store(store_url, "run", "held-finish").labels[0]
    assert (label.state, label.exit_code, label.missing) == ("finished", 0, 0)


def test_sigterm_while_log_drops_ends_the_process(local_redis, store_url):
    # Redis is gone and the byte buffer has no room, so a full outbox drops: the SIGTERM lands
    # inside the drop's lock.
    proc = sigterm_inside(
        local_redis.url,
        "held-drop",
        "Outbox._drop",
        "_put_when_room",
        "self._unnumbered_drops += 1",
        "log",
        buffer_bytes=1,
    )
    local_redis.kill()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert stopped_within(proc, 60) == -signal.SIGTERM


def test_start_and_finish_are_kept_when_the_buffers_are_full_and_redis_is_down(local_redis, store_url):
    local_redis.kill()
    run = init(
        local_redis.url,
        "full",
        max_backoff=0.2,
        max_buffer_events=1,
        max_buffer_bytes=1,  # no room for anything but the vital events
        finish_timeout=60,
        spool_dir=False,  # nor a spool, whose finish() would not wait for Redis to come back
    )
    started = time.monotonic()
    for step in range(2000):
        run.log({"loss": float(step)}, step=step)
    assert time.monotonic() - started < 30  # never waited for the absent Redis (a hang guard)
    assert run.dropped > 1900

    def restart_later() -> None:
        time.sleep(1.0)
        local_redis.start()

    restarting = threading.Thread(target=restart_later)
    restarting.start()
    # The finish is put while Redis is still down and the buffers are full.
    assert run.finish() is False  # events were dropped
    restarting.join()
    ingest(local_redis.url, store_url)
    stored = read_store(store_url, "run", "full")
    label = stored.labels[0]
    assert (stored.state, label.state, label.exit_code) == ("finished", "finished", 0)
    assert label.start is not None and label.start["pid"] == os.getpid()
    assert label.missing == run.dropped
    assert sum(gap.dropped for gap in label.gaps) == run.dropped  # every gap explained


def test_nothing_follows_the_finish_while_redis_pauses_writes(local_redis, store_url):
    run = init(
        local_redis.url,
        "paused",
        heartbeat_interval=0.01,
        max_backoff=0.2,
        finish_timeout=60,
    )
    for step in range(100):
        run.log({"loss": float(step)}, step=step)
    client = redis.Redis.from_url(local_redis.url)
    key = wire.stream_key("paused", "rank0")
    wait_for("heartbeats out", lambda: any(f[b"kind"] == b"heartbeat" for _, f in client.xrange(key)))
    # Writes hang for 12 s, longer than the socket timeout (10 s): the shipper times out, backs
    # off and tries again, while its heartbeat timer keeps firing.
    client.execute_command("CLIENT", "PAUSE", 12000, "WRITE")
    assert run.finish() is True
    entries = client.xrange(wire.stream_key("paused", "rank0"))
    kinds = [fields[b"kind"] for _, fields in entries]
    seqs = [int(fields[b"seq"]) for _, fields in entries]
    assert kinds[-1] == b"finish" and seqs[-1] == max(seqs)
    assert b"heartbeat" in kinds  # heartbeats were sent, all before the finish
    client.close()
    ingest(local_redis.url, store_url)
    label = read_store(store_url, "run", "paused").labels[0]
    assert (label.state, label.missing) == ("finished", 0)


def test_no_event_takes_a_seq_after_the_finish_from_racing_threads(redis_url):
    # Threads putting console lines and samples while finish() runs: whatever they put either
    # comes before the finish or is discarded.
    run = init(redis_url, "racing")
    stop = threading.Event()
    rounds = [0, 0, 0]  # each thread's rounds of puts so far

    def chatter(index: int) -> None:
        while not stop.is_set():
            for _ in range(100):
                run._put("log", None, {"stream": "stdout", "level": "INFO", "text": "tick"})
            rounds[index] += 1
            time.sleep(0.0005)

    threads = [threading.Thread(target=chatter, args=(index,)) for index in range(len(rounds))]
    for thread in threads:
        thread.start()
    wait_for("every thread putting", lambda: all(count >= 2 for count in rounds))
    assert run.finish() is True
    stop.set()
    for thread in threads:
        thread.join()
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(wire.stream_key("racing", "rank0"))
    client.close()
    seqs = sorted(int(fields[b"seq"]) for _, fields in entries)
    assert entries[-1][1][b"kind"] == b"finish" and int(entries[-1][1][b"seq"]) == seqs[-1]
    assert seqs == list(range(1, len(seqs) + 1))  # no gap: nothing was lost either


class Metric(enum.StrEnum):
    LOSS = "loss"


def exactly(size: int) -> dict[str, float]:
    """Metrics whose data field encodes to exactly `size` bytes."""
    metrics: dict[str, float] = {}
    encoded = 2  # {}
    while True:
        room = size - encoded - len('"":0.5') - (1 if metrics else 0)  # for one more name
        name = f"k{len(metrics):05d}".ljust(min(256, room if room <= 256 else room - 300), "x")
        metrics[name] = 0.5
        encoded += len(name) + len('"":0.5') + (1 if len(metrics) > 1 else 0)
        if room <= 256:
            break
    assert len(orjson.dumps(metrics)) == size
    return metrics


def test_log_refuses_what_the_ingester_would_refuse(redis_url, store_url):
    with init(redis_url, "refused") as run:
        with pytest.raises(ValueError, match=r"step must be < 2\*\*63"):
            run.log({"x": 1.0}, step=2**63)
        with pytest.raises(ValueError, match="64 bits"):
            run.log({"x": 10**400})
        with pytest.raises(ValueError, match="64 bits"):
            run.log({"x": 2**63})
        with pytest.raises(ValueError, match="64 bits"):
            run.log({"x": -(2**63) - 1})
        with pytest.raises(ValueError, match="UTF-8"):
            run.log({"bad\ud800": 1.0})
        with pytest.raises(ValueError, match="over the 1048576 bytes"):
            run.log(exactly(wire.MAX_DATA_BYTES + 1))
        with pytest.raises(ValueError, match="over the 1048576 bytes"):
            run.log({f"{i:03d}" + "\x01" * 253: 1.0 for i in range(700)})  # escaped: 6 bytes a char
        with pytest.raises(ValueError, match="over the 1048576 limit"):
            run.log_text("\x01" * 200_000)
        with pytest.raises(ValueError, match="UTF-8"):
            run.log_text("bad \udcff")
        # Right at the limits, accepted, and stored.
        run.log(exactly(wire.MAX_DATA_BYTES), step=2**63 - 1)
        run.log({Metric.LOSS: 2**63 - 1, "low": -(2**63)}, step=0)
        run.log({Metric.LOSS: 0.5}, step=1)  # the name is known now: the fast path
    assert (run.finish(), run.dropped) == (True, 0)
    assert ingest(redis_url, store_url).dead_lettered == 0
    stored = read_store(store_url, "run", "refused")
    assert (stored.labels[0].missing, stored.counts["metric"]) == (0, 3)
    steps = {p.step for p in read_store(store_url, "metrics", "refused", key="loss")}
    assert steps == {0, 1}
