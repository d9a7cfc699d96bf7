"""Compaction: a label epoch's newest values, kept as rows, turned into column chunks.

A store keeps the values of each label epoch in two places. The *head* is rows (the `metrics`
and `system` tables), where a batch adds an event's values cheaply however few arrive at a time.
Once a label epoch's head holds COMPACT_EVENTS events, or its label has ended, the store moves
the head into column chunks (runbus.storage.columns, docs/columns.md), in the transaction that
wrote the batch, and deletes the rows: about 4 bytes a point instead of 50 to 200.

Each chunk holds the points of one (label, series, epoch) in seq order: a series is a run's
metric key or system key (the `series` table). A point's timestamp is kept once per event, in
the label epoch's *clock* (series CLOCK): its seqs and timestamps, the timestamps as the float64
bits of the wire's seconds, so they come back bit for bit. A key's chunks keep seqs, steps and
values, and zeros for timestamps (a column of zeros costs a few bytes: runbus.storage.values
joins the clock on read).

This module is the logic both backends share; each runs the SQL that reads the head, deletes it
and inserts the rows built here.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import compress
from operator import attrgetter
from typing import Any, NamedTuple, TypeVar

import numpy as np

from runbus.storage.base import PointTable
from runbus.storage.columns import bounds
from runbus.storage.columns_numpy import Arrays, Floats, Ints, Mask, encode_arrays
from runbus.storage.rollups import KeyColumns, MetricRow, column_rows, series_run
from runbus.storage.rows import SystemRow
from runbus.storage.rules import RUNNING
from runbus.wire import Event

T = TypeVar("T")

# A label epoch's head is compacted once this many events wait in it: a key logged every step
# then fills a chunk of this many points (docs/columns.md: larger chunks compress and decode
# better, and a head this size is read back and deleted in a few milliseconds).
COMPACT_EVENTS = 4096
# A batch that brings a label epoch this many events writes them (and its head) as chunks at once.
DIRECT_EVENTS = 256
# Points per chunk at most: a head compacted late (an old store, a label that ran long without
# a batch ending it) is cut into chunks of this size.
CHUNK_POINTS = 4096
# The kinds of event whose values the head and the chunks hold.
VALUE_KINDS = frozenset({"metric", "system"})
_KIND, _EPOCH = attrgetter("kind"), attrgetter("epoch")
# The series id of a label epoch's clock: no `series` row has it (ids start at 1).
CLOCK = 0


class ChunkRow(NamedTuple):
    """A chunk and its bounds, in the `chunks` table's column order."""

    label_id: int
    series_id: int
    epoch: int
    first_seq: int
    last_seq: int
    points: int
    min_step: int | None
    max_step: int | None
    first_ts: float
    last_ts: float
    data: bytes


# A stretch of one series' points in one label epoch, as columns: (label id, series id, epoch,
# seqs, steps (None where not given), ts, values). The values of a head row may be None (SQLite's
# NaN) or bytes (-0.0 as SQLite's head keeps it): head_value.
Part = tuple[int, int, int, Sequence[int], Sequence[int | None], Sequence[float], Sequence[Any]]
# How a head keeps -0.0 where its store would make it 0.0 (SQLite): the float64's 8 bytes.
NEGATIVE_ZERO = struct.pack("<d", -0.0)


def head_value(value: float | bytes | None) -> float:
    """A value as a head row holds it, as the float it was: None is NaN, bytes the float64's."""
    if value is None:
        return math.nan
    if isinstance(value, bytes):
        return float(struct.unpack("<d", value)[0])
    return value


def row_columns(rows: Iterable[Sequence[Any]], steps: bool) -> list[KeyColumns]:
    """Value rows, (label id, key, epoch, seq, step, ts, value) or without the step, in any
    order, as columns a label, key and epoch at a time."""
    by_series: dict[tuple[int, str, int], list[Sequence[Any]]] = {}
    for row in rows:
        by_series.setdefault((row[0], row[1], row[2]), []).append(row)
    found: list[KeyColumns] = []
    for (label_id, key, epoch), group in by_series.items():
        columns = list(zip(*group, strict=True))
        seqs = list(columns[3])
        given: list[int | None] = list(columns[4]) if steps else [None] * len(seqs)
        found.append((label_id, key, epoch, seqs, given, list(columns[-2]), list(columns[-1])))
    return found


def split_due(
    metric_columns: Sequence[KeyColumns], system_columns: Sequence[KeyColumns], due: set[tuple[int, int]]
) -> tuple[list[MetricRow], list[SystemRow], list[tuple[PointTable, KeyColumns]]]:
    """A batch's columns (label id first, epoch third) by whether their label epoch is `due`:
    the rows of those that join the head (metrics rows, then system rows, as the tables declare
    them), and the others, which go into chunks with their label epoch's head, with their table."""
    metric_rows = column_rows(c for c in metric_columns if (c[0], c[2]) not in due)
    system_rows = [
        (c[0], c[1], c[2], seq, ts, value)
        for c in system_columns
        if (c[0], c[2]) not in due
        for seq, ts, value in zip(c[3], c[5], c[6], strict=True)
    ]
    direct: list[tuple[PointTable, KeyColumns]] = [
        ("metrics", c) for c in metric_columns if (c[0], c[2]) in due
    ]
    direct.extend(("system", c) for c in system_columns if (c[0], c[2]) in due)
    return metric_rows, system_rows, direct


def series_wanted(
    found: Iterable[tuple[PointTable, KeyColumns]], runs: Mapping[int, str]
) -> set[tuple[str, str]]:
    """The series (series run, key) of columns of `found` tables: `runs` names each label id's run."""
    return {(series_run(runs[c[0]], table), c[1]) for table, c in found}


def parts_of(
    found: Iterable[tuple[PointTable, KeyColumns]],
    runs: Mapping[int, str],
    ids: Mapping[tuple[str, str], int],
) -> list[Part]:
    """The columns of `found` tables as parts of their series (`ids`: each series' id)."""
    return [(c[0], ids[series_run(runs[c[0]], table), c[1]], *c[2:]) for table, c in found]


# The label epochs whose head is due (is_due) on their own, in SQL both backends run: the FROM
# and WHERE of a query over label_epochs `e` and their labels `l`.
DUE_SQL = (
    "FROM label_epochs e JOIN labels l ON l.id = e.label_id WHERE e.head > 0 "
    f"AND (e.head >= {COMPACT_EVENTS} OR l.state != '{RUNNING}')"
)


def head_events(fresh: Iterable[tuple[int, Sequence[Event]]]) -> dict[tuple[int, int], int]:
    """How many of a batch's new events (given as (label id, its events) pairs) hold values, by
    (label id, epoch): what each label epoch's head grows by."""
    counts: dict[tuple[int, int], int] = {}
    for label_id, events in fresh:
        # Counted in C (Counter over maps): a batch brings tens of thousands of events.
        values = compress(events, map(VALUE_KINDS.__contains__, map(_KIND, events)))
        for epoch, count in Counter(map(_EPOCH, values)).items():
            counts[label_id, epoch] = counts.get((label_id, epoch), 0) + count
    return counts


def direct_heads(
    heads: Mapping[tuple[int, int], int],
) -> tuple[dict[tuple[int, int], int], list[tuple[int, int]]]:
    """A batch's growth of its label epochs' heads (head_events) in two: that of the label
    epochs which keep a head, for the store to add, and the label epochs it brings so many events
    that they go into chunks at once (is_due, whatever their head holds). Those need no growth,
    only the compaction that empties their head: a burst then writes its label epochs' rows once,
    where growing them first left a dead row version behind and an entry in the index of those
    due (PostgreSQL: 8 kB of bench/history.py's constants-and-counters run)."""
    grown = {key: added for key, added in heads.items() if not is_due(0, added, False)}
    return grown, sorted(key for key in heads if key not in grown)


def is_due(head: int, added: int, ended: bool) -> bool:
    """Whether a label epoch whose head holds `head` events, `added` of them by this batch, is
    compacted now: its head is full, its label has ended, or the batch brings so many events
    that they make a chunk of their own (a burst writes its values once, as chunks: rows
    written and deleted would leave their pages behind, and cost as much again)."""
    return head >= COMPACT_EVENTS or added >= DIRECT_EVENTS or (ended and head > 0)


class _Columns(NamedTuple):
    seq: Ints
    step: Ints
    nulls: Mask
    ts: Floats
    value: Floats


def chunk_rows(parts: Iterable[Part]) -> list[ChunkRow]:
    """The chunk rows that hold the points of `parts` (of any label epochs and series, in any
    order, none of a seq twice in a series), and each of their label epochs' clock: every
    (label, series, epoch) in seq order, cut into chunks of at most CHUNK_POINTS."""
    series: dict[tuple[int, int, int], list[_Columns]] = {}
    arrays = _Arrays()
    for label_id, series_id, epoch, seqs, steps, ts, values in parts:
        if len(seqs):
            series.setdefault((label_id, series_id, epoch), []).append(
                arrays.columns(seqs, steps, ts, values)
            )
    # Each label epoch's clock from its series' columns, those of the same events once.
    clocks: dict[tuple[int, int], dict[int, _Columns]] = {}
    rows: list[ChunkRow] = []
    for (label_id, series_id, epoch), found in series.items():
        columns = _in_seq_order(found)
        clocks.setdefault((label_id, epoch), {}).setdefault(id(columns.seq), columns)
        rows += _key_chunks(label_id, series_id, epoch, columns)
    for (label_id, epoch), distinct in clocks.items():
        rows += _clock_chunks(label_id, epoch, _in_seq_order(list(distinct.values()), distinct=True))
    return rows


class _Arrays:
    """Columns as arrays, each list converted once: a batch's keys share their events' seqs,
    steps and ts (rollups.KeyColumns)."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Sequence[Any], Any]] = {}

    def columns(
        self, seqs: Sequence[int], steps: Sequence[int | None], ts: Sequence[float], values: Sequence[Any]
    ) -> _Columns:
        step, nulls = self._steps(steps)
        return _Columns(
            self._once(seqs, lambda: np.array(seqs, np.int64)),
            step,
            nulls,
            self._once(ts, lambda: np.array(ts, np.float64)),
            _floats(values),
        )

    def _steps(self, steps: Sequence[int | None]) -> tuple[Ints, Mask]:
        def made() -> tuple[Ints, Mask]:
            if None not in steps:
                return np.array(steps, np.int64), np.zeros(len(steps), np.bool_)
            nulls = np.fromiter((s is None for s in steps), np.bool_, len(steps))
            return np.fromiter((0 if s is None else s for s in steps), np.int64, len(steps)), nulls

        return self._once(steps, made)

    def _once(self, source: Sequence[Any], make: Callable[[], T]) -> T:
        # Keyed by the list's id, kept alive beside its array so the id is not reused meanwhile.
        found = self._made.get(id(source))
        if found is None:
            found = self._made[id(source)] = (source, make())
        made: T = found[1]
        return made


def _floats(values: Sequence[Any]) -> Floats:
    try:
        return np.array(values, np.float64)
    except (TypeError, ValueError):  # a head's None (NaN) or bytes (-0.0)
        return np.fromiter(map(head_value, values), np.float64, len(values))


def _in_seq_order(found: list[_Columns], distinct: bool = False) -> _Columns:
    """`found` as one set of columns in seq order; with `distinct`, the first of each seq."""
    joined = (
        found[0] if len(found) == 1 else _Columns._make(np.concatenate(c) for c in zip(*found, strict=True))
    )
    seq = joined.seq
    if len(seq) > 1 and not (seq[1:] > seq[:-1]).all():
        order = np.argsort(seq, kind="stable")
        joined = _Columns._make(c[order] for c in joined)
        if distinct:
            first = np.ones(len(seq), np.bool_)
            first[1:] = joined.seq[1:] != joined.seq[:-1]
            joined = _Columns._make(c[first] for c in joined)
    return joined


def _cuts(count: int) -> Iterator[tuple[int, int]]:
    for at in range(0, count, CHUNK_POINTS):
        yield at, min(at + CHUNK_POINTS, count)


def _key_chunks(label_id: int, series_id: int, epoch: int, c: _Columns) -> Iterator[ChunkRow]:
    for start, end in _cuts(len(c.seq)):
        part = slice(start, end)
        nulls = c.nulls[part]
        data = encode_arrays(
            Arrays(
                c.seq[part],
                c.step[part],
                nulls if nulls.any() else None,
                np.zeros(end - start, np.int64),
                c.value[part],
            )
        )
        yield _row(label_id, series_id, epoch, data, c.ts[part])


def _clock_chunks(label_id: int, epoch: int, c: _Columns) -> Iterator[ChunkRow]:
    """A label epoch's events once each: their seqs, and their ts as the float64's bits."""
    for start, end in _cuts(len(c.seq)):
        count = end - start
        ts = c.ts[start:end]
        data = encode_arrays(
            Arrays(
                c.seq[start:end],
                np.zeros(count, np.int64),
                np.ones(count, np.bool_),
                np.ascontiguousarray(ts).view(np.int64),
                np.zeros(count, np.int64),
            )
        )
        yield _row(label_id, CLOCK, epoch, data, ts)


def _row(label_id: int, series_id: int, epoch: int, data: bytes, ts: Floats) -> ChunkRow:
    """A chunk's row: its bounds as its header gives them (steps None where it has none), and
    its points' times (`ts`, which a series chunk's bytes leave out)."""
    found = bounds(data)
    return ChunkRow(
        label_id,
        series_id,
        epoch,
        found.first_seq,
        found.last_seq,
        found.points,
        found.min_step if found.has_steps else None,
        found.max_step if found.has_steps else None,
        float(ts.min()),
        float(ts.max()),
        data,
    )
