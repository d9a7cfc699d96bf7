"""The alerts with real processes: two ranks log a loss, one goes NaN at step 5, then both are
SIGKILLed. A live `runbus ingest --on-alert` raises one alert per change, in order: the first
anomaly (that rank, that step), the silence, the run crashed; the ops endpoint's per-run gauges
say the same while the run is live and drop it once it ended. `runbus watch` prints what came
from the bus neutralised."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from runbus.ingester.localredis import free_port
from runbus.storage.beats import RunVitals
from runbus.storage.health import Verdict
from tests.helpers import ingest, ingest_command, read_store, run_cli, wait_for, xadd_event
from tests.rank_processes import ranks_running
from tests.test_health import alerts_of, health
from tests.test_pipeline import store_opened

RANK = textwrap.dedent(
    """
    import os, signal, time
    import runbus

    run = runbus.init(system_interval=None, hardware=False, git=False, heartbeat_interval=1.0)
    rank = run.identity.rank
    for step in range(int(os.environ["STEPS"])):
        loss = float("nan") if rank == 1 and step >= 5 else 1.0 / (step + 1)
        run.log({"loss": loss}, step=step)
        time.sleep(0.2)
    time.sleep(2)  # the last events and a beat reach Redis
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        f"{s.name}{{{','.join(f'{k}={v!r}' for k, v in sorted(s.labels.items()))}}}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("runbus_run_")
    }


@contextlib.contextmanager
def alerting_job(
    redis_url: str, store_url: str, alerts: Path, script: str, world: int, env: dict[str, str], *ingest: str
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """A live `runbus ingest --on-alert` (`ingest`: its other arguments) appending each alert to
    `alerts`, and `world` ranks running `script` with `env`, while the block runs; the worker
    must then stop cleanly on SIGTERM."""
    on_alert = f"cat >> {alerts}; echo >> {alerts}"
    worker = subprocess.Popen(
        [*ingest_command(redis_url, store_url, *ingest), "--on-alert", on_alert],
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for("the worker to open its store", lambda: store_opened(store_url) or worker.poll() is not None)
    try:
        with ranks_running(
            script, world, {"RUNBUS_REDIS_URL": redis_url, "RUNBUS_QUIET": "1", **env}
        ) as ranks:
            yield ranks
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err


def test_a_nan_then_a_crash_alert_once_each_and_show_in_the_gauges(redis_url, store_url, tmp_path: Path):
    alerts, port, run_id = tmp_path / "alerts.jsonl", free_port(), f"nan-{os.getpid()}"
    ingest = ("--crash-after", "4", "--stall-after", "3", "--http", f"127.0.0.1:{port}")
    env = {"RUNBUS_RUN_ID": run_id, "STEPS": "25"}
    with alerting_job(redis_url, store_url, alerts, RANK, 2, env, *ingest) as ranks:
        first = wait_for("the anomaly alert", lambda: alerts_of(alerts), timeout=60)[0]
        assert first["run"] == run_id and first["state"] == "anomaly"
        assert [(a["label"], a["key"], a["step"], a["kind"]) for a in first["anomalies"]] == [
            ("rank1", "loss", 5, "nan")
        ]
        gauges = wait_for("the run's gauges", lambda: (g := scrape(port)) and g, timeout=30)
        assert gauges[f"runbus_run_health{{run={run_id!r},state='anomaly'}}"] == 1
        assert gauges[f"runbus_run_health{{run={run_id!r},state='ok'}}"] == 0
        assert gauges[f"runbus_run_anomalies{{run={run_id!r}}}"] == 1
        assert gauges[f"runbus_run_stragglers{{run={run_id!r}}}"] == 0
        assert [p.wait(60) for p in ranks] == [-signal.SIGKILL] * 2
        wait_for(
            "the crash alert", lambda: [a for a in alerts_of(alerts) if a["state"] == "crashed"], timeout=60
        )
        states = [a["state"] for a in alerts_of(alerts)]
        assert states[0] == "anomaly" and states[-1] == "crashed"
        assert states.count("anomaly") == 1 and states.count("crashed") == 1
        assert set(states) <= {"anomaly", "silent", "stalled", "dead", "crashed"}
        crashed = health(store_url, run_id)
        assert crashed["state"] == "crashed" and crashed["anomalies"][0]["label"] == "rank1"
        # An ended run's series are dropped.
        wait_for("the ended run's series to go", lambda: not any(run_id in k for k in scrape(port)))


def test_watch_prints_a_hostile_health_line_neutralised_and_ends_with_the_run(redis_url, store_url):
    """A verdict whose strings came from the bus (a hand-written heartbeat's host, a label) is
    printed with the terminal controls shown, not obeyed; an ended run ends `runbus watch` (0)."""
    client = redis.Redis.from_url(redis_url)
    run_id = f"hostile-watch-{os.getpid()}"
    xadd_event(client, run_id, "rank0", "start", 1, 1, {"primary": True})
    xadd_event(client, run_id, "rank0", "finish", 1, 2, {"exit_code": 0})
    ingest(redis_url, store_url)
    straggler = {
        "label": "rank1",
        "kind": "chronic",
        "behind": 1.3,
        "lost_s": 2.0,
        "host": "n\x1b]0;pwned\x07",
    }
    verdict = Verdict("ok", note="the run has finished\x1b[2J", ended=True, stragglers=[straggler])
    run = RunVitals(run_id, "finished", None, None)
    assert read_store(store_url, "record_health", run, "ok", verdict.key, verdict.document(None), 0.0)

    text = run_cli("--store", store_url, "watch", run_id).stdout
    assert "\x1b" not in text and "\x07" not in text
    assert (
        text.count("\n") == 1 and "stragglers: rank1 chronic 1.3x (2.0s lost, on n\\x1b]0;pwned\\x07)" in text
    )
    lines = run_cli("--store", store_url, "watch", run_id, "--json").stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["stragglers"][0]["host"] == "n\x1b]0;pwned\x07"
    assert "\x1b" not in lines[0]
    refused = run_cli("--store", store_url, "watch", run_id, "--every", "0", check=False)
    assert refused.returncode == 1 and "--every" in refused.stderr
    missing = run_cli("--store", store_url, "watch", "no-such-run", check=False)
    assert missing.returncode == 1 and missing.stderr.startswith("runbus: ")


LEAVER = textwrap.dedent(
    """
    import os, random, time
    import runbus

    run = runbus.init(system_interval=None, hardware=False, git=False, heartbeat_interval=1.0)
    rank, noise = run.identity.rank, random.Random(run.identity.rank)
    for step in range(600):
        loss = 2.0 / (1 + step / 100) + noise.gauss(0, 0.01)
        run.log({"loss": loss * 5 if rank == 2 and step >= 300 else loss}, step=step)
        time.sleep(0.001)
    time.sleep(float(os.environ["LINGER"]))  # alive, beating: the run is judged meanwhile
    run.finish()
    """
)


def test_a_rank_leaving_the_band_alerts_as_an_anomaly_naming_it_and_its_step(
    redis_url, store_url, tmp_path: Path
):
    alerts, run_id = tmp_path / "alerts.jsonl", f"leaver-{os.getpid()}"
    env = {"RUNBUS_RUN_ID": run_id, "LINGER": "30"}
    with alerting_job(redis_url, store_url, alerts, LEAVER, 4, env, "--stall-after", "120"):
        first = wait_for("the anomaly alert", lambda: alerts_of(alerts), timeout=60)[0]
        assert first["run"] == run_id and first["state"] == "anomaly"
        assert [(a["label"], a["key"], a["step"], a["kind"]) for a in first["anomalies"]] == [
            ("rank2", "loss", 300, "outlier")
        ]
        low, high = first["anomalies"][0]["band"]
        assert low < first["anomalies"][0]["median"] < high < first["anomalies"][0]["value"]
        # Once every rank's 600 steps are in, the band is checked up to the bucket before their
        # open ones (512-639): to step 383, past the departure.
        wait_for(
            "the band checked to step 383", lambda: (health(store_url, run_id) or {}).get("band_to") == 383
        )
        text = run_cli("show", run_id, "--store", store_url).stdout
        assert (
            "rank2 left the cross-rank band in loss at step 300 first; cross-rank band checked to step 383"
            in text
        )
        assert "outlier  rank2 loss left the cross-rank band first, at step 300" in text
