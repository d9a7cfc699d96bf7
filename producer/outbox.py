"""The bounded in-memory queue between the training thread and the shipper thread.

`put` is the hot path: a sequence number, a clock read and an append, never a lock or I/O.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

from runbus.producer.backlog import DropLog

# (kind, seq, ts, step, data): data is the caller's values, serialised later off the hot path.
Pending = tuple[str, int, float, "int | None", Any]


class Outbox:
    """Events numbered 1, 2, 3 … in the order `put` is called, held until the shipper takes them.

    When `max_events` are held, further events still take their seq (so storage shows the gap)
    but are dropped and noted in `drops`. The shipper empties it continuously, so it only fills
    when events come faster than they can be encoded.
    """

    __slots__ = ("_events", "_next_seq", "drops", "max_events")

    def __init__(self, max_events: int, drops: DropLog) -> None:
        if max_events < 1:
            raise ValueError(f"max_buffer_events must be >= 1, got {max_events}")
        self.max_events = max_events
        self._events: deque[Pending] = deque()
        self._next_seq = itertools.count(1).__next__
        self.drops = drops

    def put(self, kind: str, step: int | None, data: Any) -> None:
        """Number and keep one event (or count it dropped when full)."""
        seq = self._next_seq()
        if len(self._events) >= self.max_events:
            self.drops.note(seq)
            return
        self._events.append((kind, seq, time.time(), step, data))

    def take(self, limit: int) -> list[Pending]:
        """Up to `limit` events, oldest first, removed from the box."""
        events = self._events
        taken = []
        for _ in range(min(limit, len(events))):
            taken.append(events.popleft())
        return taken

    def __len__(self) -> int:
        return len(self._events)
