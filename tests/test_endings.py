"""Every way a process ends is stored as it ended: the label's and the run's state and exit code
against the process's real exit status, with plain `python`, under `runbus run`, and under
`runbus run` in a script that never calls runbus.init() (its console's Run is made at its end).

Every ending runs once, as a real process against a real Redis, all of them before one ingest;
each case then reads its own run from the store. A rank killed without a handler (SIGKILL,
SIGSEGV) under `runbus run` is stored by its console keeper, with the exit status it reads while
the rank is unreaped, or crashed when the rank was reaped first: those tests run beside a live
ingester whose crash detection waits its default 120 s, so the keeper's notice is what ends them.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import redis

from runbus import wire
from tests.helpers import ingest, ingest_command, read_store, wait_for
from tests.test_launch import clean_env, wait_for_lines

# The script: an optional runbus.init(), then the ending, given as a statement in argv[1].
SCRIPT = textwrap.dedent(
    """
    import argparse, os, signal, sys, threading, time
    if sys.argv[2] == "init":
        import runbus
        run = runbus.init(system_interval=None, hardware=False)
        run.log({"x": 1.0})
    print("started", flush=True)
    exec(sys.argv[1])
    """
)
SELF_KILL = "os.kill(os.getpid(), signal.{}); time.sleep(60)"
SHIPPED_THEN_KILLED = (
    "deadline = time.monotonic() + 60\n"
    "while run.buffered and time.monotonic() < deadline: time.sleep(0.01)\n"
    "os.kill(os.getpid(), signal.SIGKILL)"
)
# A segfault's default action, with no handler of Python's (faulthandler off) and no core file.
SHIPPED_THEN_SEGFAULT = (
    "import faulthandler, resource\n"
    "faulthandler.disable()\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "deadline = time.monotonic() + 60\n"
    "while run.buffered and time.monotonic() < deadline: time.sleep(0.01)\n"
    "os.kill(os.getpid(), signal.SIGSEGV); time.sleep(60)"
)
# Python 3.11 cannot see a SystemExit raised without sys.exit (runbus.producer.exits): stored as 0.
RAISED_CODE = 4 if sys.version_info >= (3, 12) else 0


@dataclass(frozen=True)
class Ending:
    statement: str
    returncode: int  # the process's exit status, as subprocess reports it (-N: killed by signal N)
    stored: tuple[str, int | None]  # the state and exit code of the label and of the run
    # Where `runbus run` stores otherwise: its keeper reads the status of a rank killed without a
    # handler (subprocess.run reaps the rank only once the keeper has closed its stdout).
    under_keeper: tuple[str, int | None] | None = None

    def stored_in(self, mode: str) -> tuple[str, int | None]:
        return self.under_keeper if self.under_keeper and mode != "python" else self.stored


ENDINGS = {
    "normal": Ending("pass", 0, ("finished", 0)),
    "sys.exit(3)": Ending("sys.exit(3)", 3, ("failed", 3)),
    "sys.exit()": Ending("sys.exit()", 0, ("finished", 0)),
    "sys.exit(None)": Ending("sys.exit(None)", 0, ("finished", 0)),
    "sys.exit(message)": Ending("sys.exit('giving up')", 1, ("failed", 1)),
    "sys.exit(258)": Ending("sys.exit(258)", 2, ("failed", 2)),  # the OS keeps the low 8 bits
    "sys.exit(-1)": Ending("sys.exit(-1)", 255, ("failed", 255)),
    "sys.exit caught": Ending("try:\n    sys.exit(5)\nexcept SystemExit:\n    pass", 0, ("finished", 0)),
    "argparse error": Ending("argparse.ArgumentParser().parse_args(['--nope'])", 2, ("failed", 2)),
    "raise SystemExit(4)": Ending(
        "raise SystemExit(4)", 4, ("failed", 4) if RAISED_CODE else ("finished", 0)
    ),
    "exception": Ending("raise RuntimeError('blew up')", 1, ("failed", 1)),
    "KeyboardInterrupt": Ending("raise KeyboardInterrupt", -signal.SIGINT, ("failed", 130)),
    "SIGINT": Ending(SELF_KILL.format("SIGINT"), -signal.SIGINT, ("failed", 130)),
    "SIGTERM": Ending(SELF_KILL.format("SIGTERM"), -signal.SIGTERM, ("failed", 143)),
    "SIGHUP": Ending(SELF_KILL.format("SIGHUP"), -signal.SIGHUP, ("failed", 129)),
    # The process exits 0: only the thread failed. Its traceback is in the stored console.
    "exception in a thread": Ending(
        "t = threading.Thread(target=lambda: 1 / 0); t.start(); t.join()", 0, ("finished", 0)
    ),
    "os._exit(4)": Ending("os._exit(4)", 4, ("failed", 4)),
    # Nothing runs in the process: the ingester marks it crashed once it is silent; under
    # `runbus run` its keeper stores the status it read, 128 + the signal.
    "SIGKILL": Ending(SHIPPED_THEN_KILLED, -signal.SIGKILL, ("crashed", None), ("failed", 137)),
    "SIGSEGV": Ending(SHIPPED_THEN_SEGFAULT, -signal.SIGSEGV, ("crashed", None), ("failed", 139)),
}
KILLED = ("SIGKILL", "SIGSEGV")
MODES = ("python", "runbus run", "runbus run, no init")
CASES = [
    (mode, name)
    for mode in MODES
    for name in ENDINGS
    # A killed script that never made a Run leaves nothing to store.
    if not (mode == "runbus run, no init" and name in KILLED)
]


@dataclass(frozen=True)
class Outcome:
    returncode: int
    label: tuple[str, int | None]
    run: tuple[str, int | None]
    logs: list[str]


def run_id_of(mode: str, name: str) -> str:
    return f"ending-{MODES.index(mode)}-{list(ENDINGS).index(name)}"


def command(mode: str, name: str) -> list[str]:
    script = [sys.executable, "-c", SCRIPT, ENDINGS[name].statement, "bare" if "no init" in mode else "init"]
    if mode == "python":
        return script
    return [sys.executable, "-m", "runbus", "run", "--run-id", run_id_of(mode, name), "--", *script]


@pytest.fixture(scope="module")
def outcomes(redis_server_url, tmp_path_factory) -> dict[tuple[str, str], Outcome]:
    """Every case run once (a few at a time), then one ingest that also marks the silent crashed."""
    client = redis.Redis.from_url(redis_server_url)
    client.flushdb()
    client.close()
    store_url = f"sqlite:///{tmp_path_factory.mktemp('endings') / 'runbus.db'}"

    def end(case: tuple[str, str]) -> int:
        env = clean_env(redis_server_url, RUNBUS_RUN_ID=run_id_of(*case))
        done = subprocess.run(command(*case), env=env, capture_output=True, timeout=120)
        return done.returncode

    with ThreadPoolExecutor(max_workers=6) as pool:
        codes = dict(zip(CASES, pool.map(end, CASES), strict=True))
    ingest(redis_server_url, store_url, crash_after=0.0)  # every process has ended by now
    found = {}
    for case, code in codes.items():
        stored = read_store(store_url, "run", run_id_of(*case))
        if stored is None:  # nothing of it reached the store
            found[case] = Outcome(code, ("absent", None), ("absent", None), [])
            continue
        labels = {label.label: (label.state, label.exit_code) for label in stored.labels}
        logs = [line.text for line in read_store(store_url, "logs", run_id_of(*case))]
        found[case] = Outcome(
            code, labels.get("rank0", ("absent", None)), (stored.state, stored.exit_code), logs
        )
    return found


@pytest.mark.parametrize(("mode", "name"), CASES)
def test_every_ending_is_stored_as_the_process_ended(outcomes, mode, name):
    ending, outcome = ENDINGS[name], outcomes[(mode, name)]
    assert outcome.returncode == ending.returncode
    assert outcome.label == ending.stored_in(mode)
    assert outcome.run == ending.stored_in(mode)
    if name not in KILLED:  # under runbus run its line may still be in the keeper: not stored
        assert "started" in outcome.logs  # the console of the rank, before its end


@pytest.mark.parametrize("mode", MODES)
def test_an_exception_in_a_thread_is_in_the_stored_console(outcomes, mode):
    logs = outcomes[(mode, "exception in a thread")].logs
    assert any("ZeroDivisionError" in text for text in logs), logs


# -- killed under `runbus run`, beside a live ingester: what the keeper stores ------------------------

# A wait well inside the ingester's default --crash-after (120 s): what ends the label by then is
# the keeper's notice, not the ingester's crash detection.
PROMPTLY = 60.0


@pytest.fixture(scope="module")
def live_store(redis_server_url, tmp_path_factory) -> Iterator[str]:
    """A store with a `runbus ingest` following Redis, its --crash-after left at its default."""
    store_url = f"sqlite:///{tmp_path_factory.mktemp('keeper') / 'runbus.db'}"
    ingester = subprocess.Popen(
        ingest_command(redis_server_url, store_url), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    yield store_url
    ingester.terminate()
    ingester.wait(timeout=60)


def stored_end(store_url: str, run_id: str) -> tuple[tuple[str, int | None], tuple[str, int | None]] | None:
    """(the label's, the run's) state and exit code once the label has ended; else None."""
    stored = read_store(store_url, "run", run_id)
    labels = {label.label: label for label in stored.labels} if stored else {}
    rank0 = labels.get("rank0")
    if rank0 is None or rank0.state == "running":
        return None
    return (rank0.state, rank0.exit_code), (stored.state, stored.exit_code)


def started_rank(redis_url: str, run_id: str, statement: str) -> subprocess.Popen:
    """`runbus run -- python SCRIPT` as this test's child (the test is its launcher), once it
    printed "started" (its Run has claimed the label and told its keeper)."""
    rank = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runbus",
            "run",
            "--run-id",
            run_id,
            "--",
            sys.executable,
            "-c",
            SCRIPT,
            statement,
            "init",
        ],
        env=clean_env(redis_url, RUNBUS_RUN_ID=run_id),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert wait_for_lines(rank, 1) == ["started"]
    return rank


@pytest.mark.parametrize(("name", "code"), [("SIGKILL", 137), ("SIGSEGV", 139)])
def test_a_killed_rank_is_stored_by_its_keeper_with_its_status_while_unreaped(
    redis_server_url, live_store, name, code
):
    run_id = f"keeper-unreaped-{name}"
    with started_rank(redis_server_url, run_id, ENDINGS[name].statement) as rank:
        # Not reaped (no wait, no poll) until the store shows the end: the keeper reads the status.
        ended = wait_for(f"{run_id} ended", lambda: stored_end(live_store, run_id), timeout=PROMPTLY)
        assert rank.wait(timeout=60) == ENDINGS[name].returncode
    assert ended == (("failed", code), ("failed", code))


def keeper_of(pid: int) -> int:
    """The pid of the console keeper `runbus run` forked in the rank `pid` (its child)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    fields = handle.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                return int(entry)
    raise AssertionError(f"no child of {pid}")


def test_a_sigkilled_rank_reaped_at_once_is_stored_crashed_by_its_keeper(redis_server_url, live_store):
    run_id = "keeper-reaped"
    with started_rank(redis_server_url, run_id, "time.sleep(120)") as rank:
        keeper = keeper_of(rank.pid)
        # The keeper stopped while its rank is killed and reaped: its status is gone when it looks.
        os.kill(keeper, signal.SIGSTOP)
        try:
            rank.kill()
            assert rank.wait(timeout=60) == -signal.SIGKILL
        finally:
            os.kill(keeper, signal.SIGCONT)
    ended = wait_for(f"{run_id} ended", lambda: stored_end(live_store, run_id), timeout=PROMPTLY)
    assert ended == (("crashed", None), ("crashed", None))


def test_a_keeper_that_cannot_reach_redis_gives_up_and_exits(local_redis):
    with started_rank(local_redis.url, "keeper-no-redis", "time.sleep(120)") as rank:
        local_redis.kill()
        rank.kill()
        assert rank.wait(timeout=60) == -signal.SIGKILL
        # The keeper holds the rank's stdout until it exits: a few bounded tries, then it ends.
        assert rank.stdout is not None
        wait_for("the keeper's exit", lambda: select.select([rank.stdout], [], [], 1.0)[0], timeout=PROMPTLY)
        assert os.read(rank.stdout.fileno(), 4096) == b""


def test_a_rank_that_execs_with_a_run_unfinished_gets_no_notice_from_its_keeper(redis_server_url, live_store):
    """An exec closes the control pipe too, but the rank lives on: its first keeper stores no end."""
    run_id = "keeper-exec"
    code = "import runbus; runbus.init(system_interval=None, hardware=False); print('after exec')"
    statement = f"sys.stdout.flush(); os.execv(sys.executable, [sys.executable, '-c', {code!r}])"
    with started_rank(redis_server_url, run_id, statement) as rank:
        assert rank.wait(timeout=120) == 0
        assert rank.stdout is not None
        assert rank.stdout.read() == b"after exec\n"  # once both keepers have exited
    ended = wait_for(f"{run_id} ended", lambda: stored_end(live_store, run_id), timeout=PROMPTLY)
    assert ended == (("finished", 0), ("finished", 0))
    with redis.Redis.from_url(redis_server_url) as client:
        entries = client.xrange(wire.stream_key(run_id, "rank0"))
    assert [fields[b"data"] for _, fields in entries if b"noticed_by" in fields[b"data"]] == []
