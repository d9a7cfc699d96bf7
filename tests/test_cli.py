"""The `runbus` command's read side, human and JSON, and its errors."""

from __future__ import annotations

import asyncio
import json
import time

import redis

import runbus
from runbus.ingester.worker import Worker, WorkerSettings
from tests.helpers import ingest, read_store, run_cli, xadd_event


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
            "epoch": 1,
            "last_seq": 7,
            "events": 7,
            "missing": 0,
            "gaps": [],
        },
        {
            "label": "rank1",
            "primary": False,
            "state": "running",
            "exit_code": None,
            "epoch": 1,
            "last_seq": 9,
            "events": 7,
            "missing": 2,
            "gaps": [{"epoch": 1, "first": 7, "last": 8, "dropped": 0}],
        },
    ]
    assert doc["config"] == {"lr": 0.5}


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
    assert set(points[0]) == {"label", "key", "step", "seq", "epoch", "ts", "value"}
    only = json.loads(
        run_cli(
            "--store", store_url, "metrics", "cli-run", "--key", "loss", "--label", "rank1", "--json"
        ).stdout
    )
    assert [p["value"] for p in only] == [1.0, 0.5, 1.0 / 3]
    text = run_cli("--store", store_url, "metrics", "cli-run", "--key", "acc").stdout.splitlines()
    assert text[0].split() == ["LABEL", "KEY", "STEP", "EPOCH", "SEQ", "VALUE"]
    assert text[1].split() == ["rank1", "acc", "2", "1", "9", "0.9"]


def test_runs_show_and_logs_as_text(redis_url, store_url):
    seed(redis_url, store_url)
    runs = run_cli("--store", store_url, "runs").stdout.splitlines()
    assert runs[0].split()[:4] == ["RUN", "STATE", "PRIMARY", "LABELS"]
    assert runs[1].split()[:5] == ["cli-run", "finished", "(exit", "0)", "rank0"]
    shown = run_cli("--store", store_url, "show", "cli-run").stdout
    assert "state    finished (exit 0)" in shown and "rank1           running" in shown
    logs = run_cli("--store", store_url, "logs", "cli-run", "--level", "warning").stdout.splitlines()
    assert [line.split(" | ")[0].strip() for line in logs] == ["rank0", "rank1"]
    assert all(line.endswith("oops</b>") for line in logs)
    grep = run_cli("--store", store_url, "logs", "cli-run", "--label", "rank1", "--grep", "fine").stdout
    assert grep.count("\n") == 1 and "rank1" in grep


def test_unknown_run_and_bad_store_are_clear_errors(store_url):
    result = run_cli("--store", store_url, "show", "nope", check=False)
    assert result.returncode == 1 and "unknown run 'nope'" in result.stderr
    result = run_cli("--store", "mysql://u:secret@h/db", "runs", check=False)
    assert (
        result.returncode == 1 and "unsupported store URL" in result.stderr and "secret" not in result.stderr
    )


def test_a_running_worker_picks_up_a_new_producer_stream(redis_url, store_url):
    async def scenario():
        worker = Worker(WorkerSettings(redis_url=redis_url, store_url=store_url, handle_signals=False))
        task = asyncio.create_task(worker.async_run())
        await asyncio.sleep(0.3)  # the worker is up and has found no streams yet
        run = runbus.init(
            run_id="live", label="rank0", redis_url=redis_url, system_interval=None, hardware=False
        )
        run.log({"loss": 1.0}, step=0)
        deadline = time.monotonic() + 10
        while worker.stats.stored < 2:
            assert time.monotonic() < deadline, "the new stream was never consumed"
            await asyncio.sleep(0.05)
        run.finish()
        worker.request_stop()
        await task

    asyncio.run(scenario())
    assert [p.value for p in read_store(store_url, "metrics", "live")] == [1.0]
