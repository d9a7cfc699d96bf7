"""`runbus tail RUN` as a process against a real Redis, while entries are written by hand."""

from __future__ import annotations

import contextlib
import io
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest
import redis

from runbus import wire
from runbus.dashboard.tail import Tail, TailSettings, format_line
from tests.helpers import T0, ingest, read_store, wait_for, xadd_event

RUN = "tail-run"


class TailProcess:
    """`python -m runbus tail ARGS`, its stdout and stderr read line by line as they come."""

    def __init__(self, redis_url: str, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runbus", "tail", "--redis", redis_url, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "NO_COLOR": ""},
        )
        self.out: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.process.stdout, self.out.put), daemon=True),
            threading.Thread(target=self._pump, args=(self.process.stderr, self.err.append), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def line(self, timeout: float = 10.0) -> str:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout} s; stderr: {self.err}") from None

    def wait_ready(self, timeout: float = 15.0) -> None:
        def ready() -> bool:
            return any("following run" in line or "already finished" in line for line in self.err)

        try:
            wait_for("the tail ready", ready, timeout, running=self.process)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; stderr: {self.err}") from None

    def wait(self, timeout: float = 15.0) -> int:
        code = self.process.wait(timeout=timeout)
        for thread in self._threads:
            thread.join(timeout=5)
        return code

    def rest(self) -> list[str]:
        lines = []
        while not self.out.empty():
            lines.append(self.out.get_nowait())
        return lines

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.wait()
        self.process.stdout.close()
        self.process.stderr.close()


@pytest.fixture
def tail_process(redis_url):
    started: list[TailProcess] = []

    def start(*args: str) -> TailProcess:
        started.append(TailProcess(redis_url, *args))
        return started[-1]

    yield start
    for process in started:
        process.close()


def log(client, label, seq, text, level="INFO", ts=None):
    xadd_event(client, RUN, label, "log", 1, seq, {"stream": "stdout", "level": level, "text": text}, ts=ts)


def test_tail_follows_every_label_live_and_exits_after_the_primary_finishes(
    redis_url, store_url, tail_process
):
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, RUN, "rank1", "start", 1, 1, {"primary": False})
        log(client, "rank0", 2, "an old line, before the tail started")
        tail = tail_process(RUN, "--level", "info")
        tail.wait_ready()

        log(client, "rank0", 3, "hello from rank0")
        assert tail.line() == "rank0 | hello from rank0"
        log(client, "rank1", 2, "prefetching", level="DEBUG")  # under --level INFO
        log(client, "rank1", 3, "two\nlines", level="WARNING")
        assert [tail.line(), tail.line()] == ["rank1 | two", "rank1 | lines"]

        # A label whose stream appears only now is found by the next scan and read from its start.
        xadd_event(client, RUN, "worker-2", "start", 1, 1, {"primary": False})
        log(client, "worker-2", 2, "joined late")
        assert tail.line() == "worker-2 | joined late"

        xadd_event(client, RUN, "rank1", "finish", 1, 4, {"exit_code": 0})  # a worker: tail goes on
        log(client, "rank0", 4, "still here")
        assert tail.line() == "rank0    | still here"  # padded to the widest label
        xadd_event(client, RUN, "rank0", "finish", 1, 5, {"exit_code": 0})
        log(client, "worker-2", 3, "a last line after the primary's finish")
        assert tail.wait() == 0
        assert tail.rest() == ["worker-2 | a last line after the primary's finish"]
        assert not any("\x1b[" in line for line in tail.err)

        # XREAD took nothing from anyone: no consumer group, every entry left for the ingesters.
        assert client.xinfo_groups(wire.stream_key(RUN, "rank0")) == []
    ingest(redis_url, store_url)
    assert len(read_store(store_url, "logs", RUN)) == 7


@pytest.mark.parametrize("live_claim", [True, False], ids=["live-claim", "earliest-claim"])
def test_a_stray_primary_claim_cannot_end_the_tail(redis_url, tail_process, live_claim):
    """The tail ends at the finish of the primary the ingesters decide (the label holding the
    producers' live claim; with none, the earliest claim), not at any start claiming the role."""
    with redis.Redis.from_url(redis_url) as client:
        if live_claim:
            client.set(wire.primary_key(RUN), "rank0", ex=60)
        # With a live claim, even an earlier stray claim loses; without, the earlier claim wins.
        stray_ts = T0 if live_claim else T0 + 50
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True}, ts=T0 + 10)
        tail = tail_process(RUN)
        tail.wait_ready()
        xadd_event(client, RUN, "stray", "start", 1, 1, {"primary": True}, ts=stray_ts)
        xadd_event(client, RUN, "stray", "finish", 1, 2, {"exit_code": 0}, ts=stray_ts + 1)
        # Past the finish grace (1 s) a tail that took the stray's finish has ended: the wait
        # returns as soon as it does.
        with contextlib.suppress(subprocess.TimeoutExpired):
            tail.process.wait(timeout=2.5)
        assert tail.process.poll() is None, tail.err
        log(client, "rank0", 2, "still training", ts=T0 + 60)
        assert tail.line().endswith("| still training")
        xadd_event(client, RUN, "rank0", "finish", 1, 3, {"exit_code": 3}, ts=T0 + 61)
        assert tail.wait() == 0


def test_tail_from_start_prints_the_history_of_one_label(redis_url, tail_process):
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, RUN, "rank1", "start", 1, 1, {"primary": False})
        for seq in range(2, 6):
            log(client, "rank0", seq, f"rank0 line {seq}", ts=T0 + 100.0 + seq)
            level = "ERROR" if seq == 5 else "INFO"
            log(client, "rank1", seq, f"rank1 line {seq}", level=level, ts=T0 + 100.5 + seq)
        xadd_event(client, RUN, "rank0", "finish", 1, 6, {"exit_code": 1})
    tail = tail_process(RUN, "--from-start", "--label", "rank1")
    assert tail.wait() == 0
    assert tail.rest() == [f"rank1 | rank1 line {seq}" for seq in range(2, 6)]
    tail = tail_process(RUN, "--from-start", "--level", "ERROR")
    assert tail.wait() == 0
    assert tail.rest() == ["rank1 | rank1 line 5"]


def test_tail_of_a_finished_run_exits_at_once(redis_url, tail_process):
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True})
        log(client, "rank0", 2, "done soon")
        xadd_event(client, RUN, "rank0", "finish", 1, 3, {"exit_code": 0})
    tail = tail_process(RUN)
    assert tail.wait() == 0
    assert tail.rest() == []
    assert any("already finished" in line for line in tail.err)


def test_ctrl_c_exits_130_quietly(redis_url, tail_process):
    tail = tail_process("not-started-yet", "--wait")  # waits for its streams to appear
    tail.wait_ready()
    tail.process.send_signal(signal.SIGINT)
    assert tail.wait() == 130
    assert tail.rest() == []
    assert not any("Traceback" in line for line in tail.err)


def test_bad_arguments_and_an_unreachable_redis_are_clear_errors(tail_process):
    tail = tail_process("bad run!")
    assert tail.wait() == 2 and any("invalid name" in line for line in tail.err)
    tail = TailProcess("redis://:hunter2@127.0.0.1:1/0", RUN)
    try:
        assert tail.wait() == 1
        assert any("cannot read the streams" in line for line in tail.err)
        assert not any("hunter2" in line for line in tail.err)
    finally:
        tail.close()


def test_labels_get_their_own_colour_on_a_terminal(redis_url):
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, RUN, "rank10", "start", 1, 1, {"primary": False})
        log(client, "rank0", 2, "zero", ts=T0 + 10.0)
        xadd_event(client, RUN, "rank10", "log", 1, 2, {"stream": "stderr", "text": "ten"}, ts=T0 + 11.0)
        xadd_event(client, RUN, "rank0", "finish", 1, 3, {"exit_code": 0})
    out, err = io.StringIO(), io.StringIO()
    settings = TailSettings(redis_url=redis_url, run_id=RUN, from_start=True, color=True, finish_grace=0.2)
    assert Tail(settings, out=out, err=err).run() == 0
    assert out.getvalue().splitlines() == [
        format_line("rank0", 6, "zero", "36"),
        format_line("rank10", 6, "ten", "33"),
    ]
    assert format_line("rank0", 6, "zero", "36") == "\x1b[36mrank0  |\x1b[0m zero"
    assert format_line("rank0", 6, "zero", None) == "rank0  | zero"


@pytest.mark.parametrize(("code", "ending"), [(None, "crashed"), (137, "failed (exit 137)")])
def test_tail_ends_at_a_keepers_notice_saying_how_the_primary_ended(redis_url, code, ending):
    """`runbus run`'s keeper stores a killed rank's end as a finish of a new epoch: with its
    exit code, or a null one when it could not read the status (crashed)."""
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True})
        log(client, "rank0", 2, "training")
        xadd_event(client, RUN, "rank0", "finish", 2, 1, {"exit_code": code, "noticed_by": "keeper"})
    out, err = io.StringIO(), io.StringIO()
    settings = TailSettings(redis_url=redis_url, run_id=RUN, from_start=True, finish_grace=0.2)
    assert Tail(settings, out=out, err=err).run() == 0
    assert out.getvalue().splitlines() == ["rank0 | training"]
    assert err.getvalue().splitlines()[-1] == f"runbus: run {RUN} {ending}"


PRIMARY = """
import sys, time, runbus
run = runbus.init(run_id=sys.argv[1], system_interval=None, hardware=False)

def shipped(message):
    deadline = time.monotonic() + 60
    while run.buffered and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.__stderr__.write(message + "\\n")
    sys.__stderr__.flush()

shipped("started")
sys.stdin.readline()
print("a last line", flush=True)
if sys.argv[2] == "killed":
    shipped("shipped")
    time.sleep(120)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize(
    ("ending", "last_line"),
    [("0", "finished"), ("3", "failed (exit 3)"), ("killed", "crashed")],
    ids=["finished", "failed", "crashed"],
)
def test_tail_ends_at_the_runs_end_with_a_last_line_saying_how(
    redis_url, store_url, tail_process, ending, last_line
):
    run_id = f"tail-ends-{ending}"
    env = {**os.environ, "RUNBUS_REDIS_URL": redis_url, "RUNBUS_QUIET": "1"}
    with subprocess.Popen(
        [sys.executable, "-c", PRIMARY, run_id, ending],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as primary:
        try:
            assert primary.stderr.readline() == "started\n"
            tail = tail_process(run_id, "--store", store_url)
            tail.wait_ready()
            primary.stdin.write("go\n")
            primary.stdin.flush()
            if ending == "killed":
                # SIGKILL: no finish is ever sent; the ingester marks the silent primary crashed.
                assert primary.stderr.readline() == "shipped\n"
                primary.kill()
                primary.wait(30)
                ingest(redis_url, store_url, crash_after=0.0)
            assert tail.line(timeout=30) == "rank0 | a last line"
            assert tail.wait(timeout=60) == 0
        finally:
            primary.kill()
    assert tail.err[-1] == f"runbus: run {run_id} {last_line}"
