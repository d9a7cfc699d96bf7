"""A run's events left waiting in Redis with no ingester running, stored before a read shows the run.

`runbus show`, `metrics`, `logs` and runbus.Api.run() read the store. Where the run is not in it,
or not finished there, its streams hold entries that the store's consumer group has not
acknowledged, and no consumer of that group has read them lately (no ingester of this store is
running), the read first runs `runbus ingest --burst --run RUN` as a child process and prints one
line on stderr. That is the real ingester, a consumer of the store's own group: each batch is
written once and acknowledged after its commit, in (epoch, seq) order, and an ingester started
later (or at the same time) is handed only what the burst did not acknowledge, so it never writes
anything twice. Secrets stay out of the child's command line: the URLs go in its environment.

RUNBUS_CATCH_UP=0 (or a command's --no-catch-up) turns this off; the read then says what waits
and what to run. Only the run's exact id is looked for in Redis (a prefix names stored runs only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runbus import config, wire
from runbus.redis import reply_text, sync_client
from runbus.terminal import printable

if TYPE_CHECKING:
    from runbus.redis import SyncClient

# A consumer of the group that Redis saw this recently on the run's streams is a running ingester's,
# busy storing them. Redis 7.0 refreshes a consumer's idle time when it is handed entries, 7.2 on
# every read: an idle ingester may look gone, and then the burst reads beside it, which the shared
# group makes harmless; a busy one, far behind, is left to its work.
LIVE_WITHIN_MS = 10_000
# How long a read of a run not stored yet waits for a busy ingester to store it, and how often
# it looks.
BUSY_WAIT, BUSY_POLL = 10.0, 0.2
# How long the child burst keeps trying an unreachable Redis or store before it gives up (exit 1).
GIVE_UP_AFTER = 30.0
# The last characters of a failed burst's stderr that its error quotes.
ERROR_TAIL = 400


@dataclass(frozen=True, slots=True)
class Backlog:
    """What of one run waits in Redis for a consumer group."""

    run_id: str
    streams: int  # the run's streams that Redis announces
    entries: int  # entries of them the group has not acknowledged (the group absent: all of them)
    live: str | None = None  # a consumer of the group that read them lately: a running ingester


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """RUNBUS_CATCH_UP: unset, empty or 1/true/yes/on lets reads store a run's waiting events;
    0/false/no/off does not; anything else is a ValueError naming the variable."""
    return config.catch_up(env)


def backlog(redis_url: str, run_id: str, group: str | None) -> Backlog | None:
    """What of `run_id` waits in Redis for `group` (None: the store has no group yet, so every
    entry waits); None where Redis cannot be asked, or holds no stream of the run (it only
    decides whether to store them, and adds a hint to an error)."""
    import redis

    try:
        client = sync_client(redis_url, socket_connect_timeout=2, socket_timeout=10)
        try:
            streams = run_streams(client, run_id)
            if not streams:
                return None
            return _backlog(client, run_id, streams, group)
        finally:
            client.close()
    except (redis.RedisError, ValueError):  # unreachable, refused, or a bad URL: the read goes on without
        return None


def run_streams(client: SyncClient, run_id: str) -> list[str]:
    """The keys of `run_id`'s streams that producers announced (wire.REGISTRY_KEY)."""
    keys = client.sscan_iter(wire.REGISTRY_KEY, match=wire.stream_key(run_id, "*"), count=1000)
    found = []
    for raw in keys:
        key = reply_text(raw)
        names = wire.parse_stream_key(key)
        if names is not None and names[0] == run_id:
            found.append(key)
    return sorted(found)


def _backlog(client: SyncClient, run_id: str, streams: list[str], group: str | None) -> Backlog:
    from redis.exceptions import ResponseError

    entries, live = 0, None
    for key in streams:
        try:
            found = None if group is None else _group(client, key, group)
            if group is None or found is None:
                entries += client.xlen(key)
                continue
            entries += found["pending"] + _unread(client, key, found)
            live = live or _live_consumer(client, key, group)
        except ResponseError:  # deleted meanwhile, or another type now: nothing of it waits
            continue
    return Backlog(run_id, len(streams), entries, live)


def _group(client: SyncClient, key: str, group: str) -> dict[str, Any] | None:
    """XINFO GROUPS's record of `group` on `key`, None where the group is not made on it."""
    return next((g for g in client.xinfo_groups(key) if reply_text(g["name"]) == group), None)


def _unread(client: SyncClient, key: str, found: dict[str, Any]) -> int:
    """Entries of `key` after the group's last delivered one: Redis's `lag` where it can tell,
    else counted (after deletions inside the stream, Redis 7 gives no lag)."""
    if found.get("lag") is not None:
        return int(found["lag"])
    return len(client.xrange(key, min="(" + reply_text(found["last-delivered-id"]), max="+") or ())


def _live_consumer(client: SyncClient, key: str, group: str) -> str | None:
    for consumer in client.xinfo_consumers(key, group):
        if consumer["idle"] < LIVE_WITHIN_MS:
            return reply_text(consumer["name"])
    return None


def store_waiting(store_url: str, redis_url: str, run_id: str, group: str | None) -> Backlog | None:
    """Store `run_id`'s waiting events when no ingester is storing them (the module docstring),
    printing one line on stderr; what waits afterwards (None: nothing of the run in Redis).
    Raises CommandError when the burst fails."""
    found = backlog(redis_url, run_id, group)
    if found is None or found.entries == 0 or found.live is not None:
        return found
    run_burst(store_url, redis_url, run_id)
    left = backlog(redis_url, run_id, group) if group is not None else None
    stored = found.entries - (left.entries if left is not None else 0)
    print(
        printable(
            f"runbus: stored {stored} entries of run {run_id} that waited in Redis with no "
            "ingester running (`runbus ingest` keeps the store current; RUNBUS_CATCH_UP=0 reads "
            "without storing them)"
        ),
        file=sys.stderr,
        flush=True,
    )
    return left or Backlog(run_id, found.streams, 0)


def burst_command(run_id: str) -> list[str]:
    """The `runbus ingest` that stores one run's waiting events and exits."""
    return [
        sys.executable,
        "-m",
        "runbus",
        "--log-level",
        "WARNING",
        "ingest",
        "--burst",
        "--run",
        run_id,
        "--give-up-after",
        f"{GIVE_UP_AFTER:g}",
    ]


def run_burst(store_url: str, redis_url: str, run_id: str) -> None:
    """Run burst_command as a child process, the URLs in its environment; CommandError, with
    the end of its stderr, if it fails."""
    from runbus.errors import CommandError

    env = {**os.environ, config.STORE_ENV: store_url, config.REDIS_URL_ENV: redis_url}
    done = subprocess.run(
        burst_command(run_id), env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        said = done.stderr.strip()[-ERROR_TAIL:] or f"exit code {done.returncode}"
        raise CommandError(f"storing run {run_id!r}'s waiting events failed: {said}")
