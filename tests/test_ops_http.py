"""The ingester's ops endpoints: /healthz, /readyz against real and missing servers, /metrics in
Prometheus' text format with the worker's live figures."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
import redis

from runbus import wire
from runbus.ingester import telemetry
from runbus.ingester.http import OpsServer, parse_address
from runbus.ingester.localredis import free_port
from runbus.ingester.worker import Worker, WorkerSettings
from tests.helpers import ingest_command, xadd_event

LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
SAMPLE = re.compile(rf"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{{{LABEL}(,{LABEL})*\}})? \S+$")


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
async def running(worker: Worker):
    """The worker's loop and its ops server on a free loopback port; stopped on the way out."""
    server = OpsServer(worker, "127.0.0.1", 0)
    await server.start()
    task = asyncio.create_task(worker.async_run())
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{server.port}") as session:
            yield session
    finally:
        worker.request_stop()
        await task
        await server.stop()


async def wait_until(condition, within: float = 20.0) -> None:
    """Poll `condition` (a function, or a coroutine function) until it holds."""
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_parse_address():
    assert parse_address("9100") == ("127.0.0.1", 9100)
    assert parse_address(":9100") == ("127.0.0.1", 9100)
    assert parse_address("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_address("[::1]:9100") == ("::1", 9100)
    for bad in ("", "host:", "host:http", "70000"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_address(bad)


def test_histogram_and_escaping_follow_the_text_format():
    histogram = telemetry.Histogram((1, 10))
    for value in (0.5, 1, 5, 50):
        histogram.observe(value)
    out = telemetry.Exposition()
    out.histogram("h", "help", histogram)
    out.family("g", "gauge", "help", [({"stream": 'a"b\\c\nd'}, float("nan"))])
    samples = parse_metrics(out.text())
    assert [samples[f'h_bucket{{le="{le}"}}'] for le in ("1.0", "10.0", "+Inf")] == [2, 3, 4]
    assert samples["h_count"] == 4 and samples["h_sum"] == 56.5
    assert 'g{stream="a\\"b\\\\c\\nd"} NaN' in out.text()


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
        client.xgroup_create(other, wire.DEFAULT_GROUP, id="0")
        client.xreadgroup(wire.DEFAULT_GROUP, "elsewhere", {other: ">"})

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
        await wait_until(lambda: worker.stats.entries >= 13)
        async with session.get("/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == telemetry.CONTENT_TYPE
            samples = parse_metrics(await response.text())

        async def gaps_known() -> bool:
            async with session.get("/metrics") as response:
                return 'runbus_missing_events{run="ops"}' in await response.text()

        await wait_until(gaps_known)  # the first scrape starts computing them
        async with session.get("/metrics") as response:
            final = parse_metrics(await response.text())

    assert samples['runbus_ingester_info{consumer="ops-test",group="runbus"}'] == 1
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
    assert "runbus_reconnects_total" in samples and "runbus_claimed_total" in samples


async def test_readyz_says_what_is_unreachable(store_url):
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    worker = Worker(WorkerSettings(redis_url=dead_redis, store_url=store_url, handle_signals=False))
    async with running(worker) as session:
        await wait_until(lambda: worker.stats.reconnects >= 1)
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

        await wait_until(ready)
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


def test_the_cli_serves_them_and_stops_on_sigterm(redis_url, store_url):
    port = free_port()
    with subprocess.Popen(
        ingest_command(redis_url, store_url, "--http", f"127.0.0.1:{port}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        deadline = time.monotonic() + 60
        while status(f"http://127.0.0.1:{port}/readyz") != 200:  # 503 until connected
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"ops endpoints of {socket.gethostname()}-{proc.pid} at http://127.0.0.1:{port}/" in err


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
