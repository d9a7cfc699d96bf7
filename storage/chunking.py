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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from runbus.storage.columns_numpy import Arrays, Floats, Ints, Mask, encode_arrays
from runbus.storage.rollups import series_run
from runbus.storage.rules import RUNNING
from runbus.wire import Event

# A label epoch's head is compacted once this many events wait in it: a key logged every step
# then fills a chunk of this many points (docs/columns.md: larger chunks compress and decode
# better, and a head this size is read back and deleted in a few milliseconds).
COMPACT_EVENTS = 4096
# Points per chunk at most: a head compacted late (an old store, a label that ran long without
# a batch ending it) is cut into chunks of this size.
CHUNK_POINTS = 4096
# The kinds of event whose values the head and the chunks hold.
VALUE_KINDS = frozenset({"metric", "system"})
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


# A head row as compaction reads it: (label id, table, key, epoch, seq, step or None, ts, value),
# the value None where SQLite kept NaN, or bytes where it kept -0.0 (head_value).
HeadRow = tuple[int, str, str, int, int, int | None, float, float | bytes | None]
# A head point: (label id, series id, epoch, seq, step or None, ts, value).
HeadPoint = tuple[int, int, int, int, int | None, float, float | bytes | None]
# How a head keeps -0.0 where its store would make it 0.0 (SQLite): the float64's 8 bytes.
NEGATIVE_ZERO = struct.pack("<d", -0.0)


def head_value(value: float | bytes | None) -> float:
    """A value as a head row holds it, as the float it was: None is NaN, bytes the float64's."""
    if value is None:
        return math.nan
    if isinstance(value, bytes):
        return float(struct.unpack("<d", value)[0])
    return value


def head_events(fresh: Iterable[tuple[int, Sequence[Event]]]) -> dict[tuple[int, int], int]:
    """How many of a batch's new events (given as (label id, its events) pairs) hold values, by
    (label id, epoch): what each label epoch's head grows by."""
    counts: dict[tuple[int, int], int] = {}
    for label_id, events in fresh:
        for event in events:
            if event.kind in VALUE_KINDS:
                key = (label_id, event.epoch)
                counts[key] = counts.get(key, 0) + 1
    return counts


def is_due(head: int, ended: bool) -> bool:
    """Whether a label epoch whose head holds `head` events is compacted now."""
    return head >= COMPACT_EVENTS or (ended and head > 0)


# The label epochs whose head is due (is_due), in SQL both backends run: the FROM and WHERE of a
# query over label_epochs `e` and their labels `l`.
DUE_SQL = (
    "FROM label_epochs e JOIN labels l ON l.id = e.label_id WHERE e.head > 0 "
    f"AND (e.head >= {COMPACT_EVENTS} OR l.state != '{RUNNING}')"
)


def split_due(
    metric_rows: Sequence[tuple], system_rows: Sequence[tuple], due: Iterable[tuple[int, int]]
) -> tuple[list[tuple], list[tuple], list[HeadRow]]:
    """A batch's metric and system rows (rollups.fold_metrics, rows.value_rows: label id first,
    epoch third) by whether their (label id, epoch) is `due`: the metric and system rows that join
    the head, and the others as head rows that go into chunks with their label epoch's head."""
    now = set(due)
    direct: list[HeadRow] = [(r[0], "metrics", *r[1:]) for r in metric_rows if (r[0], r[2]) in now]
    direct += [(r[0], "system", *r[1:4], None, *r[4:]) for r in system_rows if (r[0], r[2]) in now]
    return (
        [r for r in metric_rows if (r[0], r[2]) not in now],
        [r for r in system_rows if (r[0], r[2]) not in now],
        direct,
    )


def head_series(head: Sequence[HeadRow], runs: Mapping[int, str]) -> list[tuple[str, str]]:
    """Each head row's series, as (series run, key): `runs` gives each label id's run."""
    run_of: dict[tuple[int, str], str] = {}
    for label_id, table, *_ in head:
        if (label_id, table) not in run_of:
            run_of[label_id, table] = series_run(runs[label_id], table)
    return [(run_of[h[0], h[1]], h[2]) for h in head]


def head_points(
    head: Sequence[HeadRow], series: Sequence[tuple[str, str]], ids: Mapping[tuple[str, str], int]
) -> list[HeadPoint]:
    """The head rows as points of their series (`series`: head_series; `ids`: the series' ids)."""
    return [(h[0], ids[s], *h[3:]) for h, s in zip(head, series, strict=True)]


class _Columns(NamedTuple):
    label: Ints
    series: Ints
    epoch: Ints
    seq: Ints
    step: Ints
    nulls: Mask
    ts: Floats
    value: Floats


def chunk_rows(points: Sequence[HeadPoint]) -> list[ChunkRow]:
    """The chunk rows that hold `points` (head points of any label epochs, in any order), and
    each of their label epochs' clock: every (label, series, epoch) cut into chunks of at most
    CHUNK_POINTS consecutive seqs."""
    if not points:
        return []
    columns = _columns(points)
    order = np.lexsort((columns.seq, columns.epoch, columns.series, columns.label))
    ordered = _Columns._make(column[order] for column in columns)
    return [*_key_chunks(ordered), *_clock_chunks(ordered)]


def _columns(points: Sequence[HeadPoint]) -> _Columns:
    label, series, epoch, seq, step, ts, value = zip(*points, strict=True)
    nulls = np.fromiter((s is None for s in step), np.bool_, len(step))
    return _Columns(
        np.array(label, np.int64),
        np.array(series, np.int64),
        np.array(epoch, np.int64),
        np.array(seq, np.int64),
        np.fromiter((0 if s is None else s for s in step), np.int64, len(step)),
        nulls,
        np.array(ts, np.float64),
        np.fromiter(map(head_value, value), np.float64, len(value)),
    )


def _runs(*keys: Ints) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of equal `keys` (sorted), cut at CHUNK_POINTS."""
    count = len(keys[0])
    change = np.zeros(count, np.bool_)
    change[0] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    starts = np.flatnonzero(change).tolist()
    for start, end in zip(starts, [*starts[1:], count], strict=True):
        for at in range(start, end, CHUNK_POINTS):
            yield at, min(at + CHUNK_POINTS, end)


def _key_chunks(c: _Columns) -> Iterator[ChunkRow]:
    for start, end in _runs(c.label, c.series, c.epoch):
        part = slice(start, end)
        nulls = c.nulls[part]
        seqs = c.seq[part]
        given = c.step[part][~nulls]
        data = encode_arrays(
            Arrays(
                seqs,
                c.step[part],
                nulls if nulls.any() else None,
                np.zeros(end - start, np.int64),
                c.value[part],
            )
        )
        ts = c.ts[part]
        yield ChunkRow(
            int(c.label[start]),
            int(c.series[start]),
            int(c.epoch[start]),
            int(seqs[0]),
            int(seqs[-1]),
            end - start,
            int(given.min()) if len(given) else None,
            int(given.max()) if len(given) else None,
            float(ts.min()),
            float(ts.max()),
            data,
        )


def _clock_chunks(c: _Columns) -> Iterator[ChunkRow]:
    """Each label epoch's events once: (label, epoch, seq) in order, the first point of each."""
    order = np.lexsort((c.seq, c.epoch, c.label))
    label, epoch, seq, ts = c.label[order], c.epoch[order], c.seq[order], c.ts[order]
    first = np.ones(len(seq), np.bool_)
    first[1:] = (label[1:] != label[:-1]) | (epoch[1:] != epoch[:-1]) | (seq[1:] != seq[:-1])
    label, epoch, seq, ts = label[first], epoch[first], seq[first], ts[first]
    for start, end in _runs(label, epoch):
        part = slice(start, end)
        count = end - start
        data = encode_arrays(
            Arrays(
                seq[part],
                np.zeros(count, np.int64),
                np.ones(count, np.bool_),
                np.ascontiguousarray(ts[part]).view(np.int64),
                np.zeros(count, np.int64),
            )
        )
        yield ChunkRow(
            int(label[start]),
            CLOCK,
            int(epoch[start]),
            int(seq[start]),
            int(seq[end - 1]),
            count,
            None,
            None,
            float(ts[part].min()),
            float(ts[part].max()),
            data,
        )
