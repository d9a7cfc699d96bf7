"""The bounded in-memory queue between the threads that log and the shipper thread.

`put` is the hot path: a clock read and an append, never a lock or I/O. Only a full (or closed)
box takes the slow path: wait for room while the shipper makes it (it encodes into a backlog with
room, or Redis takes events), else drop (counted).

Events are numbered (seq 1, 2, 3 …) when the shipper takes them, in the order they were
appended, so a number is never taken by an event that is not in the box: a put interrupted
half-way (by a signal handler that finishes the run) leaves no hole, and nothing appended after
the finish can be numbered after it.

A metric event whose values a GPU has not computed yet (runbus.producer.devicevalues) is not
taken: it and what follows wait in the box, in order, and `blocked_at` says since when. A
heartbeat put meanwhile goes first (`put_first`): a rank whose GPU hangs keeps telling what it is
doing. At a finish that gives up, `take(force=True)` takes them anyway: their values cannot be
read, so they become explained drops (runbus.producer.shipper).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from runbus.producer import exits
from runbus.producer.backlog import DropLog
from runbus.producer.devicevalues import DeviceMetrics

# (kind, seq, ts, step, data): data is the caller's values, serialised later off the hot path.
Pending = tuple[str, int, float, "int | None", Any]

# Kinds that neither wait nor drop when the box is full: start and finish are the label's state,
# and heartbeats come from the shipper thread, which cannot wait for itself. One of each at a
# time, at most, so the bound is passed by a few events.
UNBOUNDED_KINDS = frozenset({"start", "finish", "heartbeat"})
# Kinds that wait for room while the shipper makes it, like any, but are never dropped: run metadata
# (a config, summary, name or tags update) is kept past the bound instead.
KEPT_KINDS = frozenset({"meta"})
WAIT_SLICE = 0.02  # a waiting put looks again this often whether it still may wait


def _never() -> bool:
    return False


class Outbox:
    """Events held in the order `put` is called, until the shipper takes (and numbers) them.

    When `max_events` are held, a put waits for the shipper to take some while `may_wait()` says
    so (the shipper sets it: it is encoding into a backlog with room, or Redis takes events);
    otherwise the event is dropped and counted, and the shipper gives it a seq of its own (so
    storage shows the gap) and notes it in `drops`.

    `close` appends the finish event, the label's last: whatever is put after it (a heartbeat,
    a sample or a console line racing the finish) is discarded, never numbered.
    """

    __slots__ = (
        "_closed",
        "_events",
        "_finish_taken",
        "_limit",
        "_lock",
        "_seq",
        "_unnumbered_drops",
        "blocked_at",
        "demand",
        "drops",
        "holds_gpu_values",
        "max_events",
        "may_wait",
        "room",
        "waiting_since",
        "waits",
    )

    def __init__(self, max_events: int, drops: DropLog) -> None:
        if max_events < 1:
            raise ValueError(f"max_buffer_events must be >= 1, got {max_events}")
        self.max_events = max_events
        # What `put` compares the length with: max_events, or -1 once closed (every put then
        # takes the slow path, which discards it).
        self._limit = max_events
        self._events: deque[tuple[str, float, int | None, Any]] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._finish_taken = False
        self._seq = 0  # the last seq given (only the shipper thread numbers)
        self._unnumbered_drops = 0  # dropped by put, not yet given their seqs
        self.drops = drops
        self.may_wait: Callable[[], bool] = _never
        self.room = threading.Event()  # set by `take`: a waiting put looks again
        self.demand = threading.Event()  # set when a put finds the box full: wakes the shipper
        self.waits = 0  # puts that had to wait for room
        # When a put now waiting for room began to wait (None: none waits): past a bound, the
        # shipper moves events into its backlog rather than leave log() waiting for Redis.
        self.waiting_since: float | None = None
        # Since when (time.monotonic()) the box's first event waits for its GPU; None: it does not.
        self.blocked_at: float | None = None
        # Set (by Run.log) once a metric event with CUDA values was put: until then `take` does
        # not look at the events it takes for them.
        self.holds_gpu_values = False

    def put(self, kind: str, step: int | None, data: Any) -> None:
        """Keep one event; when full, wait for room or drop it (counted)."""
        if len(self._events) >= self._limit:
            self._put_slow(kind, step, data)
            return
        self._events.append((kind, time.time(), step, data))

    def _put_slow(self, kind: str, step: int | None, data: Any) -> None:
        try:
            self._put_when_room(kind, step, data)
        finally:
            exits.safe_point()

    def _put_when_room(self, kind: str, step: int | None, data: Any) -> None:
        event = (kind, time.time(), step, data)
        if self._closed:
            return  # after the finish: never sent
        if kind not in UNBOUNDED_KINDS:
            waited = False
            while len(self._events) >= self.max_events:
                if not self.may_wait():
                    self.waiting_since = None
                    if kind in KEPT_KINDS:
                        break
                    self._drop()
                    return
                if not waited:
                    waited = True
                    self.waits += 1
                    if self.waiting_since is None:
                        self.waiting_since = time.monotonic()
                self.room.clear()
                if len(self._events) < self.max_events:
                    break  # taken between the look and the clear
                self.demand.set()
                self.room.wait(WAIT_SLICE)
                exits.safe_point()  # a SIGTERM that came while waiting ends the Runs now
            if waited:
                self.waiting_since = None
        self._events.append(event)

    def _drop(self) -> None:
        with self._lock:
            if self._closed:
                return  # racing the finish: discarded like any event put after it
            self._unnumbered_drops += 1
        self.demand.set()  # the backlog is full: the shipper moves (or drops) what is queued
        exits.safe_point()

    def close(self, data: Any) -> None:
        """Append the finish event; every put after it is discarded. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._limit = -1
            self._events.append(("finish", time.time(), None, data))
        self.demand.set()
        exits.safe_point()

    def put_first(self, kind: str, step: int | None, data: Any) -> None:
        """Keep one event ahead of every other (a heartbeat while the box waits for a GPU)."""
        if not self._closed:
            self._events.appendleft((kind, time.time(), step, data))

    def take(self, limit: int, force: bool = False) -> list[Pending]:
        """Up to `limit` events, oldest first, removed from the box and numbered (the events
        dropped since the last take are numbered first, and noted in `drops`). Nothing after
        the finish, nor from a metric event whose GPU values are not computed yet on (unless
        `force`)."""
        events = self._events
        if self._finish_taken:
            events.clear()  # appended by a put that raced the finish
            return []
        raw = [events.popleft() for _ in range(min(limit, len(events)))]
        if self.holds_gpu_values and not force:
            raw = self._ready_part(raw)
        with self._lock:  # drops counted before close() are in, so they come before the finish
            dropped, self._unnumbered_drops = self._unnumbered_drops, 0
        seq = self._seq
        if dropped:
            self.drops.note(seq + 1, seq + dropped)
            seq += dropped
        taken: list[Pending] = []
        for kind, ts, step, data in raw:
            seq += 1
            taken.append((kind, seq, ts, step, data))
            if kind == "finish":
                self._finish_taken = True
                events.clear()
                break
        self._seq = seq
        if raw:
            self.room.set()
        return taken

    def _ready_part(
        self, raw: list[tuple[str, float, int | None, Any]]
    ) -> list[tuple[str, float, int | None, Any]]:
        """`raw` up to its first event that waits for a GPU, that one and the rest put back."""
        for index, event in enumerate(raw):
            data = event[3]
            if type(data) is DeviceMetrics and not data.ready():
                self._events.extendleft(reversed(raw[index:]))
                if self.blocked_at is None:
                    self.blocked_at = time.monotonic()
                return raw[:index]
        self.blocked_at = None
        return raw

    @property
    def unnumbered_drops(self) -> int:
        """Events dropped by put that the shipper has not numbered yet."""
        return self._unnumbered_drops

    @property
    def closed(self) -> bool:
        return self._closed

    def wake_waiters(self) -> None:
        """Make waiting puts look again now (the shipper lost Redis, or stopped)."""
        self.room.set()

    def __len__(self) -> int:
        return 0 if self._finish_taken else len(self._events)


# The waits, drops and close take the outbox's lock and its Events' (which are not reentrant):
# a SIGTERM handler that finished the Run in the middle of one would wait for itself.
exits.guard_signals(Outbox._put_slow, Outbox._put_when_room, Outbox._drop, Outbox.close)
