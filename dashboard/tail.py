"""`runbus tail RUN`: every rank's log lines as they are produced, read straight from the streams.

It reads with XREAD, never through the consumer group, so it takes nothing from the ingesters.
Streams are found in the producers' registry and by SCAN, again every second, so a label that
appears later is followed from its first entry. By default only lines produced from now on are
printed (`from_start` prints the history first). It returns once the run has ended, and the
streams have been quiet for `finish_grace` (the other ranks' last lines still show), with a last
line saying how: once its primary's finish is read from the streams, or once the store records
the run as ended (finished, failed, or crashed: a primary killed with SIGKILL sends no finish,
and the ingesters mark it crashed after their `--crash-after`); the store is asked every
`store_interval`.
The primary is the one the ingesters decide (runbus.storage.rules.decide_primary): the store's
decision where the store has the run, else the label holding the producers' live claim, else the
earliest start claiming it. A stray start claiming the role from another label cannot end a tail.
A run with no stream in Redis is looked up in the store: unknown there too, it is an error unless
`wait` asks to wait for it to start. Log text is printed redacted (`runbus.redact`: an entry
written by hand or by an older runbus) and through `runbus.terminal.printable`: escape sequences
in it are shown, not obeyed.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TextIO

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runbus import wire
from runbus.config import safe_url
from runbus.errors import CommandError, InvalidEntry, StoreMissing
from runbus.query.tables import state_text
from runbus.redact import LineRedactor, redact_text, url_secrets
from runbus.redis import StreamEntry, read_streams, reply_text, stream_entries, sync_client
from runbus.storage import RunSummary, lookup, open_store
from runbus.storage.rules import decide_primary, primary_claims
from runbus.terminal import printable

if TYPE_CHECKING:
    from runbus.redis import SyncClient

# docker compose's order: cyan, yellow, green, magenta, blue, then the bright ones.
COLORS = ("36", "33", "32", "35", "34", "96", "93", "92", "95", "94", "31", "91")
READ_COUNT = 1000

Entries = list[tuple[bytes, list[StreamEntry]]]


@dataclass
class TailSettings:
    """What `runbus tail` follows and prints."""

    redis_url: str
    run_id: str
    labels: frozenset[str] | None = None
    min_level: int = 0
    from_start: bool = False
    color: bool = False
    rescan_interval: float = 1.0
    finish_grace: float = 1.0
    store_url: str | None = None  # where to look for a run that has no stream in Redis
    wait: bool = False  # wait for a run found nowhere to start, instead of an error
    store_interval: float = 2.0  # how often the store is asked whether the run has ended


def format_line(label: str, width: int, text: str, color: str | None) -> str:
    """`label | text`, the label padded to `width` and, with a colour, painted with it; the
    label and text printable (their own escape sequences shown, not obeyed)."""
    prefix = printable(f"{label.ljust(width)} |")
    if color is not None:
        prefix = f"\x1b[{color}m{prefix}\x1b[0m"
    return f"{prefix} {printable(text)}"


@dataclass
class Tail:
    """One follow of one run; `run()` returns the exit code."""

    settings: TailSettings
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    _ids: dict[str, str] = field(default_factory=dict, init=False)
    _labels: dict[str, str] = field(default_factory=dict, init=False)
    _primary: str | None = field(default=None, init=False)  # once decided, as the store decides it
    _claims: list[wire.Event] = field(default_factory=list, init=False)
    _holder: str | None = field(default=None, init=False)
    _colors: dict[str, str] = field(default_factory=dict, init=False)
    _width: int = field(default=0, init=False)
    _finished: bool = field(default=False, init=False)
    _ending: str | None = field(default=None, init=False)  # how the run ended, once known
    _next_check: float = field(default=0.0, init=False)
    _store_failed: bool = field(default=False, init=False)
    _lost: bool = field(default=False, init=False)
    _redactors: dict[tuple[str, str], LineRedactor] = field(default_factory=dict, init=False)

    def run(self) -> int:
        client = sync_client(self.settings.redis_url, socket_connect_timeout=5, socket_timeout=10)
        try:
            return self._follow(client)
        finally:
            client.close()

    def _follow(self, client: SyncClient) -> int:
        ended = self._begin(client)
        if ended is not None:
            return ended
        s = self.settings
        what = "its history, then new lines" if s.from_start else "new lines"
        self._say(f"following run {s.run_id} ({len(self._ids)} stream(s) so far): {what}; Ctrl-C stops")
        next_scan = time.monotonic() + s.rescan_interval
        while True:
            entries, next_scan = self._read_new(client, next_scan)
            if entries is None:
                continue
            if not entries and self._finished:
                self._say(f"run {s.run_id} {self._ending or 'finished'}")
                return 0
            self._show(entries)

    def _begin(self, client: SyncClient) -> int | None:
        """Find the run (in Redis, else in the store) and its streams: the exit code where there
        is nothing to follow, else None."""
        s = self.settings
        stored = stored_run(s.store_url, s.run_id, prefix=True) if s.store_url else None
        if stored is not None and stored.run_id != s.run_id:
            if self._stream_keys(client):
                stored = None  # a run of exactly this id, in Redis: it wins over a prefix match
            else:
                s = self.settings = replace(s, run_id=stored.run_id)
        if stored is not None and stored.primary is not None:
            self._primary = stored.primary
        self._discover(client, initial=True)
        if not self._ids and not s.wait:
            if stored is None:
                raise self._nowhere()
            if stored.state != "running":
                self._say(
                    f"run {s.run_id} is {stored.state} and has no streams left in Redis: "
                    f"`runbus logs {s.run_id}` prints its lines from the store"
                )
                return 0
        if stored is not None and stored.state != "running":
            self._end_with(stored)
        if not s.from_start and (self._finished or self._finished_already(client)):
            ending = self._ending or "finished"
            self._say(f"run {s.run_id} has already {ending}; --from-start prints its lines")
            return 0
        return None

    def _read_new(self, client: SyncClient, next_scan: float) -> tuple[Entries | None, float]:
        """One round of the follow: look for new streams and ask the store when due, then read
        what is new (None: nothing was read, with no stream yet or Redis away); and when to look
        for new streams next."""
        s = self.settings
        try:
            now = time.monotonic()
            if now >= next_scan and not self._finished:
                self._discover(client, initial=False)
                next_scan = now + s.rescan_interval
            if s.store_url and now >= self._next_check and not self._finished:
                self._check_store()
            if not self._ids:
                time.sleep(s.rescan_interval)
                return None, next_scan
            block = s.finish_grace if self._finished else max(0.01, next_scan - time.monotonic())
            # A copy: redis-py types the argument as a dict of any key and id types (invariant).
            reply = client.xread(dict(self._ids.items()), count=READ_COUNT, block=int(block * 1000))
            entries = read_streams(reply)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            # Where it was is kept in the ids: once Redis is back, nothing is skipped.
            if not self._lost:
                self._say(f"lost Redis ({exc}); retrying every {s.rescan_interval:g} s")
            self._lost = True
            time.sleep(s.rescan_interval)
            return None, next_scan
        if self._lost:
            self._say("Redis is back")
            self._lost = False
        return entries, next_scan

    def _nowhere(self) -> CommandError:
        s = self.settings
        where = f"no stream of it in Redis at {safe_url(s.redis_url)}"
        if s.store_url:
            where += f" and not in the store {safe_url(s.store_url)}"
        return CommandError(f"no run {s.run_id!r}: {where}; `runbus tail --wait` waits for it to start")

    def _check_store(self) -> None:
        s = self.settings
        self._next_check = time.monotonic() + s.store_interval
        assert s.store_url is not None
        try:
            stored = stored_run(s.store_url, s.run_id)
        except Exception as exc:  # any store error: asked again later; a finish in the streams still ends it
            if not self._store_failed:
                self._say(f"cannot read the store ({type(exc).__name__}: {exc}); asking again")
            self._store_failed = True
            return
        self._store_failed = False
        if stored is not None and stored.state != "running":
            self._end_with(stored)

    def _end_with(self, stored: RunSummary) -> None:
        """The store records the run as ended: the streams are read until quiet, then the tail ends."""
        self._finished = True
        self._ending = state_text(stored)

    def _say(self, message: str) -> None:
        print(f"runbus: {_shown(message, self.settings.redis_url)}", file=self.err, flush=True)

    # -- finding the streams -------------------------------------------------------------------

    def _stream_keys(self, client: SyncClient) -> dict[str, str]:
        """This run's stream keys, in order, each with its label."""
        # stream_key with "*" for the label is the MATCH pattern of this run's keys; the parse
        # below drops its other keys (epoch counters, the primary marker).
        pattern = wire.stream_key(self.settings.run_id, "*")
        found = [reply_text(m) for m in client.sscan_iter(wire.REGISTRY_KEY, match=pattern, count=1000)]
        found += [reply_text(k) for k in client.scan_iter(match=pattern, count=1000, _type="stream")]
        streams = {}
        for key in sorted(set(found)):
            names = wire.parse_stream_key(key)
            if names is not None and names[0] == self.settings.run_id:
                streams[key] = names[1]
        return streams

    def _discover(self, client: SyncClient, initial: bool) -> None:
        if self._primary is None and self._holder is None:
            # The producers' live claim (gone once the primary finishes), read as the ingesters do.
            self._holder = wire.claim_holder(client.get(wire.primary_key(self.settings.run_id)))
        for key, label in self._stream_keys(client).items():
            if key in self._ids:
                continue
            self._labels[key] = label
            self._color_for(label)
            if initial and not self.settings.from_start:
                # Start after the newest entry; the stream's first entry (its start) says
                # whether the label is the primary, whose finish ends the tail.
                newest = stream_entries(client.xrevrange(key, count=1))
                self._ids[key] = newest[0][0].decode() if newest else "0-0"
                for event in self._decode(key, stream_entries(client.xrange(key, count=1))):
                    self._learn(event)
            else:
                # A label that appears while following is new: all of it is worth printing.
                self._ids[key] = "0-0"

    def _finished_already(self, client: SyncClient) -> bool:
        for key in self._ids:
            if self._labels[key] == self._decided():
                last = self._decode(key, stream_entries(client.xrevrange(key, count=1)))
                if last and last[0].kind == "finish":
                    return True
        return False

    def _color_for(self, label: str) -> str:
        if label not in self._colors:
            self._colors[label] = COLORS[len(self._colors) % len(COLORS)]
            if self._shown(label):
                self._width = max(self._width, len(label))
        return self._colors[label]

    # -- reading and printing ------------------------------------------------------------------

    @staticmethod
    def _decode(key: str | bytes, entries: Iterable[StreamEntry]) -> list[wire.Event]:
        key = key.decode() if isinstance(key, bytes) else key
        events = []
        for _, fields in entries:
            try:
                events.append(wire.decode_entry(key, fields))
            except InvalidEntry:
                continue  # the ingesters dead-letter it; a tail has nothing to show
        return events

    def _decided(self) -> str | None:
        """The run's primary as the ingesters decide it, from what this tail has seen so far; the
        live claim's holder until a claim is seen."""
        if self._primary is None and self._claims:
            self._primary = decide_primary(None, self._claims, self._holder)
        return self._primary if self._primary is not None else self._holder

    def _learn(self, event: wire.Event) -> None:
        if event.kind == "start":
            self._claims += primary_claims([event])
        elif event.kind == "finish" and event.label == self._decided():
            self._finished = True
            code = event.data.get("exit_code")
            if self._ending is None:
                self._ending = {0: "finished", None: "crashed"}.get(code, f"failed (exit {code})")

    def _shown(self, label: str) -> bool:
        return self.settings.labels is None or label in self.settings.labels

    def _show(self, entries: Entries) -> None:
        events: list[wire.Event] = []
        for key, batch in entries:
            if batch:
                self._ids[key.decode()] = batch[-1][0].decode()
            events += self._decode(key, batch)
        lines = []
        for event in sorted(events, key=lambda e: e.ts):
            self._learn(event)
            if event.kind != "log" or not self._shown(event.label):
                continue
            if wire.level_number(str(event.data.get("level", "INFO"))) < self.settings.min_level:
                continue
            color = self._color_for(event.label) if self.settings.color else None
            for text in self._redacted(event).splitlines() or [""]:
                lines.append(format_line(event.label, self._width, text, color))
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()

    def _redacted(self, event: wire.Event) -> str:
        """The event's text, through its label's stream's LineRedactor."""
        where = (event.label, str(event.data.get("stream")))
        redactor = self._redactors.get(where)
        if redactor is None:
            redactor = self._redactors[where] = LineRedactor()
        return redactor(event.data["text"])


def _shown(message: str, redis_url: str) -> str:
    """A message for stderr: no secret of the Redis URL in a driver's error text, no control."""
    return printable(redact_text(message, url_secrets(redis_url)))


def stored_run(store_url: str, run_id: str, prefix: bool = False) -> RunSummary | None:
    """The run as the store has it (with `prefix`, the run `run_id` names: its id or a unique
    prefix of it, storage.lookup); None where the store has no such run, or there is no store."""

    async def read() -> RunSummary | None:
        store = open_store(store_url, create=False)
        try:
            await store.connect()
            found = await lookup.run_id_of(store, run_id) if prefix else run_id
            return None if found is None else await store.run(found)
        except StoreMissing:
            return None
        finally:
            await store.close()

    return asyncio.run(read())


def tail(settings: TailSettings) -> int:
    """Follow a run until it ends (see the module doc): 0; Redis unreachable at the start: 1."""
    try:
        return Tail(settings).run()
    except (RedisConnectionError, RedisTimeoutError) as exc:
        message = f"cannot read the streams at {safe_url(settings.redis_url)}: {exc}"
        print(f"runbus: {_shown(message, settings.redis_url)}", file=sys.stderr)
        return 1
