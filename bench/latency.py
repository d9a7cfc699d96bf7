"""End-to-end latency: from `log()` to queryable in storage, at 1k and 10k events/s.

A producer process logs at a fixed rate; a live ingester (in this process) commits batches into
SQLite. The latency of an event is its commit time less the time `log()` stamped on it (`ts`).

    python bench/latency.py [--seconds 10] [--rates 1000,10000]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence

from common import ROOT, emit, percentile, private_redis

from runbus import storage
from runbus.ingester.worker import Worker, WorkerSettings

PRODUCER = textwrap.dedent(
    """
    import os, time, runbus
    rate, seconds = float(os.environ["RATE"]), float(os.environ["SECONDS"])
    run = runbus.init(system_interval=None, hardware=False, console="off")
    started, step, total = time.perf_counter(), 0, int(rate * seconds)
    while step < total:  # every event, paced: the last is due at `seconds`
        due = min(total, int((time.perf_counter() - started) * rate))
        while step < due:
            run.log({"loss": 0.5, "lr": 1e-4}, step=step)
            step += 1
        time.sleep(0.0005)
    run.finish()
    """
)


class TimedStore:
    """A store that notes, per committed metric event, how long after `log()` it became readable."""

    def __init__(self, inner: storage.Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.latencies: list[float] = []

    async def write(self, events: Sequence) -> int:
        stored = await self.inner.write(events)
        now = time.time()
        self.latencies.extend(now - e.ts for e in events if e.kind == "metric")
        return stored

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


async def measure(redis_url: str, store_url: str, rate: int, seconds: float) -> dict:
    store = TimedStore(storage.open_store(store_url))
    worker = Worker(
        WorkerSettings(redis_url=redis_url, store_url=store_url, handle_signals=False), store=store
    )
    task = asyncio.create_task(worker.async_run())
    await asyncio.sleep(0.5)
    env = {
        **os.environ,
        "RUNBUS_REDIS_URL": redis_url,
        "RUNBUS_RUN_ID": f"latency-{rate}",
        "RATE": str(rate),
        "SECONDS": str(seconds),
    }
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", PRODUCER, env=env, cwd=ROOT)
    await proc.wait()
    expected = int(rate * seconds)
    deadline = time.monotonic() + 30
    # Polled on purpose: the worker is left untouched, the store only counts.
    while len(store.latencies) < expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    worker.request_stop()
    await task
    ms = [1000 * x for x in store.latencies]
    return {
        "rate": rate,
        "events": len(ms),
        "p50_ms": round(percentile(ms, 0.50), 1),
        "p99_ms": round(percentile(ms, 0.99), 1),
        "max_ms": round(max(ms), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rates", default="1000,10000")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    results = []
    with private_redis() as redis_url, tempfile.TemporaryDirectory() as tmp:
        for rate in (int(r) for r in args.rates.split(",")):
            store_url = f"sqlite:///{tmp}/latency-{rate}.db"
            results.append(asyncio.run(measure(redis_url, store_url, rate, args.seconds)))
    emit("latency", {"store": "sqlite", "results": results})


if __name__ == "__main__":
    main()
