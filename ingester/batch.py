"""One read's entries decoded: the valid events, where each came from, the dead entries, and the
stretch of events each stream gave (with the decoder's columns, for the fence)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import NamedTuple, cast, overload

from runbus import wire
from runbus.errors import InvalidEntry
from runbus.ingester import decoding
from runbus.ingester.deadletter import DeadEntry
from runbus.ingester.decoding import Columns

# An entry's fields: XAUTOCLAIM's reply parses them into a dict; XREADGROUP's stays a flat
# [name, value, ...] list (worker._raw_reply).
Fields = dict[bytes, bytes] | wire.FlatEntry
# Raw entries as redis-py returns them: (stream key, [(entry id, fields)]).
StreamItems = list[tuple[bytes, Fields]]
Entries = list[tuple[str, StreamItems]]
# Where a decoded event came from: (stream key, entry id, raw fields as a dict or a flat list).
Source = tuple[str, bytes, Fields]

_ONLY_EVENTS = frozenset({wire.Event})


class Stretch(NamedTuple):
    """Where one stream's events lie in a batch, and their Columns where the decoder made them."""

    where: slice
    columns: Columns | None


class Sources(Sequence[Source]):
    """Where each of a batch's events came from, kept as each stream's ids and fields as read:
    a Source is made only for the events asked for (those refused, isolated or dead-lettered),
    not a tuple for every event of every batch."""

    __slots__ = ("_blocks", "_len", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._blocks: list[tuple[str, Sequence[bytes], Sequence[Fields]]] = []
        self._len = 0

    def add(self, key: str, ids: Sequence[bytes], fieldses: Sequence[Fields]) -> None:
        """The next events came from these entries of stream `key`, in this order."""
        self._starts.append(self._len)
        self._blocks.append((key, ids, fieldses))
        self._len += len(ids)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, at: int) -> Source: ...
    @overload
    def __getitem__(self, at: slice) -> Sources: ...
    def __getitem__(self, at: int | slice) -> Source | Sources:
        if isinstance(at, slice):
            return self._part(*at.indices(self._len))
        if at < 0:
            at += self._len
        if not 0 <= at < self._len:
            raise IndexError("source index out of range")
        block = bisect_right(self._starts, at) - 1
        key, ids, fieldses = self._blocks[block]
        offset = at - self._starts[block]
        return key, ids[offset], fieldses[offset]

    def _part(self, start: int, stop: int, step: int) -> Sources:
        """The sources of events start to stop (by step), as slices of the streams' blocks: a
        batch written in several transactions, or halved to isolate an event, is sliced so."""
        part = Sources()
        if step != 1:
            for key, entry_id, fields in map(self.__getitem__, range(start, stop, step)):
                part.add(key, (entry_id,), (fields,))
            return part
        for first, (key, ids, fieldses) in zip(self._starts, self._blocks, strict=True):
            low, high = max(start - first, 0), min(stop - first, len(ids))
            if low < high:
                part.add(key, ids[low:high], fieldses[low:high])
        return part

    def __iter__(self) -> Iterator[Source]:
        for key, ids, fieldses in self._blocks:
            yield from zip(repeat(key), ids, fieldses, strict=False)


def decode_batch(
    entries: Entries, deliveries: dict[bytes, int] | None = None, max_deliveries: int = 0
) -> tuple[list[wire.Event], Sources, list[DeadEntry], list[Stretch]]:
    """Split raw entries into valid events (with where each came from) and dead entries, and
    the stretch of events each stream gave (with the decoder's Columns, for the fence).

    An entry delivered more than `max_deliveries` times (per `deliveries`) is poison: it is
    dead-lettered whatever it holds, since processing it keeps failing.
    """
    events: list[wire.Event] = []
    sources = Sources()
    dead: list[DeadEntry] = []
    stretches: list[Stretch] = []
    for key, items in entries:
        if deliveries and max_deliveries:
            items = _not_poison(key, items, deliveries, max_deliveries, dead)
        if not items:
            continue
        ids, fieldses = zip(*items, strict=True)
        # XAUTOCLAIM's reply comes parsed into dicts; XREADGROUP's stays flat (worker._raw_reply).
        flats = fieldses if dict not in set(map(type, fieldses)) else list(map(as_flat, fieldses))
        decoded, columns = decoding.decode_with_columns(key, flats)
        start = len(events)
        if columns is not None or _ONLY_EVENTS.issuperset(map(type, decoded)):  # the common case, in C
            events += cast("list[wire.Event]", decoded)
            sources.add(key, ids, fieldses)
        else:
            kept_ids, kept_fields = [], []
            for entry_id, fields, event in zip(ids, fieldses, decoded, strict=True):
                if isinstance(event, InvalidEntry):
                    dead.append(DeadEntry(key, entry_id, as_dict(fields), str(event)))
                else:
                    events.append(event)
                    kept_ids.append(entry_id)
                    kept_fields.append(fields)
            sources.add(key, kept_ids, kept_fields)
        if len(events) > start:
            stretches.append(Stretch(slice(start, len(events)), columns))
    return events, sources, dead, stretches


def _not_poison(
    key: str, items: StreamItems, deliveries: dict[bytes, int], max_deliveries: int, dead: list[DeadEntry]
) -> StreamItems:
    """`items` delivered at most `max_deliveries` times; the others join `dead`."""
    kept = []
    for entry_id, fields in items:
        count = deliveries.get(entry_id, 1)
        if count > max_deliveries:
            reason = f"delivered {count} times, over --max-deliveries {max_deliveries}"
            dead.append(DeadEntry(key, entry_id, as_dict(fields), reason, count))
        else:
            kept.append((entry_id, fields))
    return kept


def as_dict(fields: Fields) -> dict[bytes, bytes]:
    """An entry's fields as a dict, however they were read."""
    return fields if isinstance(fields, dict) else wire.fields_dict(fields)


def as_flat(fields: Fields) -> wire.FlatEntry:
    """An entry's fields as a flat [name, value, ...] list, however they were read."""
    return [item for pair in fields.items() for item in pair] if isinstance(fields, dict) else fields
