"""A run's values as arrays, read from its column chunks and its head rows.

Every read of stored values (runbus.Api's history and system tables, exports, `runbus metrics`,
the charts' exact path and straggler reads) comes through `assemble`: the backend selects the
chunk rows, the clock chunks and the head rows a read needs (runbus.storage.chunking says what
each is), and this module decodes them together (columns_numpy.decode_many) into one set of
columns in (label, key, epoch, seq) order, labels in natural order and keys by code point: the
order and the types the tables are built from, never a Python object per value.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from runbus.storage.base import Point
from runbus.storage.chunking import head_value
from runbus.storage.columns import Bounds, FormatError, bounds, is_v1, seqs_column
from runbus.storage.columns_numpy import Arrays, Floats, Ints, Mask, decode_arrays, decode_many, decode_times
from runbus.storage.rules import natural_key

# A chunk row as a read selects it: (label, key, epoch, first seq, data).
ChunkPart = tuple[str, str, int, int, bytes]
# A clock chunk: (label, epoch, data).
ClockPart = tuple[str, int, bytes]
# A head row: (label, key, epoch, seq, step or None, ts, value or None).
HeadRow = tuple[str, str, int, int, int | None, float, float | bytes | None]


SLICE_POINTS = 1 << 17  # points decoded together: a read's workings beyond its columns
MIN_SLICE_POINTS = 1 << 14  # a slice smaller than this costs more to hand to a thread than it saves
DECODE_THREADS = 4  # at most, and no more than the machine's cores

# Label and key codes: places in Values.labels and Values.keys, in as few bytes as they need
# (code_type): a table's categoricals keep them so, with no copy.
Codes = npt.NDArray[np.signedinteger[Any]]


def code_type(names: int) -> type[np.signedinteger[Any]]:
    """The smallest integer type of the codes of `names` names, as pandas' categoricals pick it."""
    return np.int8 if names < 2**7 else np.int16 if names < 2**15 else np.int32


@dataclass(frozen=True, slots=True)
class Values:
    """Stored points as columns: `label` and `key` index `labels` and `keys`; `step` is 0 where
    `no_step` is True. len() is the number of points (a dataclass, not a NamedTuple: a tuple's
    length is its fields')."""

    labels: list[str]
    keys: list[str]
    label: Codes
    key: Codes
    epoch: Ints
    seq: Ints
    step: Ints
    no_step: Mask
    ts: Floats
    value: Floats

    def __len__(self) -> int:
        return len(self.seq)

    def columns(self) -> tuple[Codes, Codes, Ints, Ints, Ints, Mask, Floats, Floats]:
        """The columns, one value per point each, in the fields' order."""
        return (self.label, self.key, self.epoch, self.seq, self.step, self.no_step, self.ts, self.value)

    def points(self) -> list[Point]:
        """The points as Point tuples, in the columns' order: for the few reads that want them."""
        labels, keys = self.labels, self.keys
        return [
            Point(labels[lab], keys[key], None if none else step, epoch, seq, ts, value)
            for lab, key, step, none, epoch, seq, ts, value in zip(
                self.label.tolist(),
                self.key.tolist(),
                self.step.tolist(),
                self.no_step.tolist(),
                self.epoch.tolist(),
                self.seq.tolist(),
                self.ts.tolist(),
                self.value.tolist(),
                strict=True,
            )
        ]

    def take(self, index: Any) -> Values:
        """The points at `index` (a slice, a mask or positions)."""
        taken: list[Any] = [column[index] for column in self.columns()]
        return Values(self.labels, self.keys, *taken)


def empty(labels: Sequence[str] = (), keys: Sequence[str] = ()) -> Values:
    ints, codes = np.zeros(0, np.int64), np.zeros(0, np.int32)
    return Values(
        list(labels),
        list(keys),
        codes,
        codes,
        ints,
        ints,
        ints,
        np.zeros(0, np.bool_),
        np.zeros(0),
        np.zeros(0),
    )


def assemble(chunks: Iterable[ChunkPart], clocks: Iterable[ClockPart], head: Iterable[HeadRow]) -> Values:
    """The points of `chunks` (their timestamps from `clocks`, the chunks of the same label
    epochs' clocks) and of `head` rows, as one set of columns in (label, key, epoch, seq) order.
    A stored chunk that does not decode (a store damaged by hand or on disk) raises a FormatError
    that names its label, key and lease epoch."""
    chunks, clocks = list(chunks), list(clocks)
    try:
        return _assembled(chunks, clocks, list(head))
    except FormatError as error:
        raise _damaged(chunks, clocks) or error from None


def _damaged(chunks: list[ChunkPart], clocks: list[ClockPart]) -> FormatError | None:
    """The error of the first of these chunks that does not decode on its own, with its names."""
    named = [
        (f"a stored chunk of label {label!r}, key {key!r}, lease epoch {epoch}, from seq {first_seq}", blob)
        for label, key, epoch, first_seq, blob in chunks
    ]
    named += [
        (f"the clock chunk of label {label!r}, lease epoch {epoch}", blob) for label, epoch, blob in clocks
    ]
    for where, blob in named:
        try:
            decode_arrays(blob)
        except FormatError as error:
            return FormatError(f"{where} does not decode: {error}")
    return None


def _assembled(chunks: list[ChunkPart], clocks: list[ClockPart], head: list[HeadRow]) -> Values:
    labels = sorted({c[0] for c in chunks} | {h[0] for h in head}, key=natural_key)
    keys = sorted({c[1] for c in chunks} | {h[1] for h in head})
    if not labels:
        return empty()
    label_code = {name: code for code, name in enumerate(labels)}
    key_code = {name: code for code, name in enumerate(keys)}
    chunked, ordered = _from_chunks(chunks, clocks, label_code, key_code)
    rows = _from_head(head, label_code, key_code)
    if not len(rows):  # a run's values all in chunks: in order unless chunks overlap
        joined = replace(chunked, labels=labels, keys=keys)
        return joined if ordered else joined.take(_order(joined))
    joined = (
        replace(rows, labels=labels, keys=keys)
        if not len(chunked)
        else _joined(labels, keys, [chunked, rows])
    )
    return joined if _in_order(joined) else joined.take(_order(joined))


def _joined(labels: list[str], keys: list[str], parts: list[Values]) -> Values:
    return Values(
        labels,
        keys,
        *(np.concatenate(columns) for columns in zip(*(p.columns() for p in parts), strict=True)),
    )


def _from_chunks(
    chunks: list[ChunkPart], clocks: list[ClockPart], label_code: dict[str, int], key_code: dict[str, int]
) -> tuple[Values, bool]:
    """The points of `chunks`, decoded a slice at a time into columns made once (slices side by
    side on threads): a read holds its columns and a slice's workings, never every chunk's.
    And whether they are in (label, key, epoch, seq) order: unless a late compaction's chunk
    overlaps another's seqs, as its header says."""
    chunks.sort(key=lambda c: (label_code[c[0]], key_code[c[1]], c[2], c[3]))
    heads = [bounds(chunk[4]) for chunk in chunks]
    if not all(head.points for head in heads):  # decode_many leaves empty chunks out: so do we
        kept = [(chunk, head) for chunk, head in zip(chunks, heads, strict=True) if head.points]
        chunks, heads = [chunk for chunk, _ in kept], [head for _, head in kept]
    if not chunks:
        return empty(), True
    counts = np.array([head.points for head in heads], np.int64)
    # Each label epoch a group: a point's timestamp is its group's clock's at its seq.
    groups: dict[tuple[str, int], int] = {}
    chunk_group = np.array([groups.setdefault((c[0], c[2]), len(groups)) for c in chunks], np.int64)
    twins = _twins(chunks, heads, clocks)
    unmatched = [at for at, twin in enumerate(twins) if twin is None]
    clock = _Clock.of(clocks, groups, [chunks[at] for at in unmatched], [heads[at] for at in unmatched])
    found = _columns_of(int(counts.sum()), len(label_code), len(key_code))
    offsets = np.cumsum(counts) - counts
    # A chunk's label, key and epoch are its points': filled a run of equal ones at a time.
    constants = [
        (found.label, [label_code[c[0]] for c in chunks]),
        (found.key, [key_code[c[1]] for c in chunks]),
        (found.epoch, [c[2] for c in chunks]),
    ]
    edges = (offsets + counts).tolist()

    def fill(first: int, end: int) -> None:
        at = slice(int(offsets[first]), int(offsets[end - 1] + counts[end - 1]))
        for column, each in constants:
            _fill_runs(column, each, edges, first, end)
        ts = found.ts[at]
        # Decoded where the columns are, with no copy (the series chunks' ts are zeros: not read).
        into = Arrays(found.seq[at], found.step[at], found.no_step[at], ts.view(np.int64), found.value[at])
        arrays = decode_many([chunk[4] for chunk in chunks[first:end]], times=False, into=into)
        if any(twin is None for twin in twins[first:end]):
            ts[:] = clock.times(chunk_group[first:end], counts[first:end], arrays.seqs)
        _twin_times(ts, twins[first:end], counts[first:end].tolist())

    _side_by_side(fill, _slices(counts), _on_threads(chunk[4] for chunk in chunks))
    return found, not _overlapping(chunks, heads)


def _columns_of(total: int, labels: int, keys: int) -> Values:
    """The columns a read's chunks are decoded into, a slice at a time (on threads, side by side:
    pages are first written there)."""
    return Values(
        [],
        [],
        np.empty(total, code_type(labels)),
        np.empty(total, code_type(keys)),
        np.empty(total, np.int64),
        np.empty(total, np.int64),
        np.empty(total, np.int64),
        np.empty(total, np.bool_),
        np.empty(total, np.float64),
        np.empty(total, np.float64),
    )


def _fill_runs(column: npt.NDArray[Any], each: list[int], edges: list[int], first: int, end: int) -> None:
    """Chunks first to end of `column` (chunk i's points end at edges[i]) set to each one's value
    in `each`, a run of chunks of one value at a time."""
    start = 0 if first == 0 else edges[first - 1]
    for at in range(first, end):
        if at + 1 == end or each[at + 1] != each[at]:
            column[start : edges[at]] = each[at]
            start = edges[at]


def _twins(chunks: list[ChunkPart], heads: list[Bounds], clocks: list[ClockPart]) -> list[bytes | None]:
    """For each chunk, the clock chunk of its label epoch that holds the same seqs (as many
    points, the seqs column's bytes the same: a key logged at every event of a compaction), or
    None: its timestamps are then the clock's, point for point, with no seq looked up."""
    by_start: dict[tuple[str, int, int], tuple[bytes, int]] = {}
    for label, epoch, data in clocks:
        head = bounds(data)
        by_start[label, epoch, head.first_seq] = data, head.points
    twins: list[bytes | None] = []
    for chunk, head in zip(chunks, heads, strict=True):
        data, points = by_start.get((chunk[0], chunk[2], head.first_seq), (b"", 0))
        same = points == head.points and seqs_column(data) == seqs_column(chunk[4])
        twins.append(data if same else None)
    return twins


def _twin_times(ts: Floats, twins: list[bytes | None], counts: list[int]) -> None:
    """The timestamps of a slice's chunks that have a twin clock chunk (_twins), each clock
    chunk decoded once for the slice, put in `ts` (the slice's)."""
    places: dict[int, int] = {}  # a clock chunk (by id) -> where its points start in `times`
    blobs: list[bytes] = []
    at = 0
    for twin, count in zip(twins, counts, strict=True):
        if twin is not None and id(twin) not in places:
            places[id(twin)] = at
            blobs.append(twin)
            at += count
    if not blobs:
        return
    if at == len(ts):  # each chunk a clock chunk of its own, in order (a read of one key): in place
        decode_times(blobs, ts.view(np.int64))
        return
    times = decode_times(blobs).view(np.float64)
    start = 0
    for twin, count in zip(twins, counts, strict=True):
        if twin is not None:
            source = places[id(twin)]
            ts[start : start + count] = times[source : source + count]
        start += count


def _overlapping(chunks: list[ChunkPart], heads: list[Bounds]) -> bool:
    """Whether a chunk's seqs reach into the next one's of the same label, key and epoch (the
    chunks in that order, then by first seq)."""
    return any(
        ahead.last_seq >= behind.first_seq and _series_of(before) == _series_of(after)
        for before, after, ahead, behind in zip(chunks, chunks[1:], heads, heads[1:], strict=False)
    )


def _series_of(chunk: ChunkPart) -> tuple[str, str, int]:
    return chunk[0], chunk[1], chunk[2]  # label, key, epoch (a database's row, sliced, may not be a tuple)


def _slices(counts: Ints) -> list[tuple[int, int]]:
    """(first, end) chunk indexes of slices of about SLICE_POINTS points (a chunk is not cut),
    or smaller, down to MIN_SLICE_POINTS, so that a smaller read is still shared by the threads."""
    total = int(counts.sum())
    size = max(MIN_SLICE_POINTS, min(SLICE_POINTS, -(-total // _thread_count())))
    ends = np.flatnonzero(np.diff((np.cumsum(counts) - counts) // size)) + 1
    edges = [0, *ends.tolist(), len(counts)]
    return [(first, end) for first, end in pairwise(edges) if end > first]


def _side_by_side(work: Callable[[int, int], None], slices: list[tuple[int, int]], threads: bool) -> None:
    """work(first, end) for every slice: on the decoding threads where there are several and
    `threads` says they help."""
    if len(slices) == 1 or not threads:
        for first, end in slices:
            work(first, end)
        return
    for done in [_threads().submit(work, first, end) for first, end in slices]:
        done.result()


def _on_threads(blobs: Iterable[bytes]) -> bool:
    """Whether slices of these chunks are decoded on threads: where some are format 1 (zlib and
    numpy let go of the GIL). pcodec holds it while it decodes format 2, so threads would only
    take turns (a key's 128k values: 3.5 ms in one thread, 4.4 ms in two)."""
    return any(map(is_v1, blobs))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """The threads that decode slices of a read side by side: zlib and numpy let go of the GIL
    while they work, so a read uses the machine's cores (up to DECODE_THREADS)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_thread_count(), thread_name_prefix="runbus-decode")
        return _pool


def _thread_count() -> int:
    return min(DECODE_THREADS, os.cpu_count() or 1)


def _forget_threads() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has none of its parent's threads


os.register_at_fork(after_in_child=_forget_threads)


def _clock_columns(blobs: list[bytes], counts: Ints) -> tuple[Ints, Floats]:
    """The seqs and timestamps of clock chunks (of `counts` points each, none empty), decoded a
    slice at a time, side by side, into one pair of columns made once (as _from_chunks fills its)."""
    offsets = np.cumsum(counts) - counts
    total = int(counts.sum())
    seqs, ts = np.empty(total, np.int64), np.empty(total, np.float64)

    def fill(first: int, end: int) -> None:
        arrays = decode_many(blobs[first:end])
        at = slice(int(offsets[first]), int(offsets[first]) + len(arrays.seqs))
        seqs[at], ts[at] = arrays.seqs, arrays.ts.view(np.float64)

    if len(blobs):
        _side_by_side(fill, _slices(counts), _on_threads(blobs))
    return seqs, ts


class _Clock:
    """The timestamps of a read's label epochs (groups), looked up by (group, seq): the clock
    chunks that hold the read chunks' seqs, decoded once for every slice of the read."""

    def __init__(self, group: Ints, seq: Ints, ts: Floats, low: int, span: int) -> None:
        self.group, self.seq, self.ts, self.low, self.span = group, seq, ts, low, span
        # (group, seq) as one rank, in which the clock is sorted and each point is looked up; a
        # label epoch at a time where seqs lie too far apart for one.
        self.ranks: Ints | None = None
        if len(seq) and (int(group.max()) + 1) * span < 2**62:
            ranks = group * span + (seq - low)
            if len(ranks) > 1 and not (ranks[1:] > ranks[:-1]).all():  # a late compaction's clock
                order = np.argsort(ranks, kind="stable")
                ranks, self.group, self.seq, self.ts = ranks[order], group[order], seq[order], ts[order]
            self.ranks = ranks

    @classmethod
    def of(
        cls,
        clocks: list[ClockPart],
        groups: dict[tuple[str, int], int],
        chunks: list[ChunkPart],
        heads: list[Bounds],
    ) -> _Clock:
        spans: dict[int, tuple[int, int]] = {}
        for chunk, head in zip(chunks, heads, strict=True):
            of_chunk = groups[chunk[0], chunk[2]]
            low, high = spans.get(of_chunk, (head.first_seq, head.last_seq))
            spans[of_chunk] = (min(low, head.first_seq), max(high, head.last_seq))
        mine = []
        for clock in clocks if spans else ():  # no chunk to time: no clock chunk decoded
            of = groups.get((clock[0], clock[1]))
            span = None if of is None else spans.get(of)
            head = bounds(clock[2])
            if span is None or not head.points:
                continue
            if head.last_seq >= span[0] and head.first_seq <= span[1]:
                mine.append((of, head.first_seq, head.points, clock[2]))
        mine.sort(key=lambda found: found[:2])
        counts = np.array([n for _, _, n, _ in mine], np.int64)
        seqs, ts = _clock_columns([blob for _, _, _, blob in mine], counts)
        group = np.repeat(np.array([of for of, _, _, _ in mine], np.int64), counts)
        low = min([head.first_seq for head in heads] + ([int(seqs.min())] if mine else []), default=0)
        high = max([head.last_seq for head in heads] + ([int(seqs.max())] if mine else []), default=0)
        return cls(group, seqs, ts, low, high - low + 1)

    def times(self, chunk_group: Ints, counts: Ints, seq: Ints) -> Floats:
        """Each point's timestamp (chunks laid end to end: each one's group and point count);
        NaN where the clock lacks its seq (a store damaged by hand: every compaction writes the
        clock with the values)."""
        if not len(self.seq) or not len(seq):
            return np.full(len(seq), np.nan)
        group = np.repeat(chunk_group, counts)
        if self.ranks is None:
            return self._by_group(group, seq)
        ranks, span, low = self.ranks, self.span, self.low
        # Where a chunk's seqs are the clock's between its first and last (a key logged at every
        # event: the common case), its points' places in the clock follow from its first's alone.
        starts = np.cumsum(counts) - counts
        first = np.searchsorted(ranks, chunk_group * span + (seq[starts] - low))
        at = np.arange(len(seq)) + np.repeat(first - starts, counts)
        np.minimum(at, len(ranks) - 1, out=at)
        found = (self.seq[at] == seq) & (self.group[at] == group)
        if not found.all():  # the others looked up one by one
            lost = np.flatnonzero(~found)
            wanted = group[lost] * span + (seq[lost] - low)
            at[lost] = np.minimum(np.searchsorted(ranks, wanted), len(ranks) - 1)
            found[lost] = ranks[at[lost]] == wanted
        ts: Floats = self.ts[at]
        ts[~found] = np.nan
        return ts

    def _by_group(self, group: Ints, seq: Ints) -> Floats:
        ts = np.full(len(seq), np.nan)
        for g in np.unique(group).tolist():
            mine, clock = group == g, self.group == g
            order = np.argsort(self.seq[clock], kind="stable")
            seqs, times = self.seq[clock][order], self.ts[clock][order]
            if not len(seqs):
                continue
            at = np.minimum(np.searchsorted(seqs, seq[mine]), len(seqs) - 1)
            hit = seqs[at] == seq[mine]
            ts[np.flatnonzero(mine)[hit]] = times[at[hit]]
        return ts


def _from_head(head: list[HeadRow], label_code: dict[str, int], key_code: dict[str, int]) -> Values:
    if not head:
        return empty()
    label, key, epoch, seq, step, ts, value = zip(*head, strict=True)
    count = len(head)
    return Values(
        [],
        [],
        np.fromiter((label_code[n] for n in label), np.int32, count),
        np.fromiter((key_code[n] for n in key), np.int32, count),
        np.array(epoch, np.int64),
        np.array(seq, np.int64),
        np.fromiter((0 if s is None else s for s in step), np.int64, count),
        np.fromiter((s is None for s in step), np.bool_, count),
        np.array(ts, np.float64),
        np.fromiter(map(head_value, value), np.float64, count),
    )


def _in_order(v: Values) -> bool:
    """Whether (label, key, epoch, seq) rises from each point to the next."""
    if len(v) < 2:
        return True
    later = np.zeros(len(v) - 1, np.bool_)
    same = np.ones(len(v) - 1, np.bool_)
    for column in (v.label, v.key, v.epoch, v.seq):
        later |= same & (column[1:] > column[:-1])
        same &= column[1:] == column[:-1]
    return bool(later.all())


def _order(v: Values) -> Ints:
    return np.lexsort((v.seq, v.epoch, v.key, v.label))


def by_step(v: Values) -> Values:
    """The points by label, key, step (none first), epoch, seq: the order of Store.metrics."""
    return v.take(np.lexsort((v.seq, v.epoch, v.step, ~v.no_step, v.key, v.label)))


def by_time(v: Values) -> Values:
    """The points by label, key, ts, epoch, seq: the order of Store.system."""
    return v.take(np.lexsort((v.seq, v.epoch, v.ts, v.key, v.label)))


def after(v: Values, key: str, epoch: int, seq: int) -> Values:
    """The points past (key, epoch, seq), of a single label's points in (key, epoch, seq) order."""
    code = bisect_left(v.keys, key)
    return v.take(~_up_to(v, code, epoch, seq, v.keys[code : code + 1] == [key], inclusive=True))


def page(
    chunks: Iterable[tuple[ChunkPart, int]],
    clocks: Sequence[ClockPart],
    head: Sequence[HeadRow],
    limit: int,
    past: tuple[str, int, int] | None = None,
) -> Values:
    """The first `limit` points past `past` (key, epoch, seq) of a single label, from its
    chunks in (key, epoch, first seq) order with their point counts, and its head rows: chunks
    are taken in that order only until enough points are held, the rest is never decoded.

    The chunks not taken hold no point before the first of them's (key, epoch, first seq), so
    the points before it are complete even where a late compaction made chunks overlap."""
    pager = Pager(clocks, head, limit, past)
    for part, points in chunks:
        found = pager.add(part, points)
        if found is not None:
            return found
    return pager.end()


class Pager:
    """`page` a chunk at a time, for a backend whose chunks come from an asynchronous cursor:
    `add` each chunk in (key, epoch, first seq) order until it gives the page, else `end`."""

    def __init__(
        self,
        clocks: Sequence[ClockPart],
        head: Sequence[HeadRow],
        limit: int,
        past: tuple[str, int, int] | None = None,
    ) -> None:
        self.clocks, self.head, self.limit, self.past = clocks, head, limit, past
        self.taken: list[ChunkPart] = []
        self.count = 0

    def add(self, part: ChunkPart, points: int) -> Values | None:
        """Take the next chunk (`points` its point count): the page, where the chunks taken
        before it already hold it (no chunk after is needed then), else None."""
        if self.count >= self.limit:
            before = _before(self._held(), part[1], part[2], part[3])
            if len(before) >= self.limit:
                return before.take(slice(0, self.limit))
        self.taken.append(part)
        self.count += points
        return None

    def end(self) -> Values:
        """The page, once no chunk is left to add."""
        return self._held().take(slice(0, self.limit))

    def _held(self) -> Values:
        found = assemble(self.taken, self.clocks, self.head)
        return found if self.past is None else after(found, *self.past)


def _before(v: Values, key: str, epoch: int, seq: int) -> Values:
    """The points before (key, epoch, seq), of points in (key, epoch, seq) order."""
    code = bisect_left(v.keys, key)
    return v.take(_up_to(v, code, epoch, seq, v.keys[code : code + 1] == [key], inclusive=False))


def _up_to(v: Values, code: int, epoch: int, seq: int, known: bool, inclusive: bool) -> Mask:
    """Which points come before (key, epoch, seq), or at it with `inclusive`: `code` is the
    key's place in v.keys (sorted), where it is if `known`, else where it would go."""
    if not known:
        return v.key < code
    at = (v.epoch < epoch) | ((v.epoch == epoch) & ((v.seq <= seq) if inclusive else (v.seq < seq)))
    before: Mask = (v.key < code) | ((v.key == code) & at)
    return before


STEP_MIN, STEP_MAX = -(2**63), 2**63 - 1


def step_range(steps: Any, table: str = "metrics") -> tuple[int, int] | None:
    """`steps` checked: None (every value), or (first, last) steps, both included, either None
    for no bound; a ValueError says what is wrong. System samples have no steps."""
    if steps is None:
        return None
    if table != "metrics":
        raise ValueError("system samples have no steps: choose them by labels and keys")
    if not isinstance(steps, tuple | list) or len(steps) != 2:
        raise ValueError(f"steps must be (first, last), either None for no bound, not {steps!r}")
    first = STEP_MIN if steps[0] is None else steps[0]
    last = STEP_MAX if steps[1] is None else steps[1]
    for bound in (first, last):
        if isinstance(bound, bool) or not isinstance(bound, int) or not STEP_MIN <= bound <= STEP_MAX:
            raise ValueError(f"steps must be whole numbers (64-bit) or None, not {steps!r}")
    if first > last:
        raise ValueError(f"steps {steps!r}: the first is past the last")
    return first, last


def in_steps(found: Values, steps: tuple[int, int] | None) -> Values:
    """The points of `found` at steps first to last (none without a step), or all if None."""
    if steps is None:
        return found
    return found.take(~found.no_step & (found.step >= steps[0]) & (found.step <= steps[1]))
