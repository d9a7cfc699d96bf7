"""The ingest loop: read a batch with XREADGROUP, validate, write it in one transaction, then ack.

Acknowledging only after the commit means a worker that dies mid-batch leaves its entries
pending, never lost; storage's (run, label, epoch, seq) identity makes the redelivery harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, TypeVar, cast

from redis.crc import key_slot
from redis.exceptions import ClusterDownError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runbus import config, storage, wire
from runbus.config import safe_url
from runbus.errors import AccessDenied, GaveUp, StoreError, StoreRejected
from runbus.ingester import decoding, maintenance
from runbus.ingester.batch import Entries, Source, StreamItems, as_dict, decode_batch
from runbus.ingester.deadletter import DeadEntry, dead_letter_fields
from runbus.ingester.discovery import Discovery
from runbus.ingester.fence import Fences
from runbus.ingester.health import HealthKeeper
from runbus.ingester.process import STOP_SIGNALS, run_worker
from runbus.ingester.stats import WorkerStats
from runbus.redis import access_denied, async_client, is_cluster, pending_entries, reply_text
from runbus.storage.base import Store
from runbus.storage.chunking import CHUNK_POINTS
from runbus.storage.health import HealthSettings
from runbus.storage.rules import primary_claims

if TYPE_CHECKING:
    from runbus.redis import AsyncClient

T = TypeVar("T")

log = logging.getLogger("runbus.ingester")

# Redis unreachable, or a cluster without a master for a slot for now: wait and retry.
REDIS_AWAY = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, TryAgainError)
# An entry id as redis-py's commands take it.
StreamId = int | bytes | str | memoryview
# Entries one XREADGROUP may bring at most, over all its streams: a read names at most this many
# over --batch-size streams (streams_per_read), so a worker's batch stays within bounds whatever
# the batch size.
READ_ENTRIES = 262_144
STATS_INTERVAL = 30.0
# Runs whose primary claim (wire.primary_key) this worker has read, remembered at most.
CLAIMS_REMEMBERED = 65536


@dataclass
class _Due:
    """When the worker loop next claims idle entries, runs maintenance, logs its stats."""

    claim: float
    maintenance: float
    stats: float


@dataclass
class Commits:
    """The batches being committed, in the order they were read: one written at a time (the
    store takes a batch after the other), while the batch before it is still acknowledged. So
    the store does not sit idle through each XACK, and at most two batches are in flight."""

    writing: asyncio.Task[None] | None = None  # the newest batch's commit
    written: asyncio.Future[None] | None = None  # done once its store write has returned
    acknowledging: asyncio.Task[None] | None = None  # the batch before, finishing its commit

    async def start(self, commit: Callable[[asyncio.Future[None]], Coroutine[Any, Any, None]]) -> None:
        """Start `commit(written)` once the store is free, and the batch before last is done."""
        if self.written is not None:
            await self.written
        if self.writing is not None and self.writing.done():
            self.writing.result()  # its error now, not a batch later
        if self.acknowledging is not None:
            await self.acknowledging
        self.acknowledging = self.writing
        self.written = asyncio.get_running_loop().create_future()
        self.writing = asyncio.create_task(commit(self.written))

    async def settle(self) -> None:
        """Wait until every batch has committed (the first error propagates)."""
        tasks = [task for task in (self.acknowledging, self.writing) if task is not None]
        self.acknowledging = self.writing = self.written = None
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def cancel(self) -> None:
        """Stop both: what they have not acknowledged stays pending for another worker."""
        for task in (self.acknowledging, self.writing):
            if task is not None:
                task.cancel()


def default_consumer_name() -> str:
    """host-pid: stable for the life of a process, distinct across workers."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class WorkerSettings:
    """How one ingester worker connects, reads and stops."""

    redis_url: str = field(default_factory=config.redis_url)
    store_url: str = field(default_factory=config.default_store_url)
    group: str = ""  # "": the store's own, wire.store_group(its id), set once connected
    consumer: str = field(default_factory=default_consumer_name)
    # Entries read from each stream at once: a backlog (an ingester catching up, a burst) then
    # brings each label epoch a full chunk per read, which the store writes as one chunk per key
    # (storage/chunking.py): fewer, larger chunks are smaller on disk and faster to read back
    # (bench/history.py, docs/performance.md). A live run's streams hold a few entries each.
    batch_size: int = CHUNK_POINTS
    # Rows one store transaction writes at most (row_slices): a read past it is written in
    # several transactions, and acknowledged after the last.
    batch_rows: int = 200_000
    block_ms: int = 250
    burst: bool = False
    registry_interval: float = 0.25
    scan_interval: float = 10.0
    drain_timeout: float = 10.0
    claim_idle: float = 30.0
    max_deliveries: int = 5
    retain: float = 3600.0
    crash_after: float = 120.0
    maintenance_interval: float = 30.0
    # How often Redis's memory is looked at: above maintenance.MEMORY_TRIM_AT of its maxmemory,
    # acknowledged entries are trimmed whatever --retain says.
    memory_interval: float = 1.0
    max_backoff: float = 5.0
    # With burst: stop (GaveUp) once Redis or the store has been unreachable this long; 0: never.
    give_up_after: float = 300.0
    # Where a group made on a stream starts: "start" (its first entry) or "now" (the group's
    # first `--from now`, kept in wire.GROUP_STARTS_KEY so every worker and restart agrees).
    start_from: str = "start"
    handle_signals: bool = True
    only_runs: frozenset[str] | None = None  # read only these runs' streams (the demo's worker)
    # (index, count) under `--workers N`: this worker reads new entries of its share of the
    # streams first (stream_share), and the others' only when its own have none.
    share: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.start_from not in ("start", "now"):
            raise ValueError(f"start_from must be 'start' or 'now', not {self.start_from!r}")

    # Refuse entries without a seal even of labels no sealing producer wrote (ingester/fence.py):
    # for when every producer is a runbus that seals.
    require_seal: bool = field(default_factory=config.require_seal)
    # The health detector (ingester/health.py): its thresholds, how often it judges the live
    # runs, and the command run with each alert as JSON on its stdin.
    health: HealthSettings = field(default_factory=HealthSettings)
    health_interval: float = 1.0
    on_alert: str | None = None


_KIND, _RUN, _DATA = attrgetter("kind"), attrgetter("run"), attrgetter("data")
_ID = itemgetter(0)


def row_slices(events: Sequence[wire.Event], limit: int) -> list[tuple[int, int]]:
    """(start, end) of the consecutive slices of `events` that one store transaction each
    writes: at most `limit` rows each, counting an event's values (a metric's keys) and one
    for the event itself, an upper bound of what it adds to the tables; an event wider than
    `limit` is a slice of its own. A slice ends where a label's events begin where it can, so
    that a label's events of one read are written together (as one chunk per key)."""
    if len(events) + sum(map(len, map(_DATA, events))) <= limit:  # the common case, in C
        return [(0, len(events))]
    slices, start, rows = [], 0, 0
    label_start, label_rows, label = 0, 0, ("", "")
    for i, event in enumerate(events):
        size = len(event.data) + 1
        if (event.run, event.label) != label:
            label_start, label_rows, label = i, 0, (event.run, event.label)
        if rows and rows + size > limit:
            cut = label_start if label_start > start else i
            slices.append((start, cut))
            start, rows = cut, label_rows if cut == label_start else 0
            label_rows = rows
        rows += size
        label_rows += size
    slices.append((start, len(events)))
    return slices


def _raw_reply(response: T, **options: object) -> T:
    """XREADGROUP's reply as the server sent it: entries stay flat [name, value, ...] lists,
    decoded by position (decoding.decode_stream) instead of becoming a dict each."""
    return response


@functools.lru_cache(maxsize=65536)
def _slot(key: str) -> int:
    return key_slot(key.encode())


@functools.lru_cache(maxsize=65536)
def stream_share(key: str, count: int) -> int:
    """Which of `count` workers' shares the stream `key` is in (a hash of the key).

    Workers reading the same label's stream write the same label's row, and on PostgreSQL the
    second waits for the first's commit: with each label read mostly by one worker, they write
    side by side. A share is a preference, not a claim: a worker whose streams have nothing new
    reads every stream, so a share whose worker is down or behind is still read."""
    return zlib.crc32(key.encode("utf-8", "surrogateescape")) % count


def streams_per_read(batch_size: int) -> int:
    """How many streams one XREADGROUP names: READ_ENTRIES entries at most, at least one stream."""
    return max(1, READ_ENTRIES // max(1, batch_size))


def read_chunks(streams: Sequence[str], batch_size: int, by_slot: bool = False) -> list[list[str]]:
    """The streams one XREADGROUP each reads, at most streams_per_read(batch_size) per call.

    In a cluster (`by_slot`) one call may only name keys of one hash slot: the streams are
    grouped by slot first, which keeps each run's streams together (the run is their hash tag).
    """
    groups: list[Sequence[str]] = [streams]
    if by_slot:
        slots: dict[int, list[str]] = {}
        for key in streams:
            slots.setdefault(_slot(key), []).append(key)
        groups = list(slots.values())
    size = streams_per_read(batch_size)
    return [list(group[i : i + size]) for group in groups for i in range(0, len(group), size)]


class Worker:
    """One consumer of the group: `run()` for the CLI, `async_run()` for tests and embedding."""

    def __init__(self, settings: WorkerSettings | None = None, store: Store | None = None) -> None:
        self.settings = settings or WorkerSettings()
        self.store = store or storage.open_store(self.settings.store_url)
        self.stats = WorkerStats()
        self.redis: AsyncClient | None = None  # connected by async_run (None before)
        self.discovery: Discovery | None = None
        self._stop_requested = False
        self._stop_time: float | None = None
        self._stopping = asyncio.Event()  # set with _stop_requested: cuts retry waits short
        self._loop_task: asyncio.Task[None] | None = None
        # Jittered, so that workers that lost Redis or the store together do not retry in step.
        self._retry = config.backoff(self.settings.max_backoff)
        # Why run() stopped the worker with exit code 1, if Redis or the store refused access.
        self.access_denied: AccessDenied | None = None
        # Why run() stopped a burst with exit code 1, if Redis or the store stayed unreachable.
        self.gave_up: GaveUp | None = None
        # Per run: the label holding the producers' live primary claim when first read, or None.
        self._claim_holders: dict[str, str | None] = {}
        self._next_memory_check = 0.0
        self._memory_pressed = False  # above MEMORY_TRIM_AT at the last look (logged once)
        self._fences = Fences(self.settings.require_seal)
        # The entries this worker has read and not yet acknowledged or given up, by stream: its
        # batches, the one read ahead, what it claimed. Kept alive (_keep_alive), never claimed
        # (_claim): XAUTOCLAIM would hand them back to it, to be written twice. Kept as the
        # lists read (one per stream and read), not as sets of ids: a set costs a hash and an
        # insertion per entry, held and let go, where the ids are wanted only every few seconds.
        self._in_flight: dict[str, list[StreamItems]] = {}
        self.health = HealthKeeper(
            self.store, self.settings.health, self.settings.health_interval, self.settings.on_alert
        )

    def run(self, http: tuple[str, int] | None = None) -> int:
        """Run as this process's one job until stopped (or, with burst, until nothing is left),
        with the ops endpoints on `http` (host, port) if given; the exit code.

        The process is the worker's own here: it is set up as every worker process is
        (ingester/process.py: its garbage collector tuned for ingesting); async_run() leaves an
        embedding process alone.
        """
        return run_worker(self, http)

    def request_stop(self) -> None:
        """Stop reading; the batches in flight are finished and acknowledged first, for at most
        drain_timeout, after which they are cancelled and stay pending for another worker."""
        if not self._stop_requested:
            log.info("stopping: finishing the batches in flight (at most %.0fs)", self.settings.drain_timeout)
            self._stop_requested = True
            self._stopping.set()
            self._stop_time = time.monotonic()
            if self._loop_task is not None:
                asyncio.get_running_loop().call_later(
                    self.settings.drain_timeout + 1.0, self._loop_task.cancel
                )

    @property
    def _redis(self) -> AsyncClient:
        """The Redis client, for the loop that async_run starts once it has connected."""
        if self.redis is None:
            raise RuntimeError("the worker has no Redis client before async_run()")
        return self.redis

    @property
    def _discovery(self) -> Discovery:
        """The streams to read, for the loop that async_run starts once it has connected."""
        if self.discovery is None:
            raise RuntimeError("the worker discovers streams only once async_run() has connected")
        return self.discovery

    async def _pause(self, delay: float) -> None:
        """Wait `delay` seconds before a retry: cut short by a stop request, and after it never
        past the drain timeout, so a stop is not held up by a long backoff."""
        if self._stop_time is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            return
        left = self._stop_time + self.settings.drain_timeout - time.monotonic()
        await asyncio.sleep(max(0.0, min(delay, left)))

    def _drain_expired(self) -> bool:
        return self._stop_time is not None and (
            time.monotonic() - self._stop_time > self.settings.drain_timeout
        )

    async def async_run(self) -> WorkerStats:
        settings = self.settings
        loop = asyncio.get_running_loop()
        if settings.handle_signals:
            for signum in STOP_SIGNALS:
                loop.add_signal_handler(signum, self.request_stop)
        redis = self.redis = async_client(settings.redis_url, socket_connect_timeout=5, socket_timeout=30)
        redis.set_response_callback("XREADGROUP", _raw_reply)
        started = time.monotonic()
        log.info(
            "worker %s starting: redis %s, store %s, group %s, %s%s%s",
            settings.consumer,
            safe_url(settings.redis_url),
            safe_url(settings.store_url),
            settings.group or "(the store's)",
            "a stream new to the group is read from its first entry (--from start)"
            if settings.start_from == "start"
            else "a stream new to the group is read from when the group started (--from now)",
            " (burst)" if settings.burst else "",
            "" if decoding.decoder_in_use == "fast" else f", {decoding.decoder_in_use} decoder",
        )
        stop_keeping_alive = asyncio.Event()
        keep_alive = asyncio.create_task(self._keep_alive(stop_keeping_alive))
        compacting: asyncio.Task[None] | None = None
        judging: asyncio.Task[None] | None = None
        try:
            if not await self._connect():
                return self.stats  # stopped while the store was away
            compacting = asyncio.create_task(self._compact_backlog())
            judging = asyncio.create_task(self.health.run(stop_keeping_alive))
            self._loop_task = asyncio.create_task(self._loop())
            try:
                await self._loop_task
            except asyncio.CancelledError:
                if not self._stop_requested:
                    raise
                log.warning("drain timeout: the batches in flight stay pending for another worker")
            if settings.burst and not self._stop_requested:
                await self._maintain()
                await compacting  # a burst leaves the store compacted
            await self._release_consumer()
        finally:
            # Told to stop, not cancelled: redis-py may swallow a cancellation that lands while
            # a command is in flight (119 of 300 tries, redis-py 8.1), and the task then runs on for
            # ever. Awaiting a per-batch keep-alive cancelled so is how a burst used to hang.
            stop_keeping_alive.set()
            await keep_alive
            if judging is not None:
                # Its judgment is redone by the next tick of any worker: a stop waits for it no
                # longer than for the batches in flight (a store that does not answer holds it).
                done, _ = await asyncio.wait({judging}, timeout=settings.drain_timeout)
                if not done:
                    judging.cancel()
                await asyncio.gather(judging, return_exceptions=True)
            if compacting is not None and not compacting.done():
                compacting.cancel()
                await asyncio.gather(compacting, return_exceptions=True)
            if settings.handle_signals:
                for signum in STOP_SIGNALS:
                    loop.remove_signal_handler(signum)
            await self.store.close()
            await redis.aclose()
            s = self.stats
            log.info(
                "worker %s stopped after %.1fs: %d batches, %d entries, %d stored, %d duplicates, "
                "%d dead-lettered (%d poison), %d claimed, %d trimmed, %d crashed, %d store retries, "
                "%d reconnects",
                settings.consumer,
                time.monotonic() - started,
                s.batches,
                s.entries,
                s.stored,
                s.duplicates,
                s.dead_lettered,
                s.poison,
                s.claimed,
                s.trimmed,
                s.crashed,
                s.store_retries,
                s.reconnects,
            )
        return self.stats

    async def _connect(self) -> bool:
        """Connect the store, learn the group and where it starts, and discover the streams;
        False if a stop came while the store was away."""
        settings = self.settings
        await self._with_redis(self.store.connect, retry_store=True)
        group = settings.group or await self._with_redis(self._store_group, retry_store=True)
        if group is None:
            return False
        settings.group = group
        start_id = await self._with_redis(lambda: self._start_id(group))
        if start_id is None:
            return False
        self.discovery = Discovery(
            self._redis,
            group,
            settings.registry_interval,
            settings.scan_interval,
            settings.only_runs,
            start_id,
        )
        await self._with_redis(lambda: self._discovery.refresh(force=True))
        await self._with_redis(self._report_new_groups)
        return True

    async def _start_id(self, group: str) -> str:
        """Where `group`, made on a stream, starts reading it: at its first entry (--from
        start), or at the id where the group's first `--from now` started it, kept in
        wire.GROUP_STARTS_KEY (taken from Redis's clock now if no ingest did before), so a
        restart reads whole the streams that appeared while it was down."""
        if self.settings.start_from != "now":
            return "0"
        redis = self._redis
        seconds, micros = await redis.time()
        await redis.hsetnx(wire.GROUP_STARTS_KEY, group, f"{seconds * 1000 + micros // 1000}-0")
        return reply_text(cast("bytes", await redis.hget(wire.GROUP_STARTS_KEY, group)))

    async def _report_new_groups(self) -> None:
        """After the first discovery, one line: on how many streams the group was just made,
        where it starts them, and the entries they hold (what a fresh store reads, or skips)."""
        discovery, settings = self._discovery, self.settings
        made = discovery.made
        if not made:
            log.info("group %s: on all %d streams already", settings.group, len(discovery.streams))
            return
        pipe = self._redis.pipeline(transaction=False)
        for key in made:
            pipe.xlen(key)
        entries = sum(await pipe.execute())
        if discovery.start_id == "0":
            log.info(
                "group %s made on %d of %d streams, read from their first entry (--from start): "
                "%d entries to ingest (--from now skips what is there)",
                settings.group,
                len(made),
                len(discovery.streams),
                entries,
            )
            return
        started_ms = int(discovery.start_id.split("-")[0])
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started_ms / 1000))
        log.info(
            "group %s made on %d of %d streams at %s (--from now: %s UTC): of their %d entries, "
            "those written before are skipped",
            settings.group,
            len(made),
            len(discovery.streams),
            discovery.start_id,
            started,
            entries,
        )

    async def _store_group(self) -> str:
        group = wire.store_group(await self.store.identity())
        log.info("consumer group %s: the store's own (runbus ingest --group overrides it)", group)
        return group

    async def _loop(self) -> None:
        settings = self.settings
        claim_every = max(0.5, settings.claim_idle / 2)
        now = time.monotonic()
        due = _Due(now, now + settings.maintenance_interval, now + STATS_INTERVAL)
        # Our own pending entries first (a restart under the same consumer name), then new ones.
        pending_first = True
        # New entries are read, decoded and screened by the fence while the previous batch is
        # written (in the store's thread), and written while the one before is acknowledged
        # (Commits). After a batch of new entries the next is asked for at once (read_ahead), so
        # Redis serves it while this one is decoded instead of after.
        commits = Commits()
        read_ahead: asyncio.Task[Entries | None] | None = None
        finished = False
        try:
            while not self._stop_requested:
                await self._with_redis(self._discovery.refresh)
                now = time.monotonic()
                if pending_first:
                    pending_first = await self._redeliver_own()
                    continue
                if now >= due.claim:
                    await commits.settle()
                    took_over = await self._take_over_idle()
                    due.claim = now if took_over else now + claim_every
                    if took_over:
                        continue
                if read_ahead is None:
                    entries = await self._with_redis(lambda: self._read(">"))
                else:
                    entries, read_ahead = await read_ahead, None
                if entries:
                    read_ahead = self._read_new_ahead()
                    # A turn of the event loop: the read's command goes out now, and Redis makes
                    # its reply while this batch is decoded, not after.
                    await asyncio.sleep(0)
                    started = time.monotonic()
                    screened = await self._screened(entries)
                    if screened is not None:
                        await commits.start(functools.partial(self._commit, entries, *screened, started))
                else:
                    await commits.settle()
                    if entries is not None and settings.burst:
                        left = await self._burst_left()
                        if left is not None:
                            if left:
                                continue
                            break
                await self._relieve_memory(now)
                await self._on_schedule(now, due, commits)
            finished = True
        finally:
            await self._wind_down(commits, read_ahead, finished)

    async def _redeliver_own(self) -> bool:
        """One batch of this consumer's own pending entries processed (a restart under its
        name); whether any may be left (Redis unanswered counts as maybe)."""
        entries = await self._with_redis(lambda: self._read("0"))
        if entries:
            await self._process(entries, redelivered=True)
        return entries is None or bool(entries)

    async def _burst_left(self) -> bool | None:
        """A burst that read nothing new: True where it took entries over (go on at once), False
        where no stream has anything left (the burst ends), None where streams were found."""
        # Before a burst finishes, whatever other consumers left idle is its too, and so is
        # anything of its own still pending.
        if await self._take_over_idle() or await self._take_back_own():
            return True
        if not await self._with_redis(lambda: self._discovery.refresh(force=True)):
            return False
        return None

    async def _on_schedule(self, now: float, due: _Due, commits: Commits) -> None:
        """Maintenance (never in a burst) and the stats line, when due."""
        if now >= due.maintenance and not self.settings.burst:
            due.maintenance = now + self.settings.maintenance_interval
            await commits.settle()
            await self._maintain()
        if now >= due.stats:
            due.stats = now + STATS_INTERVAL
            s = self.stats
            log.info("%d entries, %d stored, %d dead-lettered", s.entries, s.stored, s.dead_lettered)

    async def _wind_down(
        self, commits: Commits, read_ahead: asyncio.Task[Entries | None] | None, finished: bool
    ) -> None:
        """Stopping or done: the batches in flight commit, then what was read ahead. Cancelled
        because the drain timed out, or on an error: all are cancelled, and stay pending for
        another worker (or this one, restarted under its name)."""
        current = asyncio.current_task()  # the loop's task: never None in a coroutine
        cancelled = current is not None and current.cancelling() > 0
        keep_ahead = finished and not cancelled
        if read_ahead is not None and not keep_ahead:
            read_ahead.cancel()
        if cancelled:
            commits.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await commits.settle()
        if read_ahead is not None:
            with contextlib.suppress(asyncio.CancelledError):
                ahead = await read_ahead
                if ahead and keep_ahead:
                    await self._process(ahead)

    def _read_new_ahead(self) -> asyncio.Task[Entries | None] | None:
        """The next read of new entries, started now; None once a stop is requested.

        Its entries wait delivered but unacknowledged while the batches before are written, for
        as long as the store takes: held in flight, they are kept alive and never claimed."""
        if self._stop_requested:
            return None
        return asyncio.create_task(self._with_redis(lambda: self._read(">")))

    async def _claim(self) -> Entries:
        """Entries left pending for longer than claim_idle by other consumers (or by this one,
        outside what it holds in flight): found with XPENDING, then taken with XCLAIM, which
        takes each only if still that idle. Not XAUTOCLAIM: it tells no consumer apart, and
        hands a worker its own batches waiting on a slow store, to be written twice."""
        claimed: Entries = []
        for key in list(self._discovery.streams):
            try:
                items = await self._claim_idle(key)
            except ResponseError as exc:
                await self._recover_groups([key], exc)
                continue
            if items:
                claimed.append((key, items))
        if claimed:
            log.info("claimed %d idle entries from other consumers", sum(len(i) for _, i in claimed))
        return claimed

    async def _claim_idle(self, key: str) -> StreamItems:
        settings = self.settings
        idle_ms = int(settings.claim_idle * 1000)
        ids = await self._idle_ids(key, idle_ms)
        if not ids:
            return []
        reply = await self._redis.xclaim(key, settings.group, settings.consumer, idle_ms, list(ids))
        # Parsed as XAUTOCLAIM's is: [(id, {name: value})], an entry deleted meanwhile as None.
        claimed = cast("StreamItems", reply)
        items: StreamItems = [(entry_id, fields) for entry_id, fields in claimed if fields is not None]
        self._hold([(key, items)])
        return items

    async def _idle_ids(self, key: str, idle_ms: int) -> list[StreamId]:
        """Up to batch_size ids of `key` pending for idle_ms or more, none held in flight here."""
        size, start, found = self.settings.batch_size, "-", list[StreamId]()
        while len(found) < size:
            reply = await self._redis.xpending_range(
                key, self.settings.group, min=start, max="+", count=size, idle=idle_ms
            )
            pending = pending_entries(reply)
            held = self._held_ids(key)
            found += [p["message_id"] for p in pending if p["message_id"] not in held]
            if len(pending) < size:
                break
            start = "(" + reply_text(pending[-1]["message_id"])
        return found[:size]

    async def _take_over_idle(self) -> bool:
        """Claim and process what other consumers left idle; whether there was any."""
        claimed = await self._with_redis(self._claim)
        if claimed:
            self.stats.claimed += sum(len(items) for _, items in claimed)
            await self._process(claimed, redelivered=True)
        return bool(claimed)

    async def _take_back_own(self) -> bool:
        """Process this consumer's pending entries, which no read of new entries returns (what
        an acknowledgement that failed left); whether there were any. Called with nothing in
        flight: a burst does not end with entries of its own pending."""
        own = await self._with_redis(lambda: self._read("0"))
        if own:
            await self._process(own, redelivered=True)
        return bool(own)

    async def _deliveries(self, entries: Entries) -> dict[bytes, int]:
        """How often each entry has been delivered (XPENDING), to spot poison entries."""
        counts: dict[bytes, int] = {}
        for key, items in entries:
            try:
                pending = await self._redis.xpending_range(
                    key,
                    self.settings.group,
                    min=items[0][0],
                    max=items[-1][0],
                    count=len(items) * 2,
                    consumername=self.settings.consumer,
                )
            except ResponseError as exc:  # deleted, or another type now: counted as first deliveries
                log.debug("delivery counts of %s unknown: %s", key, exc)
                continue
            counts.update((p["message_id"], p["times_delivered"]) for p in pending_entries(pending))
        return counts

    def _hold(self, entries: Entries) -> None:
        """`entries` were delivered to this worker: in flight until _let_go."""
        for key, items in entries:
            self._in_flight.setdefault(key, []).append(items)

    def _let_go(self, entries: Entries) -> None:
        """`entries` are acknowledged, or left pending for another worker."""
        for key, items in entries:
            held = self._in_flight.get(key, [])
            # By identity: another read's list of the same entries (a redelivery) is not this one.
            at = next((at for at, those in enumerate(held) if those is items), None)
            if at is not None:
                del held[at]
                if not held:
                    del self._in_flight[key]

    def _held_ids(self, key: str) -> set[bytes]:
        """The ids of the entries of stream `key` held in flight."""
        return set(map(_ID, chain.from_iterable(self._in_flight.get(key, ()))))

    async def _keep_alive(self, stop: asyncio.Event) -> None:
        """Every third of claim_idle until `stop`, reset the idle time of every entry held in
        flight (XCLAIM JUSTID: no delivery counted), so no other worker claims one however long
        the store takes: the batches being written, those waiting for the store, the one read
        ahead."""
        interval = max(0.2, self.settings.claim_idle / 3)
        settings = self.settings
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
                return
            held = [(key, list(self._held_ids(key))) for key in list(self._in_flight)]
            if not held:
                continue
            pipe = self._redis.pipeline(transaction=False)
            for key, ids in held:
                pipe.xclaim(key, settings.group, settings.consumer, 0, list[StreamId](ids), justid=True)
            try:
                await pipe.execute(raise_on_error=False)
            except Exception as exc:  # best effort: a lapse only risks a deduplicated rewrite
                log.debug("keep-alive of %d streams failed: %s", len(held), exc)

    async def _compact_backlog(self) -> None:
        try:
            await maintenance.compact_backlog(self.store)
        except StoreError as exc:  # the next start takes it up where this one stopped
            log.warning("compaction of the stored values stopped: %s", exc)

    async def _maintain(self) -> None:
        settings, stats = self.settings, self.stats
        for key in list(self._discovery.streams):
            try:
                stats.trimmed += await maintenance.trim(self._redis, key, settings.retain)
                await maintenance.retire_consumers(self._redis, key, settings.group, settings.consumer)
                if await maintenance.remove_if_empty(self._redis, key, settings.retain):
                    self._discovery.forget(key)
                    log.info("removed empty stream %s (no entry for %.0fs)", key, settings.retain)
            except (ResponseError, RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("maintenance of %s skipped: %s", key, exc)
        try:
            stats.crashed += await maintenance.mark_crashed(self.store, settings.crash_after)
        except StoreError as exc:
            log.warning("crash detection skipped: %s", exc)

    async def _relieve_memory(self, now: float) -> None:
        """Every memory_interval: when Redis nears its maxmemory, trim acknowledged entries
        whatever their age, so producers refused with -OOM can ship again."""
        if now < self._next_memory_check:
            return
        self._next_memory_check = now + self.settings.memory_interval
        try:
            share, trimmed = await maintenance.trim_for_memory(self._redis, list(self._discovery.streams))
        except (ResponseError, RedisConnectionError, RedisTimeoutError, OSError) as exc:
            log.debug("memory check skipped: %s", exc)
            return
        self.stats.trimmed += trimmed
        pressed = share is not None and share >= maintenance.MEMORY_TRIM_AT
        if share is not None and pressed and not self._memory_pressed:
            log.warning(
                "Redis holds %.0f%% of its maxmemory: trimming acknowledged entries whatever their "
                "age (--retain %.0fs) while above %.0f%% (%d trimmed now)",
                share * 100,
                self.settings.retain,
                maintenance.MEMORY_TRIM_AT * 100,
                trimmed,
            )
        self._memory_pressed = pressed

    async def _release_consumer(self) -> None:
        for key in list(self._discovery.streams):
            try:
                await maintenance.release_consumer(
                    self._redis, key, self.settings.group, self.settings.consumer
                )
            except (ResponseError, RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.debug("could not release consumer on %s: %s", key, exc)
                return

    async def _read(self, start_id: str) -> Entries:
        streams = self._discovery.streams
        if not streams:
            if not self.settings.burst:
                await asyncio.sleep(self.settings.block_ms / 1000)
            return []
        share = self.settings.share
        if share is not None and start_id == ">":
            index, count = share
            mine = [key for key in streams if stream_share(key, count) == index]
            if mine and len(mine) < len(streams):
                entries = await self._read_streams(mine, start_id, wait=False)
                if entries:
                    return entries
        return await self._read_streams(streams, start_id, wait=True)

    async def _read_streams(self, streams: Sequence[str], start_id: str, wait: bool) -> Entries:
        """One read of `streams`; with `wait`, a read that finds nothing new takes block_ms."""
        chunks = read_chunks(streams, self.settings.batch_size, by_slot=is_cluster(self.settings.redis_url))
        # Only a lone chunk may block: with several, a block on one would starve the others.
        lone = len(chunks) == 1 and wait
        block = None if self.settings.burst or start_id == "0" or not lone else self.settings.block_ms
        entries: Entries = []
        for chunk in chunks:
            try:
                reply = await self._redis.xreadgroup(
                    self.settings.group,
                    self.settings.consumer,
                    dict.fromkeys(chunk, start_id),
                    count=self.settings.batch_size,
                    block=block,
                )
            except ResponseError as exc:
                await self._recover_groups(chunk, exc)
                continue
            # _raw_reply keeps the reply as the server sent it, which redis-py's types do not
            # describe: [[key, [[id, [name, value, ...]], ...]], ...] (a map of the same in RESP3).
            read = cast("dict[bytes, StreamItems] | list[tuple[bytes, StreamItems]] | None", reply)
            for key, items in read.items() if isinstance(read, dict) else read or []:
                if items:
                    entries.append((reply_text(key), items))
        self._hold(entries)
        if not entries and wait and block is None and len(chunks) > 1 and not self.settings.burst:
            await asyncio.sleep(self.settings.block_ms / 1000)
        return entries

    async def _recover_groups(self, keys: Sequence[str], error: ResponseError) -> None:
        """A stream was deleted (while a read blocked on it, too), its group destroyed, or its
        key now holds another type: forget it, make the group again, or skip it (logged once);
        any other error is raised."""
        if not any(code in str(error) for code in ("NOGROUP", "WRONGTYPE", "UNBLOCKED")):
            raise error
        redis, discovery = self._redis, self._discovery
        for key in keys:
            if not await redis.exists(key):
                log.info("stream %s is gone; no longer reading it", key)
                discovery.forget(key)
            elif await redis.type(key) not in (b"stream", "stream"):
                discovery.not_a_stream(key)
            else:
                await discovery.ensure_group(key)

    async def _process(self, entries: Entries, redelivered: bool = False) -> None:
        started = time.monotonic()
        deliveries = await self._with_redis(lambda: self._deliveries(entries)) if redelivered else None
        screened = await self._screened(entries, deliveries)
        if screened is not None:
            await self._commit(entries, *screened, started)

    async def _screened(
        self, entries: Entries, deliveries: dict[bytes, int] | None = None
    ) -> tuple[list[wire.Event], Sequence[Source], list[DeadEntry]] | None:
        """decode_batch's events (and their sources) that their epochs' lease holders wrote
        (ingester/fence.py), and the dead entries, those the fence stopped included. None if a
        stop gave up on Redis: then `entries` are let go, left pending for another worker."""
        events, sources, dead, stretches = decode_batch(entries, deliveries, self.settings.max_deliveries)
        fenced = await self._with_redis(
            lambda: self._fences.screen(self._redis, events, sources, dead, stretches), drain=True
        )
        if fenced is None:
            self._let_go(entries)
            return None
        return *fenced, dead

    async def _commit(
        self,
        entries: Entries,
        events: list[wire.Event],
        sources: Sequence[Source],
        dead: list[DeadEntry],
        started: float,
        written: asyncio.Future[None] | None = None,
    ) -> None:
        """Write a screened batch (_screened), dead-letter what must be, then acknowledge it
        all; `written` is done once the store write has returned (or failed)."""
        try:
            try:
                invalid = len(dead)  # _write adds the events the store rejects
                # Counted once: what the claims, the health keeper and the stats look for.
                kinds = Counter(map(_KIND, events))
                holders = await self._holders(events, kinds)
                stored = None if holders is None else await self._write_sliced(events, sources, dead, holders)
            finally:
                # Not when the loop awaiting it was cancelled (a drain timing out): then it is.
                if written is not None and not written.done():
                    written.set_result(None)
            if stored is None:
                return  # draining ran out of time: left pending for another worker
            await self.health.note(events, kinds)
            # Stored already: keep trying through a drain, so a stop does not cause redelivery.
            await self._with_redis(lambda: self._dead_letter(dead), drain=True)
            await self._with_redis(lambda: self._ack(entries), drain=True)
        finally:
            self._let_go(entries)
        count = sum(len(items) for _, items in entries)
        s = self.stats
        s.batches += 1
        s.entries += count
        s.stored += stored
        s.duplicates += len(events) - stored - (len(dead) - invalid)
        s.dead_lettered += len(dead)
        s.poison += sum(1 for d in dead if d.deliveries > 1)
        s.batch_sizes.observe(count)
        for kind, n in kinds.items():
            s.by_kind[kind] = s.by_kind.get(kind, 0) + n
        written_at = time.time()
        for run in set(map(_RUN, events)):
            s.runs_written[run] = written_at
        log.debug(
            "batch of %d from %d stream(s): %d stored, %d duplicates, %d dead in %.1f ms",
            count,
            len(entries),
            stored,
            len(events) - stored - (len(dead) - invalid),
            len(dead),
            (time.monotonic() - started) * 1000,
        )

    async def _holders(self, events: list[wire.Event], kinds: Counter[str]) -> dict[str, str | None] | None:
        """For each run with a primary claim among `events` (of `kinds`): the label holding the
        producers' live claim (wire.primary_key), read once per run; None if a stop gave up on
        Redis."""
        if not kinds["start"]:
            return {}
        runs = {event.run for event in primary_claims(events)}
        unread = [run for run in runs if run not in self._claim_holders]
        if unread and await self._with_redis(lambda: self._read_holders(unread), drain=True) is None:
            return None
        return {run: self._claim_holders.get(run) for run in runs}

    async def _read_holders(self, runs: list[str]) -> bool:
        pipe = self._redis.pipeline(transaction=False)
        for run in runs:
            pipe.get(wire.primary_key(run))
        replies = await pipe.execute()
        if len(self._claim_holders) + len(runs) > CLAIMS_REMEMBERED:
            self._claim_holders.clear()  # each store decides a run's primary once: reading again is harmless
        for run, held in zip(runs, replies, strict=True):
            self._claim_holders[run] = holder = wire.claim_holder(held)
            if held is not None and holder is None:
                log.warning("run %s: its primary claim key holds no label (%r); ignored", run, held[:140])
        return True

    async def _write_sliced(
        self,
        events: list[wire.Event],
        sources: Sequence[Source],
        dead: list[DeadEntry],
        holders: dict[str, str | None],
    ) -> int | None:
        """_write in one transaction per row_slices slice: a read of wide events (50 keys each)
        makes bounded transactions, not one of millions of rows; as _write returns."""
        slices = row_slices(events, self.settings.batch_rows)
        if len(slices) == 1:
            return await self._write(events, sources, dead, holders)
        stored = 0
        for start, end in slices:
            part = await self._write(events[start:end], sources[start:end], dead, holders)
            if part is None:
                return None
            stored += part
        return stored

    async def _write(
        self,
        events: list[wire.Event],
        sources: Sequence[Source],
        dead: list[DeadEntry],
        holders: dict[str, str | None] | None = None,
    ) -> int | None:
        """Store events, retrying while the store is unavailable; None if a drain ran out of time.

        Data the store rejects (StoreRejected), or an error the store did not classify, is
        isolated: the batch is halved until the events at fault are found, and they join `dead`
        with the reason. AccessDenied is raised: only a change of configuration helps.
        """
        failures, failing_since = 0, None
        while True:
            write_started = time.perf_counter()
            try:
                stored = await self.store.write(events, holders)
            except StoreRejected as exc:
                return await self._isolate(events, sources, dead, exc, holders)
            except StoreError as exc:  # StoreUnavailable, or a store error of no known kind
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.error(
                        "store write failed, retrying without acknowledging%s: %s", self._giving_up(), exc
                    )
                self.stats.store_retries += 1
                self._give_up_if_away(failing_since, "the store", exc)
                if self._drain_expired():
                    return None
                await self._pause(self._retry.compute(failures))
                failures += 1
                continue
            except AccessDenied:
                raise
            except Exception as exc:  # the data, not the store: halved until the events at fault are found
                return await self._isolate(events, sources, dead, exc, holders)
            self.stats.write_seconds.observe(time.perf_counter() - write_started)
            if failing_since is not None:
                log.warning("store writes work again after %.1fs", time.monotonic() - failing_since)
            return stored

    async def _isolate(
        self,
        events: list[wire.Event],
        sources: Sequence[Source],
        dead: list[DeadEntry],
        exc: Exception,
        holders: dict[str, str | None] | None = None,
    ) -> int | None:
        """Write the two halves of a batch the store refused, down to the single events it
        refuses, which are dead-lettered with the reason; as _write returns."""
        if len(events) == 1:
            key, entry_id, fields = sources[0]
            log.error("the store rejected %s %s: %s", key, entry_id.decode(), exc)
            reason = (
                str(exc)
                if isinstance(exc, StoreRejected)
                else f"storage rejected it: {type(exc).__name__}: {exc}"
            )
            dead.append(DeadEntry(key, entry_id, as_dict(fields), reason))
            return 0
        half = len(events) // 2
        first = await self._write(events[:half], sources[:half], dead, holders)
        second = None if first is None else await self._write(events[half:], sources[half:], dead, holders)
        return None if first is None or second is None else first + second

    async def _dead_letter(self, dead: list[DeadEntry]) -> None:
        if not dead:
            return
        pipe = self._redis.pipeline(transaction=False)
        for entry in dead:
            pipe.xadd(wire.DEAD_LETTER_KEY, dead_letter_fields(entry))
        await pipe.execute()
        for entry in dead[:5]:
            log.warning("dead-lettered %s %s: %s", entry.stream, entry.entry_id.decode(), entry.reason)

    async def _ack(self, entries: Entries) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key, items in entries:
            pipe.xack(key, self.settings.group, *map(_ID, items))
        for (key, _), reply in zip(entries, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, ResponseError):  # deleted or replaced meanwhile: nothing to keep
                log.warning("could not acknowledge entries of %s: %s", key, reply)

    async def _with_redis(
        self, call: Callable[[], Awaitable[T]], retry_store: bool = False, drain: bool = False
    ) -> T | None:
        """Run `call`, retrying with capped, jittered backoff while Redis (or the store) is away.

        Once a stop is requested it gives up (returning None) at once, or with `drain` when the
        drain timeout has passed. Redis refusing the credentials, or its certificate, raises
        AccessDenied: retrying cannot help.
        """
        failures, down_since, what = 0, None, "redis"
        while True:
            try:
                result = await call()
            except Exception as exc:  # sorted below: denied, away (retried), or anything else raised again
                denied = access_denied(exc, self.settings.redis_url)
                if denied is not None:
                    raise denied from exc
                if isinstance(exc, REDIS_AWAY):
                    what = "redis"
                elif isinstance(exc, StoreError) and retry_store:
                    what = "store"
                else:
                    raise
                error = exc
            else:
                if down_since is not None:
                    log.warning("%s is back after %.1fs", what, time.monotonic() - down_since)
                return result
            if down_since is None:
                down_since = time.monotonic()
                log.error("%s unreachable, retrying with backoff%s: %s", what, self._giving_up(), error)
            self.stats.reconnects += 1
            self._give_up_if_away(down_since, "redis" if what == "redis" else "the store", error)
            if self._stop_requested and (not drain or self._drain_expired()):
                return None
            await self._pause(self._retry.compute(failures))
            failures += 1

    def _giving_up(self) -> str:
        limit = self.settings.give_up_after
        return f" (a burst gives up after {limit:g}s)" if self.settings.burst and limit > 0 else ""

    def _give_up_if_away(self, since: float, what: str, error: BaseException) -> None:
        """With burst, raise GaveUp once `what` has been failing since `since` for longer than
        give_up_after: a burst must end, and an unreachable server would keep it forever."""
        limit, away = self.settings.give_up_after, time.monotonic() - since
        if self.settings.burst and limit > 0 and away >= limit:
            where = safe_url(self.settings.redis_url) if what == "redis" else ""
            reason = " ".join(str(error).split())  # one line, whatever the driver wrote
            raise GaveUp(
                f"{what}{' ' + where if where else ''} unreachable for {away:.0f}s, over "
                f"--give-up-after {limit:g}s: {reason}"
            )
