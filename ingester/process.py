"""One ingester worker process, however it was started: its garbage collector tuned, its setup
logged, and the worker run until it stops, with its ops server beside it when given an address.

Every way of running a worker comes through `run_worker`: `runbus ingest` (with or without
`--burst` and `--http`), each worker process of `--workers N` (ingester/supervisor.py), and so the
Dockerfile's and docker-compose.yml's `ingest --http`. A worker embedded with `async_run()` leaves
its process alone.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from typing import TYPE_CHECKING

from runbus.errors import AccessDenied, CannotListen, GaveUp

if TYPE_CHECKING:
    from runbus.ingester.worker import Worker

log = logging.getLogger("runbus.ingester")

# Every event allocates a handful of container objects (none in reference cycles). At the default
# gen-0 threshold of 700 the cyclic collector runs every ~100 events and its older generations
# sweep every live object in turn: a third of a worker's CPU (bench/ingest.py, SQLite, one worker:
# 41k -> 58k-75k events/s with start-up objects frozen and (20000, 50, 100); 121k-133k -> 128k-149k
# with (100000, 20, 100), and no further gain at 400000 then). Reads of 4,096 entries a stream
# (CHUNK_POINTS) make ~130k containers a read of 8 streams, and a collection at every 100k went
# through the batch being written and the one read ahead, still alive: at 400000 a worker's main
# thread spends 6.3-6.8 µs an event, not 7.7-7.9 (1M: 6.6-7.0; 400k events, 8 labels). Raised,
# not disabled, so cycles (the tracebacks of retried errors) are still freed.
GC_THRESHOLDS = (400_000, 20, 100)
# What the worker handles, when it handles signals (WorkerSettings.handle_signals): stop reading,
# finish the batches in flight for at most drain_timeout, exit.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def tune_gc() -> int:
    """Freeze what start-up allocated and raise the thresholds (GC_THRESHOLDS); the number of
    objects frozen."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    return gc.get_freeze_count()


def run_worker(worker: Worker, http: tuple[str, int] | None = None) -> int:
    """Run `worker` as this process's one job until it stops (or, with burst, is done), with its
    ops endpoints on `http` (host, port) if given; the exit code: 1 if that cannot be bound,
    when Redis or the store refused access (logged in one line, kept in `worker.access_denied`),
    or when a burst gave up on an unreachable one (one line, kept in `worker.gave_up`)."""
    if http is not None:
        # aiohttp is imported only by a worker that serves; before the freeze, to be frozen too.
        from runbus.ingester import http as ops_http
    frozen = tune_gc()
    settings = worker.settings
    log.info(
        "worker %s in process %d: gc thresholds %s, %d start-up objects frozen; %s",
        settings.consumer,
        os.getpid(),
        gc.get_threshold(),
        frozen,
        f"{', '.join(s.name for s in STOP_SIGNALS)} finish the batches in flight "
        f"(at most {settings.drain_timeout:g}s), then stop"
        if settings.handle_signals
        else "no signal handlers (handle_signals is off)",
    )
    try:
        # ops_http is imported above whenever http is given.
        asyncio.run(worker.async_run() if http is None else ops_http.serve_while_running(worker, *http))  # pyright: ignore[reportPossiblyUnboundVariable]
    except CannotListen as exc:
        log.error("%s", exc)
        return 1
    except AccessDenied as exc:
        # Retrying cannot help: kept on the worker so the supervisor does not restart it.
        worker.access_denied = exc
        log.error("worker %s stopped: %s", settings.consumer, exc)
        return 1
    except GaveUp as exc:
        # Not restarted either: a burst that gave up is done, and says why in one line.
        worker.gave_up = exc
        log.error("worker %s gave up: %s", settings.consumer, exc)
        return 1
    return 0
