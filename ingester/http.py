"""A worker's operations endpoints (`runbus ingest --http [HOST:]PORT`): /healthz, /readyz, /metrics.

The server runs on the worker's own event loop and reads its live counters; Redis and the store
are asked through the worker's own clients. Every worker process serves its own: with
`--workers N`, worker i listens on PORT+i, one Prometheus target each (nothing to aggregate
across processes, and each one's /readyz speaks for that process). Bound to loopback, it answers
only requests addressed to loopback (runbus/loopback.py). A connection that sends no whole
request head within `idle_timeout` of its opening or last response is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from runbus.config import HTTP_IDLE_TIMEOUT
from runbus.errors import AccessDenied, CannotListen, StoreError
from runbus.ingester import telemetry
from runbus.loopback import is_loopback, loopback_requests_only

if TYPE_CHECKING:
    from runbus.ingester.worker import Worker

log = logging.getLogger("runbus.ingester")

DEFAULT_HOST = "127.0.0.1"
CHECK_TIMEOUT = 2.0
# A name that is never a run: metric_keys on it is one indexed lookup that finds nothing.
READYZ_RUN = "__readyz__"
GAPS_INTERVAL = 30.0
GAPS_WINDOW = 3600.0  # runs written to within this long are checked for gaps
GAPS_MAX_RUNS = 10
# Store.run() reads every event of a run: on big runs the gaps are recomputed less often, so
# that they never take more than 1/GAPS_COST_SHARE of the store's time.
GAPS_COST_SHARE = 20
MAX_STREAM_SERIES = 200
XINFO_CHUNK = 500


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPv6]:PORT`, `:PORT` or `PORT`; the host defaults to 127.0.0.1."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT, got {text!r}")
    return host, number


class OpsServer:
    """The aiohttp server for one worker; `start()` binds, `stop()` closes."""

    def __init__(
        self, worker: Worker, host: str = DEFAULT_HOST, port: int = 0, idle_timeout: float = HTTP_IDLE_TIMEOUT
    ) -> None:
        self.worker = worker
        self.host, self.port = host, port
        self.idle_timeout = idle_timeout
        self._runner: web.AppRunner | None = None
        settings = worker.settings
        self.collector = telemetry.WorkerCollector(
            worker.stats, settings.consumer, settings.group, MAX_STREAM_SERIES
        )
        self.collector.health = worker.health.live
        self.registry = telemetry.worker_registry(self.collector)
        self._missing_next = 0.0
        self._missing_task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        middlewares = [loopback_requests_only()] if is_loopback(self.host) else []
        app = web.Application(middlewares=middlewares)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> None:
        # aiohttp's keep-alive timer runs from a connection's opening too: it bounds a request
        # head that never arrives whole.
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, keepalive_timeout=self.idle_timeout
        )
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as exc:
            await self._runner.cleanup()
            raise CannotListen(f"cannot serve the ops endpoints on {self.host}:{self.port}: {exc}") from exc
        self.port = self._runner.addresses[0][1]
        shown = f"[{self.host}]" if ":" in self.host else self.host
        log.info(
            "ops endpoints of %s at http://%s:%d/ (healthz, readyz, metrics)",
            self.worker.settings.consumer,
            shown,
            self.port,
        )

    async def stop(self) -> None:
        if self._missing_task is not None:
            self._missing_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._missing_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def healthz(self, request: web.Request) -> web.Response:
        """The process and its event loop answer."""
        consumer = self.worker.settings.consumer
        return web.json_response({"status": "ok", "consumer": consumer, "pid": os.getpid()})

    async def readyz(self, request: web.Request) -> web.Response:
        """Redis answers PING and the store answers a cheap indexed query, each within 2 s."""
        checks = {"redis": await self._check(self._ping_redis), "store": await self._check(self._ping_store)}
        ready = all(result == "ok" for result in checks.values())
        return web.json_response({"ready": ready, **checks}, status=200 if ready else 503)

    async def _ping_redis(self) -> None:
        if self.worker.redis is None:
            raise RuntimeError("not connected yet")
        await self.worker.redis.ping()

    async def _ping_store(self) -> None:
        await self.worker.store.metric_keys(READYZ_RUN)

    @staticmethod
    async def _check(probe: Callable[[], Awaitable[object]]) -> str:
        try:
            await asyncio.wait_for(probe(), CHECK_TIMEOUT)
        except TimeoutError:
            return f"no answer within {CHECK_TIMEOUT:.0f}s"
        except Exception as exc:  # any failure means not ready; the message says which
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    async def metrics(self, request: web.Request) -> web.Response:
        """The worker's registry, in the format the scraper asks for (Prometheus' text format
        unless it accepts OpenMetrics), as prometheus_client's own servers choose it."""
        self._refresh_missing()
        self.collector.backlog = await self._backlog()
        self.collector.group = self.worker.settings.group  # the store's, once connected
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self.registry), headers={"Content-Type": content_type})

    async def _backlog(self) -> list[telemetry.StreamBacklog] | None:
        """XINFO GROUPS of every stream the worker reads, pipelined; None if Redis is away."""
        worker = self.worker
        if worker.redis is None or worker.discovery is None:
            return None
        streams = list(worker.discovery.streams)
        group = worker.discovery.group.encode()
        backlog = []
        try:
            if not streams:
                await asyncio.wait_for(worker.redis.ping(), CHECK_TIMEOUT)  # "none" only if Redis says so
            for i in range(0, len(streams), XINFO_CHUNK):
                chunk = streams[i : i + XINFO_CHUNK]
                pipe = worker.redis.pipeline(transaction=False)
                for key in chunk:
                    pipe.xinfo_groups(key)
                replies = await asyncio.wait_for(pipe.execute(raise_on_error=False), CHECK_TIMEOUT)
                for key, groups in zip(chunk, replies, strict=True):
                    if isinstance(groups, Exception):
                        continue  # deleted meanwhile: no longer read
                    for info in groups:
                        if info["name"] == group or info["name"] == group.decode():
                            backlog.append(telemetry.StreamBacklog(key, info.get("lag"), info["pending"]))
        except Exception as exc:  # Redis away or slow: the scrape still answers, without these
            log.debug("stream backlog not read: %s", exc)
            return None
        return backlog

    def _refresh_missing(self) -> None:
        """Recompute the gaps in the background, at most every GAPS_INTERVAL, only when scraped."""
        idle = self._missing_task is None or self._missing_task.done()
        if idle and time.monotonic() >= self._missing_next:
            self._missing_next = float("inf")
            self._missing_task = asyncio.create_task(self._compute_missing())

    async def _compute_missing(self) -> None:
        written = self.worker.stats.runs_written
        cutoff = time.time() - GAPS_WINDOW
        for run_id in [run for run, at in written.items() if at < cutoff]:
            del written[run_id]
        recent = sorted(written, key=written.__getitem__, reverse=True)[:GAPS_MAX_RUNS]
        missing: dict[str, int] = {}
        started = time.monotonic()
        try:
            for run_id in recent:
                run = await self.worker.store.run(run_id)
                if run is not None:
                    missing[run_id] = sum(label.missing for label in run.labels)
        except (StoreError, AccessDenied) as exc:
            log.debug("gaps not computed: %s", exc)
        else:
            self.collector.missing = missing
        finally:
            took = time.monotonic() - started
            self._missing_next = time.monotonic() + max(GAPS_INTERVAL, GAPS_COST_SHARE * took)


async def serve_while_running(worker: Worker, host: str, port: int) -> None:
    """Run `worker` with its ops server beside it; the server closes after the worker stops."""
    server = OpsServer(worker, host, port)
    await server.start()
    try:
        await worker.async_run()
    finally:
        await server.stop()
