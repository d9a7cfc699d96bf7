"""Housekeeping between batches: trimming stored entries (by age, and by Redis's memory), retiring
idle consumers and empty streams, and marking labels whose heartbeats stopped as crashed."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError, WatchError

from runbus import wire
from runbus.progress import Progress
from runbus.storage.base import Store

if TYPE_CHECKING:
    from runbus.redis import AsyncClient

log = logging.getLogger("runbus.ingester")

# A consumer with nothing pending and idle this long is removed from the group (a live worker
# that reads again is simply added back).
STALE_CONSUMER_MS = 3_600_000
# Above this share of Redis's maxmemory, acknowledged entries are trimmed whatever their age:
# --retain keeps stored entries for a while as a convenience, while Redis at maxmemory refuses
# the producers' events (-OOM), which then wait in their buffers.
MEMORY_TRIM_AT = 0.8


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(entry_id: tuple[int, int]) -> str:
    return f"{entry_id[0]}-{entry_id[1]}"


async def safe_trim_id(redis: AsyncClient, key: str, retain_ms: int, now_ms: int) -> tuple[int, int] | None:
    """The lowest id that must stay: nothing pending, unread, or younger than `retain_ms`.

    None when no group reads the stream yet (then nothing may go).
    """
    groups = await redis.xinfo_groups(key)
    if not groups:
        return None
    keep = (max(0, now_ms - retain_ms), 0)
    for group in groups:
        last = parse_id(group["last-delivered-id"])
        keep = min(keep, (last[0], last[1] + 1))  # unread entries come after the last delivered
        if group["pending"]:
            summary = await redis.xpending(key, group["name"])
            # Another consumer may have acknowledged them all since XINFO: then none is pending.
            if summary["min"] is not None:
                keep = min(keep, parse_id(summary["min"]))
    return keep


async def trim(redis: AsyncClient, key: str, retain_s: float, approximate: bool = True) -> int:
    """XTRIM MINID ~ the safe id: acknowledged entries older than the retention go (exactly up
    to it unless `approximate`: then only whole nodes of the stream, cheaper)."""
    keep = await safe_trim_id(redis, key, int(retain_s * 1000), int(time.time() * 1000))
    if keep is None or keep <= (0, 1):
        return 0
    return await redis.xtrim(key, minid=format_id(keep), approximate=approximate)


async def memory_use(redis: AsyncClient) -> float | None:
    """Redis's used_memory as a share of its maxmemory (a cluster's fullest node); None when no
    maxmemory is set."""
    if isinstance(redis, RedisCluster):
        info = await redis.info("memory", target_nodes=RedisCluster.PRIMARIES)  # {node: its info}
    else:
        info = await redis.info("memory")
    replies = [info] if "used_memory" in info else [v for v in info.values() if isinstance(v, dict)]
    shares = [int(r["used_memory"]) / int(r["maxmemory"]) for r in replies if int(r.get("maxmemory", 0))]
    return max(shares, default=None)


async def trim_for_memory(redis: AsyncClient, keys: list[str]) -> tuple[float | None, int]:
    """When Redis holds more than MEMORY_TRIM_AT of its maxmemory, trim every acknowledged
    entry of `keys` whatever its age, oldest first (never anything pending or unread): Redis's
    memory share, and the entries trimmed."""
    share = await memory_use(redis)
    if share is None or share < MEMORY_TRIM_AT:
        return share, 0
    trimmed = 0
    for key in keys:
        trimmed += await trim(redis, key, 0.0, approximate=False)
    return share, trimmed


async def retire_consumers(redis: AsyncClient, key: str, group: str, me: str) -> int:
    """Remove consumers of `group` that have nothing pending and have been idle for an hour."""
    removed = 0
    for consumer in await redis.xinfo_consumers(key, group):
        name = consumer["name"].decode()
        if name != me and consumer["pending"] == 0 and consumer["idle"] > STALE_CONSUMER_MS:
            await redis.xgroup_delconsumer(key, group, name)
            removed += 1
    return removed


async def release_consumer(redis: AsyncClient, key: str, group: str, me: str) -> bool:
    """Remove our own consumer at shutdown, only if nothing is pending for it."""
    try:
        consumers = await redis.xinfo_consumers(key, group)
    except ResponseError:
        return False
    for consumer in consumers:
        if consumer["name"].decode() == me and consumer["pending"] == 0:
            await redis.xgroup_delconsumer(key, group, me)
            return True
    return False


async def remove_if_empty(redis: AsyncClient, key: str, retain_s: float) -> bool:
    """Delete a stream that is empty, has nothing pending, and has had no entry for `retain_s`.

    WATCH makes it safe against a producer adding an entry meanwhile: then nothing is deleted.
    """
    async with redis.pipeline(transaction=True) as pipe:
        await pipe.watch(key)
        if await pipe.xlen(key):
            return False
        info = await pipe.xinfo_stream(key)
        last_ms = parse_id(info["last-generated-id"])[0]
        if last_ms > (time.time() - retain_s) * 1000:
            return False
        for group in await pipe.xinfo_groups(key):
            if group["pending"]:
                return False
        pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves the cluster pipeline's unannotated
        pipe.delete(key)
        try:
            await pipe.execute()
        except WatchError:
            return False
    await redis.srem(wire.REGISTRY_KEY, key)
    return True


async def mark_crashed(store: Store, crash_after_s: float) -> int:
    """Labels silent for `crash_after_s` (by ingest time) become crashed."""
    marked = await store.mark_crashed(time.time() - crash_after_s)
    for run, label in marked[:10]:
        log.warning("label %s of run %s sent nothing for %.0fs: crashed", label, run, crash_after_s)
    return len(marked)


# Label epochs compacted per transaction: each slice is one write, between the batches.
COMPACT_SLICE = 16
# How often a long compaction says how far it is.
COMPACT_REPORT_S = 10.0


async def compact_backlog(store: Store) -> int:
    """Compact every label epoch already due (a store migrated from value rows to column chunks:
    storage/chunking.py), a slice at a time between the batches; how many were compacted. On a
    terminal the count is a progress line; elsewhere (a pipe, a service's log) a log line now
    and then says how far it is and how long is left."""
    left = await store.compact_due(0)
    if not left:
        return 0
    total, started, reported = left, time.monotonic(), time.monotonic()
    log.info("compacting the values of %d label epochs into column chunks, while ingesting", total)
    with Progress("migration", total=total, unit="label epochs compacted") as progress:
        while left:
            left = await store.compact_due(COMPACT_SLICE)
            progress.update(total - left)
            now = time.monotonic()
            if left and not progress.shown and now - reported >= COMPACT_REPORT_S:
                done = total - left
                eta = (now - started) / max(done, 1) * left
                log.info("compacted %d of %d label epochs (about %.0fs left)", done, total, eta)
                reported = now
    log.info("compacted %d label epochs into column chunks in %.1fs", total, time.monotonic() - started)
    return total
