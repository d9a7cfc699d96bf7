"""`runbus serve`'s JSON API against a real store filled by a real ingester, and its security."""

from __future__ import annotations

import math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
import redis
from aiohttp import ClientSession, CookieJar
from aiohttp.test_utils import TestClient, TestServer

from runbus.dashboard import downsample, security
from runbus.dashboard.api import create_app
from tests.helpers import (
    SECOND_LIFE,
    OpenStore,
    assert_idle_connections_closed,
    ingest,
    restarted_run,
    run_cli,
    xadd_event,
)

RUN = "resnet50-ddp"
HOSTILE = "hostile-run"
RANKS = 4
STEPS = 300
T0 = 1_763_700_000.0
CONFIG = {
    "model": "resnet50",
    "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.05},
    "batch_size": 256,
    "epochs": 3,
    "amp": True,
    "dataset": "imagenet-1k",
}


def seed_run(client: redis.Redis, run: str = RUN) -> None:
    """A finished 4-rank job: metrics, system samples, logs, a gap, a spike and a dead letter."""
    pipe = client.pipeline(transaction=False)
    for rank in range(RANKS):
        label, seq = f"rank{rank}", 0

        def add(kind, data, step=None, ts=None, label=label):
            nonlocal seq
            seq += 1
            if (label, seq) in {("rank1", 40), ("rank1", 41)}:  # lost on the way: a gap of two
                seq += 2
            xadd_event(pipe, run, label, kind, 1, seq, data, step=step, ts=ts)

        start = {
            "primary": rank == 0,
            "host": f"gpu-node-{rank // 2}",
            "pid": 4100 + rank,
            "rank": rank,
            "local_rank": rank % 2,
            "world_size": RANKS,
            "restart_count": 0,
        }
        if rank == 0:
            start["config"] = CONFIG
        add("start", start, ts=T0)
        for step in range(STEPS):
            ts = T0 + 2.0 + step * 2.0 + rank * 0.01
            wobble = math.sin(step / 7.0 + rank) * 0.04 + ((step * 7919 + rank * 104729) % 97) / 97 * 0.06
            grad = 1.2 + 0.6 * math.exp(-step / 80) + 0.2 * math.sin(step / 5.0 + rank)
            data = {
                "loss": 2.3 * math.exp(-step / 110) + 0.35 + wobble,
                "lr": 3e-4 * 0.5 * (1 + math.cos(math.pi * step / STEPS)),
                "grad_norm": grad,
                "throughput": 1850 + 60 * math.sin(step / 11.0 + rank * 2) - rank * 25,
            }
            if rank == 2 and step == 137:
                data["grad_norm"] = 25.0
            if rank == 1 and step == 200:
                data["grad_norm"] = "NaN"
            if rank == 3 and step == 250:
                data["grad_norm"] = "Infinity"
            add("metric", data, step=step, ts=ts)
            if step % 15 == 0:
                system = {
                    "proc.cpu_percent": 96 + 3 * math.sin(step / 9.0 + rank),
                    "proc.rss_mb": 6100 + rank * 140 + step * 1.5,
                    f"gpu.{rank}.util": 91 + 6 * math.sin(step / 13.0 + rank),
                    f"gpu.{rank}.mem_used_mb": 30500 + rank * 300 + 20 * math.sin(step / 17.0),
                }
                if rank % 2 == 0:
                    system["sys.memory_percent"] = 41 + step * 0.01
                add("system", system, ts=ts + 0.005)
            if step % 50 == 0:
                epoch = step // 100
                add(
                    "log",
                    {
                        "stream": "stdout",
                        "level": "INFO",
                        "text": f"epoch {epoch} step {step}: loss {data['loss']:.4f}",
                    },
                    ts=ts + 0.002,
                )
            if step % 60 == 30:
                add(
                    "log",
                    {"stream": "logging", "level": "DEBUG", "text": f"dataloader prefetch {step}"},
                    ts=ts + 0.003,
                )
        if rank == 0:
            add(
                "log",
                {
                    "stream": "logging",
                    "level": "WARNING",
                    "text": "checkpoint took 4.2 s (over the 2 s budget)",
                },
                ts=T0 + 300.0,
            )
        if rank == 3:
            add(
                "log",
                {
                    "stream": "stderr",
                    "level": "ERROR",
                    "text": "NCCL watchdog: collective 1812 slow on rank 3\n  retrying",
                },
                ts=T0 + 500.0,
            )
        add("finish", {"exit_code": 0}, ts=T0 + 2.0 + STEPS * 2.0 + 1)
    pipe.execute()
    dead_letter_one(client, run, "rank3")


def dead_letter_one(client: redis.Redis, run: str, label: str) -> None:
    """An entry that breaks the wire contract (unknown kind): the ingester dead-letters it."""
    from runbus import wire

    client.xadd(wire.stream_key(run, label), {"v": "1", "kind": "bogus", "run": run, "label": label})


def seed_hostile(client: redis.Redis) -> None:
    """Strings from the bus that would run script if a page ever took them as markup."""
    xadd_event(
        client,
        HOSTILE,
        "rank0",
        "start",
        1,
        1,
        {"primary": True, "config": {"note": "<script>window.__pwned = 'config'</script>"}},
    )
    xadd_event(client, HOSTILE, "rank1", "start", 1, 1, {"primary": False})
    for label in ("rank0", "rank1"):
        for step in range(3):
            data = {"<img src=x onerror=\"window.__pwned='metric'\">": step * 1.5, "loss": 1.0 / (step + 1)}
            xadd_event(client, HOSTILE, label, "metric", 1, step + 2, data, step=step)
    xadd_event(
        client,
        HOSTILE,
        "rank0",
        "log",
        1,
        5,
        {"stream": "stdout", "level": "INFO", "text": "<script>window.__pwned = 'log'</script>"},
    )
    xadd_event(
        client,
        HOSTILE,
        "rank1",
        "log",
        1,
        5,
        {"stream": "stderr", "level": "ERROR", "text": "<img src=x onerror=\"window.__pwned='img'\">"},
    )
    xadd_event(
        client, HOSTILE, "rank1", "meta", 1, 7, HOSTILE_META
    )  # seq 6: test_logs_follow_shows_new_lines


# Run metadata a worker set by hand: a name and summary that would run script if taken as markup.
HOSTILE_META = {
    "name": "<img src=x onerror=\"window.__pwned='name'\">",
    "tags": ["lr=3e-4", "a/b"],
    "summary": {"<b>best</b>": "<script>window.__pwned = 'summary'</script>"},
    "config": {"<i>k</i>": "<script>window.__pwned = 'config2'</script>"},
}


@pytest.fixture(scope="module")
def seeded(redis_server_url: str, tmp_path_factory) -> str:
    """A store holding RUN and HOSTILE, ingested from the test Redis (left holding a dead letter)."""
    store_url = f"sqlite:///{tmp_path_factory.mktemp('dashboard') / 'runbus.db'}"
    with redis.Redis.from_url(redis_server_url) as client:
        client.flushdb()
        seed_run(client)
        seed_hostile(client)
    ingest(redis_server_url, store_url)
    return store_url


@pytest.fixture
async def api(seeded: str, redis_server_url: str):
    async with TestClient(TestServer(create_app(seeded, redis_url=redis_server_url))) as client:
        yield client


async def get_json(client: TestClient, path: str, status: int = 200, **kwargs):
    response = await client.get(path, **kwargs)
    body = await response.read()
    assert response.status == status, body
    assert response.content_type == "application/json"
    return orjson.loads(body)


async def test_runs_list_state_primary_labels_counts_and_times(api):
    doc = await get_json(api, "/api/runs")
    by_id = {run["run_id"]: run for run in doc["runs"]}
    assert set(by_id) == {RUN, HOSTILE}
    run = by_id[RUN]
    assert (run["state"], run["primary"], run["exit_code"], run["label_count"]) == ("finished", "rank0", 0, 4)
    assert run["labels"] == [{"label": f"rank{i}", "primary": i == 0, "state": "finished"} for i in range(4)]
    assert run["counts"]["metric"] == RANKS * STEPS  # events, each with four keys
    assert run["started_ts"] == T0 and run["ended_ts"] == T0 + 2.0 + STEPS * 2.0 + 1
    assert by_id[HOSTILE]["state"] == "running"
    paged = await get_json(api, "/api/runs?limit=1&offset=1")
    assert len(paged["runs"]) == 1 and paged["runs"][0]["run_id"] == doc["runs"][1]["run_id"]


async def test_run_has_labels_epochs_gaps_config_and_dead_letters(api):
    run = await get_json(api, f"/api/runs/{RUN}")
    assert run["config"] == CONFIG
    labels = {lab["label"]: lab for lab in run["labels"]}
    assert labels["rank0"]["primary"] and not labels["rank1"]["primary"]
    assert {(lab["lease_epoch"], lab["life"]) for lab in labels.values()} == {(1, 1)}
    assert labels["rank1"]["missing"] == 2 and run["gaps"] == 2
    rank2 = labels["rank2"]
    assert (rank2["host"], rank2["rank"], rank2["world_size"]) == ("gpu-node-1", 2, 4)
    assert run["dead_letters"] == {"total": 1, "run": 1, "labels": {"rank3": 1}, "complete": True}
    other = await get_json(api, f"/api/runs/{HOSTILE}")
    assert other["dead_letters"]["run"] == 0 and other["dead_letters"]["total"] == 1
    assert (run["name"], run["tags"], run["summary"]) == (None, [], {})
    assert run["set_by"]["config"] == dict.fromkeys(CONFIG, "rank0")


async def test_a_restarted_label_is_in_its_second_life_the_raw_epoch_named_lease_epoch(
    open_stores: OpenStore, any_store_url: str
):
    store = await open_stores()
    await store.write(restarted_run("again"))
    async with TestClient(TestServer(create_app(any_store_url))) as client:
        run = await get_json(client, "/api/runs/again")
        logs = await get_json(client, "/api/runs/again/logs")
    labels = {lab["label"]: lab for lab in run["labels"]}
    assert (labels["rank0"]["lease_epoch"], labels["rank0"]["life"]) == (SECOND_LIFE, 2)
    assert (labels["rank1"]["lease_epoch"], labels["rank1"]["life"]) == (SECOND_LIFE + 1, 1)
    assert all("epoch" not in lab for lab in run["labels"])
    assert [(line["lease_epoch"], line["text"]) for line in logs["lines"]] == [(SECOND_LIFE, "resumed")]


async def test_run_has_its_name_tags_and_metadata_with_the_label_that_set_each(api):
    run = await get_json(api, f"/api/runs/{HOSTILE}")
    assert (run["name"], run["tags"], run["summary"]) == (
        HOSTILE_META["name"],
        HOSTILE_META["tags"],
        HOSTILE_META["summary"],
    )
    assert run["config"] == {"note": "<script>window.__pwned = 'config'</script>", **HOSTILE_META["config"]}
    assert run["set_by"] == {
        "config": {"note": "rank0", "<i>k</i>": "rank1"},
        "summary": {"<b>best</b>": "rank1"},
        "name": "rank1",
        "tags": "rank1",
    }
    labels = {lab["label"]: lab for lab in run["labels"]}
    assert (labels["rank1"]["name"], labels["rank1"]["summary"]) == (
        HOSTILE_META["name"],
        HOSTILE_META["summary"],
    )
    assert (labels["rank0"]["name"], labels["rank0"]["tags"], labels["rank0"]["summary"]) == (None, None, {})
    listed = {r["run_id"]: r for r in (await get_json(api, "/api/runs"))["runs"]}
    assert (listed[HOSTILE]["name"], listed[HOSTILE]["tags"]) == (HOSTILE_META["name"], HOSTILE_META["tags"])


async def test_metric_series_one_line_per_label_and_non_finite_values_as_strings(api):
    keys = await get_json(api, f"/api/runs/{RUN}/metrics")
    assert keys["keys"] == ["grad_norm", "loss", "lr", "throughput"]
    doc = await get_json(api, f"/api/runs/{RUN}/metrics/series", params={"key": "grad_norm"})
    assert doc["x"] == "step" and doc["columns"] == list(downsample.COLUMNS)
    assert [s["label"] for s in doc["series"]] == [f"rank{i}" for i in range(RANKS)]
    for series in doc["series"]:
        assert series["count"] == STEPS and not series["downsampled"]
        assert [row[0] for row in series["data"]] == list(range(STEPS))
    rank1, rank2, rank3 = (doc["series"][i]["data"] for i in (1, 2, 3))
    assert rank1[200][1] == "NaN" and rank1[200][2] is None
    assert rank3[250][1] == "Infinity" and rank3[250][4] == "Infinity"
    assert rank2[137][1] == 25.0
    one = await get_json(api, f"/api/runs/{RUN}/metrics/series", params={"key": "loss", "label": "rank2"})
    assert [s["label"] for s in one["series"]] == ["rank2"]
    none = await get_json(api, f"/api/runs/{RUN}/metrics/series", params={"key": "no-such-key"})
    assert none["series"] == []


async def test_long_series_are_downsampled_with_min_and_max_kept(api):
    doc = await get_json(api, f"/api/runs/{RUN}/metrics/series", params={"key": "grad_norm", "points": "40"})
    for series in doc["series"]:
        assert series["downsampled"] and len(series["data"]) == 40
        assert sum(row[5] for row in series["data"]) == STEPS
        assert series["data"][-1][0] == STEPS - 1  # the last bucket ends on the last step
    spike = max(doc["series"][2]["data"], key=lambda row: row[4])
    assert spike[4] == 25.0 and spike[0] >= 137 and spike[2] < 25.0  # the mean hides it, max does not
    assert max(row[4] for row in doc["series"][3]["data"] if isinstance(row[4], str)) == "Infinity"


def test_downsample_buckets_are_consecutive_and_honest():
    xs = list(range(10))
    values = [1.0, 2.0, math.nan, 4.0, -math.inf, 6.0, 7.0, 8.0, 9.0, 100.0]
    rows = downsample.downsample(xs, values, 3)
    assert [row[0] for row in rows] == [2, 5, 9] and [row[5] for row in rows] == [3, 3, 4]
    assert rows[0][1:5] == ["NaN", 1.5, 1.0, 2.0]
    assert rows[1][1:5] == [6.0, 5.0, "-Infinity", 6.0]
    assert rows[2][1:5] == [100.0, 31.0, 7.0, 100.0]
    assert downsample.downsample([0], [math.nan], 5) == [[0, "NaN", None, None, None, 1]]
    with pytest.raises(ValueError):
        downsample.downsample([1, 2], [1.0], 5)


async def test_system_series_per_key_and_label(api):
    doc = await get_json(api, f"/api/runs/{RUN}/system")
    keys = {k["key"]: k for k in doc["keys"]}
    wanted = {"proc.cpu_percent", "proc.rss_mb", "sys.memory_percent", "gpu.0.util", "gpu.3.mem_used_mb"}
    assert wanted <= keys.keys()
    assert [s["label"] for s in keys["proc.cpu_percent"]["series"]] == [f"rank{i}" for i in range(RANKS)]
    assert [s["label"] for s in keys["sys.memory_percent"]["series"]] == ["rank0", "rank2"]
    assert [s["label"] for s in keys["gpu.1.util"]["series"]] == ["rank1"]
    assert keys["proc.cpu_percent"]["series"][0]["count"] == STEPS // 15
    ts = [row[0] for row in keys["proc.cpu_percent"]["series"][0]["data"]]
    assert ts == sorted(ts) and ts[0] > T0
    only = await get_json(api, f"/api/runs/{RUN}/system", params={"key": "proc.rss_mb", "label": "rank3"})
    assert [(k["key"], [s["label"] for s in k["series"]]) for k in only["keys"]] == [
        ("proc.rss_mb", ["rank3"])
    ]


async def test_logs_filter_by_label_level_and_text_and_page(api):
    every = await get_json(api, f"/api/runs/{RUN}/logs")
    assert len(every["lines"]) == RANKS * (6 + 5) + 2 and not every["more"]
    assert [line["ts"] for line in every["lines"]] == sorted(line["ts"] for line in every["lines"])
    rank3 = await get_json(api, f"/api/runs/{RUN}/logs", params={"label": "rank3", "level": "warning"})
    assert [(line["label"], line["level"], line["text"]) for line in rank3["lines"]] == [
        ("rank3", "ERROR", "NCCL watchdog: collective 1812 slow on rank 3\n  retrying")
    ]
    grep = await get_json(api, f"/api/runs/{RUN}/logs", params={"grep": "step 250:"})
    assert sorted(line["label"] for line in grep["lines"]) == [f"rank{i}" for i in range(RANKS)]
    first = await get_json(api, f"/api/runs/{RUN}/logs", params={"limit": "10"})
    second = await get_json(api, f"/api/runs/{RUN}/logs", params={"limit": "10", "offset": "10"})
    assert first["more"] and first["next_offset"] == 10 and second["offset"] == 10
    assert first["lines"] + second["lines"] == every["lines"][:20]
    hostile = await get_json(api, f"/api/runs/{HOSTILE}/logs")
    assert hostile["lines"][0]["text"] == "<script>window.__pwned = 'log'</script>"


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        (f"/api/runs/{RUN}/metrics/series?key=loss&points=abc", "points must be an integer"),
        (f"/api/runs/{RUN}/metrics/series?key=loss&points=5", "points must be between 10 and 10000"),
        (f"/api/runs/{RUN}/metrics/series?key=loss&points=99999", "points must be between"),
        (f"/api/runs/{RUN}/metrics/series", "key is required"),
        (f"/api/runs/{RUN}/metrics/series?key=loss&label=not%20a%20label", "invalid label"),
        (f"/api/runs/{RUN}/logs?limit=0", "limit must be between 1 and 5000"),
        (f"/api/runs/{RUN}/logs?offset=-1", "offset must be between"),
        (f"/api/runs/{RUN}/logs?level=LOUD", "level must be one of"),
        (f"/api/runs/{RUN}/logs?grep=" + "x" * 1001, "grep must be at most"),
        ("/api/runs?limit=many", "limit must be an integer"),
        ("/api/runs/bad%20run%21", "invalid run id"),
    ],
)
async def test_bad_parameters_are_400_with_a_reason(api, path, reason):
    doc = await get_json(api, path, status=400)
    assert reason in doc["error"]


async def test_unknown_runs_and_routes_are_404(api):
    for path in ("/api/runs/nope", "/api/runs/nope/metrics", "/api/runs/nope/logs", "/api/runs/nope/system"):
        assert (await get_json(api, path, status=404))["error"] == "unknown run 'nope'"
    assert "error" in await get_json(api, "/api/nothing-here", status=404)


async def test_page_and_files_are_served_offline_under_a_strict_policy(api):
    page = await api.get("/")
    html = await page.text()
    assert page.status == 200 and page.content_type == "text/html"
    assert page.headers["Content-Security-Policy"] == security.CONTENT_SECURITY_POLICY
    policy = security.CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert '<script src="/static/app.js" type="module"></script>' in html and "<script>" not in html
    static = Path(__file__).parents[1] / "dashboard" / "static"
    for name in ("app.js", "js/chart.js", "style.css", "favicon.svg"):
        response = await api.get(f"/static/{name}")
        assert response.status == 200 and "Content-Security-Policy" in response.headers
        text = await response.text()
        assert text == (static / name).read_text()
        # No CDN, no network: the only absolute URL is the SVG namespace, which is never fetched.
        assert set(re.findall(r"https?://[^\s'\")]+", text)) <= {"http://www.w3.org/2000/svg"}
    script = (static / "app.js").read_text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script
    assert (await api.get("/static/../api.py")).status == 404
    api_response = await api.get("/api/runs")
    assert api_response.headers["Cache-Control"] == "no-store"
    assert api_response.headers["Content-Security-Policy"] == security.CONTENT_SECURITY_POLICY


async def test_without_a_token_only_requests_addressed_to_loopback_are_answered(api):
    response = await api.get("/api/runs", headers={"Host": "evil.example:8080"})
    assert response.status == 403 and "loopback" in (await response.json())["error"]
    assert (await api.get("/api/runs", headers={"Host": "localhost:8080"})).status == 200


async def test_a_token_guards_every_request(seeded):
    app = create_app(seeded, token="s3cret-token")
    async with TestClient(TestServer(app)) as client:
        for path in ("/", "/static/app.js", "/api/runs", f"/api/runs/{RUN}"):
            response = await client.get(path)
            assert response.status == 401, path
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert "s3cret" not in await response.text()
        assert (await client.get("/api/runs", headers={"Authorization": "Bearer wrong"})).status == 401
        assert (await client.get("/api/runs", params={"token": "s3cret-token-longer"})).status == 401
        good = await client.get("/api/runs", headers={"Authorization": "Bearer s3cret-token"})
        assert good.status == 200 and "Set-Cookie" not in good.headers
    # unsafe: aiohttp's jar keeps no cookies for IP addresses unless told to (browsers do).
    jar = CookieJar(unsafe=True)
    server = TestServer(create_app(seeded, token="s3cret-token"))
    async with ClientSession(cookie_jar=jar) as session, server:
        # The browser's way: ?token= on the page sets an HttpOnly cookie its own files load with.
        page = await session.get(server.make_url("/?token=s3cret-token"))
        assert page.status == 200
        cookie = page.cookies[security.COOKIE]
        assert cookie["httponly"] and cookie["samesite"] == "Strict"
        assert (await session.get(server.make_url("/static/app.js"))).status == 200
    assert all(map(security.is_loopback, ("127.0.0.1", "127.8.0.1", "[::1]", "::1", "localhost")))
    assert not security.is_loopback("0.0.0.0") and not security.is_loopback("192.168.1.5")


async def test_dead_letters_are_null_when_redis_is_unreachable(seeded):
    app = create_app(seeded, redis_url="redis://127.0.0.1:1/0")
    async with TestClient(TestServer(app)) as client:
        for _ in range(2):  # the second is answered from the "Redis is down" memory
            run = await get_json(client, f"/api/runs/{RUN}")
            assert run["dead_letters"] == {"total": None, "run": None, "labels": {}, "complete": False}


# -- `runbus serve` as a process ---------------------------------------------------------------


@contextmanager
def serve(
    store_url: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`runbus --log-level INFO --store URL serve --port 0 ARGS` running: its base URL and process
    (whose `stderr` reads its log from the start)."""
    # The log goes to a file, not a pipe: the access log of a long module (the browser tests) fills
    # a pipe nobody reads, and the server then blocks writing its next line.
    log = tempfile.NamedTemporaryFile("w", prefix="runbus-serve-", suffix=".log")  # noqa: SIM115
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runbus",
            "--log-level",
            "INFO",
            "--store",
            store_url,
            "serve",
            "--port",
            "0",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, **(env or {})},
    )
    process.stderr = open(log.name)  # noqa: SIM115 (closed below)
    try:
        deadline, url = time.monotonic() + 30, None
        while url is None and time.monotonic() < deadline and process.poll() is None:
            ready, _, _ = select.select([process.stdout], [], [], 0.5)
            if ready:
                match = re.search(r"dashboard at (http://\S+/)", process.stdout.readline())
                url = match.group(1) if match else None
        assert url, f"runbus serve did not start: {'' if process.poll() is None else process.stderr.read()}"
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        finally:
            process.stdout.close()
            process.stderr.close()
            log.close()


def test_serve_refuses_other_addresses_without_a_token(store_url):
    result = run_cli(
        "--store", store_url, "serve", "--host", "0.0.0.0", check=False, env={security.TOKEN_ENV: ""}
    )
    assert result.returncode == 1
    assert "refusing to listen on 0.0.0.0 without a token" in result.stderr and "--token" in result.stderr


async def test_serve_closes_connections_that_never_send_a_whole_request(seeded):
    """Half-open connections (a request line never finished) and idle keep-alive ones are closed
    after --idle-timeout, while every other request is answered."""
    with serve(seeded, "--idle-timeout", "1") as (url, _):
        port = int(url.rstrip("/").rpartition(":")[2])
        await assert_idle_connections_closed(port, "/api/runs")


async def test_serve_with_a_token_never_prints_or_logs_it(seeded):
    token = "tok-" + "9" * 24
    with serve(seeded, "--redis", "redis://127.0.0.1:1/0", env={security.TOKEN_ENV: token}) as (url, process):
        async with ClientSession() as session:
            assert (await session.get(url + "api/runs")).status == 401
            response = await session.get(url + f"api/runs/{RUN}?token={token}")
            assert response.status == 200 and (await response.json())["run_id"] == RUN
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        out, err = process.stdout.read(), process.stderr.read()
    assert "?token=TOKEN" in out
    assert f"GET /api/runs/{RUN} 200" in err and "GET /api/runs 401" in err  # the access log, at INFO
    assert token not in out + err
