"""The ingester's ops endpoints: /healthz, /readyz against real and missing servers, /metrics in
Prometheus' text format with the worker's live figures; the process setup every way of running a
worker gets (ingester/process.py), seen in its log and its /metrics."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import aiohttp
import prometheus_client
import pytest
import redis
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from runbus import wire
from runbus.ingester import telemetry
from runbus.ingester.http import OpsServer, parse_address
from runbus.ingester.localredis import free_port
from runbus.ingester.process import GC_THRESHOLDS
from runbus.ingester.stats import WorkerStats
from runbus.ingester.worker import Worker, WorkerSettings
from tests.helpers import (
    assert_idle_connections_closed,
    ingest_command,
    pending_count,
    read_store,
    run_cli,
    store_group_async,
    wait_for,
    wait_for_async,
    xadd_event,
)
from tests.test_supervisor import free_ports

LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
SAMPLE = re.compile(rf"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{{{LABEL}(,{LABEL})*\}})? \S+$")
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
# Every name of the README's metric table, as a metric family or one of its samples.
README_METRICS = (
    "runbus_run_health",
    "runbus_run_culprits",
    "runbus_run_stragglers",
    "runbus_run_anomalies",
    "runbus_run_stalled_seconds",
    "runbus_run_lost_seconds",
    "runbus_ingested_events_total",
    "runbus_stored_events_total",
    "runbus_duplicate_events_total",
    "runbus_entries_total",
    "runbus_batches_total",
    "runbus_batch_size_entries",
    "runbus_store_write_seconds",
    "runbus_lag_entries",
    "runbus_pending_entries",
    "runbus_streams",
    "runbus_stream_lag_entries",
    "runbus_stream_pending_entries",
    "runbus_dead_lettered_total",
    "runbus_poison_total",
    "runbus_missing_events",
    "runbus_reconnects_total",
    "runbus_store_retries_total",
    "runbus_claimed_total",
    "runbus_trimmed_total",
    "runbus_crashed_labels_total",
)
# The line a worker process logs as it starts (ingester/process.py).
SETUP_LINE = re.compile(
    rf"worker (\S+) in process (\d+): gc thresholds {re.escape(str(GC_THRESHOLDS))}, (\d+) start-up "
    r"objects frozen; SIGTERM, SIGINT finish the batches in flight \(at most 10s\), then stop"
)


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample as {'name{labels}': value}, checking each line against the text format."""
    samples: dict[str, float] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        assert SAMPLE.match(line), line
        name, _, value = line.rpartition(" ")
        samples[name] = float(value)
    return samples


@contextlib.asynccontextmanager
async def running(worker: Worker, server: OpsServer | None = None):
    """The worker's loop and its ops server (`server`, else one on a free loopback port); stopped
    on the way out."""
    server = server or OpsServer(worker, "127.0.0.1", 0)
    await server.start()
    task = asyncio.create_task(worker.async_run())
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{server.port}") as session:
            yield session
    finally:
        worker.request_stop()
        await task
        await server.stop()


def test_parse_address():
    assert parse_address("9100") == ("127.0.0.1", 9100)
    assert parse_address(":9100") == ("127.0.0.1", 9100)
    assert parse_address("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_address("[::1]:9100") == ("::1", 9100)
    for bad in ("", "host:", "host:http", "70000"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_address(bad)


def exposition(stats: WorkerStats, consumer: str = "c", **scraped) -> str:
    """What a scrape of a worker with these figures returns (text format)."""
    collector = telemetry.WorkerCollector(stats, consumer, "g", max_streams=2)
    for name, value in scraped.items():
        setattr(collector, name, value)
    return prometheus_client.generate_latest(telemetry.worker_registry(collector)).decode()


def test_histograms_and_escaping_follow_the_text_format():
    stats = WorkerStats()
    for value in (0.5, 1, 5, 50):  # into the buckets up to 1, 10, 50
        stats.batch_sizes.observe(value)
    hostile = 'runbus:{a"b\\c\nd}:rank0'  # stream names come from whoever writes to Redis
    backlog = [
        telemetry.StreamBacklog(hostile, None, 7),
        telemetry.StreamBacklog("quiet", 0, 0),
        telemetry.StreamBacklog("busy", 5, 1),
    ]
    text = exposition(stats, backlog=backlog)
    samples = parse_metrics(text)
    buckets = [samples[f'runbus_batch_size_entries_bucket{{le="{le}"}}'] for le in ("1.0", "10.0", "50.0")]
    assert buckets == [2, 3, 4] and samples['runbus_batch_size_entries_bucket{le="+Inf"}'] == 4
    assert samples["runbus_batch_size_entries_count"] == 4
    assert samples["runbus_batch_size_entries_sum"] == 56.5
    families = {f.name: f for f in text_string_to_metric_families(text)}
    pending = {s.labels["stream"]: s.value for s in families["runbus_stream_pending_entries"].samples}
    assert pending == {hostile: 7, "busy": 1}  # the two with the most; the totals count all three
    assert [s.labels for s in families["runbus_stream_lag_entries"].samples] == [{"stream": "busy"}]
    assert samples["runbus_pending_entries"] == 8 and samples["runbus_lag_entries"] == 5
    assert samples["runbus_streams"] == 3


def test_each_worker_has_a_registry_of_its_own():
    first, second = WorkerStats(stored=3), WorkerStats(stored=5)
    texts = [exposition(first, "first"), exposition(second, "second")]
    assert [parse_metrics(text)["runbus_stored_events_total"] for text in texts] == [3, 5]
    assert 'consumer="second"' in texts[1] and 'consumer="second"' not in texts[0]
    default = prometheus_client.generate_latest().decode()  # the library's global registry
    assert "runbus_" not in default


async def test_metrics_count_what_the_worker_did(redis_url, store_url):
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, "ops", "rank0", "start", 1, 1, {"primary": True})
        for seq in range(2, 12):
            xadd_event(client, "ops", "rank0", "metric", 1, seq, {"loss": 1.0}, step=seq)
        xadd_event(client, "ops", "rank0", "metric", 1, 15, {"loss": 1.0}, step=15)  # 12..14 missing
        client.xadd(wire.stream_key("ops", "rank0"), {"v": "1", "kind": "bogus"})
        # Another consumer holds three entries of a second stream (the worker won't claim them).
        other = wire.stream_key("ops", "rank1")
        for seq in range(1, 4):
            xadd_event(client, "ops", "rank1", "metric", 1, seq, {"loss": 2.0}, step=seq)
        group = await store_group_async(store_url)
        client.xgroup_create(other, group, id="0")
        client.xreadgroup(group, "elsewhere", {other: ">"})

    worker = Worker(
        WorkerSettings(
            redis_url=redis_url,
            store_url=store_url,
            handle_signals=False,
            claim_idle=3600,
            consumer="ops-test",
        )
    )
    async with running(worker) as session:
        async with session.get("/healthz") as response:
            assert response.status == 200 and (await response.json())["consumer"] == "ops-test"
        await wait_for_async("13 entries read", lambda: worker.stats.entries >= 13, 20)
        async with session.get("/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == TEXT_FORMAT
            text = await response.text()
            samples = parse_metrics(text)
        openmetrics = {"Accept": "application/openmetrics-text; version=1.0.0"}
        async with session.get("/metrics", headers=openmetrics) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            scraped_as_openmetrics = {f.name for f in openmetrics_families(await response.text())}

        async def gaps_known() -> bool:
            async with session.get("/metrics") as response:
                return 'runbus_missing_events{run="ops"}' in await response.text()

        await wait_for_async("the gaps", gaps_known, 20)  # the first scrape starts computing them
        async with session.get("/metrics") as response:
            final_text = await response.text()
            final = parse_metrics(final_text)

    assert samples[f'runbus_ingester_info{{consumer="ops-test",group="{group}"}}'] == 1
    assert samples['runbus_ingested_events_total{kind="start"}'] == 1
    assert samples['runbus_ingested_events_total{kind="metric"}'] == 11
    assert samples["runbus_stored_events_total"] == 12
    assert samples["runbus_dead_lettered_total"] == 1
    assert samples["runbus_batches_total"] >= 1
    assert samples["runbus_batch_size_entries_count"] == samples["runbus_batches_total"]
    assert samples["runbus_batch_size_entries_sum"] == samples["runbus_entries_total"] == 13
    assert samples['runbus_store_write_seconds_bucket{le="+Inf"}'] >= 1
    assert samples["runbus_streams"] == 2
    assert samples[f'runbus_stream_pending_entries{{stream="{other}"}}'] == 3
    assert samples[f'runbus_stream_lag_entries{{stream="{other}"}}'] == 0
    assert samples["runbus_pending_entries"] == 3 and samples["runbus_lag_entries"] == 0
    assert final['runbus_missing_events{run="ops"}'] == 3
    families = list(text_string_to_metric_families(final_text))
    names = {f.name for f in families} | {s.name for f in families for s in f.samples}
    assert set(README_METRICS) <= names
    assert {"runbus_stored_events", "runbus_batch_size_entries"} <= scraped_as_openmetrics
    # The process's own figures, beside the worker's.
    assert samples['runbus_gc_threshold{generation="0"}'] == gc.get_threshold()[0]
    assert "process_cpu_seconds_total" in samples and "python_gc_collections_total" in text


async def test_readyz_says_what_is_unreachable(store_url):
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    worker = Worker(WorkerSettings(redis_url=dead_redis, store_url=store_url, handle_signals=False))
    async with running(worker) as session:
        await wait_for_async("a reconnect", lambda: worker.stats.reconnects >= 1, 20)
        async with session.get("/readyz") as response:
            body = await response.json()
            assert response.status == 503
        assert body["ready"] is False and body["store"] == "ok" and "ConnectionError" in body["redis"]
        async with session.get("/healthz") as response:
            assert response.status == 200  # alive, just not ready
        async with session.get("/metrics") as response:
            assert response.status == 200
            samples = parse_metrics(await response.text())
        assert samples["runbus_reconnects_total"] >= 1 and "runbus_streams" not in samples


async def test_connections_that_never_send_a_whole_request_are_closed(redis_url, store_url):
    worker = Worker(WorkerSettings(redis_url=redis_url, store_url=store_url, handle_signals=False))
    server = OpsServer(worker, "127.0.0.1", 0, idle_timeout=1.0)
    async with running(worker, server):
        await assert_idle_connections_closed(server.port, "/healthz")


async def test_readyz_is_ready_with_redis_and_store_and_refuses_foreign_hosts(redis_url, store_url):
    worker = Worker(WorkerSettings(redis_url=redis_url, store_url=store_url, handle_signals=False))
    async with running(worker) as session:

        async def ready() -> bool:
            async with session.get("/readyz") as response:
                return response.status == 200 and (await response.json()) == {
                    "ready": True,
                    "redis": "ok",
                    "store": "ok",
                }

        await wait_for_async("ready", ready, 20)
        # Bound to loopback: a page that rebinds its own name to 127.0.0.1 is refused.
        async with session.get("/metrics", headers={"Host": "attacker.example:80"}) as response:
            assert response.status == 403


def status(url: str) -> int | None:
    """The HTTP status of GET `url`, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response open
        return exc.code
    except OSError:
        return None


def scrape(port: int) -> dict[str, float] | None:
    """The samples of a worker's /metrics, None when nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return parse_metrics(response.read().decode())
    except OSError:
        return None


def assert_set_up(samples: dict[str, float]) -> None:
    """The worker process's garbage collector is tuned and its start-up objects frozen."""
    thresholds = [samples[f'runbus_gc_threshold{{generation="{g}"}}'] for g in range(3)]
    assert tuple(thresholds) == GC_THRESHOLDS
    assert samples["runbus_gc_frozen_objects"] > 1000


def seed(redis_url: str, run: str, count: int) -> None:
    with redis.Redis.from_url(redis_url) as client:
        xadd_event(client, run, "rank0", "start", 1, 1, {"primary": True})
        for seq in range(2, count + 1):
            xadd_event(client, run, "rank0", "metric", 1, seq, {"loss": 1.0}, step=seq)


def test_the_cli_serves_them_set_up_and_drains_on_sigterm(redis_url, store_url):
    # The Dockerfile's and docker-compose.yml's way to run a worker: `runbus ingest --http`.
    seed(redis_url, "served", 500)
    port = free_port()
    with subprocess.Popen(
        ingest_command(redis_url, store_url, "--http", f"127.0.0.1:{port}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        ready = f"http://127.0.0.1:{port}/readyz"
        wait_for("ready", lambda: status(ready) == 200, 60, running=proc)  # 503 until connected
        samples = wait_for(
            "500 entries",
            lambda: (m := scrape(port)) and m["runbus_entries_total"] == 500 and m,
            60,
            running=proc,
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert_set_up(samples)
    consumer = f"{socket.gethostname()}-{proc.pid}"
    assert f"ops endpoints of {consumer} at http://127.0.0.1:{port}/" in err
    setup = SETUP_LINE.search(err)
    assert setup and setup.group(1, 2) == (consumer, str(proc.pid)), err
    assert "stopping: finishing the batches in flight" in err
    assert f"worker {consumer} stopped after" in err and ", 500 entries, 500 stored," in err
    with redis.Redis.from_url(redis_url) as client:
        assert pending_count(client, wire.stream_key("served", "rank0")) == 0
    assert read_store(store_url, "run", "served").counts["metric"] == 499


def test_every_worker_of_a_supervisor_is_set_up_and_serves(redis_url, store_url):
    seed(redis_url, "supervised", 300)
    base = free_ports(2)
    command = ingest_command(redis_url, store_url, "--workers", "2", "--consumer", "sup", "--http", str(base))
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        both = wait_for(
            "both workers", lambda: (m := [scrape(base), scrape(base + 1)]) and all(m) and m, 60, running=proc
        )
        wait_for(
            "300 entries",
            lambda: sum(scrape(base + i)["runbus_entries_total"] for i in range(2)) == 300,
            60,
            running=proc,
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    for samples in both:
        assert_set_up(samples)
    workers = sorted(match.group(1) for match in SETUP_LINE.finditer(err))
    assert workers == ["sup-0", "sup-1"], err
    assert "[sup-0] " in err and "[sup-1] " in err  # each worker process configured its logging
    assert "supervisor stopped: 0 restarts; last exit codes [0, 0]" in err
    assert read_store(store_url, "run", "supervised").counts["metric"] == 299


@pytest.mark.parametrize(
    "options",
    [["--burst"], ["--burst", "--http", "127.0.0.1:0"], ["--burst", "--workers", "2"]],
    ids=["burst", "burst-http", "burst-workers"],
)
def test_every_way_of_running_a_worker_sets_its_process_up(redis_url, store_url, options):
    seed(redis_url, "burst", 50)
    result = run_cli("--store", store_url, "ingest", "--redis", redis_url, *options)
    workers = 2 if "--workers" in options else 1
    setups = SETUP_LINE.findall(result.stderr)
    assert len(setups) == workers, result.stderr
    assert all(int(frozen) > 1000 for _, _, frozen in setups)
    assert read_store(store_url, "run", "burst").counts["metric"] == 49


def test_an_address_in_use_is_a_clean_error(redis_url, store_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            ingest_command(redis_url, store_url, "--http", f"127.0.0.1:{port}"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1 and "cannot serve the ops endpoints" in result.stderr
