"""Label rollups as the tables keep them: each running label series' open 128-step bucket as a row,
every other bucket packed with its neighbours into compressed blocks. Pure functions both backends
share.

A label's rollup rows (storage/rollups.py) are many and small: one per 128 steps per key, and a
third as many again at the wider widths. As rows they weighed nearly as much as the values
themselves (PostgreSQL: ~240 bytes a row with its index entry, 3.8 bytes a point on issue #22's
bench). So they are kept as:

- `label_open`: one row per series (key, axis, label, epoch) of a running label, its highest
  128-step bucket. That bucket grows with every batch of a live run, so it stays a plain row,
  cheap to rewrite (a block would be encoded again each batch);
- `label_blocks`: every other bucket, in blocks. A *fine* block holds 16 consecutive 128-step
  buckets; a *wide* block holds every wider bucket (512 ... 131072) within one 131072-step
  bucket: 256 + 64 + 16 + 4 + 1 places. A 128-step bucket goes into its block once it is closed (a
  higher one got a value) and changes after that only for a late value; the wider buckets change
  only as 128-step buckets close under them. So a block is rewritten about once per batch of its
  series (a live run: once per 128 steps).

Once a label has ended its series' open buckets are final: the batch that ends it puts them into
their fine blocks and deletes their label_open rows (migration 11 did so for the labels ended
before it). Their row, its index entry and the room label_open keeps for updates weighed more
than the bucket does in its block (PostgreSQL, issue #22's run of constants and counters: 0.19 of
its 1.68 bytes a point). A series without a label_open row whose label runs again (a late value,
a label that came back) keeps its open bucket in its block. A series of an ended label with a few
thousand steps is two rows.

A block's data is its buckets' partials as 13 columns of 64-bit words (integers as they are,
floats by their bits): each column as its first bucket's word, then differences from the bucket
before (wrapping), or differences of those differences where they are smaller (the counts, seqs,
steps, timestamps and counters of a label logging at a steady pace), zigzagged (a small negative
number as a small number); the differences' bytes shuffled into planes (a column's first bytes,
its second bytes, ...) and the planes of zeros left out, behind maps of the places present, of the
None values, of the columns differenced twice and of the planes kept; deflated.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from itertools import groupby
from typing import Any, NamedTuple

import numpy as np

from runbus.storage import rollups
from runbus.storage.rollups import (
    FINE_SHIFT,
    FINE_WIDTH,
    HI,
    LAST,
    LO,
    SHIFTS,
    LabelRowKey,
    Partial,
    SeriesKey,
)

FORMAT = 1
FINE, WIDE = 0, 1
FINE_PLACES = 16  # 128-step buckets per fine block
FINE_BITS = FINE_PLACES.bit_length() - 1
_WIDE_SHIFT = SHIFTS[-1]  # a wide block spans one bucket of the widest width
# Where each wider width's buckets start in a wide block, and how many it holds.
_WIDE_START: dict[int, int] = {}
_start = 0
for _shift in reversed(SHIFTS[1:]):  # widest first: a coarse read decodes only a block's first places
    _WIDE_START[_shift] = _start
    _start += 1 << (_WIDE_SHIFT - _shift)
WIDE_PLACES = _start
_WIDE_ORDER = sorted((start, shift) for shift, start in _WIDE_START.items())

# (key id, kind: FINE or WIDE, axis, label id, epoch, block)
BlockKey = tuple[int, int, int, int, int, int]
# A block's buckets by place.
Places = dict[int, Partial]

_FIELDS = 13
_FLOATS = [rollups.TOTAL, LO, HI, LAST, rollups.TS_LO, rollups.TS_HI]
_INTS = [c for c in range(_FIELDS) if c not in _FLOATS]
_NULLABLE = (LO, HI, LAST)  # None where a bucket has no such value (lo/hi: no value but NaN)

# The order converted() reads label_rollups rows in: a label series' rows together.
CONVERTED_ORDER = "key_id, axis, label_id, epoch, width, bucket"
OPEN_COLUMNS = f"key_id, axis, label_id, epoch, bucket, {rollups.LABEL_VALUE_COLUMNS}"
BLOCK_COLUMNS = "key_id, kind, axis, label_id, epoch, block, data"
# The rows `folded` takes: label_open rows, each with the data of the fine block its bucket
# falls in (NULL where there is none yet), of the labels a backend's condition on o.label_id
# names (appended to this).
FOLDED_ROWS = (
    f"SELECT o.{OPEN_COLUMNS.replace(', ', ', o.')}, b.data FROM label_open o "
    f"LEFT JOIN label_blocks b ON b.key_id = o.key_id AND b.kind = {FINE} "
    "AND b.axis = o.axis AND b.label_id = o.label_id AND b.epoch = o.epoch "
    f"AND b.block = o.bucket >> {FINE_BITS} WHERE o.label_id"
)


def place_of(key: LabelRowKey) -> tuple[BlockKey, int]:
    """The block a label_rollups bucket is kept in, and its place there."""
    kid, width, axis, label_id, epoch, bucket = key
    shift = width.bit_length() - 1
    if shift == FINE_SHIFT:
        return (kid, FINE, axis, label_id, epoch, bucket >> FINE_BITS), bucket & (FINE_PLACES - 1)
    within = _WIDE_SHIFT - shift
    place = _WIDE_START[shift] + (bucket & ((1 << within) - 1))
    return (kid, WIDE, axis, label_id, epoch, bucket >> within), place


def block_range(width: int, lo: int, hi: int) -> tuple[int, int, int]:
    """The kind and the first and last block that hold `width`'s buckets lo..hi."""
    shift = width.bit_length() - 1
    if shift == FINE_SHIFT:
        return FINE, lo >> FINE_BITS, hi >> FINE_BITS
    within = _WIDE_SHIFT - shift
    return WIDE, lo >> within, hi >> within


def buckets(kind: int, block: int, places: Mapping[int, Partial]) -> Iterator[tuple[int, int, Partial]]:
    """(width, bucket, partial) of a block's places."""
    if kind == FINE:
        for place, part in places.items():
            yield FINE_WIDTH, (block << FINE_BITS) + place, part
        return
    for place, part in places.items():
        start, shift = _WIDE_ORDER[_wide_width(place)]
        yield 1 << shift, (block << (_WIDE_SHIFT - shift)) + place - start, part


def _wide_width(place: int) -> int:
    """The index in _WIDE_ORDER of the width a wide block's place belongs to."""
    found = 0
    for index, (start, _) in enumerate(_WIDE_ORDER):
        if place >= start:
            found = index
    return found


def encode(places: Mapping[int, Partial]) -> bytes:
    """A block's data from its buckets by place (at least one)."""
    order = sorted(places)
    rows = [places[p] for p in order]
    present = np.zeros(order[-1] + 1, dtype=bool)
    present[order] = True
    nones = np.array([[row[c] is None for row in rows] for c in _NULLABLE], dtype=bool)
    words = np.empty((_FIELDS, len(order)), dtype=np.int64)
    words[_INTS] = np.array([[row[c] for c in _INTS] for row in rows], dtype=np.int64).T
    # None (a bucket with no lo, hi or last) becomes NaN here: its mark in `nones` says which.
    words[_FLOATS] = np.array([[row[c] for c in _FLOATS] for row in rows], dtype=np.float64).T.view(np.int64)
    first = np.diff(words, axis=1)  # from the first bucket's, kept whole
    second = first.copy()
    second[:, 1:] = np.diff(first, axis=1)
    twice = _width(second) < _width(first)  # per column: what moves at a steady pace
    first[twice] = second[twice]
    zigzag = (first << 1) ^ (first >> 63)  # small negative differences as small numbers
    planes = zigzag.view(np.uint8).reshape(_FIELDS, -1, 8).transpose(0, 2, 1).reshape(_PLANES, -1)
    kept = planes.any(axis=1)  # a plane of zeros is left out: most of a steady column's
    maps = [present, *nones, twice, kept]
    shuffled = (
        b"".join(np.packbits(bits).tobytes() for bits in maps)
        + words[:, 0].tobytes()
        + planes[kept].tobytes()
    )
    # A block's kB need no larger window, and zlib's default one costs more to set up than to use.
    squeezer = zlib.compressobj(6, zlib.DEFLATED, -12, 4)
    head = bytes([FORMAT]) + len(present).to_bytes(2, "little")
    return head + squeezer.compress(shuffled) + squeezer.flush()


_TWICE_BYTES = (_FIELDS + 7) // 8
_PLANES = _FIELDS * 8  # a column's first bytes, its second bytes, ...
_PLANE_BYTES = _PLANES // 8
_BYTE_LIMITS = np.array([1 << (8 * n - 1) for n in range(1, 8)], dtype=np.int64)


def _width(differences: np.ndarray) -> np.ndarray:
    """Per column, the bytes its differences take as signed integers: how well it compresses."""
    magnitude = np.where(differences < 0, ~differences, differences)
    counts: np.ndarray = (magnitude[:, :, None] >= _BYTE_LIMITS).sum(axis=(1, 2))
    return counts


class _Parsed(NamedTuple):
    """One block's maps and bytes, as decode_many lays them side by side."""

    order: np.ndarray  # the places present
    nones: np.ndarray  # (3, count) where lo, hi, last are None
    twice: np.ndarray  # the columns differenced twice
    kept: np.ndarray  # the byte planes stored
    head: np.ndarray  # each column's first word
    planes: np.ndarray  # the stored planes' bytes


def _parsed(data: bytes) -> _Parsed:
    if data[0] != FORMAT:
        raise ValueError(f"a rollup block of format {data[0]}: this runbus reads format {FORMAT}")
    size = int.from_bytes(data[1:3], "little")
    raw = np.frombuffer(zlib.decompress(data[3:], -15), dtype=np.uint8)
    present_bytes = (size + 7) // 8
    order = np.flatnonzero(np.unpackbits(raw[:present_bytes], count=size))
    count = len(order)
    none_bits = (count + 7) // 8 * 8
    at = present_bytes + none_bits // 8 * len(_NULLABLE)
    # The None marks, the columns differenced twice and the planes kept: one unpacking.
    bits = np.unpackbits(raw[present_bytes : at + _TWICE_BYTES + _PLANE_BYTES]).view(bool)
    nones = bits[: none_bits * len(_NULLABLE)].reshape(len(_NULLABLE), -1)[:, :count]
    twice = bits[none_bits * len(_NULLABLE) :][:_FIELDS]
    kept = bits[none_bits * len(_NULLABLE) + _TWICE_BYTES * 8 :][:_PLANES]
    at += _TWICE_BYTES + _PLANE_BYTES
    head = raw[at : at + _FIELDS * 8].view(np.int64)
    planes = raw[at + _FIELDS * 8 :]
    return _Parsed(order, nones, twice, kept, head, planes)


def decode_many(datas: Sequence[bytes], wanted: tuple[int, int] | None = None) -> list[Places]:
    """Blocks' buckets by place, from their data; only those at places [first, end) if `wanted`
    (places_of: one width's), so a read of one width never builds the others' partials. The
    blocks side by side in one array, their running sums taken at once: a read of a thousand
    labels' blocks costs little more per block than inflating it."""
    if not datas:
        return []
    parsed = [_parsed(data) for data in datas]
    # Each block's places [first, end) wanted; its places up to `end` are stacked, as each place's
    # words are sums from the block's first.
    bounds = [
        (0, len(p.order)) if wanted is None else tuple(np.searchsorted(p.order, wanted).tolist())
        for p in parsed
    ]
    stacked = [index for index, (_, end) in enumerate(bounds) if end > 0]
    found: list[Places] = [{} for _ in parsed]
    if not stacked:
        return found
    counts = np.array([bounds[index][1] for index in stacked], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    total = int(counts.sum())
    planes = np.zeros((_PLANES, total), dtype=np.uint8)
    twice = np.zeros((_FIELDS, total), dtype=bool)
    nones = np.zeros((len(_NULLABLE), total), dtype=bool)
    heads = np.empty((_FIELDS, len(stacked)), dtype=np.int64)
    for at, (index, start, count) in enumerate(zip(stacked, starts.tolist(), counts.tolist(), strict=True)):
        block = parsed[index]
        # A block's words after its first: planes[:, start] stays zero, its head goes there.
        if count > 1:
            stored = block.planes.reshape(-1, len(block.order) - 1)
            planes[block.kept, start + 1 : start + count] = stored[:, : count - 1]
            twice[block.twice, start + 1 : start + count] = True
        nones[:, start : start + count] = block.nones[:, :count]
        heads[:, at] = block.head
    unsigned = (
        planes.reshape(_FIELDS, 8, total).transpose(0, 2, 1).copy().view(np.uint64).reshape(_FIELDS, total)
    )
    differences = (unsigned >> np.uint64(1)).view(np.int64) ^ -(unsigned & np.uint64(1)).view(np.int64)
    if twice.any():
        summed = np.cumsum(np.where(twice, differences, 0), axis=1)
        within = summed - np.repeat(summed[:, starts], counts, axis=1)
        differences = np.where(twice, within, differences)
    differences[:, starts] = heads
    summed = np.cumsum(differences, axis=1)
    words = summed - np.repeat(summed[:, starts] - heads, counts, axis=1)
    firsts = [bounds[index][0] for index in stacked]
    for index, places in zip(
        stacked, _partials([parsed[i] for i in stacked], starts, firsts, words, nones), strict=True
    ):
        found[index] = places
    return found


def _partials(
    parsed: list[_Parsed], starts: np.ndarray, firsts: list[int], words: np.ndarray, nones: np.ndarray
) -> list[Places]:
    """Each block's partials by place, from its `firsts` stacked place to its last, from the
    blocks' words (13 x places) and None marks: each partial a list made once, its numbers
    Python's (an object array's rows)."""
    counts = np.diff(np.append(starts, words.shape[1])).tolist()
    spans = []
    for block, start, first, count in zip(parsed, starts.tolist(), firsts, counts, strict=True):
        spans.append((block.order[first:count].tolist(), start + first, start + count))
    chosen = np.concatenate([np.arange(a, b) for _, a, b in spans]) if spans else np.zeros(0, np.int64)
    table = np.empty((len(chosen), _FIELDS), dtype=object)
    table[:, _INTS] = words[_INTS][:, chosen].T
    table[:, _FLOATS] = words[_FLOATS][:, chosen].view(np.float64).T
    missing = nones[:, chosen]
    if missing.any():
        for row, column in enumerate(_NULLABLE):
            table[missing[row], column] = None
    rows = table.tolist()
    found: list[Places] = []
    at = 0
    for order, _, _ in spans:
        found.append(dict(zip(order, rows[at : at + len(order)], strict=True)))
        at += len(order)
    return found


def decoded(rows: Iterable[Sequence[Any]]) -> dict[BlockKey, Places]:
    """Stored blocks read as rows of BLOCK_COLUMNS (the key, then the data), decoded together."""
    found = list(rows)
    keys: list[BlockKey] = [tuple(row[:6]) for row in found]
    return dict(zip(keys, decode_many([row[6] for row in found]), strict=True))


def buckets_in(
    blocks: Sequence[tuple[Any, Any, Any, int, bytes]], kind: int, width: int, lo: int, hi: int
) -> Iterator[tuple[Any, Any, Any, int, Partial]]:
    """The `width` buckets lo..hi of blocks read as (label, epoch, generation, block, data), as
    (label, epoch, generation, bucket, partial): the blocks decoded together (decode_many)."""
    decoded = decode_many([row[4] for row in blocks], places_of(width))
    for (label, epoch, generation, block, _), places in zip(blocks, decoded, strict=True):
        for at, bucket, part in buckets(kind, block, places):
            if at == width and lo <= bucket <= hi:
                yield label, epoch, generation, bucket, part


def fine_rows(held: Mapping[BlockKey, Places]) -> dict[LabelRowKey, Partial]:
    """The 128-step label_rollups rows (key, partial) of the fine blocks of `held`: what
    rollups.plan() is given as stored."""
    found: dict[LabelRowKey, Partial] = {}
    for block, places in held.items():
        if block[1] == FINE:
            found.update(stored_rows(block, places))
    return found


def places_of(width: int) -> tuple[int, int]:
    """The places [first, end) of `width`'s buckets in its blocks."""
    shift = width.bit_length() - 1
    if shift == FINE_SHIFT:
        return 0, FINE_PLACES
    start = _WIDE_START[shift]
    return start, start + (1 << (_WIDE_SHIFT - shift))


class Placed(NamedTuple):
    """Where a batch's rollup rows go (placed)."""

    opens: list[tuple[Any, ...]]  # label_open rows (OPEN_COLUMNS) to write
    blocks: list[tuple[Any, ...]]  # label_blocks rows (BLOCK_COLUMNS) to write
    closed: list[SeriesKey]  # the series whose label_open row is to go: its bucket is in a block


def placed(
    plan: rollups.Plan,
    stored: Mapping[LabelRowKey, Partial],
    opens: Mapping[SeriesKey, int],
    held: Mapping[BlockKey, Places],
    ended: Container[int],
) -> Placed:
    """Where a batch's rollup rows go: the label_open rows of the series whose open bucket
    changed and stays a row (its label runs, and it has such a row or no rows at all), the
    label_blocks rows of the blocks that changed, each whole (`held`'s stored buckets with the
    batch's merged in), and the series whose label_open row goes (its label has `ended`: the
    bucket goes into its block). `stored` is what plan() was given, `opens` the stored open
    bucket of each series that has a label_open row; `held` must hold every stored block of the
    fine rows plan() names (from each series' lowest bucket in the batch, or its open one if
    lower: its label_open row's, else its highest block's) and of its wide deltas."""
    have_rows = {(kid, axis, label_id, epoch) for kid, _, axis, label_id, epoch, _ in stored}
    rowed = {
        series
        for series in plan.tops
        if series[2] not in ended and (series in opens or series not in have_rows)
    }
    open_rows: list[tuple[Any, ...]] = []
    into: dict[BlockKey, Places] = {}
    for key, part in plan.fine_rows.items():
        kid, _, axis, label_id, epoch, bucket = key
        series = (kid, axis, label_id, epoch)
        if series in rowed and plan.tops[series] == bucket:
            open_rows.append((*series, bucket, *part))
        else:
            _put(into, held, key, part)
    # A stored open row the batch closed (or whose label ended) without a value of its own.
    for series, bucket in opens.items():
        top = plan.tops.get(series)
        key = (series[0], FINE_WIDTH, *series[1:], bucket)
        if top is not None and (bucket < top or series not in rowed) and key not in plan.fine_rows:
            _put(into, held, key, stored[key])
    for key, delta in plan.wide_deltas.items():
        block, place = place_of(key)
        known = held.get(block, {}).get(place)
        _put(into, held, key, delta if known is None else rollups.merge(known.copy(), delta))
    blocks = [(*block, encode(places)) for block, places in into.items()]
    closed = [series for series in opens if series in plan.tops and series not in rowed]
    return Placed(open_rows, blocks, closed)


def _put(
    into: dict[BlockKey, Places], held: Mapping[BlockKey, Places], key: LabelRowKey, part: Partial
) -> None:
    block, place = place_of(key)
    places = into.get(block)
    if places is None:
        places = into[block] = dict(held.get(block, {}))
    places[place] = part


def open_part(row: Iterable[Any]) -> Partial:
    """A partial from a row's value columns (label_rollups', label_open's: schemas 9 and 10);
    NaN where a store holds NULL (SQLite's NaN)."""
    part = list(row)
    for place in (rollups.TOTAL, LAST):
        if part[place] is None:
            part[place] = math.nan
    return part


def opened(
    blocks: Sequence[tuple[Any, Any, Any, int, bytes]],
) -> Iterator[tuple[Any, Any, Any, int, Partial]]:
    """The open bucket of each series without a label_open row, from its highest fine block read
    as (label, epoch, generation, block, data): (label, epoch, generation, bucket, partial) of
    the block's last place."""
    for (label, epoch, generation, block, _), places in zip(
        blocks, decode_many([row[4] for row in blocks], places_of(FINE_WIDTH)), strict=True
    ):
        if places:
            top = max(places)
            yield label, epoch, generation, (block << FINE_BITS) + top, places[top]


def folded(rows: Iterable[Sequence[Any]]) -> Iterator[tuple[Any, ...]]:
    """label_open rows (OPEN_COLUMNS, then the data of the fine block their bucket falls in, or
    None where it has none) as label_blocks rows, each open bucket in its block: how the open
    buckets of a label that has ended go into its blocks. The blocks are decoded together
    (decode_many): the batch that ends a large job's labels folds thousands of series."""
    rows = list(rows)
    stored = iter(decode_many([row[-1] for row in rows if row[-1] is not None]))
    for row in rows:
        kid, axis, label_id, epoch, bucket = row[:5]
        block, place = place_of((kid, FINE_WIDTH, axis, label_id, epoch, bucket))
        places = {} if row[-1] is None else next(stored)
        places[place] = open_part(row[5:-1])
        yield (*block, encode(places))


def stored_rows(block: BlockKey, places: Mapping[int, Partial]) -> Iterator[tuple[LabelRowKey, Partial]]:
    """The label_rollups rows (key, partial) of a block's places."""
    kid, kind, axis, label_id, epoch, number = block
    for width, bucket, part in buckets(kind, number, places):
        yield (kid, width, axis, label_id, epoch, bucket), part


def converted_series(row: Sequence[Any]) -> tuple[Any, ...]:
    """The label series (key, axis, label, epoch) of a schema-9 label_rollups row as converted()
    reads it: the rows of one series come together."""
    return row[0], row[2], row[3], row[4]


def converted(rows: Iterable[Any]) -> Iterator[tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]]:
    """Rows of the label_rollups table of schema 9 (its key columns, then its value columns; in
    CONVERTED_ORDER) as label_open and label_blocks rows, a label series (key, axis, label,
    epoch) at a time: how a store migrates to blocks in bounded memory."""
    for series, group in groupby(rows, key=converted_series):
        parts = {(row[1], row[5]): open_part(row[6:]) for row in group}
        kid, axis, label_id, epoch = series
        open_rows = []
        fine = [bucket for width, bucket in parts if width == FINE_WIDTH]
        if fine:
            top = max(fine)
            open_rows.append((kid, axis, label_id, epoch, top, *parts.pop((FINE_WIDTH, top))))
        blocks: dict[BlockKey, Places] = {}
        for (width, bucket), part in parts.items():
            block, place = place_of((kid, width, axis, label_id, epoch, bucket))
            blocks.setdefault(block, {})[place] = part
        yield open_rows, [(*block, encode(places)) for block, places in blocks.items()]
