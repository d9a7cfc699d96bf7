"""The bounded in-memory queue between the threads that log and the shipper thread.

`put` is the hot path: a sequence number, a clock read and an append, never a lock or I/O. Only
a full (or closed) box takes the slow path: wait for room while Redis answers, else drop.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from runbus.producer.backlog import DropLog

# (kind, seq, ts, step, data): data is the caller's values, serialised later off the hot path.
Pending = tuple[str, int, float, "int | None", Any]

# Kinds that neither wait nor drop when the box is full: start and finish are the label's state,
# and heartbeats come from the shipper thread, which cannot wait for itself. One of each at a
# time, at most, so the bound is passed by a few events.
UNBOUNDED_KINDS = frozenset({"start", "finish", "heartbeat"})
WAIT_SLICE = 0.05  # a waiting put looks again this often whether it still may wait


def _never() -> bool:
    return False


class Outbox:
    """Events numbered 1, 2, 3 … in the order `put` is called, held until the shipper takes them.

    When `max_events` are held, a put waits for the shipper to take some while `may_wait()` says
    so (the shipper sets it: Redis answers and shipping progresses), else the event keeps its
    seq (so storage shows the gap) but is dropped and noted in `drops`.

    `close` puts the finish event, the label's last: any put that takes a later seq (a heartbeat
    or a sample racing the finish) is discarded, so nothing follows the finish.
    """

    __slots__ = (
        "_events",
        "_limit",
        "_lock",
        "_next_seq",
        "demand",
        "dropped_at_put",
        "drops",
        "finish_seq",
        "max_events",
        "may_wait",
        "room",
        "taken",
        "waits",
    )

    def __init__(self, max_events: int, drops: DropLog) -> None:
        if max_events < 1:
            raise ValueError(f"max_buffer_events must be >= 1, got {max_events}")
        self.max_events = max_events
        # What `put` compares the length with: max_events, or -1 once closed (every put then
        # takes the slow path, which discards what comes after the finish).
        self._limit = max_events
        self._events: deque[Pending] = deque()
        self._next_seq = itertools.count(1).__next__
        self._lock = threading.Lock()
        self.drops = drops
        self.may_wait: Callable[[], bool] = _never
        self.room = threading.Event()  # set by `take`: a waiting put looks again
        self.demand = threading.Event()  # set when a put finds the box full: wakes the shipper
        self.finish_seq: int | None = None
        self.taken = 0  # events taken by the shipper (only the shipper thread writes it)
        self.dropped_at_put = 0
        self.waits = 0  # puts that had to wait for room

    def put(self, kind: str, step: int | None, data: Any) -> None:
        """Number and keep one event; when full, wait for room or drop it (counted)."""
        seq = self._next_seq()
        if len(self._events) >= self._limit:
            self._put_slow(kind, seq, step, data)
            return
        self._events.append((kind, seq, time.time(), step, data))

    def _put_slow(self, kind: str, seq: int, step: int | None, data: Any) -> None:
        event = (kind, seq, time.time(), step, data)
        # close() sets the limit before it takes the finish's seq, under this lock: a put that
        # took a later seq is here, and sees finish_seq once it holds the lock.
        with self._lock:
            finish_seq = self.finish_seq
        if finish_seq is not None and seq > finish_seq:
            return  # after the finish: never sent, and no gap (nothing follows the finish)
        if kind not in UNBOUNDED_KINDS:
            waited = False
            while len(self._events) >= self.max_events:
                if not self.may_wait():
                    self._drop(seq)
                    return
                if not waited:
                    waited = True
                    self.waits += 1
                self.room.clear()
                if len(self._events) < self.max_events:
                    break  # taken between the look and the clear
                self.demand.set()
                self.room.wait(WAIT_SLICE)
        self._events.append(event)

    def _drop(self, seq: int) -> None:
        with self._lock:
            self.dropped_at_put += 1
        self.drops.note(seq)
        self.demand.set()  # Redis is away: the shipper moves events into the bounded backlog

    def close(self, data: Any) -> None:
        """Put the finish event; every put that takes a later seq is discarded. Idempotent."""
        with self._lock:
            if self.finish_seq is not None:
                return
            self._limit = -1
            seq = self._next_seq()
            self.finish_seq = seq
        self._events.append(("finish", seq, time.time(), None, data))
        self.demand.set()

    def settled(self) -> bool:
        """Closed, and every event numbered before the finish taken or dropped: the finish may
        be shipped as the last event (a put that took an earlier seq may append after it)."""
        with self._lock:
            return self.finish_seq is not None and self.taken + self.dropped_at_put >= self.finish_seq

    def take(self, limit: int) -> list[Pending]:
        """Up to `limit` events, oldest first, removed from the box."""
        events = self._events
        count = min(limit, len(events))
        taken = [events.popleft() for _ in range(count)]
        if count:
            self.taken += count
            self.room.set()
        return taken

    def wake_waiters(self) -> None:
        """Make waiting puts look again now (the shipper lost Redis, or stopped)."""
        self.room.set()

    def __len__(self) -> int:
        return len(self._events)
