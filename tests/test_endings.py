"""Every way a process ends is stored as it ended: the label's and the run's state and exit code
against the process's real exit status, with plain `python`, under `runbus run`, and under
`runbus run` in a script that never calls runbus.init() (its console's Run is made at its end).

Every ending runs once, as a real process against a real Redis, all of them before one ingest;
each case then reads its own run from the store.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import redis

from tests.helpers import ingest, read_store
from tests.test_launch import clean_env

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
# Python 3.11 cannot see a SystemExit raised without sys.exit (runbus.producer.exits): stored as 0.
RAISED_CODE = 4 if sys.version_info >= (3, 12) else 0


@dataclass(frozen=True)
class Ending:
    statement: str
    returncode: int  # the process's exit status, as subprocess reports it (-N: killed by signal N)
    stored: tuple[str, int | None]  # the state and exit code of the label and of the run


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
    # Nothing runs in the process: the ingester marks it crashed once it is silent.
    "SIGKILL": Ending(SHIPPED_THEN_KILLED, -signal.SIGKILL, ("crashed", None)),
}
MODES = ("python", "runbus run", "runbus run, no init")
CASES = [
    (mode, name)
    for mode in MODES
    for name in ENDINGS
    # A SIGKILLed script that never made a Run leaves nothing to store.
    if not (mode == "runbus run, no init" and name == "SIGKILL")
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
    assert outcome.label == ending.stored
    assert outcome.run == ending.stored
    if name != "SIGKILL":  # under runbus run its line may still be in the keeper: not stored
        assert "started" in outcome.logs  # the console of the rank, before its end


@pytest.mark.parametrize("mode", MODES)
def test_an_exception_in_a_thread_is_in_the_stored_console(outcomes, mode):
    logs = outcomes[(mode, "exception in a thread")].logs
    assert any("ZeroDivisionError" in text for text in logs), logs
