"""Label rollups as the tables keep them: each label series' open 128-step bucket as a row, every
other bucket packed with its neighbours into compressed blocks. Pure functions both backends share.

A label's rollup rows (storage/rollups.py) are many and small: one per 128 steps per key, and a
quarter as many again at each wider width. As rows they weighed nearly as much as the values
themselves (PostgreSQL: ~240 bytes a row with its index entry, 3.8 bytes a point on issue #22's
bench). So they are kept as:

- `label_open`: one row per (key, axis, label, epoch), its highest 128-step bucket. That bucket
  grows with every batch of a live run, so it stays a plain row, cheap to rewrite;
- `label_blocks`: every other bucket, at every width, BLOCK (16) consecutive buckets to a row.
  A bucket goes in once it is closed (a higher one got a value) and changes after that only for a
  late value; a wider bucket changes only when a 128-step bucket closes under it. So a block is
  rewritten about once per 128 steps of its label, not per batch.

A block's data is its buckets' partials as 13 columns of 64-bit words (integers as they are,
floats by their bits), each column as differences from the bucket before (wrapping), the words'
bytes shuffled (every first byte, then every second, ...) and zlib-compressed: steps, seqs and
counts that move by the same amount each bucket become runs of zeros, and so do constants.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping
from itertools import groupby
from typing import Any

import numpy as np

from runbus.storage import rollups
from runbus.storage.rollups import FINE_WIDTH, HI, LAST, LO, LabelRowKey, Partial

BLOCK_SHIFT = 4
BLOCK = 1 << BLOCK_SHIFT  # buckets per block
FORMAT = 1

# (key id, width, axis, label id, epoch, block)
BlockKey = tuple[int, int, int, int, int, int]
# A block's buckets as read: bucket (absolute) -> partial.
Buckets = dict[int, Partial]

_FIELDS = 13
_FLOATS = (rollups.TOTAL, LO, HI, LAST, rollups.TS_LO, rollups.TS_HI)
_NULLABLE = (LO, HI, LAST)  # None where a bucket has no such value (lo/hi: no value but NaN)
_HEADER = struct.Struct("<BHHHH")  # format, buckets present, then a None mask per nullable field

OPEN_COLUMNS = f"key_id, axis, label_id, epoch, bucket, {rollups.LABEL_VALUE_COLUMNS}"
BLOCK_COLUMNS = "key_id, width, axis, label_id, epoch, block, data"


def block_of(key: LabelRowKey) -> BlockKey:
    """The block a label_rollups bucket belongs to."""
    kid, width, axis, label_id, epoch, bucket = key
    return kid, width, axis, label_id, epoch, bucket >> BLOCK_SHIFT


def encode(buckets: Mapping[int, Partial]) -> bytes:
    """A block's data from its buckets (at least one; any bucket numbers of one block)."""
    order = sorted(buckets)
    present = 0
    for bucket in order:
        present |= 1 << (bucket & (BLOCK - 1))
    nones = [0] * len(_NULLABLE)
    words = np.empty((_FIELDS, len(order)), dtype=np.int64)
    floats = words.view(np.float64)
    for column in range(_FIELDS):
        values = [buckets[b][column] for b in order]
        if column in _NULLABLE:
            place = _NULLABLE.index(column)
            for i, value in enumerate(values):
                if value is None:
                    nones[place] |= 1 << i
            values = [0.0 if v is None else v for v in values]
        if column in _FLOATS:
            floats[column] = values
        else:
            words[column] = values
    deltas = np.diff(words, axis=1, prepend=np.zeros((_FIELDS, 1), dtype=np.int64))
    shuffled = deltas.view(np.uint8).reshape(-1, 8).T.tobytes()
    return _HEADER.pack(FORMAT, present, *nones) + zlib.compress(shuffled)


def decode(block: int, data: bytes) -> Buckets:
    """The buckets of block number `block` from its data."""
    form, present, *nones = _HEADER.unpack_from(data)
    if form != FORMAT:
        raise ValueError(f"a rollup block of format {form}: this runbus reads format {FORMAT}")
    places = [i for i in range(BLOCK) if present >> i & 1]
    count = len(places)
    raw = np.frombuffer(zlib.decompress(data[_HEADER.size :]), dtype=np.uint8)
    words = np.cumsum(raw.reshape(8, -1).T.copy().view(np.int64).reshape(_FIELDS, count), axis=1)
    floats = words.view(np.float64)
    columns: list[list[Any]] = [(floats[c] if c in _FLOATS else words[c]).tolist() for c in range(_FIELDS)]
    for place, column in enumerate(_NULLABLE):
        mask = nones[place]
        if mask:
            columns[column] = [None if mask >> i & 1 else v for i, v in enumerate(columns[column])]
    first = block << BLOCK_SHIFT
    return {first + at: list(part) for at, part in zip(places, zip(*columns, strict=True), strict=True)}


def rows_of(key: BlockKey, data: bytes) -> Iterator[tuple[LabelRowKey, Partial]]:
    """The label_rollups rows (key, partial) a stored block holds."""
    kid, width, axis, label_id, epoch, block = key
    for bucket, part in decode(block, data).items():
        yield (kid, width, axis, label_id, epoch, bucket), part


def placed(
    plan: rollups.Plan, stored: Mapping[LabelRowKey, Partial], held: Mapping[BlockKey, Buckets]
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Where a batch's rollup rows go: the label_open rows (OPEN_COLUMNS) of the series whose open
    bucket changed, and the label_blocks rows (BLOCK_COLUMNS) of the blocks that changed, each
    whole: `held`'s stored buckets with the batch's merged in. `stored` is what plan() was
    given; `held` must hold every stored block of the fine rows plan() names (from each series'
    lowest bucket in the batch, or its highest stored if lower) and of its wide deltas."""
    open_rows: list[tuple[Any, ...]] = []
    into: dict[BlockKey, Buckets] = {}
    for key, part in plan.fine_rows.items():
        kid, _, axis, label_id, epoch, bucket = key
        if plan.tops[kid, axis, label_id, epoch] == bucket:
            open_rows.append((kid, axis, label_id, epoch, bucket, *part))
        else:
            _put(into, held, key, part)
    for key, part in _closed_opens(plan, stored, held):
        _put(into, held, key, part)
    for key, delta in plan.wide_deltas.items():
        known = held.get(block_of(key), {}).get(key[5])
        _put(into, held, key, delta if known is None else rollups.merge(known.copy(), delta))
    blocks = [(*block, encode(buckets)) for block, buckets in into.items()]
    return open_rows, blocks


def _closed_opens(
    plan: rollups.Plan, stored: Mapping[LabelRowKey, Partial], held: Mapping[BlockKey, Buckets]
) -> Iterator[tuple[LabelRowKey, Partial]]:
    """The stored open rows a batch closed without a value of their own: into their blocks."""
    for key, part in stored.items():
        kid, width, axis, label_id, epoch, bucket = key
        top = plan.tops.get((kid, axis, label_id, epoch))
        closed = width == FINE_WIDTH and top is not None and bucket < top
        if closed and key not in plan.fine_rows and bucket not in held.get(block_of(key), {}):
            yield key, part


def _put(
    into: dict[BlockKey, Buckets], held: Mapping[BlockKey, Buckets], key: LabelRowKey, part: Partial
) -> None:
    block = block_of(key)
    buckets = into.get(block)
    if buckets is None:
        buckets = into[block] = dict(held.get(block, {}))
    buckets[key[5]] = part


def open_part(row: Iterable[Any]) -> Partial:
    """A partial from label_open's or a block's value columns; NaN where a store holds NULL."""
    part = list(row)
    for place in (rollups.TOTAL, LAST):
        if part[place] is None:
            part[place] = math.nan
    return part


def converted(rows: Iterable[Any]) -> Iterator[tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]]:
    """Rows of the label_rollups table of schema 9 (its key columns, then its value columns; in
    its primary key's order) as label_open and label_blocks rows, a series (key, width, axis,
    label, epoch) at a time: how a store migrates to blocks in bounded memory."""
    for series, group in groupby(rows, key=lambda row: tuple(row[:5])):
        parts = {row[5]: open_part(row[6:]) for row in group}
        kid, width, axis, label_id, epoch = series
        open_rows = []
        if width == FINE_WIDTH:
            top = max(parts)
            open_rows.append((kid, axis, label_id, epoch, top, *parts.pop(top)))
        blocks: dict[int, Buckets] = {}
        for bucket, part in parts.items():
            blocks.setdefault(bucket >> BLOCK_SHIFT, {})[bucket] = part
        yield open_rows, [(*series, block, encode(buckets)) for block, buckets in blocks.items()]
