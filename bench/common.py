"""What the benchmarks share: a Redis to use, percentiles, the machine they ran on, one JSON line."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import orjson
import psutil

# The repository first: bench/producer.py must not shadow the `producer` package.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runbus.ingester.localredis import LocalRedis  # noqa: E402
from runbus.storage import open_store  # noqa: E402
from tests.helpers import ingest_command, wait_for  # noqa: E402
from tests.test_pipeline import store_opened  # noqa: E402

# The anchor the health benches compare against: which trackers name the rank at fault.
TRACKERS_NAMING_A_RANK = "none (W&B, MLflow, Neptune, Aim, ClearML)"


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """RUNBUS_BENCH_REDIS_URL, else a throwaway redis-server (no persistence) for this run."""
    url = os.environ.get("RUNBUS_BENCH_REDIS_URL")
    if url:
        yield url
        return
    with LocalRedis() as server:
        yield server.url


@contextlib.contextmanager
def ingester(redis_url: str, store_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """One `runbus ingest` worker with its defaults."""
    worker = subprocess.Popen(
        ingest_command(redis_url, store_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield worker
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()


@contextlib.asynccontextmanager
async def live_store(prefix: str) -> AsyncIterator[tuple[str, str, Any]]:
    """A throwaway folder, a private Redis and one live `runbus ingest` into a SQLite store there,
    while the block runs: (folder, Redis URL, the store, open for reads once the worker made it)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, private_redis() as redis_url:
        store_url = f"sqlite:///{tmp}/runbus.db"
        with ingester(redis_url, store_url) as worker:
            wait_for("the worker to make the store", lambda: store_opened(store_url), 60, running=worker)
            store = open_store(store_url)
            await store.connect()
            try:
                yield tmp, redis_url, store
            finally:
                await store.close()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
    }


def emit(name: str, results: dict) -> None:
    """Print the one JSON line a benchmark reports."""
    print(orjson.dumps({"bench": name, "machine": machine(), **results}).decode(), flush=True)
