"""Rollups of metric values, kept as each batch is stored: pure functions every backend shares.

Two kinds of rows, a row per bucket of steps at every width of WIDTHS (128, 512, ... 131072):

- `label_rollups` rows, per (label, key, epoch): count, NaN and ±inf counts, sum and min/max,
  the last value (by seq), and the step, ts and seq ranges its values span (the tables keep them
  as an open row per series and compressed blocks of 16 buckets: storage/rollup_blocks.py). A
  label's line at any zoom and its summary come from here, as do step times (ts span over step
  span).
- `run_rollups`, per (key, generation) across labels, one row per writer `slot`: the same
  counts, sum, min/max and ranges, and a sketch of the labels' 128-step means (ALPHA below),
  from which the band's p10/p50/p90 are read. Rows of every slot are merged when read; on
  PostgreSQL each transaction holds its slot, so concurrent writers never wait on each other's
  rows (storage/postgres.py), and a run spans about as many slots as writers wrote it at once.

Values enter as they do the dashboard's downsampling: NaN is counted (`nan`) and otherwise left
out; ±inf is counted (`inf`), is a min or max (a spike to infinity stays visible) but stays out
of the sum and mean. A value without a step is bucketed by its ts in whole seconds instead
(`axis` 1; its widths are then seconds).

The sketch's samples are the labels' means over each 128-step bucket (of their finite values),
one sample per (label, epoch, 128-step bucket): p50 at width 128 is the median across labels of
their means over those steps, at wider buckets the median over every label's 128-step means
inside. A label's 128-step bucket may grow over several batches, so its previous mean's sample
is taken out of the sketch when its new one goes in: the sketch is always that of the stored
rows, whatever the order and batching of the events. Exact quantiles do not merge; per-label rows
do, but a band over 1,024 labels would read 1,024 rows per bucket: the sketch keeps it at one
row per bucket and writer.

A generation is a run-wide incarnation (an elastic restart), so that the band of a resumed run
does not mix a step's values from before and after the restart: generation_of below.
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from typing import Any

from runbus.storage.rows import Params, storable_text
from runbus.wire import Event

# Bucket widths as shifts of the step (or second): 128, 512, ... 131072. A factor of 4 between
# widths gives any x range at least a quarter of the buckets a chart asks for (a 100,000-step
# run: 782 buckets of 128); the finest width of 128 keeps a batch's rollup rows to about one
# per 70 values of a label logging every step (with 64: one per 40, and half as much again of
# the ingest's CPU spent on rollups). Narrower views are read as stored (storage/charts.py).
SHIFTS = (7, 9, 11, 13, 15, 17)
WIDTHS = tuple(1 << shift for shift in SHIFTS)
FINE_SHIFT = SHIFTS[0]
FINE_WIDTH = WIDTHS[0]

STEP_AXIS, TS_AXIS = 0, 1

# A partial aggregate is a list (merged in place, cheaper than objects), its fields at these places.
N, NAN, INF, TOTAL, LO, HI, LAST, LAST_SEQ, X_LO, X_HI, TS_LO, TS_HI, FIRST_SEQ = range(13)
# [n, nan, inf, total, lo, hi, last, last_seq, x_lo, x_hi, ts_lo, ts_hi, first_seq]: ints, floats
# and None by place, so its items are Any (a tuple type would cost the in-place merge).
Partial = list[Any]

# The sketch: DDSketch's logarithmic bins (Masson et al., VLDB 2019) with relative accuracy
# ALPHA: a quantile read from it is within ALPHA of a sample's value (or of 0 for the zero bin),
# and sketches merge by adding counts. 0.5% keeps a zoomed band (a 1.9-2.1 loss) within 5% of
# the chart's height. A positive value's bin is BIN_OFFSET + ceil(log_gamma(v)), a negative one's
# the negation of its magnitude's; 0 is bin 0. |ceil(log_gamma(v))| < 75,000 for every double,
# so bins keep their signs and their order is the values' order.
ALPHA = 0.005
GAMMA = (1 + ALPHA) / (1 - ALPHA)
LOG_GAMMA = math.log(GAMMA)
BIN_OFFSET = 1 << 17
_LOG_MIDDLE = math.log(2 / (GAMMA + 1))  # a bin (g^(i-1), g^i] stands for 2 g^i / (g + 1)
_BIG_ENDIAN = sys.byteorder == "big"


def bin_of(value: float) -> int:
    """The sketch bin of a finite value."""
    if value > 0:
        return BIN_OFFSET + math.ceil(math.log(value) / LOG_GAMMA)
    if value < 0:
        return -(BIN_OFFSET + math.ceil(math.log(-value) / LOG_GAMMA))
    return 0


def bin_value(key: int) -> float:
    """The value a bin stands for: within ALPHA of every value in it."""
    if key == 0:
        return 0.0
    try:
        magnitude = math.exp((abs(key) - BIN_OFFSET) * LOG_GAMMA + _LOG_MIDDLE)
    except OverflowError:  # the top bin of the doubles: its values are up to the largest double
        magnitude = sys.float_info.max
    return magnitude if key > 0 else -magnitude


def encode_bins(bins: Mapping[int, int]) -> bytes:
    """A sketch as stored: little-endian int32 pairs (bin, count), by bin; counts that are 0 left out."""
    flat = array("i")
    for key in sorted(bins):
        count = bins[key]
        if count:
            flat.append(key)
            flat.append(count)
    if _BIG_ENDIAN:
        flat.byteswap()
    return flat.tobytes()


def decode_bins(blob: bytes | None) -> dict[int, int]:
    if not blob:
        return {}
    flat = array("i")
    flat.frombytes(bytes(blob))
    if _BIG_ENDIAN:
        flat.byteswap()
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def add_bins(into: dict[int, int], more: Mapping[int, int]) -> dict[int, int]:
    """`into` plus `more`, bin by bin (in place); a count of 0 is dropped."""
    for key, count in more.items():
        total = into.get(key, 0) + count
        if total:
            into[key] = total
        else:
            into.pop(key, None)
    return into


def quantiles(
    bins: Mapping[int, int], qs: Sequence[float], lo: float | None, hi: float | None
) -> list[float | None]:
    """The `qs` quantiles of a sketch (nearest rank), each kept within the exact [lo, hi]."""
    total = sum(bins.values())
    if total <= 0:
        return [None] * len(qs)
    keys = sorted(bins)
    out: list[float | None] = []
    for q in qs:
        rank = min(total - 1, max(0, math.ceil(q * total) - 1))
        seen = 0
        value = bin_value(keys[-1])
        for key in keys:
            seen += bins[key]
            if seen > rank:
                value = bin_value(key)
                break
        if lo is not None and value < lo:
            value = lo
        if hi is not None and value > hi:
            value = hi
        out.append(value)
    return out


# -- partial aggregates --------------------------------------------------------------------------


def _chunk(values: Sequence[Any], xs: Sequence[int], seqs: Sequence[int], ts: Sequence[float]) -> Partial:
    """The partial aggregate of one bucket's values (at least one), given in seq order."""
    total = sum(values)
    if total - total == 0:  # every value finite (a NaN or an inf makes the sum NaN or inf)
        lo, hi, nan, inf = min(values), max(values), 0, 0
    else:
        real = [v for v in values if v == v]
        finite = [v for v in real if v - v == 0]
        nan, inf = len(values) - len(real), len(real) - len(finite)
        # Finite values whose sum leaves the float range make it ±inf, and a later one NaN: a
        # mean that is then unknown (finite_mean).
        total = sum(finite)
        lo = min(real) if real else None
        hi = max(real) if real else None
    return [
        len(values),
        nan,
        inf,
        total,
        lo,
        hi,
        values[-1],
        seqs[-1],
        xs[0],
        xs[-1],
        min(ts),
        max(ts),
        seqs[0],
    ]


def fold(
    xs: Sequence[int],
    seqs: Sequence[int],
    ts: Sequence[float],
    values: Sequence[Any],
    shift: int = FINE_SHIFT,
) -> Iterator[tuple[int, Partial]]:
    """(bucket, partial) of one label's values of one key and epoch, given in seq order with their
    x (step, or second) and ts, in buckets of 1 << `shift`."""
    count = len(xs)
    if count == 0:
        return
    if xs[0] <= xs[-1] and xs == sorted(xs):  # x rising with seq (the common case): slice it
        for bucket, a, b in _spans(xs, shift):
            yield bucket, _chunk(values[a:b], xs[a:b], seqs[a:b], ts[a:b])
        return
    places: dict[int, list[int]] = {}
    for place, x in enumerate(xs):
        places.setdefault(x >> shift, []).append(place)
    for bucket in sorted(places):
        mine = places[bucket]
        part = _chunk(
            [values[i] for i in mine], [xs[i] for i in mine], [seqs[i] for i in mine], [ts[i] for i in mine]
        )
        part[X_LO] = min(xs[i] for i in mine)
        part[X_HI] = max(xs[i] for i in mine)
        yield bucket, part


def merge(into: Partial, more: Partial) -> Partial:
    """`more` added to `into` (in place): both of the same label, key, epoch, axis and bucket."""
    into[N] += more[N]
    into[NAN] += more[NAN]
    into[INF] += more[INF]
    into[TOTAL] += more[TOTAL]
    if more[LO] is not None and (into[LO] is None or more[LO] < into[LO]):
        into[LO] = more[LO]
    if more[HI] is not None and (into[HI] is None or more[HI] > into[HI]):
        into[HI] = more[HI]
    if more[LAST_SEQ] > into[LAST_SEQ]:
        into[LAST] = more[LAST]
        into[LAST_SEQ] = more[LAST_SEQ]
    if more[X_LO] < into[X_LO]:
        into[X_LO] = more[X_LO]
    if more[X_HI] > into[X_HI]:
        into[X_HI] = more[X_HI]
    if more[TS_LO] < into[TS_LO]:
        into[TS_LO] = more[TS_LO]
    if more[TS_HI] > into[TS_HI]:
        into[TS_HI] = more[TS_HI]
    if more[FIRST_SEQ] < into[FIRST_SEQ]:
        into[FIRST_SEQ] = more[FIRST_SEQ]
    return into


def finite_mean(part: Partial) -> float | None:
    """The mean of a partial's finite values (None if it has none): its sketch sample."""
    finite = part[N] - part[NAN] - part[INF]
    if finite <= 0:
        return None
    mean = part[TOTAL] / finite
    return mean if mean - mean == 0 else None


# -- one batch -----------------------------------------------------------------------------------

# (label id, key, epoch, axis, 128-step bucket)
FineKey = tuple[int, str, int, int, int]
_STEP, _SEQ, _TS, _DATA, _EPOCH = (
    attrgetter("step"),
    attrgetter("seq"),
    attrgetter("ts"),
    attrgetter("data"),
    attrgetter("epoch"),
)


# A key's values in one label epoch, as columns: (label id, stored key, epoch, seqs, steps
# (None where not given), ts, values). Columns of the same events share their seqs, steps and ts.
KeyColumns = tuple[int, str, int, list[int], list[int | None], list[float], list[Any]]


def fold_metrics(
    fresh: Iterable[tuple[int, Sequence[Event]]],
) -> tuple[list[KeyColumns], dict[FineKey, Partial]]:
    """The values of a batch's new metric events a key at a time (KeyColumns: what the store
    keeps as head rows or chunks), and their fine partials, given (label id, its new events in
    (epoch, seq) order) pairs.

    Both come from one pass over each label's values a key at a time, never a Python object per
    value: that pays for most of the partials.
    """
    rows: list[KeyColumns] = []
    out: dict[FineKey, Partial] = {}
    for label_id, events in fresh:
        metrics = [e for e in events if e.kind == "metric"]
        start = 0
        while start < len(metrics):  # one epoch at a time
            epoch = metrics[start].epoch
            end = len(metrics)
            if metrics[-1].epoch != epoch:
                end = start + 1
                while metrics[end].epoch == epoch:
                    end += 1
            _fold_epoch(rows, out, label_id, epoch, metrics[start:end])
            start = end
    return rows, out


def _fold_epoch(
    rows: list[KeyColumns], out: dict[FineKey, Partial], label_id: int, epoch: int, events: Sequence[Event]
) -> None:
    steps = list(map(_STEP, events))
    if None not in steps:
        _fold_axis(rows, out, label_id, epoch, STEP_AXIS, events, steps, steps)
        return
    with_step = list(compress(events, [s is not None for s in steps]))
    if with_step:
        stepped = list(map(_STEP, with_step))
        _fold_axis(rows, out, label_id, epoch, STEP_AXIS, with_step, stepped, stepped)
    without = [e for e in events if e.step is None]
    _fold_axis(rows, out, label_id, epoch, TS_AXIS, without, [int(e.ts) for e in without], None)


def _fold_axis(
    rows: list[KeyColumns],
    out: dict[FineKey, Partial],
    label_id: int,
    epoch: int,
    axis: int,
    events: Sequence[Event],
    xs: list[int],
    steps: list[int] | None,
) -> None:
    """Rows and partials of one label's events of one epoch, all with a step (`steps`) or none."""
    datas = list(map(_DATA, events))
    seqs = list(map(_SEQ, events))
    ts = list(map(_TS, events))
    keys = list(datas[0])
    values_of = _same_keys(datas, keys)
    if values_of is None:
        _fold_by_key(rows, out, label_id, epoch, axis, datas, xs, seqs, ts, steps)
        return
    step_column: list[int | None] = [None] * len(seqs) if steps is None else list(steps)
    rising = xs[0] <= xs[-1] and xs == sorted(xs)
    spans = list(_spans(xs)) if rising else []
    if ts == sorted(ts):
        ranges = [(ts[a], ts[b - 1]) for _, a, b in spans]
    else:
        ranges = [(min(ts[a:b]), max(ts[a:b])) for _, a, b in spans]
    for key, values in zip(keys, values_of, strict=True):
        stored_key = key if "\x00" not in key else storable_text(key)
        rows.append((label_id, stored_key, epoch, seqs, step_column, ts, values))
        if not rising:
            for bucket, part in fold(xs, seqs, ts, values):
                _add(out, (label_id, stored_key, epoch, axis, bucket), part)
            continue
        _fold_rising(out, (label_id, stored_key, epoch, axis), values, spans, ranges, xs, seqs, ts)


def _same_keys(datas: list[dict[str, Any]], keys: list[str]) -> list[list[Any]] | None:
    """The common case: every event logs the same keys (each has all of the first's, and no
    more): each key's values, in `keys`' order; else None."""
    if sum(map(len, datas)) != len(keys) * len(datas):
        return None
    try:
        return [list(map(itemgetter(key), datas)) for key in keys]
    except KeyError:
        return None


def _fold_rising(
    out: dict[FineKey, Partial],
    at: tuple[int, str, int, int],
    values: list[Any],
    spans: list[tuple[int, int, int]],
    ranges: list[tuple[float, float]],
    xs: list[int],
    seqs: list[int],
    ts: list[float],
) -> None:
    """The partials of one key's values at rising `xs`, a bucket per span (`at`: the fine key
    without its bucket)."""
    label_id, stored_key, epoch, axis = at
    for (bucket, a, b), (ts_lo, ts_hi) in zip(spans, ranges, strict=True):
        chunk = values[a:b]
        total = sum(chunk)
        if total - total == 0:  # all finite: _chunk's fast case, inline
            part = [
                b - a,
                0,
                0,
                total,
                min(chunk),
                max(chunk),
                chunk[-1],
                seqs[b - 1],
                xs[a],
                xs[b - 1],
                ts_lo,
                ts_hi,
                seqs[a],
            ]
        else:
            part = _chunk(chunk, xs[a:b], seqs[a:b], ts[a:b])
        _add(out, (label_id, stored_key, epoch, axis, bucket), part)


def _fold_by_key(
    rows: list[KeyColumns],
    out: dict[FineKey, Partial],
    label_id: int,
    epoch: int,
    axis: int,
    datas: list[dict[str, Any]],
    xs: list[int],
    seqs: list[int],
    ts: list[float],
    steps: list[int] | None,
) -> None:
    """Rows and partials of events that log different keys: each key's columns gathered first."""
    columns: dict[str, tuple[list[int], list[int], list[float], list[Any], list[int | None]]] = {}
    for x, seq, when, data, step in zip(xs, seqs, ts, datas, steps or repeat(None), strict=False):
        for key, value in data.items():
            column = columns.get(key)
            if column is None:
                column = columns[key] = ([], [], [], [], [])
            column[0].append(x)
            column[1].append(seq)
            column[2].append(when)
            column[3].append(value)
            column[4].append(step)
    for key, (kxs, kseqs, kts, values, ksteps) in columns.items():
        stored_key = key if "\x00" not in key else storable_text(key)
        rows.append((label_id, stored_key, epoch, kseqs, ksteps, kts, values))
        for bucket, part in fold(kxs, kseqs, kts, values):
            _add(out, (label_id, stored_key, epoch, axis, bucket), part)


def _spans(xs: Sequence[int], shift: int = FINE_SHIFT) -> Iterator[tuple[int, int, int]]:
    """(bucket, start, end) of rising `xs`: the places [start, end) of each bucket's values."""
    start, count = 0, len(xs)
    while start < count:
        bucket = xs[start] >> shift
        end = bisect_left(xs, (bucket + 1) << shift, start)
        yield bucket, start, end
        start = end


def _add(out: dict[FineKey, Partial], key: FineKey, part: Partial) -> None:
    held = out.get(key)
    if held is None:
        out[key] = part
    else:
        merge(held, part)


# -- what a batch changes ------------------------------------------------------------------------
#
# A label's 128-step bucket is open while it is the label's highest (for a key, epoch and axis):
# its values are in its own label_rollups row and in the run_rollups counts at once, but not yet
# in the label's wider rows nor in the sketch. It closes when a higher bucket gets a value; its
# whole partial then goes into the wider rows and its mean into the sketch, once. So a batch
# writes one row per label and key, not one per width, however few values it brings of each
# label (a 1,024-label run read live brings a few of each); a value arriving for a bucket already
# closed goes into them at once (its mean's sample replaced). Readers add the open buckets
# (one per label, key and epoch: open_rows) to the wider rows and the sketch they read.

# label_rollups' key: (key id, width, axis, label id, epoch, bucket)
LabelRowKey = tuple[int, int, int, int, int, int]
# run_rollups' key, less the writer's slot: (key id, width, axis, generation, bucket)
RunRowKey = tuple[int, int, int, int, int]
# A label's series in the rollups: (key id, axis, label id, epoch)
SeriesKey = tuple[int, int, int, int]


@dataclass
class RunDelta:
    """What a batch adds to one run_rollups bucket: a partial (its `last` unused; None where
    only the sketch changes) and the sketch's change (samples in, replaced samples out)."""

    part: Partial | None
    bins: dict[int, int] = field(default_factory=dict)


@dataclass
class Plan:
    """A batch's rollups: the 128-step label_rollups rows as they must now be (stored merged
    with the batch), what closed buckets add to the wider label_rollups rows (to merge with the
    stored ones), and what the batch adds to each run_rollups bucket."""

    fine_rows: dict[LabelRowKey, Partial]
    wide_deltas: dict[LabelRowKey, Partial]
    run_deltas: dict[RunRowKey, RunDelta]
    # Each series' highest 128-step bucket after the batch: its open one.
    tops: dict[SeriesKey, int] = field(default_factory=dict)


def fine_ranges(
    fine: Mapping[FineKey, Partial], key_id: Mapping[tuple[int, str], int]
) -> list[tuple[int, int, int, int, int]]:
    """(key id, axis, label id, epoch, lowest bucket) of each label series a batch touches: its
    stored 128-step rows from that bucket up, and its highest one, are what plan() needs."""
    lowest: dict[SeriesKey, int] = {}
    for label_id, key, epoch, axis, bucket in fine:
        series = (key_id[label_id, key], axis, label_id, epoch)
        if bucket < lowest.get(series, bucket + 1):
            lowest[series] = bucket
    return [(*series, bucket) for series, bucket in lowest.items()]


def plan(
    fine: Mapping[FineKey, Partial],
    key_id: Mapping[tuple[int, str], int],
    generation: Mapping[tuple[int, int], int],
    stored: Mapping[LabelRowKey, Partial],
) -> Plan:
    """The rows a batch's fine partials make, given the key id of each (label id, key), the
    generation of each (label id, epoch) and the stored 128-step rows fine_ranges() names (each
    series' rows from its batch's lowest bucket up, and its highest)."""
    tops: dict[SeriesKey, int] = {}
    for kid, _, axis, label_id, epoch, bucket in stored:
        series = (kid, axis, label_id, epoch)
        if bucket > tops.get(series, bucket - 1):
            tops[series] = bucket
    deltas: dict[SeriesKey, dict[int, Partial]] = {}
    for (label_id, key, epoch, axis, bucket), part in fine.items():
        deltas.setdefault((key_id[label_id, key], axis, label_id, epoch), {})[bucket] = part
    fine_rows: dict[LabelRowKey, Partial] = {}
    tops_after: dict[SeriesKey, int] = {}
    closing: list[tuple[SeriesKey, int, Partial]] = []  # (series, bucket, what goes into wider rows)
    samples: list[tuple[SeriesKey, int, float | None, float | None]] = []  # (series, bucket, out, in)
    for series, mine in deltas.items():
        kid, axis, label_id, epoch = series
        top_before = tops.get(series)
        top = max(mine) if top_before is None else max(top_before, max(mine))
        tops_after[series] = top
        for bucket, part in mine.items():
            row_key = (kid, FINE_WIDTH, axis, label_id, epoch, bucket)
            held = stored.get(row_key)
            new = part if held is None else merge(held.copy(), part)
            fine_rows[row_key] = new
            if bucket == top:
                continue  # open: the label's highest bucket
            if top_before is not None and bucket < top_before:  # closed before: a late value
                closing.append((series, bucket, part))
                samples.append(
                    (series, bucket, None if held is None else finite_mean(held), finite_mean(new))
                )
            else:  # closes now (the open one, or one passed over by this batch's values)
                closing.append((series, bucket, new))
                samples.append((series, bucket, None, finite_mean(new)))
        if top_before is not None and top_before < top and top_before not in mine:
            held = stored[kid, FINE_WIDTH, axis, label_id, epoch, top_before]
            closing.append((series, top_before, held))
            samples.append((series, top_before, None, finite_mean(held)))
    wide: dict[LabelRowKey, Partial] = {}
    for (kid, axis, label_id, epoch), bucket, part in closing:
        for shift in SHIFTS[1:]:
            row_key = (kid, 1 << shift, axis, label_id, epoch, bucket >> (shift - FINE_SHIFT))
            held = wide.get(row_key)
            wide[row_key] = part.copy() if held is None else merge(held, part)
    return Plan(fine_rows, wide, _run_deltas(deltas, generation, samples), tops_after)


def _run_deltas(
    deltas: Mapping[SeriesKey, Mapping[int, Partial]],
    generation: Mapping[tuple[int, int], int],
    samples: Iterable[tuple[SeriesKey, int, float | None, float | None]],
) -> dict[RunRowKey, RunDelta]:
    """Every value of the batch in every run_rollups width (each width merged from the one
    below, a quarter as many rows each time), and the sketch's changes."""
    level: dict[tuple[int, int, int, int], Partial] = {}
    for (kid, axis, label_id, epoch), mine in deltas.items():
        gen = generation[label_id, epoch]
        for bucket, part in mine.items():
            held = level.get((kid, axis, gen, bucket))
            level[kid, axis, gen, bucket] = part.copy() if held is None else merge(held, part)
    run_deltas: dict[RunRowKey, RunDelta] = {}
    for shift in SHIFTS:
        coarser: dict[tuple[int, int, int, int], Partial] = {}
        for (kid, axis, gen, bucket), part in level.items():
            run_deltas[kid, 1 << shift, axis, gen, bucket] = RunDelta(part)
            up = (kid, axis, gen, bucket >> 2)
            above = coarser.get(up)
            coarser[up] = part.copy() if above is None else merge(above, part)
        level = coarser
    for (kid, axis, label_id, epoch), bucket, out, into in samples:
        was = None if out is None else bin_of(out)
        now = None if into is None else bin_of(into)
        if was == now:
            continue
        gen = generation[label_id, epoch]
        for shift in SHIFTS:
            run_key = (kid, 1 << shift, axis, gen, bucket >> (shift - FINE_SHIFT))
            delta = run_deltas.get(run_key)
            if delta is None:
                delta = run_deltas[run_key] = RunDelta(None)
            for key, count in ((was, -1), (now, 1)):
                if key is not None:
                    total = delta.bins.get(key, 0) + count
                    if total:
                        delta.bins[key] = total
                    else:
                        del delta.bins[key]
    return run_deltas


def merged_run_row(
    stored: tuple[Partial, dict[int, int]] | None, delta: RunDelta
) -> tuple[Partial, bytes, int]:
    """A run_rollups row (this writer's slot) with a batch's delta: (partial, sketch, samples)."""
    if stored is None:
        # Where only the sketch changes, in a bucket this slot never wrote: a row of counts that
        # add nothing, its bins the change (they may be negative: slots are summed).
        part = empty_part() if delta.part is None else delta.part
        bins = dict(delta.bins)
    else:
        part = stored[0] if delta.part is None else merge(stored[0], delta.part)
        bins = add_bins(stored[1], delta.bins)
    return part, encode_bins(bins), sum(bins.values())


# x bounds of a row that holds no value (the largest 64-bit integers): merged, any other's win.
_NO_X = (1 << 63) - 1


def empty_part() -> Partial:
    """The partial of no value: merged with another, it is the other's."""
    return [0, 0, 0, 0.0, None, None, None, 0, _NO_X, -_NO_X, math.inf, -math.inf, 0]


def generation_of(epoch: int, known: Mapping[int, int], restart_count: int | None) -> int:
    """The generation of a label's `epoch`, first met now, given the generations of its epochs
    known (by epoch) and the restart count its start reported (torchrun's, if any).

    One more than the label's latest earlier epoch (1 for its first), and at least one more than
    its restart count, so a label that joins a job in a later torchrun round (or whose earlier
    rounds were never logged) lines up with the labels that ran every round.
    """
    earlier = [gen for other, gen in known.items() if other < epoch]
    gen = max(earlier) + 1 if earlier else 1
    if restart_count is not None:
        gen = max(gen, restart_count + 1)
    return gen


def restart_count(start: Mapping[str, Any] | None) -> int | None:
    """The restart count a start event's data reports, if it is a plausible one."""
    found = None if start is None else start.get("restart_count")
    if isinstance(found, int) and not isinstance(found, bool) and 0 <= found < 1 << 31:
        return found
    return None


# -- rows as the tables hold them ----------------------------------------------------------------

# label_rollups' columns after its key, in Partial order.
LABEL_VALUE_COLUMNS = "n, nan, inf, total, lo, hi, last, last_seq, x_lo, x_hi, ts_lo, ts_hi, first_seq"
LABEL_KEY_COLUMNS = "key_id, width, axis, label_id, epoch, bucket"
# run_rollups' columns after its key and slot: a partial less last, last_seq and first_seq.
RUN_VALUE_COLUMNS = "n, nan, inf, total, lo, hi, x_lo, x_hi, ts_lo, ts_hi, samples, bins"
RUN_KEY_COLUMNS = "key_id, width, axis, generation, bucket"


def run_row(key: RunRowKey, slot: int, part: Partial, bins: bytes, samples: int) -> Params:
    return (
        *key,
        slot,
        part[N],
        part[NAN],
        part[INF],
        part[TOTAL],
        part[LO],
        part[HI],
        part[X_LO],
        part[X_HI],
        part[TS_LO],
        part[TS_HI],
        samples,
        bins,
    )


def run_part(values: Sequence[Any]) -> Partial:
    """A partial from run_rollups' value columns (n ... ts_hi)."""
    n, nan, inf, total, lo, hi, x_lo, x_hi, ts_lo, ts_hi = values[:10]
    return [n, nan, inf, total, lo, hi, None, 0, x_lo, x_hi, ts_lo, ts_hi, 0]


def fine_partials_from_rows(rows: Iterable[Sequence[Any]]) -> dict[FineKey, Partial]:
    """The 128-step partials of stored metric rows (label id, key, epoch, seq, step, ts, value),
    given in (label id, key, epoch, seq) order: how a migration rolls up what a store holds."""
    out: dict[FineKey, Partial] = {}
    group: list[Sequence[Any]] = []
    for row in rows:
        if group and (row[0], row[1], row[2]) != (group[0][0], group[0][1], group[0][2]):
            _fold_rows(out, group)
            group = []
        group.append(row)
    if group:
        _fold_rows(out, group)
    return out


def _fold_rows(out: dict[FineKey, Partial], group: list[Sequence[Any]]) -> None:
    label_id, key, epoch = group[0][0], group[0][1], group[0][2]
    for axis in (STEP_AXIS, TS_AXIS):
        mine = [r for r in group if (r[4] is None) == (axis == TS_AXIS)]
        if not mine:
            continue
        xs = [r[4] if axis == STEP_AXIS else int(r[5]) for r in mine]
        for bucket, part in fold(xs, [r[3] for r in mine], [r[5] for r in mine], [r[6] for r in mine]):
            _add(out, (label_id, key, epoch, axis, bucket), part)


# -- system samples ------------------------------------------------------------------------------
#
# System samples (`system` events: CPU, memory, GPU figures) are rolled up by the same code into
# the same tables, each of their keys a series of its own, on the ts axis (they have no step). A
# run's system series are those of the run id series_run() gives: no run id holds ':'
# (wire.NAME_PATTERN), so they never meet its metric keys, nor show in its metric key lists.


def series_run(run_id: str, table: str) -> str:
    """The `series` run id under which `table`'s ("metrics" or "system") keys of a run are kept."""
    return run_id if table == "metrics" else f"{run_id}:{table}"


def fold_system(system_rows: Iterable[Sequence[Any]]) -> dict[FineKey, Partial]:
    """The 128-second partials of `system` rows (label id, key, epoch, seq, ts, value), in any order."""
    ordered = sorted(system_rows, key=itemgetter(0, 1, 2, 3))
    return fine_partials_from_rows((r[0], r[1], r[2], r[3], None, r[4], r[5]) for r in ordered)


# A `metrics` row: (label id, key, epoch, seq, step, ts, value).
MetricRow = tuple[int, str, int, int, int | None, float, Any]


def column_rows(columns: Iterable[KeyColumns]) -> list[MetricRow]:
    """KeyColumns as `metrics` rows, (label id, key, epoch, seq, step, ts, value) as the table
    declares them: zipped in C."""
    rows: list[MetricRow] = []
    for label_id, key, epoch, seqs, steps, ts, values in columns:
        rows += zip(repeat(label_id), repeat(key), repeat(epoch), seqs, steps, ts, values)
    return rows
