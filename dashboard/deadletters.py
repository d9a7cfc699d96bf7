"""How many entries the ingesters refused, read from the dead-letter stream when Redis answers.

Redis is optional for the dashboard: when it does not answer the counts are None (shown as
unknown), and it is not asked again for a while, so a dead Redis never slows the pages down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from redis.exceptions import RedisError

from runbus import wire
from runbus.redis import async_client, stream_entries

if TYPE_CHECKING:
    from runbus.redis import AsyncClient

# The newest entries looked at to count one run's dead letters; the total is always exact.
SCAN_LIMIT = 10_000
RETRY_AFTER = 10.0


class DeadLetterCounts(TypedDict):
    """A run's dead letters as the API shows them; the numbers are None when Redis is away."""

    total: int | None
    run: int | None
    labels: dict[str, int]
    complete: bool


@dataclass
class DeadLetters:
    """Counts dead letters, overall and per run and label, through one lazy connection."""

    redis_url: str | None
    _redis: AsyncClient | None = field(default=None, init=False, repr=False)
    _down_until: float = field(default=0.0, init=False, repr=False)

    def _client(self) -> AsyncClient | None:
        if self.redis_url is None or time.monotonic() < self._down_until:
            return None
        if self._redis is None:
            self._redis = async_client(self.redis_url, socket_connect_timeout=0.5, socket_timeout=2.0)
        return self._redis

    async def counts(self, run_id: str) -> DeadLetterCounts:
        """The dead letters in all, and of `run_id` and each of its labels."""
        unknown: DeadLetterCounts = {"total": None, "run": None, "labels": {}, "complete": False}
        client = self._client()
        if client is None:
            return unknown
        try:
            total = await client.xlen(wire.DEAD_LETTER_KEY)
            entries = (
                stream_entries(await client.xrevrange(wire.DEAD_LETTER_KEY, count=SCAN_LIMIT))
                if total
                else []
            )
        except (RedisError, OSError):
            self._down_until = time.monotonic() + RETRY_AFTER
            return unknown
        labels: dict[str, int] = {}
        for _, fields in entries:
            names = wire.parse_stream_key(fields.get(b"source_stream", b"").decode(errors="replace"))
            if names is not None and names[0] == run_id:
                labels[names[1]] = labels.get(names[1], 0) + 1
        return {
            "total": total,
            "run": sum(labels.values()),
            "labels": dict(sorted(labels.items())),
            "complete": len(entries) >= total,
        }

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
