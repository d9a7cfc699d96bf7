"""Finding the streams to consume: the producers' registry, and a keyspace scan for the rest.

Producers announce their stream in a set as they start, so a poll of its size finds them within
a fraction of a second; streams written by anything else (redis-cli, another client) are found by
SCAN at start-up and every `scan_interval`, without any other key having to be written. In a
Redis Cluster the scan covers every master (redis-py's cluster `scan_iter` walks each primary).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from runbus import wire
from runbus.redis import reply_text

if TYPE_CHECKING:
    from runbus.redis import AsyncClient

log = logging.getLogger("runbus.ingester")


def is_event_stream(key: str) -> bool:
    """Whether `key` belongs to the event streams' key space (valid names or not).

    Keys under `runbus:{...}:` that are not valid streams are still consumed, so their entries
    are dead-lettered with a reason instead of lying unread.
    """
    return key.startswith(f"{wire.PREFIX}:{{") and "}:" in key and key.count(":") >= 2


class Discovery:
    """The set of known streams, each with its consumer group created."""

    def __init__(
        self,
        redis: AsyncClient,
        group: str,
        registry_interval: float = 0.25,
        scan_interval: float = 10.0,
    ) -> None:
        self.redis = redis
        self.group = group
        self.registry_interval = registry_interval
        self.scan_interval = scan_interval
        self.streams: list[str] = []
        self._known: set[str] = set()
        self._registry_size = -1
        self._next_registry = 0.0
        self._next_scan = 0.0

    async def refresh(self, force: bool = False) -> list[str]:
        """Check the registry (and scan when due, or when `force`); return the new streams."""
        now = time.monotonic()
        found: list[str] = []
        if force or now >= self._next_registry:
            self._next_registry = now + self.registry_interval
            size = await self.redis.scard(wire.REGISTRY_KEY)
            if size != self._registry_size or force:
                members = await self.redis.smembers(wire.REGISTRY_KEY)
                found += [reply_text(m) for m in members]
                self._registry_size = size
        if force or now >= self._next_scan:
            self._next_scan = now + self.scan_interval
            async for key in self.redis.scan_iter(match=wire.scan_pattern(), count=1000, _type="stream"):
                found.append(reply_text(key))
        new = [key for key in dict.fromkeys(found) if key not in self._known and is_event_stream(key)]
        for key in new:
            await self._ensure_group(key)
            self._known.add(key)
            self.streams.append(key)
        if new:
            log.info("discovered %d new stream(s), %d in all", len(new), len(self.streams))
        return new

    async def _ensure_group(self, key: str) -> None:
        try:
            # From id 0: a group made after the first entries still reads them all.
            await self.redis.xgroup_create(key, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def forget(self, key: str) -> None:
        """Stop reading `key` (it was deleted); a later refresh finds it again if it returns."""
        if key in self._known:
            self._known.discard(key)
            self.streams.remove(key)
            self._registry_size = -1
