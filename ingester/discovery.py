"""Finding the streams to consume: the producers' registry, and a keyspace scan for the rest.

Producers announce their stream in a set as they start, so a poll of its size finds them within
a fraction of a second; streams written by anything else (redis-cli, another client) are found by
SCAN at start-up and every `scan_interval`, without any other key having to be written. In a
Redis Cluster the scan covers every master (redis-py's cluster `scan_iter` walks each primary).

A key that cannot be read as a stream (not UTF-8, a registry member of another type, or outside
the streams' key space) is skipped and logged once, never an error that stops the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from runbus import wire

if TYPE_CHECKING:
    from runbus.redis import AsyncClient

log = logging.getLogger("runbus.ingester")

# Unreadable keys remembered (each logged once); past this many they are skipped unlogged.
MAX_SKIPPED = 10_000
ABSENT_RETRY = 30.0  # seconds a registered stream that does not exist yet is looked for


def is_event_stream(key: str) -> bool:
    """Whether `key` belongs to the event streams' key space (valid names or not).

    Keys under `runbus:{...}:` that are not valid streams are still consumed, so their entries
    are dead-lettered with a reason instead of lying unread.
    """
    return key.startswith(f"{wire.PREFIX}:{{") and "}:" in key and key.count(":") >= 2


def run_of(key: str) -> str | None:
    """The run (hash tag) of a key in the event streams' key space, valid name or not."""
    if not is_event_stream(key):
        return None
    return key[len(wire.PREFIX) + 2 : key.index("}:")]


class Discovery:
    """The set of known streams, each with its consumer group created."""

    def __init__(
        self,
        redis: AsyncClient,
        group: str,
        registry_interval: float = 0.25,
        scan_interval: float = 10.0,
        only_runs: frozenset[str] | None = None,
        start_id: str = "0",
    ) -> None:
        self.redis = redis
        self.group = group
        # Where the group, made on a stream, starts reading it: "0", its first entry, or the
        # id where `runbus ingest --from now` started the group.
        self.start_id = start_id
        # The streams the group was made on (not there before) by the latest refresh.
        self.made: list[str] = []
        self.registry_interval = registry_interval
        self.scan_interval = scan_interval
        self.only_runs = only_runs
        self.streams: list[str] = []
        self._known: set[str] = set()
        self._skipped: set[bytes] = set()
        self._not_streams: set[bytes] = set()  # of the skipped: those of another type
        self._absent: dict[str, float] = {}  # registered keys found missing, since when
        self._registry_size = -1
        self._registry_unreadable = False
        self._next_registry = 0.0
        self._next_scan = 0.0

    async def refresh(self, force: bool = False) -> list[str]:
        """Check the registry (and scan when due, or when `force`); return the new streams."""
        now = time.monotonic()
        found: list[bytes] = []
        self.made = []
        if force or now >= self._next_registry:
            self._next_registry = now + self.registry_interval
            found += await self._registry_members(force)
        if force or now >= self._next_scan:
            self._next_scan = now + self.scan_interval
            # Only streams: a key of another type under the pattern is none of ours to read.
            scanned = [key async for key in self._scan()]
            again = self._not_streams.intersection(scanned)  # streams now: read them after all
            self._skipped -= again
            self._not_streams -= again
            found += scanned
        new = []
        for raw in dict.fromkeys(found):
            key = self._readable(raw)
            if key is not None and key not in self._known and await self.ensure_group(key):
                self._known.add(key)
                self.streams.append(key)
                new.append(key)
        if new:
            log.info("discovered %d new stream(s), %d in all", len(new), len(self.streams))
        return new

    async def _registry_members(self, force: bool) -> list[bytes]:
        try:
            size = await self.redis.scard(wire.REGISTRY_KEY)
            if size == self._registry_size and not force:
                return []
            members = await self.redis.smembers(wire.REGISTRY_KEY)
        except ResponseError as exc:  # WRONGTYPE: the registry is not a set
            if not self._registry_unreadable:
                self._registry_unreadable = True
                log.error("%s cannot be read (%s); finding streams by scan only", wire.REGISTRY_KEY, exc)
            return []
        self._registry_unreadable = False
        self._registry_size = size
        return [m if isinstance(m, bytes) else m.encode() for m in members]

    def _scan(self) -> AsyncIterator[bytes]:
        pattern = wire.scan_pattern()
        if self.only_runs is not None and len(self.only_runs) == 1:
            (run,) = self.only_runs
            pattern = f"{wire.PREFIX}:{{{_glob_escape(run)}}}:*"
        return self.redis.scan_iter(match=pattern, count=1000, _type="stream")

    def _readable(self, raw: bytes | str) -> str | None:
        """`raw` as a stream key to read, or None (logged once) if it cannot be one of ours."""
        raw = raw if isinstance(raw, bytes) else raw.encode()
        if raw in self._skipped:
            return None
        try:
            key = raw.decode()
        except UnicodeDecodeError:
            self._skip(raw, "its name is not UTF-8")
            return None
        if not is_event_stream(key):
            self._skip(raw, f"it is not in the streams' key space ({wire.scan_pattern()})")
            return None
        if self.only_runs is not None and run_of(key) not in self.only_runs:
            return None  # another run's, read by other workers: nothing to log
        return key

    def _skip(self, raw: bytes, why: str) -> None:
        if len(self._skipped) < MAX_SKIPPED:
            self._skipped.add(raw)
            log.warning("skipping key %r: %s", raw[:200], why)
        elif len(self._skipped) == MAX_SKIPPED:
            self._skipped.add(raw)
            log.warning("%d unreadable keys skipped; more are skipped without a log line", MAX_SKIPPED)

    async def ensure_group(self, key: str) -> bool:
        """Create the group on `key` at start_id (from id 0 unless `--from now`: a group made
        after the first entries still reads them all); False, logged once, if `key` holds
        something other than a stream, and False if there is no `key` (yet): the key is never
        created here, so a stream deleted meanwhile (the demo's, removed while a worker
        discovers it) stays deleted. A group already on `key` keeps its position."""
        try:
            await self.redis.xgroup_create(key, self.group, id=self.start_id)
        except ResponseError as exc:
            if "BUSYGROUP" in str(exc):
                return True
            if "requires the key to exist" in str(exc):
                self._absent_now(key)
                return False
            if "WRONGTYPE" not in str(exc):
                raise
            self.not_a_stream(key)
            return False
        self._absent.pop(key, None)
        self.made.append(key)
        return True

    def _absent_now(self, key: str) -> None:
        """`key` is registered but missing: announced before its first entry, or deleted. The
        registry is read again at its next check, for ABSENT_RETRY seconds; after that only
        a change of the registry or a scan finds the stream."""
        now = time.monotonic()
        if now - self._absent.setdefault(key, now) < ABSENT_RETRY:
            self._registry_size = -1
        elif len(self._absent) > MAX_SKIPPED:
            self._absent.clear()

    def not_a_stream(self, key: str) -> None:
        """Stop reading `key`, which holds another type now (logged once); a scan finds it
        again if it becomes a stream."""
        self.forget(key)
        self._not_streams.add(key.encode())
        self._skip(key.encode(), "it is not a stream")

    def forget(self, key: str) -> None:
        """Stop reading `key` (it was deleted); a later refresh finds it again if it returns."""
        if key in self._known:
            self._known.discard(key)
            self.streams.remove(key)
            self._registry_size = -1


def _glob_escape(text: str) -> str:
    """`text` matched literally by a Redis glob pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
