"""`runbus run`: one run id for the job, each rank's console (fd-level writes included) stored from
its interpreter's start under the rank's label, the command's exit status and signals untouched."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runbus import config
from runbus.producer import bootstrap, keeper, launch
from tests.helpers import ingest, read_store

ANNOUNCED = re.compile(r"^runbus: run ([^\s:,]+)", re.MULTILINE)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def clean_env(redis_url: str, **extra: str) -> dict[str, str]:
    """The test's environment without any RUNBUS_ or launcher variable, logging to `redis_url`."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("RUNBUS_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_"))
        and name not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH")
    }
    return {**env, config.REDIS_URL_ENV: redis_url, **extra}


def runbus_run(
    *args: str, env: dict[str, str], timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runbus", "run", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def stored(redis_url: str, store_url: str, run_id: str) -> dict[str, list[tuple[str, str, str]]]:
    """Each label's stored log lines, (stream, level, text), in their order."""
    ingest(redis_url, store_url)
    lines: dict[str, list[tuple[str, str, str]]] = {}
    for line in read_store(store_url, "logs", run_id):
        lines.setdefault(line.label, []).append((line.stream, line.level, line.text))
    return lines


def texts(lines: list[tuple[str, str, str]], stream: str) -> list[str]:
    return [text for line_stream, _, text in lines if line_stream == stream]


def announced(stderr: str) -> str:
    ids = ANNOUNCED.findall(stderr)
    assert len(ids) == 1, stderr
    return ids[0]


def label_states(redis_url: str, store_url: str, run_id: str) -> dict[str, tuple[str, int | None]]:
    """Each label's state and exit code, once what Redis holds is ingested."""
    ingest(redis_url, store_url)
    return {
        label.label: (label.state, label.exit_code) for label in read_store(store_url, "run", run_id).labels
    }


# -- one process: every kind of write, in order ----------------------------------------------------

WRITES = """
    import ctypes, logging, os, sys
    libc = ctypes.CDLL(None)

    def c_write(fd, text):  # write(2) from C
        data = text.encode()
        libc.write(fd, data, len(data))

    def c_puts(text):  # C stdio, then fflush
        libc.puts(text.encode())
        libc.fflush(None)

    print("print before init")
    os.write(1, b"os.write before init\\n")
    c_puts("puts before init")
    c_write(1, "C write before init\\n")
    sys.stderr.write("stderr before init\\n")
    c_write(2, "C write to stderr before init\\n")

    import runbus
    run = runbus.init(system_interval=None, hardware=False)
    print("print after init")
    os.write(1, b"os.write after init\\n")
    c_puts("puts after init")
    c_write(1, "C write after init\\n")
    sys.stdout.buffer.write(b"bytes after init\\n")
    sys.stdout.flush()
    c_write(2, "C write to stderr after init\\n")
    logging.getLogger("train").warning("a record")
    run.log({"loss": 0.5}, step=1)
    print("a partial line", end="")
"""

STDOUT_LINES = [
    "print before init",
    "os.write before init",
    "puts before init",
    "C write before init",
    "print after init",
    "os.write after init",
    "puts after init",
    "C write after init",
    "bytes after init",
    "a partial line",
]


def test_every_write_is_stored_in_order_under_the_ranks_label(redis_url, store_url, tmp_path):
    result = runbus_run("--", sys.executable, script(tmp_path, "writes.py", WRITES), env=clean_env(redis_url))
    assert result.returncode == 0, result.stderr
    run_id = announced(result.stderr)
    assert result.stderr.startswith(f"runbus: run {run_id}: ")  # before anything the command writes
    # The terminal sees every byte, unchanged, and the text of the record once.
    assert result.stdout == "\n".join(STDOUT_LINES)
    assert result.stderr.count("a record") == 1
    assert "C write to stderr after init" in result.stderr

    lines = stored(redis_url, store_url, run_id)
    assert list(lines) == ["rank0"]
    rank0 = lines["rank0"]
    assert texts(rank0, "stdout") == STDOUT_LINES
    assert texts(rank0, "stderr") == [
        "stderr before init",
        "C write to stderr before init",
        "C write to stderr after init",
    ]
    assert [line for line in rank0 if line[0] == "logging"] == [("logging", "WARNING", "a record")]
    assert {level for stream, level, _ in rank0 if stream != "logging"} == {"INFO", "WARNING"}
    assert label_states(redis_url, store_url, run_id) == {"rank0": ("finished", 0)}


def test_a_script_that_never_calls_init_has_its_console_and_failure_stored(redis_url, store_url, tmp_path):
    failing = script(
        tmp_path,
        "failing.py",
        """
        import ctypes
        print("about to fail", flush=True)
        ctypes.CDLL(None).puts(b"C says goodbye")
        raise ValueError("boom")
        """,
    )
    result = runbus_run(sys.executable, failing, env=clean_env(redis_url))  # no `--` needed
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith("ValueError: boom")
    run_id = announced(result.stderr)
    rank0 = stored(redis_url, store_url, run_id)["rank0"]
    assert rank0[:2] == [("stdout", "INFO", "about to fail"), ("stdout", "INFO", "C says goodbye")]
    assert rank0[2] == ("stderr", "ERROR", "Traceback (most recent call last):")
    assert rank0[-1] == ("stderr", "ERROR", "ValueError: boom")
    assert label_states(redis_url, store_url, run_id) == {"rank0": ("failed", 1)}


def test_a_with_block_stores_its_traceback_once_after_the_lines_before_it(redis_url, store_url, tmp_path):
    body = """
        import os, runbus
        with runbus.init(system_interval=None, hardware=False):
            os.write(2, b"written just before\\n")
            1 / 0
    """
    result = runbus_run("--", sys.executable, script(tmp_path, "with.py", body), env=clean_env(redis_url))
    assert result.returncode == 1
    rank0 = stored(redis_url, store_url, announced(result.stderr))["rank0"]
    assert rank0[0] == ("stderr", "WARNING", "written just before")
    assert rank0[1] == ("stderr", "ERROR", "Traceback (most recent call last):")
    assert rank0[-1] == ("stderr", "ERROR", "ZeroDivisionError: division by zero")
    assert sum(text == "ZeroDivisionError: division by zero" for _, _, text in rank0) == 1


def test_c_code_holding_the_gil_writes_megabytes_without_a_hang(redis_url, store_url, tmp_path):
    # A reader thread inside the rank would need the GIL to empty the pipe: this write would
    # wait forever for it. The keeper reads from another process.
    body = """
        import ctypes, runbus
        line = b"x" * 99 + b"\\n"
        big = line * 30000  # 3 MB, in one write(2) made with the GIL held
        ctypes.PyDLL(None).write(1, big, len(big))
        run = runbus.init(system_interval=None, hardware=False)
        print("after the big write")
    """
    started = time.monotonic()
    result = runbus_run("--", sys.executable, script(tmp_path, "big.py", body), env=clean_env(redis_url))
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60
    assert len(result.stdout) == 30000 * 100 + len("after the big write\n")
    rank0 = stored(redis_url, store_url, announced(result.stderr))["rank0"]
    assert len(rank0) == 30001
    assert rank0[-1] == ("stdout", "INFO", "after the big write")
    assert all(text == "x" * 99 for _, _, text in rank0[:-1])


# -- torchrun: one run, a label per rank, children inside their rank's console ---------------------

RANKS = """
    import ctypes, multiprocessing, os, subprocess, sys
    rank = int(os.environ["RANK"])
    libc = ctypes.CDLL(None)

    def c_write(fd, text):
        data = text.encode()
        libc.write(fd, data, len(data))

    def spawned(rank):
        print(f"spawned child of rank {rank}", flush=True)

    def main():
        c_write(1, f"C before init on rank {rank}\\n")
        import torch, torch.distributed as dist, torch.utils.data as tud
        dist.init_process_group("gloo")
        import runbus
        run = runbus.init(system_interval=None, hardware=False)
        total = torch.ones(1)
        dist.all_reduce(total)
        c_write(1, f"C after init on rank {rank}: {total.item():.0f}\\n")
        c_write(2, f"ERROR: a C error on rank {rank}\\n")

        class Items(tud.Dataset):
            def __len__(self):
                return 2

            def __getitem__(self, index):
                # One write: torchrun runs ranks with -u, where print() writes its end apart
                sys.stdout.write(f"loader item {index} of rank {rank}\\n")
                return index

        list(tud.DataLoader(Items(), num_workers=2))  # forked workers
        child = multiprocessing.get_context("spawn").Process(target=spawned, args=(rank,))
        child.start()
        child.join()
        subprocess.run([sys.executable, "-c", f"print('subprocess of rank {rank}')"], check=True)
        run.log({"total": total.item()}, step=0)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
"""


@pytest.mark.timeout(300)
def test_torchrun_ranks_log_into_one_run_with_their_fd_level_output(redis_url, store_url, tmp_path):
    command = [TORCHRUN, "--nproc-per-node", "2", "--standalone", script(tmp_path, "ranks.py", RANKS)]
    result = runbus_run("--", *command, env=clean_env(redis_url), timeout=280)
    assert result.returncode == 0, result.stderr
    run_id = announced(result.stderr)

    lines = stored(redis_url, store_url, run_id)
    # The agent (torchrun) and every child of a rank (DataLoader workers, a spawned process, a
    # subprocess) logged no label of their own.
    assert sorted(lines) == ["rank0", "rank1"]
    for rank in (0, 1):
        out = texts(lines[f"rank{rank}"], "stdout")
        assert out[:2] == [f"C before init on rank {rank}", f"C after init on rank {rank}: 2"]
        assert sorted(out[2:4]) == [f"loader item 0 of rank {rank}", f"loader item 1 of rank {rank}"]
        assert out[4:] == [f"spawned child of rank {rank}", f"subprocess of rank {rank}"]
        assert ("stderr", "ERROR", f"ERROR: a C error on rank {rank}") in lines[f"rank{rank}"]
    assert label_states(redis_url, store_url, run_id) == {"rank0": ("finished", 0), "rank1": ("finished", 0)}

    # Echo rule "primary": rank 0 shows everything; rank 1 its errors only, prefixed.
    assert "C after init on rank 0: 2" in result.stdout
    assert "rank 1" not in result.stdout
    assert "[rank1] ERROR: a C error on rank 1" in result.stderr
    assert "\nERROR: a C error on rank 0" in result.stderr


@pytest.mark.timeout(200)
def test_sigterm_to_runbus_run_reaches_every_rank_under_torchrun(redis_url, store_url, tmp_path):
    sleepy = script(
        tmp_path,
        "sleepy.py",
        """
        import os, time
        os.write(1, f"rank {os.environ['RANK']} ready\\n".encode())
        time.sleep(120)
        """,
    )
    command = [sys.executable, "-m", "runbus", "run", "--console", "all", "--"]
    command += [TORCHRUN, "--nproc-per-node", "2", "--standalone", sleepy]
    process = subprocess.Popen(
        command, env=clean_env(redis_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert sorted(wait_for_lines(process, 2)) == ["[rank0] rank 0 ready", "[rank1] rank 1 ready"]
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    run_id = announced(err.decode())
    assert label_states(redis_url, store_url, run_id) == {"rank0": ("failed", 143), "rank1": ("failed", 143)}
    lines = stored(redis_url, store_url, run_id)
    assert texts(lines["rank1"], "stdout") == ["rank 1 ready"]


def wait_for_lines(process: subprocess.Popen, count: int, timeout: float = 120) -> list[str]:
    """The first `count` lines of the process's stdout, read without blocking past `timeout`."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    data = b""
    while data.count(b"\n") < count:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {count} lines within {timeout} s: {data!r}"
        chunk = os.read(process.stdout.fileno(), 4096)
        assert chunk, f"stdout closed after {data!r}"
        data += chunk
    return data.decode().splitlines()[:count]


# -- exit status and signals -------------------------------------------------------------------------


@pytest.mark.parametrize("with_init", [False, True])
def test_sigterm_reaches_the_command_and_its_console_is_stored(redis_url, store_url, tmp_path, with_init):
    body = """
        import os, sys, time
        if len(sys.argv) > 1:
            import runbus
            runbus.init(system_interval=None, hardware=False)
        os.write(1, b"ready\\n")
        time.sleep(120)
    """
    command = [sys.executable, "-m", "runbus", "run", "--", sys.executable, script(tmp_path, "wait.py", body)]
    if with_init:
        command.append("init")
    process = subprocess.Popen(
        command, env=clean_env(redis_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert wait_for_lines(process, 1, timeout=60) == ["ready"]
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGTERM  # the command died of it, as without runbus
    run_id = announced(err.decode())
    assert label_states(redis_url, store_url, run_id) == {"rank0": ("failed", 143)}
    assert stored(redis_url, store_url, run_id)["rank0"] == [("stdout", "INFO", "ready")]


def test_ctrl_c_is_the_commands(redis_url, store_url, tmp_path):
    body = """
        import os, time
        os.write(1, b"ready\\n")
        time.sleep(120)
    """
    command = [sys.executable, "-m", "runbus", "run", "--", sys.executable, script(tmp_path, "wait.py", body)]
    process = subprocess.Popen(
        command, env=clean_env(redis_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        wait_for_lines(process, 1, timeout=60)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGINT  # Python's own ending for an uncaught Ctrl-C
    assert err.decode().rstrip().endswith("KeyboardInterrupt")
    rank0 = stored(redis_url, store_url, announced(err.decode()))["rank0"]
    assert rank0[-1] == ("stderr", "ERROR", "KeyboardInterrupt")


def test_the_exit_status_is_the_commands(redis_url, tmp_path):
    env = clean_env(redis_url)
    assert runbus_run("--", sys.executable, "-c", "import sys; sys.exit(7)", env=env).returncode == 7
    shell = runbus_run("--", "sh", "-c", "echo not python; exit 5", env=env)  # any command runs
    assert (shell.returncode, shell.stdout) == (5, "not python\n")
    killed = runbus_run("--", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)", env=env)
    assert killed.returncode == -signal.SIGKILL
    missing = runbus_run("--", "no-such-command-anywhere", env=env)
    assert missing.returncode == 127
    assert missing.stderr == "runbus: command not found: no-such-command-anywhere\n"  # and no run id
    not_a_program = tmp_path / "garbage"
    not_a_program.write_bytes(b"\x7fELF not really")
    not_a_program.chmod(0o755)
    refused = runbus_run("--", str(not_a_program), env=env)
    assert refused.returncode == 126
    assert refused.stderr.splitlines()[-1].startswith(f"runbus: cannot run {not_a_program}: ")
    empty = runbus_run("--", env=env)
    assert empty.returncode == 1 and "no command to run" in empty.stderr


# -- the run id --------------------------------------------------------------------------------------


def test_each_runbus_run_is_a_run_of_its_own_and_the_id_is_printed_once(redis_url, store_url, tmp_path):
    hello = script(tmp_path, "hello.py", "print('hello')\n")
    env = clean_env(redis_url, **{config.DASHBOARD_URL_ENV: "http://dash.example:8000/"})
    first, second = (runbus_run("--", sys.executable, hello, env=env) for _ in range(2))
    first_id, second_id = announced(first.stderr), announced(second.stderr)
    assert first_id != second_id
    assert first.stderr.splitlines()[0] == (
        f"runbus: run {first_id}: runbus show {first_id} | http://dash.example:8000/#/run/{first_id}"
    )
    ingest(redis_url, store_url)
    run_ids = {run.run_id for run in read_store(store_url, "runs")}
    assert {first_id, second_id} <= run_ids
    chosen = runbus_run("--run-id", "chosen-id", "--", sys.executable, hello, env=env)
    assert announced(chosen.stderr) == "chosen-id"
    bad = runbus_run("--run-id", "not a name", "--", sys.executable, hello, env=env)
    assert bad.returncode == 2 and "invalid" in bad.stderr


def test_every_task_of_an_srun_job_agrees_and_only_task_0_prints(redis_url, store_url, tmp_path):
    # What `srun --ntasks 2 runbus run -- python task.py` starts: one runbus run per task.
    task = script(
        tmp_path,
        "task.py",
        "import os\nos.write(1, b'task ' + os.environ['SLURM_PROCID'].encode() + b'\\n')\n",
    )
    tasks = []
    for procid in ("0", "1"):
        env = clean_env(
            redis_url,
            SLURM_JOB_ID="4242",
            SLURM_STEP_ID="3",
            SLURM_PROCID=procid,
            SLURM_LOCALID=procid,
            SLURM_NTASKS="2",
            SLURM_STEP_NUM_TASKS="2",
        )
        command = [sys.executable, "-m", "runbus", "run", "--", sys.executable, task]
        tasks.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [process.communicate(timeout=120) for process in tasks]
    assert [process.returncode for process in tasks] == [0, 0]
    assert outputs[0][1] == "runbus: run slurm-4242.3: runbus show slurm-4242.3\n"
    assert outputs[1][1] == ""  # the run id is printed once for the job
    lines = stored(redis_url, store_url, "slurm-4242.3")
    assert lines == {"rank0": [("stdout", "INFO", "task 0")], "rank1": [("stdout", "INFO", "task 1")]}


# -- what runbus run leaves alone -------------------------------------------------------------------


def test_console_off_captures_nothing(redis_url, store_url, tmp_path):
    body = """
        import os, runbus
        run = runbus.init(system_interval=None, hardware=False)
        os.write(1, b"shown only\\n")
        print(os.environ.get("RUNBUS_CONSOLE_OWNER"))
    """
    result = runbus_run(
        "--console", "off", "--", sys.executable, script(tmp_path, "off.py", body), env=clean_env(redis_url)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "shown only\nNone\n"
    assert stored(redis_url, store_url, announced(result.stderr)) == {}


def test_a_sitecustomize_of_the_users_still_runs(redis_url, store_url, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['USERS_SITECUSTOMIZE'] = 'ran'\n")
    body = "import os\nprint(os.environ.get('USERS_SITECUSTOMIZE'))\n"
    env = clean_env(redis_url, PYTHONPATH=str(own))
    result = runbus_run("--", sys.executable, script(tmp_path, "site.py", body), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran\n"
    assert stored(redis_url, store_url, announced(result.stderr))["rank0"] == [("stdout", "INFO", "ran")]


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system Python")
def test_another_python_without_runbus_runs_untouched(redis_url, tmp_path):
    # Started in tmp_path: the repository's runbus/ folder is not in the working directory.
    probe = subprocess.run(["/usr/bin/python3", "-c", "import runbus"], capture_output=True, cwd=tmp_path)
    if probe.returncode == 0:
        pytest.skip("the system Python has runbus")
    command = ("--", "/usr/bin/python3", "-c", "print('plain')")
    result = runbus_run(*command, env=clean_env(redis_url), cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "plain\n")
    assert result.stderr.count("\n") == 1  # the run id line alone: no error from the hook


def test_an_exec_in_the_rank_claims_the_console_again(redis_url, store_url, tmp_path):
    body = """
        import os, sys
        os.write(1, b"before exec\\n")
        code = "import runbus; runbus.init(system_interval=None, hardware=False); print('after exec')"
        os.execv(sys.executable, [sys.executable, "-c", code])
    """
    result = runbus_run("--", sys.executable, script(tmp_path, "exec.py", body), env=clean_env(redis_url))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before exec\nafter exec\n"
    rank0 = stored(redis_url, store_url, announced(result.stderr))["rank0"]
    assert rank0 == [("stdout", "INFO", "after exec")]  # the first image never made a Run


# -- the pieces, without processes ---------------------------------------------------------------


def test_who_claims_a_console():
    python = sys.executable
    launch_env = {config.LAUNCH_ENV: "100"}
    assert bootstrap.claims_console(launch_env, [python, "train.py"], 100)  # the command itself
    assert not bootstrap.claims_console(launch_env, [python, "train.py"], 101)  # some other Python
    assert not bootstrap.claims_console({}, [python, "train.py"], 100)  # not under runbus run
    ranked = {**launch_env, "RANK": "1", "LOCAL_RANK": "1"}
    assert bootstrap.claims_console(ranked, [python, "-u", "train.py"], 555)
    for launcher in (
        [python, "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"],
        [python, "-m", "torch.distributed.run", "train.py"],
        [python, "-X", "dev", "-mtorch.distributed.launch", "train.py"],
        [python, "/venv/bin/accelerate", "launch", "train.py"],
    ):
        assert not bootstrap.claims_console({**ranked, "SLURM_PROCID": "0"}, launcher, 100), launcher
    assert not bootstrap.claims_console({**ranked, config.CONSOLE_ENV: "off"}, [python, "t.py"], 555)
    # The rank's children share its rank variables; another rank, or the rank's exec, does not.
    owned = {**ranked, config.CONSOLE_OWNER_ENV: bootstrap.owner_marker(555, ranked)}
    assert not bootstrap.claims_console(owned, [python, "-c", "worker"], 556)
    assert bootstrap.claims_console(owned, [python, "train.py"], 555)
    assert bootstrap.claims_console({**owned, "RANK": "2"}, [python, "train.py"], 557)
    sole = bootstrap.owner_marker(100, launch_env)
    assert not bootstrap.claims_console(
        {**launch_env, config.CONSOLE_OWNER_ENV: sole}, [python, "x"], 100 + 1
    )
    spawned_rank = {**launch_env, "LOCAL_RANK": "1", config.CONSOLE_OWNER_ENV: sole}
    assert bootstrap.claims_console(spawned_rank, [python, "train.py"], 101)  # Lightning's way


def test_the_run_id_of_the_job():
    assert launch.job_run_id("given", {config.RUN_ID_ENV: "env"}, []) == "given"
    assert launch.job_run_id(None, {config.RUN_ID_ENV: "env"}, []) == "env"
    assert launch.job_run_id(None, {"TORCHELASTIC_RUN_ID": "elastic"}, []) == "elastic"
    slurm_task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2", "SLURM_PROCID": "1"}
    assert launch.job_run_id(None, slurm_task, []) == "slurm-7.2"
    torchrun = ["torchrun", "--nnodes", "2", "--rdzv_id=job-9", "train.py", "--rdzv-id", "not-this"]
    assert launch.job_run_id(None, {"TORCHELASTIC_RUN_ID": "none"}, torchrun) == "job-9"
    module = ["python3", "-m", "torch.distributed.run", "--rdzv-id", "job-10", "train.py"]
    assert launch.job_run_id(None, {}, module) == "job-10"
    assert launch.job_run_id(None, {}, ["python", "train.py", "--rdzv-id", "x"]).startswith("run-")
    with pytest.raises(ValueError, match="rdzv-id"):
        launch.job_run_id(None, {}, ["torchrun", "--rdzv-id", "a b", "train.py"])


def test_which_runbus_run_prints_the_id():
    assert launch.announces({}, ["python", "train.py"])
    assert launch.announces({"SLURM_PROCID": "0"}, ["python", "train.py"])
    assert not launch.announces({"SLURM_PROCID": "3"}, ["python", "train.py"])
    assert not launch.announces({"OMPI_COMM_WORLD_RANK": "1"}, ["python", "train.py"])
    assert not launch.announces({}, ["torchrun", "--node-rank", "1", "train.py"])
    assert launch.announces({}, ["torchrun", "--node_rank=0", "train.py"])
    assert launch.announcement("r1", {}) == "runbus: run r1: runbus show r1"
    line = launch.announcement("r1", {config.DASHBOARD_URL_ENV: "http://u:hunter2@h:8080/?token=t0k"})
    assert line.startswith("runbus: run r1: runbus show r1 | http://")
    assert "hunter2" not in line and "t0k" not in line and line.endswith("#/run/r1")


def test_the_commands_pythonpath_starts_with_the_hook_once():
    env = {"PYTHONPATH": f"/mine{os.pathsep}{launch.BOOT_DIR}"}
    added = launch.command_env("r1", env, redis_url="redis://h:1/0", console="all")
    assert added["PYTHONPATH"] == f"{launch.BOOT_DIR}{os.pathsep}/mine"
    assert (launch.BOOT_DIR / "sitecustomize.py").is_file()
    assert added[config.RUN_ID_ENV] == "r1" and added[config.CONSOLE_ENV] == "all"
    assert added[config.LAUNCH_ENV] == str(os.getpid())


# -- the keeper, fed by hand ----------------------------------------------------------------------


class Pipes:
    """A Keeper on real pipes, with its echo going to two more pipes this test reads."""

    def __init__(self, echo: str = "raw", label: str = "rank0") -> None:
        self.out_read, self.out_write = os.pipe()
        self.err_read, self.err_write = os.pipe()
        self.control_read, self.control_write = os.pipe()
        self.feed_read, self.feed_write = os.pipe()
        self.shown_out = os.pipe()
        self.shown_err = os.pipe()
        self.keeper = keeper.Keeper(
            self.out_read,
            self.err_read,
            self.control_read,
            self.feed_write,
            echo,
            label,
            shown=(self.shown_out[1], self.shown_err[1]),
        )
        for fd in (self.feed_write, self.out_read, self.err_read):
            os.set_blocking(fd, False)
        self.stdout = self.keeper.streams[self.out_read]
        self.stderr = self.keeper.streams[self.err_read]

    def frames(self) -> list[tuple[int, bytes]]:
        self.keeper.send()
        os.set_blocking(self.feed_read, False)
        data = b""
        while True:
            try:
                chunk = os.read(self.feed_read, 1 << 20)
            except BlockingIOError:
                break
            data += chunk
        import io

        return list(keeper.read_frames(io.BytesIO(data)))

    def shown(self, which: tuple[int, int]) -> bytes:
        os.set_blocking(which[0], False)
        try:
            return os.read(which[0], 1 << 20)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        for fd in (
            self.out_read, self.out_write, self.err_read, self.err_write, self.control_read,
            self.control_write, self.feed_read, self.feed_write, *self.shown_out, *self.shown_err,
        ):  # fmt: skip
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def pipes():
    made: list[Pipes] = []

    def make(**kw) -> Pipes:
        made.append(Pipes(**kw))
        return made[-1]

    yield make
    for item in made:
        item.close()


def lines_of(frames: list[tuple[int, bytes]]) -> list[tuple[str, str, str]]:
    return [
        (keeper.STREAM_OF_KIND[kind], *keeper.split_line(payload))
        for kind, payload in frames
        if kind in keeper.STREAM_OF_KIND
    ]


def test_the_keeper_takes_marks_apart_however_the_bytes_arrive(pipes):
    held = pipes()
    record = keeper.marked(keeper.RECORD, keeper.line_payload("ERROR", "a record\nwith two lines"))
    shown_only = keeper.marked(keeper.RULE, b"WARNING:train:printed by a handler\n")
    fake = b"\x1b_runbus:Zzzzzzzzz\x1b\\ not a mark\n"
    data = b"one\ntw" + shown_only + b"o\n" + record + fake + b"caf\xc3\xa9 \xff\n"
    for byte in range(len(data)):  # one byte per read: every mark split everywhere
        held.stdout.data(data[byte : byte + 1])
    held.keeper.control_data(b"adopt raw rank0\n")
    assert lines_of(held.frames()) == [
        ("stdout", "INFO", "one"),
        ("stdout", "INFO", "two"),
        ("logging", "ERROR", "a record\nwith two lines"),
        ("stdout", "INFO", "\x1b_runbus:Zzzzzzzzz\x1b\\ not a mark"),
        ("stdout", "INFO", "caf\u00e9 \ufffd"),
    ]
    shown = held.shown(held.shown_out)
    assert (
        shown == b"one\ntw" + b"WARNING:train:printed by a handler\n" + b"o\n" + fake + b"caf\xc3\xa9 \xff\n"
    )


def test_the_keeper_echo_rules(pipes):
    errors = pipes(echo="errors", label="rank3")
    errors.stderr.data(b"fine\nRuntimeError: broke\n" + keeper.marked(keeper.RULE, b"hidden\n"))
    errors.stderr.data(keeper.marked(keeper.ALWAYS, b"runbus: shown\n"))
    assert errors.shown(errors.shown_err) == b"[rank3] RuntimeError: broke\n[rank3] runbus: shown\n"
    prefixed = pipes(echo="prefixed", label="rank1")
    prefixed.stdout.data(b"a\r50%\r100%\nb")
    assert prefixed.shown(prefixed.shown_out) == b"[rank1] a\r[rank1] 50%\r[rank1] 100%\n[rank1] b"
    prefixed.keeper.control_data(b"adopt raw rank1\n")  # a Run may change the rule
    prefixed.stdout.data(b"c\n")
    assert prefixed.shown(prefixed.shown_out) == b"c\n"
    assert lines_of(prefixed.frames()) == [("stdout", "INFO", "100%"), ("stdout", "INFO", "bc")]


def test_the_keeper_drops_the_oldest_lines_past_its_bound_and_says_how_many(pipes, monkeypatch):
    monkeypatch.setattr(keeper, "MAX_HELD_BYTES", 10_000)
    held = pipes(echo="errors")
    for number in range(1000):
        held.stdout.data(f"line {number:04d}\n".encode())
    held.keeper.control_data(b"adopt errors rank0\n")
    frames = held.frames()
    assert frames[0][0] == keeper.DROPPED
    dropped = int(frames[0][1])
    kept = lines_of(frames)
    assert dropped + len(kept) == 1000 and dropped > 0
    assert kept[-1] == ("stdout", "INFO", "line 0999")  # the newest are kept
    assert kept[0] == ("stdout", "INFO", f"line {dropped:04d}")


def test_a_release_hands_over_partial_lines_then_its_token(pipes):
    held = pipes()
    held.keeper.control_data(b"adopt raw rank0\n")
    os.write(held.out_write, b"written before the release, no newline")
    held.keeper.control_data(b"release 7\n")  # reads the pipe itself, then answers
    held.stdout.data(b"after the release\n")
    frames = held.frames()
    assert lines_of(frames) == [("stdout", "INFO", "written before the release, no newline")]
    assert frames[-1] == (keeper.ACK, b"7")


def test_a_slow_rank_never_blocks_the_keeper(pipes):
    held = pipes(echo="errors")  # nothing shown: only the feed could block
    held.keeper.control_data(b"adopt errors rank0\n")
    line = b"y" * 1000 + b"\n"
    for _ in range(2000):  # 2 MB: more than the feed pipe holds, while no one reads it
        held.stdout.data(line)
        held.keeper.send()
    assert held.keeper.pending  # kept for later, not written with a wait
    received = lines_of(held.frames())
    assert 0 < len(received) < 2000


def test_no_mark_goes_to_an_fd_that_no_longer_reaches_the_keeper():
    capture = bootstrap.FdCapture(0, -1, -1, {1: (0, 0)})
    assert not capture.points_at_keeper(1)
    assert not capture.write_marked(1, keeper.ALWAYS, b"x")


def test_os_exit_in_the_rank_still_stores_its_console(redis_url, store_url, tmp_path):
    body = """
        import os, runbus
        os.write(1, b"before init\\n")
        run = runbus.init(system_interval=None, hardware=False)
        print("skipping the teardown", flush=True)
        if os.fork() == 0:
            os._exit(0)  # a forked child's os._exit: at once, the rank's Run untouched
        os.wait()
        os._exit(3)
    """
    result = runbus_run("--", sys.executable, script(tmp_path, "quick.py", body), env=clean_env(redis_url))
    assert result.returncode == 3
    run_id = announced(result.stderr)
    rank0 = stored(redis_url, store_url, run_id)["rank0"]
    assert texts(rank0, "stdout") == ["before init", "skipping the teardown"]
    assert label_states(redis_url, store_url, run_id) == {"rank0": ("failed", 3)}
