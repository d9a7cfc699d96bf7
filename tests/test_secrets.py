"""Secrets never stored, shown or logged; text from the bus never drives the terminal.

Against a real Redis, real stores (SQLite and PostgreSQL) and real `runbus` processes: configs and
command lines full of credentials, start entries written by hand, a store written by an older
runbus, workers given passwords in their URLs (right and wrong), and log lines, metric keys and
dead letters full of escape sequences. The bytes that land in the store and on stdout and stderr
are searched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, quote_plus

import asyncpg
import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

import runbus
from runbus import config, wire
from runbus.dashboard.api import create_app
from runbus.ingester.localredis import LocalRedis
from runbus.redact import MARKER
from tests.conftest import private_redis
from tests.helpers import get_json, ingest, read_store, run_cli, xadd_event
from tests.pgserver import LocalPostgres

RUN = "secret-run"
SECRETS = {
    "api_key": "sekrit-api-key-1",
    "hf_token": "hf_" + "SeKrItHfToKeN" * 3,
    "db_password": "sekrit-db-pw-3",
    "url_password": "sekrit-url-pw-4",
    "query_password": "sekrit-query-pw-5",
    "authorization": "sekrit-bearer-6",
}


def namespace_config() -> argparse.Namespace:
    """The documented use: `config=args`, args from argparse."""
    return argparse.Namespace(
        lr=3e-4,
        max_tokens=2048,
        api_key=SECRETS["api_key"],
        hf_token=SECRETS["hf_token"],
        db_password=SECRETS["db_password"],
        redis_url=f"redis://runbus:{SECRETS['url_password']}@cache:6379/0",
        cache_url=f"redis://cache:6379/1?password={SECRETS['query_password']}",
        headers={"authorization": f"Bearer {SECRETS['authorization']}"},
    )


def nested_config() -> dict:
    return {
        "optimizer": {"name": "adamw", "lr": 3e-4},
        "services": {
            "hub": {"hf_token": SECRETS["hf_token"], "repo": "org/model"},
            "db": [{"db_password": SECRETS["db_password"], "host": "db"}],
            "urls": [
                f"postgresql://trainer:{SECRETS['url_password']}@db:5432/runs",
                f"redis://cache:6379/0?password={SECRETS['query_password']}",
            ],
        },
        "api": {
            "api_key": SECRETS["api_key"],
            "headers": {"Authorization": f"Bearer {SECRETS['authorization']}"},
        },
    }


@pytest.fixture(params=["sqlite", "postgres"])
def any_store(request) -> str:
    return request.getfixturevalue("store_url" if request.param == "sqlite" else "postgres_url")


def store_contents(store_url: str) -> str:
    """Everything the store holds, as text: the SQLite files' bytes, or every PostgreSQL row."""
    if store_url.startswith("sqlite:///"):
        path = Path(store_url.removeprefix("sqlite:///"))
        files = sorted(path.parent.glob(path.name + "*"))
        assert files, store_url
        return "".join(f.read_bytes().decode("utf-8", errors="replace") for f in files)

    async def dump() -> str:
        con = await asyncpg.connect(store_url)
        try:
            tables = await con.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            rows = [
                await con.fetch(f'SELECT t::text AS row FROM "{table["tablename"]}" t') for table in tables
            ]
        finally:
            await con.close()
        return "\n".join(r["row"] for table_rows in rows for r in table_rows)

    return asyncio.run(dump())


def store_execute(store_url: str, statement: str) -> None:
    """One SQL statement run straight on the store, as an older runbus (or a person) might."""
    if store_url.startswith("sqlite:///"):
        with sqlite3.connect(store_url.removeprefix("sqlite:///")) as con:
            con.execute(statement)
        return

    async def run() -> None:
        con = await asyncpg.connect(store_url)
        try:
            await con.execute(statement)
        finally:
            await con.close()

    asyncio.run(run())


def api_run(store_url: str, run_id: str) -> dict:
    """The dashboard API's document of one run."""

    async def get() -> dict:
        async with TestClient(TestServer(create_app(store_url))) as client:
            response = await client.get(f"/api/runs/{run_id}")
            assert response.status == 200, await response.text()
            document: dict = await response.json()
            return document

    return asyncio.run(get())


def redis_contents(redis_url: str) -> str:
    """Every entry of every stream in Redis, as text."""
    with redis.Redis.from_url(redis_url) as client:
        keys = list(client.scan_iter(_type="stream"))
        return repr([client.xrange(key) for key in keys])


def assert_no_secret(where: str, text: str, secrets: list[str] | None = None) -> None:
    for secret in SECRETS.values() if secrets is None else secrets:
        assert secret not in text, f"{secret!r} found in {where}"


def all_shown(store_url: str, run_id: str) -> dict[str, str]:
    """The run as every reader shows it: the store's bytes, `show`, `show --json`, the API."""
    return {
        "the store": store_contents(store_url),
        "runbus show": run_cli("--store", store_url, "show", run_id).stdout,
        "runbus show --json": run_cli("--store", store_url, "show", run_id, "--json").stdout,
        "the API": json.dumps(api_run(store_url, run_id)),
    }


@pytest.mark.parametrize("make_config", [namespace_config, nested_config], ids=["namespace", "nested-dict"])
def test_config_secrets_are_never_stored_or_shown(redis_url, any_store, make_config):
    run = runbus.init(
        run_id=RUN, label="rank0", primary=True, redis_url=redis_url, config=make_config(),
        system_interval=None, console="off",
    )  # fmt: skip
    run.log({"loss": 1.0}, step=1)
    assert run.finish(timeout=30)
    assert_no_secret("Redis, before any ingest", redis_contents(redis_url))
    ingest(redis_url, any_store)
    for where, text in all_shown(any_store, RUN).items():
        assert_no_secret(where, text)
        assert MARKER in text, where

    shown = json.loads(run_cli("--store", any_store, "show", RUN, "--json").stdout)["config"]
    if make_config is namespace_config:
        assert shown == {
            "lr": 3e-4,
            "max_tokens": 2048,  # a harmless name that holds "token" stays visible
            "api_key": MARKER,
            "hf_token": MARKER,
            "db_password": MARKER,
            "redis_url": "redis://runbus:***@cache:6379/0",
            "cache_url": "redis://cache:6379/1?password=***",
            "headers": {"authorization": MARKER},
        }
    else:
        assert shown["services"]["urls"] == [
            "postgresql://trainer:***@db:5432/runs",
            "redis://cache:6379/0?password=***",
        ]
        assert shown["services"]["hub"] == {"hf_token": MARKER, "repo": "org/model"}
        assert shown["api"]["headers"] == {"Authorization": MARKER}


ARGV_SECRETS = [f"argv-sekrit-{n}" for n in range(1, 14)]


def test_command_line_secrets_are_never_stored(redis_url, store_url, monkeypatch):
    s = ARGV_SECRETS
    argv = [
        "train.py",
        "--api-key", s[0],
        "--hf-token=" + s[1],
        "--redis-url", f"redis://runbus:{s[2]}@cache:6379/0",
        "--redis-url=" + f"redis://cache:6379/0?password={s[3]}",
        "-p", s[4],
        "-p" + s[5],
        "--pass", s[6],
        "--auth", s[7],
        "--auth=" + s[8],
        f"postgresql://trainer:{s[9]}@db/runs",
        f"redis://:{quote(s[10])}@127.0.0.1:6379/0",
        "db.password=" + s[11],
        "--header", f"Authorization: Bearer {s[12]}-and-more",
        "--lr", "0.1",
        "--num-passes", "3",
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    run = runbus.init(
        run_id=RUN, label="rank0", primary=True, redis_url=redis_url, system_interval=None, console="off"
    )
    assert run.finish(timeout=30)
    assert_no_secret("Redis", redis_contents(redis_url), s)
    ingest(redis_url, store_url)
    assert_no_secret("the store", store_contents(store_url), s)
    [label] = read_store(store_url, "run", RUN).labels
    assert label.start["hardware"]["argv"] == [
        "train.py",
        "--api-key", MARKER,
        "--hf-token=***",
        "--redis-url", "redis://runbus:***@cache:6379/0",
        "--redis-url=redis://cache:6379/0?password=***",
        "-p", MARKER,
        "-p***",
        "--pass", MARKER,
        "--auth", MARKER,
        "--auth=***",
        "postgresql://trainer:***@db/runs",
        "redis://:***@127.0.0.1:6379/0",
        "db.password=***",
        "--header", "Authorization: Bearer ***",
        "--lr", "0.1",
        "--num-passes", "3",
    ]  # fmt: skip


HAND_WRITTEN = {
    "primary": True,
    "config": {
        "lr": 0.5,
        "api_key": SECRETS["api_key"],
        "db": {
            "url": f"postgresql://u:{SECRETS['url_password']}@db/x",
            "db_password": SECRETS["db_password"],
        },
    },
    "hardware": {
        "argv": ["train.py", "--hf-token", SECRETS["hf_token"], "--auth=" + SECRETS["authorization"]]
    },
}


def test_a_start_entry_written_by_hand_is_stored_and_shown_redacted(redis_url, any_store):
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, HAND_WRITTEN)
        xadd_event(client, RUN, "rank0", "finish", 1, 2, {"exit_code": 0})
    ingest(redis_url, any_store)
    for where, text in all_shown(any_store, RUN).items():
        assert_no_secret(where, text)
    [label] = read_store(any_store, "run", RUN).labels
    assert label.start["hardware"]["argv"] == ["train.py", "--hf-token", MARKER, "--auth=***"]
    assert label.start["config"]["db"] == {"url": "postgresql://u:***@db/x", "db_password": MARKER}


def test_metadata_secrets_are_never_stored_or_shown(redis_url, any_store):
    """Secrets set after init, through run.config.update and run.summary, and in meta entries
    written by hand (in values, and as keys), and in a store edited by hand: never shown."""
    with runbus.init(
        run_id=RUN, label="rank0", redis_url=redis_url, system_interval=None, console="off"
    ) as run:
        run.config.update(namespace_config())
        run.summary.update(
            {"hf_token": SECRETS["hf_token"], "note": f"authorization={SECRETS['authorization']}"}
        )
    assert_no_secret("Redis, before any ingest", redis_contents(redis_url))
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank1", "meta", 1, 1, {
            "config": {SECRETS["hf_token"]: 1, "db": {"db_password": SECRETS["db_password"]}},
            "summary": {"api_key": SECRETS["api_key"]},
        })  # fmt: skip
    ingest(redis_url, any_store)
    for where, text in all_shown(any_store, RUN).items():
        assert_no_secret(where, text)
        assert MARKER in text, where
    doc = json.loads(run_cli("--store", any_store, "show", RUN, "--json").stdout)
    assert doc["labels"][1]["config"] == {MARKER: 1, "db": {"db_password": MARKER}}
    assert doc["summary"] == {"hf_token": MARKER, "note": "authorization=***", "api_key": MARKER}
    assert doc["set_by"]["summary"] == {"hf_token": "rank0", "note": "rank0", "api_key": "rank1"}

    summary = json.dumps({"api_key": SECRETS["api_key"], SECRETS["hf_token"]: 1}).replace("'", "''")
    store_execute(
        any_store, f"UPDATE runs SET summary = '{summary}', name = 'db_password={SECRETS['db_password']}'"
    )
    shown = {k: v for k, v in all_shown(any_store, RUN).items() if k != "the store"}
    shown["runbus runs"] = run_cli("--store", any_store, "runs").stdout
    shown["runbus runs --json"] = run_cli("--store", any_store, "runs", "--json").stdout
    for where, text in shown.items():
        assert_no_secret(where, text)


def test_a_store_holding_secrets_shows_them_redacted(redis_url, any_store):
    """A store written by an older runbus, or edited by hand, still holds the secrets: what
    `show`, `show --json` and the API print is redacted all the same."""
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True, "config": {"lr": 0.5}})
    ingest(redis_url, any_store)
    config = json.dumps(HAND_WRITTEN["config"]).replace("'", "''")
    store_execute(any_store, f"UPDATE runs SET config = '{config}' WHERE run_id = '{RUN}'")
    assert SECRETS["api_key"] in store_contents(any_store)
    shown = {k: v for k, v in all_shown(any_store, RUN).items() if k != "the store"}
    for where, text in shown.items():
        assert_no_secret(where, text)
    doc = json.loads(shown["runbus show --json"])
    assert doc["config"] == {
        "lr": 0.5,
        "api_key": MARKER,
        "db": {"url": "postgresql://u:***@db/x", "db_password": MARKER},
    }
    assert json.loads(shown["the API"])["config"] == doc["config"]


# -- console lines ----------------------------------------------------------------------------------

# Each shape of secret a console line can hold; each secret is a string found nowhere else.
LINE_SECRETS = [
    "hunter2pw", "abc.def.ghi", "pw-in-log-42", "tok-in-log-77", "key-in-log-88", "dsn-pw-in-log-7",
    "MIIEpemBODYsecretLINE1", "pemBODYsecretLINE2xyz",
]  # fmt: skip
SHAPES = (
    "redis://:hunter2pw@h Authorization: Bearer abc.def.ghi password=pw-in-log-42 token=tok-in-log-77"
    " api_key=key-in-log-88 postgresql://alice:dsn-pw-in-log-7@db/x"
)
SHAPES_SHOWN = (
    "redis://:***@h Authorization: Bearer *** password=*** token=*** api_key=*** postgresql://alice:***@db/x"
)
PEM_LINES = [
    "-----BEGIN RSA PRIVATE KEY-----", "MIIEpemBODYsecretLINE1", "pemBODYsecretLINE2xyz==",
    "-----END RSA PRIVATE KEY-----",
]  # fmt: skip
PEM = "\n".join(PEM_LINES)

# Every way a line leaves a rank: print, logging (a record, a record with a traceback), a
# traceback printed and one uncaught, log_text and the Run's logging handler, C's write(2) to
# fds 1 and 2 and puts (stored under `runbus run` only), and a private key over several lines.
CONSOLE_SCRIPT = f"""
    import ctypes, logging, sys, traceback
    SHAPES, PEM = {SHAPES!r}, {PEM!r}
    libc = ctypes.CDLL(None)

    def c_write(fd, text):
        data = text.encode()
        libc.write(fd, data, len(data))

    run = None
    if sys.argv[1] == "init":
        import runbus
        run = runbus.init(system_interval=None, hardware=False)
    print("print:", SHAPES)
    print(PEM)
    log = logging.getLogger("train")
    log.warning("logging: %s", SHAPES)
    log.error("a logged key:\\n%s", PEM)
    try:
        raise ConnectionError("caught: " + SHAPES)
    except ConnectionError:
        traceback.print_exc()
        log.exception("logging.exception")
    if run is not None:
        run.log_text("log_text: " + SHAPES)
        handled = logging.getLogger("handled")
        handled.propagate = False
        handled.addHandler(run.logging_handler())
        handled.warning("handler: %s", SHAPES)
    c_write(1, "C stdout: " + SHAPES + "\\n")
    c_write(2, "C stderr: " + SHAPES + "\\n")
    libc.puts(("puts: " + SHAPES).encode())
    libc.fflush(None)
    c_write(1, "C key:\\n" + PEM + "\\n")
    raise ConnectionError("uncaught: " + SHAPES)
"""
TAGS = ["print: ", "logging: ", "ConnectionError: caught: ", "ConnectionError: uncaught: "]
TAGS_WITH_INIT = ["log_text: ", "handler: "]
TAGS_OF_FDS = ["C stdout: ", "C stderr: ", "puts: "]


def console_run(redis_url: str, tmp_path: Path, how: str) -> str:
    """CONSOLE_SCRIPT run `how` (under `runbus run` with or without init(), or a plain process
    calling init()); its run id. It ends with an uncaught exception: exit status 1."""
    from tests.test_launch import clean_env, runbus_run, script

    path = script(tmp_path, "console.py", CONSOLE_SCRIPT)
    run_id = f"console-{how}"
    env = clean_env(redis_url)
    if how == "plain-init":
        env[config.RUN_ID_ENV] = run_id
        result = subprocess.run(
            [sys.executable, path, "init"], env=env, capture_output=True, text=True, timeout=120
        )
    else:
        mode = "init" if how == "run-init" else "no-init"
        result = runbus_run("--run-id", run_id, "--", sys.executable, path, mode, env=env)
    assert result.returncode == 1, result.stderr
    assert "hunter2pw" in result.stdout + result.stderr  # the terminal shows the script's own output
    return run_id


def api_logs(store_url: str, run_id: str) -> str:
    async def get() -> str:
        async with TestClient(TestServer(create_app(store_url))) as client:
            return json.dumps(await get_json(client, f"/api/runs/{run_id}/logs", limit=5000))

    return asyncio.run(get())


def logs_shown(store_url: str, run_id: str) -> dict[str, str]:
    """The run's log lines as every reader shows them: `runbus logs` (text, JSON), the API."""
    return {
        "runbus logs": run_cli("--store", store_url, "logs", run_id).stdout,
        "runbus logs --json": run_cli("--store", store_url, "logs", run_id, "--json").stdout,
        "the API": api_logs(store_url, run_id),
    }


@pytest.mark.parametrize("how", ["run-init", "run-no-init", "plain-init"])
def test_console_secrets_never_leave_the_process(redis_url, store_url, tmp_path, how):
    run_id = console_run(redis_url, tmp_path, how)
    assert_no_secret("Redis", redis_contents(redis_url), LINE_SECRETS)
    ingest(redis_url, store_url)
    texts = [line.text for line in read_store(store_url, "logs", run_id)]
    tags = TAGS + (TAGS_WITH_INIT if how != "run-no-init" else [])
    tags += TAGS_OF_FDS if how != "plain-init" else []
    for tag in tags:
        assert any(text.endswith(tag + SHAPES_SHOWN) for text in texts), (tag, texts)
    key_shown = [MARKER] * len(PEM_LINES)
    assert any(texts[i : i + 4] == key_shown for i in range(len(texts))), texts
    assert "a logged key:\n***\n" in "\n".join(texts)  # a record, or its lines (no init: stderr)
    shown = {"the store": store_contents(store_url), **logs_shown(store_url, run_id)}
    for where, text in shown.items():
        assert_no_secret(where, text, LINE_SECRETS)
        assert "redis://:***@h" in text, where


def test_log_lines_written_by_hand_are_stored_and_shown_redacted(redis_url, any_store):
    """An entry written by hand (or by an older runbus) in Redis: stored redacted, and shown
    redacted by `runbus tail`; a store that holds such lines shows them redacted."""
    lines = [SHAPES, *PEM_LINES, "after the key"]
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True})
        for seq, text in enumerate(lines, 2):
            xadd_event(
                client, RUN, "rank0", "log", 1, seq, {"stream": "stdout", "level": "INFO", "text": text}
            )
        xadd_event(client, RUN, "rank0", "finish", 1, len(lines) + 2, {"exit_code": 0})
    tail = runbus_bytes("tail", RUN, "--redis", redis_url, "--from-start").decode()
    assert_no_secret("runbus tail", tail, LINE_SECRETS)
    shown_lines = [SHAPES_SHOWN, *[MARKER] * len(PEM_LINES), "after the key"]
    assert [line.partition("| ")[2] for line in tail.splitlines()] == shown_lines
    ingest(redis_url, any_store)
    assert_no_secret("the store", store_contents(any_store), LINE_SECRETS)

    # A store written before lines were redacted at ingest: one row per line of the key.
    for seq, text in enumerate(lines, 2):
        quoted = text.replace("'", "''")
        store_execute(any_store, f"UPDATE logs SET text = '{quoted}' WHERE seq = {seq}")
    assert "hunter2pw" in store_contents(any_store)
    for where, text in logs_shown(any_store, RUN).items():
        assert_no_secret(where, text, LINE_SECRETS)
    shown = json.loads(logs_shown(any_store, RUN)["runbus logs --json"])
    assert [line["text"] for line in shown] == shown_lines


# -- workers given passwords in their URLs ----------------------------------------------------------

REDIS_PASSWORD = "red-sekrit sekrit&pw"
PG_PASSWORD = "pg-sekrit pw-sekrit"
WRONG = "wrong-sekrit&sekrit"


@pytest.fixture
def guarded_redis() -> Iterator[LocalRedis]:
    """A private redis-server whose default user needs REDIS_PASSWORD."""
    yield from private_redis(extra_args=("--requirepass", REDIS_PASSWORD))


def query_password_url(server: LocalRedis, password: str) -> str:
    """The server's URL with the password as a `?password=` query parameter."""
    return f"{server.url}?password={quote_plus(password)}"


@pytest.fixture
def guarded_postgres(local_postgres: LocalPostgres) -> str:
    """A store URL with a user and password, for a database that user owns."""
    dsn = asyncio.run(local_postgres.password_user("trainer", PG_PASSWORD))

    async def own_database() -> None:
        con = await asyncpg.connect(local_postgres.dsn)
        try:
            await con.execute('CREATE DATABASE secrets OWNER "trainer"')
        finally:
            await con.close()

    asyncio.run(own_database())
    return dsn.replace("trainer@", f"trainer:{quote(PG_PASSWORD)}@").replace("/postgres", "/secrets")


def assert_never_logged(result: subprocess.CompletedProcess) -> None:
    """Every password here holds "sekrit" in each of its words, so in every form (decoded,
    %-encoded, +-encoded) and in every piece a driver might quote."""
    output = result.stdout + result.stderr
    assert "sekrit" not in output, output


def test_a_worker_with_passwords_in_its_urls_never_logs_them(guarded_redis, guarded_postgres):
    url = query_password_url(guarded_redis, REDIS_PASSWORD)
    with redis.Redis.from_url(url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True})
        xadd_event(client, RUN, "rank0", "finish", 1, 2, {"exit_code": 0})
    for workers in ("1", "2"):
        result = run_cli(
            "--log-level", "DEBUG", "--store", guarded_postgres,
            "ingest", "--redis", url, "--burst", "--workers", workers,
        )  # fmt: skip
        assert_never_logged(result)
        assert "?password=***" in result.stderr and "trainer:***@" in result.stderr, result.stderr
    assert read_store(guarded_postgres, "run", RUN).state == "finished"


def test_wrong_passwords_in_the_urls_are_never_logged(guarded_redis, guarded_postgres, store_url):
    wrong_redis = query_password_url(guarded_redis, WRONG)
    wrong_store = guarded_postgres.replace(quote(PG_PASSWORD), quote(WRONG))
    right_redis = query_password_url(guarded_redis, REDIS_PASSWORD)
    # Typed unescaped, a password's '&' or '/' splits it: the driver then quotes a piece of it.
    no_password = guarded_postgres.replace(f":{quote(PG_PASSWORD)}@", "@")
    attempts = {
        "redis refused": (("--store", store_url, "ingest", "--redis", wrong_redis, "--burst"), "refused"),
        "redis refused, supervised": (
            ("--store", store_url, "ingest", "--redis", wrong_redis, "--workers", "2"),
            "refused",
        ),
        "store refused": (("--store", wrong_store, "ingest", "--redis", right_redis, "--burst"), "refused"),
        "show, store refused": (("--store", wrong_store, "show", RUN), "refused"),
        "tail, redis refused": (("tail", RUN, "--redis", wrong_redis), "password"),
        "dead, redis refused": (("dead", "--redis", wrong_redis), "password"),
        "show, an unescaped '&'": (
            ("--store", f"{no_password}?password=wrong&piece-sekrit", "show", RUN),
            "bad query field: '***'",
        ),
        "show, an unescaped '/'": (
            ("--store", no_password.replace("trainer@", "trainer:wrong-sekrit/piece-sekrit@"), "show", RUN),
            "runbus: ",
        ),
        "dead, an unescaped '/'": (
            ("dead", "--redis", guarded_redis.url.replace("redis://", "redis://:wrong-sekrit/sekrit@")),
            "runbus: ",
        ),
    }
    for what, (args, said) in attempts.items():
        result = run_cli("--log-level", "DEBUG", *args, check=False)
        assert result.returncode == 1, (what, result.stderr)
        assert_never_logged(result)
        assert said in result.stderr, (what, result.stderr)


# -- terminal control sequences from the bus --------------------------------------------------------

HOSTILE = (
    "clear\x1b[2J"  # erase the screen
    "|clip\x1b]52;c;cm0gLXJmIH4K\x07"  # OSC 52: write the clipboard, ended by BEL
    "|bell\x07"
    "|c1\x9b31m"  # C1 CSI: ESC [ in one character
    "|bidi\u202eevil\u202c"  # right-to-left override
    "|cr\rover"
    "|tab\tok"
)
# Raw bytes a terminal obeys: C0 but tab and newline, DEL, C1 and bidi controls in UTF-8.
RAW_CONTROL = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xaa-\xae]|\xe2\x81[\xa6-\xa9]")


def runbus_bytes(*args: str) -> bytes:
    """`python -m runbus ARGS`'s stdout, as bytes."""
    result = subprocess.run(
        [sys.executable, "-m", "runbus", *args],
        capture_output=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert not RAW_CONTROL.search(result.stderr), result.stderr
    return result.stdout


def seed_hostile(redis_url: str, store_url: str | None = None) -> None:
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, RUN, "rank0", "start", 1, 1, {"primary": True, "config": {"note\x1b[2J": HOSTILE}})
        xadd_event(client, RUN, "rank0", "log", 1, 2, {"stream": "stdout", "level": "INFO", "text": HOSTILE})
        xadd_event(
            client, RUN, "rank0", "log", 1, 3, {"stream": "stderr", "level": "\x1b[5mERROR", "text": "x"}
        )
        xadd_event(client, RUN, "rank0", "metric", 1, 4, {HOSTILE: 1.0}, step=1)
        xadd_event(client, RUN, "rank0", "finish", 1, 5, {"exit_code": 0})
        client.xadd(
            wire.DEAD_LETTER_KEY,
            {
                "reason": HOSTILE,
                "source_stream": "runbus:{x}:\x1b[2J",
                "source_id": "1-0",
                "deliveries": 1,
                "data": json.dumps({"config": {"api_key": SECRETS["api_key"]}}),
            },
        )
    if store_url is not None:
        ingest(redis_url, store_url)


def test_text_commands_print_no_control_character(redis_url, store_url):
    seed_hostile(redis_url, store_url)
    outputs = {
        "logs": runbus_bytes("--store", store_url, "logs", RUN),
        "metrics": runbus_bytes("--store", store_url, "metrics", RUN),
        "show": runbus_bytes("--store", store_url, "show", RUN),
        "dead": runbus_bytes("dead", "--redis", redis_url),
        "tail": runbus_bytes("tail", RUN, "--redis", redis_url, "--from-start"),
    }
    for command, out in outputs.items():
        assert not RAW_CONTROL.search(out), (command, out)
    shown = "clear\\x1b[2J|clip\\x1b]52;c;cm0gLXJmIH4K\\x07|bell\\x07|c1\\x9b31m|bidi\\u202eevil\\u202c"
    for command in ("logs", "tail"):
        assert shown.encode() in outputs[command], outputs[command]
        assert b"\\x1b[5mERROR" in outputs[command] or command == "tail"
    assert shown.encode() in outputs["metrics"] and shown.encode() in outputs["dead"]
    assert b"runbus:{x}:\\x1b[2J" in outputs["dead"]


def test_json_output_is_exact_json_with_no_control_character(redis_url, store_url):
    seed_hostile(redis_url, store_url)
    logs = runbus_bytes("--store", store_url, "logs", RUN, "--json")
    metrics = runbus_bytes("--store", store_url, "metrics", RUN, "--json")
    dead = runbus_bytes("dead", "--redis", redis_url, "--json")
    for out in (logs, metrics, dead):
        assert not RAW_CONTROL.search(out), out
    assert [(line["level"], line["text"]) for line in json.loads(logs)] == [
        ("INFO", HOSTILE),
        ("\x1b[5mERROR", "x"),
    ]
    assert json.loads(metrics)[0]["key"] == HOSTILE
    [letter] = json.loads(dead)
    assert letter["reason"] == HOSTILE
    assert SECRETS["api_key"] not in dead.decode() and json.loads(letter["fields"]["data"]) == {
        "config": {"api_key": MARKER}
    }
