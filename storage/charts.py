"""Chart reads built on the rollups (storage/rollups.py): one key's band across labels with its
outlying labels as lines, the labels' step times and stragglers. One implementation over the row
reads every backend gives (RollupReader), so SQLite and PostgreSQL answer alike.

A chart asks for an x range and at most `points` buckets; the narrowest width of WIDTHS that
fits is read, so a chart reads at most `points` rows per writer slot for its band whatever the
run's size. Where the values in view are few (RAW_POINTS), they are read as stored instead and
the band is exact, a step per bucket where they fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import pairwise
from operator import itemgetter
from typing import Literal

from runbus.storage import rollups, steptimes
from runbus.storage.base import (
    ALL_LINES_UP_TO,
    DEFAULT_HEAT_BUCKETS,
    DEFAULT_OUTLIERS,
    DEFAULT_POINTS,
    BandBucket,
    BandSegment,
    Envelope,
    LabelBucket,
    Line,
    LinePoint,
    LineSegment,
    RollupReader,
    RunBucket,
    Span,
    Store,
    StragglerLabel,
    Stragglers,
    XUnit,
)
from runbus.storage.rollups import (
    FINE_SHIFT,
    HI,
    INF,
    LAST,
    LO,
    NAN,
    STEP_AXIS,
    TOTAL,
    TS_AXIS,
    TS_HI,
    TS_LO,
    WIDTHS,
    X_HI,
    X_LO,
    N,
    Partial,
)
from runbus.storage.rules import natural_key
from runbus.storage.values import Values

# Values in view up to this many are read as stored: exact band and lines.
RAW_POINTS = 50_000
# Outliers are ranked on at most this many buckets per label (the widest width that has them).
RANKING_BUCKETS = 8
QUANTILES = (0.1, 0.5, 0.9)
# A label's step is slow in a bucket where it takes SLOW times the median label's or more. A
# label is a straggler only when it is behind the median: chronic when its steps took SLOW times
# the median's time for the same steps or more, slow in at least half of its buckets; one-off when
# it lost time overall and one stretch took STALL times the median's or more. Jitter (a label on
# time, or faster, that is a few percent slow in some bucket) is neither.
SLOW = 1.05
STALL = 1.25


# -- what backends read ----------------------------------------------------------------------------


def merge_slots(rows: Iterable[tuple[int, int, Partial, bytes | None]]) -> list[RunBucket]:
    """(generation, bucket, partial, sketch) rows of several slots, in (generation, bucket) order,
    as one RunBucket each."""
    merged: list[RunBucket] = []
    for generation, bucket, part, blob in rows:
        if merged and (merged[-1].generation, merged[-1].bucket) == (generation, bucket):
            rollups.merge(merged[-1].part, part)
            rollups.add_bins(merged[-1].bins, rollups.decode_bins(blob))
        else:
            merged.append(RunBucket(generation, bucket, part, rollups.decode_bins(blob)))
    return merged


async def label_rows(
    reader: RollupReader,
    run_id: str,
    key: str,
    axis: int,
    width: int,
    lo: int,
    hi: int,
    labels: Sequence[str] | None,
    open_rows: Sequence[LabelBucket] | None = None,
) -> list[LabelBucket]:
    """A key's label buckets lo..hi at `width` (of `labels`, all if None) holding every stored
    value: the wider rows hold closed 128-step buckets only, each label epoch's open one is added
    (`open_rows`: every label's open buckets, if already read)."""
    rows = await reader.label_buckets(run_id, key, axis, width, lo, hi, labels)
    if width == rollups.FINE_WIDTH:
        return rows
    if open_rows is None:
        open_rows = await reader.open_buckets(run_id, key, axis, labels)
    elif labels is not None:
        chosen = set(labels)
        open_rows = [row for row in open_rows if row.label in chosen]
    shift = _shift(width) - FINE_SHIFT
    found = {(row.label, row.epoch, row.bucket): row for row in rows}
    for row in open_rows:
        bucket = row.bucket >> shift
        if lo <= bucket <= hi:
            held = found.get((row.label, row.epoch, bucket))
            if held is None:
                found[row.label, row.epoch, bucket] = LabelBucket(
                    row.label, row.epoch, row.generation, bucket, row.part.copy()
                )
            else:
                rollups.merge(held.part, row.part)
    return list(found.values())


async def run_rows(
    reader: RollupReader,
    run_id: str,
    key: str,
    axis: int,
    width: int,
    lo: int,
    hi: int,
    open_rows: Sequence[LabelBucket] | None = None,
) -> list[RunBucket]:
    """A key's run buckets lo..hi at `width` with every stored value in their sketches: each label
    epoch's open 128-step bucket's mean is added (the stored sketches hold closed ones only)."""
    buckets = await reader.run_buckets(run_id, key, axis, width, lo, hi)
    if open_rows is None:
        open_rows = await reader.open_buckets(run_id, key, axis, None)
    shift = _shift(width) - FINE_SHIFT
    found = {(b.generation, b.bucket): b for b in buckets}
    for row in open_rows:
        mean = rollups.finite_mean(row.part)
        held = found.get((row.generation, row.bucket >> shift))
        if mean is not None and held is not None:
            sample = rollups.bin_of(mean)
            held.bins[sample] = held.bins.get(sample, 0) + 1
    return buckets


# -- the band and its lines --------------------------------------------------------------------------


def choose_width(span: float, points: int) -> int:
    """The narrowest width of WIDTHS that shows `span` x units in at most `points` buckets."""
    for width in WIDTHS:
        if span / width <= points:
            return width
    return WIDTHS[-1]


async def envelope(
    reader: RollupReader,
    run_id: str,
    key: str,
    x: XUnit | None = None,
    start: float | None = None,
    end: float | None = None,
    points: int = DEFAULT_POINTS,
    outliers: int = DEFAULT_OUTLIERS,
    all_lines_up_to: int = ALL_LINES_UP_TO,
    shown: Sequence[str] = (),
) -> Envelope | None:
    """One key's band, and its lines: every label's if there are at most `all_lines_up_to`, else
    the `outliers` labels furthest from the median and the `shown` labels' (the labels the user
    turned on; one without values in view has no line). None if the run never logged the key."""
    shown = list(dict.fromkeys(shown))
    extent = await reader.key_extent(run_id, key)
    if extent is None:
        return None
    has_steps = bool(extent.axis_spans(STEP_AXIS))
    unit: XUnit = x or ("step" if has_steps else "ts")
    axis = STEP_AXIS if has_steps else TS_AXIS
    if not has_steps:
        unit = "ts"
    spans = extent.axis_spans(axis)
    other = sum(s.n for s in extent.spans if s.axis != axis)
    labels = extent.labels.get(axis, 0)
    lo, hi = await _x_range(reader, run_id, key, spans, unit, axis, start, end)
    # The chart with nothing drawn yet: what the exact and rolled-up reads fill in.
    empty = Envelope(run_id, key, unit, 1, True, labels, start, end, [], [], labels <= all_lines_up_to, other)
    if hi < lo:
        return empty
    total = sum(s.n for s in spans)
    in_view = total * (hi - lo + 1) / max(1, max(s.x_hi for s in spans) - min(s.x_lo for s in spans) + 1)
    if total <= RAW_POINTS or (empty.all_lines and in_view <= RAW_POINTS):
        return await _exact_envelope(reader, empty, axis, lo, hi, total, points, outliers, shown)
    return await _rolled_up_envelope(reader, empty, axis, lo, hi, points, outliers, shown)


async def _x_range(
    reader: RollupReader,
    run_id: str,
    key: str,
    spans: list[Span],
    unit: XUnit,
    axis: int,
    start: float | None,
    end: float | None,
) -> tuple[int, int]:
    """The x range lo..hi of the chart's view on `axis` (empty when hi < lo): the ts
    `start`..`end` as the steps logged then where the key has steps and x is ts."""
    lo, hi = min(s.x_lo for s in spans), max(s.x_hi for s in spans)
    if unit == "ts" and axis == STEP_AXIS and (start is not None or end is not None):
        lo, hi = await _steps_between(reader, run_id, key, spans, start, end)
    elif unit == "ts" and axis == TS_AXIS:
        lo = max(lo, math.floor(start)) if start is not None else lo
        hi = min(hi, math.floor(end)) if end is not None else hi
    else:
        lo = max(lo, math.ceil(start)) if start is not None else lo
        hi = min(hi, math.floor(end)) if end is not None else hi
    return lo, hi


async def _exact_envelope(
    reader: RollupReader,
    empty: Envelope,
    axis: int,
    lo: int,
    hi: int,
    total: int,
    points: int,
    outliers: int,
    shown: list[str],
) -> Envelope:
    """envelope from the stored values in view (few enough to read): an exact band and lines."""
    run_id, key, start, end, all_lines = empty.run_id, empty.key, empty.start, empty.end, empty.all_lines
    by_ts = empty.x == "ts" and axis == STEP_AXIS
    values = await _stored_values(reader, run_id, key, axis, lo, hi, total)
    generations = await _generations(reader, run_id, key, axis)
    raw_width = exact_width(len({v[3] for v in values}), hi - lo + 1, points)
    band = _exact_band(values, generations, raw_width, by_ts, start, end)
    ranked: list[tuple[str, float]] = []
    if not all_lines and (outliers > 0 or shown):
        ranking = exact_width(RANKING_BUCKETS + 1, hi - lo + 1, RANKING_BUCKETS)
        ranked = _rank_values(values, generations, _shift(ranking))
    drawn = set(_chosen(ranked, outliers, shown))
    mine = values if all_lines else [v for v in values if v[0] in drawn]
    exact_rows = _label_rows(mine, generations, raw_width)
    lines = (
        _lines(exact_rows, by_ts, start, end)
        if all_lines
        else _chosen_lines(exact_rows, ranked, outliers, shown, by_ts, start, end)
    )
    return replace(empty, width=raw_width, band=band, lines=lines)


async def _rolled_up_envelope(
    reader: RollupReader,
    empty: Envelope,
    axis: int,
    lo: int,
    hi: int,
    points: int,
    outliers: int,
    shown: list[str],
) -> Envelope:
    """envelope from the rollups: the band and lines of the narrowest width that fits `points`."""
    run_id, key, start, end, all_lines = empty.run_id, empty.key, empty.start, empty.end, empty.all_lines
    by_ts = empty.x == "ts" and axis == STEP_AXIS
    width = choose_width(hi - lo + 1, points)
    first, last = lo >> _shift(width), hi >> _shift(width)
    open_rows = await reader.open_buckets(run_id, key, axis, None)  # read once for the whole chart
    band_rows = await run_rows(reader, run_id, key, axis, width, first, last, open_rows)
    band = _band(band_rows, by_ts, width, start, end)
    if all_lines:
        rows = await label_rows(reader, run_id, key, axis, width, first, last, None, open_rows)
        lines = _lines(rows, by_ts, start, end)
    else:
        ranked = await _ranking(reader, run_id, key, axis, lo, hi, open_rows) if outliers or shown else []
        chosen = _chosen(ranked, outliers, shown)
        rows = (
            await label_rows(reader, run_id, key, axis, width, first, last, chosen, open_rows)
            if chosen
            else []
        )
        lines = _chosen_lines(rows, ranked, outliers, shown, by_ts, start, end)
    return replace(empty, width=width, exact=False, band=band, lines=lines)


def _shift(width: int) -> int:
    return width.bit_length() - 1


def exact_width(distinct: int, span: int, points: int) -> int:
    """The width of an exact band: a bucket per x where they fit in `points`, else the least
    power of two that shows `span` in `points` buckets."""
    if distinct <= points:
        return 1
    width = 1
    while span / width > points:
        width *= 2
    return width


async def _steps_between(
    reader: RollupReader, run_id: str, key: str, spans: list[Span], start: float | None, end: float | None
) -> tuple[int, int]:
    """The step range whose values were logged between the ts `start` and `end`, to the nearest
    bucket of a width that cuts the key's steps into at most 256."""
    lo, hi = min(s.x_lo for s in spans), max(s.x_hi for s in spans)
    width = choose_width(hi - lo + 1, 256)
    found = await reader.run_buckets(run_id, key, STEP_AXIS, width, lo >> _shift(width), hi >> _shift(width))
    inside = [
        b.part
        for b in found
        if (start is None or b.part[TS_HI] >= start) and (end is None or b.part[TS_LO] <= end)
    ]
    if not inside:
        return 1, 0
    return min(p[X_LO] for p in inside), max(p[X_HI] for p in inside)


async def _generations(reader: RollupReader, run_id: str, key: str, axis: int) -> dict[tuple[str, int], int]:
    """(label, epoch) -> generation of every label epoch that logged the key on `axis` (each has
    an open bucket: its highest)."""
    return {
        (row.label, row.epoch): row.generation for row in await reader.open_buckets(run_id, key, axis, None)
    }


# A stored value as the exact reads fold it: (label, epoch, seq, x, ts, value), x its step or
# second (by the axis read).
Value = tuple[str, int, int, int, float, float]


async def _stored_values(
    reader: RollupReader, run_id: str, key: str, axis: int, lo: int, hi: int, total: int
) -> list[Value]:
    """The key's stored values on `axis` with x in lo..hi: all read at once where the key holds few,
    else each label epoch's seq range in view, read a page at a time."""
    on_steps = axis == STEP_AXIS
    if total <= RAW_POINTS:
        return [
            (label, epoch, seq, x, ts, value)
            for label, epoch, seq, step, ts, value in await reader.key_values(run_id, key)
            if (step is not None) == on_steps
            for x in (step if step is not None else math.floor(ts),)
            if lo <= x <= hi
        ]
    width = rollups.FINE_WIDTH
    rows = await reader.label_buckets(run_id, key, axis, width, lo >> FINE_SHIFT, hi >> FINE_SHIFT, None)
    seqs: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        held = seqs.setdefault(
            (row.label, row.epoch), [row.part[rollups.FIRST_SEQ], row.part[rollups.LAST_SEQ]]
        )
        held[0] = min(held[0], row.part[rollups.FIRST_SEQ])
        held[1] = max(held[1], row.part[rollups.LAST_SEQ])
    values: list[Value] = []
    for (label, epoch), (first, last) in sorted(seqs.items()):
        after: tuple[str, int, int] = (key, epoch, first - 1)
        while True:
            page = await reader.point_page("metrics", run_id, label, after, 5000, key=key)
            mine = [p for p in page if p.epoch == epoch and p.seq <= last]
            for p in mine:
                if (p.step is not None) == on_steps:
                    x = p.step if p.step is not None else math.floor(p.ts)
                    if lo <= x <= hi:
                        values.append((label, epoch, p.seq, x, p.ts, p.value))
            if len(mine) < len(page) or len(page) < 5000:
                break
            after = (key, page[-1].epoch, page[-1].seq)
    return values


def _label_rows(
    values: Sequence[Value], generations: dict[tuple[str, int], int], width: int
) -> list[LabelBucket]:
    """Each label epoch's buckets of `width` from its stored values, as its rollups would hold them."""
    shift = _shift(width)
    by_label: dict[tuple[str, int], list[Value]] = {}
    for value in values:
        by_label.setdefault((value[0], value[1]), []).append(value)
    rows: list[LabelBucket] = []
    for (label, epoch), mine in sorted(by_label.items()):
        mine.sort(key=_SEQ)
        generation = generations.get((label, epoch), 1)
        columns = list(zip(*mine, strict=True))
        for bucket, part in rollups.fold(columns[3], columns[2], columns[4], columns[5], shift):
            rows.append(LabelBucket(label, epoch, generation, bucket, part))
    return rows


def _exact_band(
    values: Sequence[Value],
    generations: dict[tuple[str, int], int],
    width: int,
    by_ts: bool,
    start: float | None,
    end: float | None,
) -> list[BandSegment]:
    """The band from stored values: per generation and bucket of `width`, every value's count,
    min, max and mean, and the exact quantiles of the finite values in it (at a width of 1, of
    the labels' values at that step)."""
    shift = _shift(width)
    groups: dict[tuple[int, int], list[Value]] = {}
    for value in values:
        generation = generations.get((value[0], value[1]), 1)
        groups.setdefault((generation, value[3] >> shift), []).append(value)
    segments: list[BandSegment] = []
    for (generation, _), mine in sorted(groups.items()):
        ts = [v[4] for v in mine]
        if by_ts and not ((start is None or max(ts) >= start) and (end is None or min(ts) <= end)):
            continue
        if not segments or segments[-1].generation != generation:
            segments.append(BandSegment(generation, [], []))
        segments[-1].buckets.append(_exact_bucket(mine, by_ts))
    for segment in segments:
        segment.gaps.extend(gaps([(b.x_lo, b.x_hi) for b in segment.buckets], 0 if by_ts else width))
    return segments


def _exact_bucket(mine: Sequence[Value], by_ts: bool) -> BandBucket:
    """One bucket of an exact band from its stored values: x bounds (their ts where `by_ts`),
    counts, min, max, mean and the exact quantiles of the finite ones."""
    ts = [v[4] for v in mine]
    numbers = [v[5] for v in mine]
    real = [v for v in numbers if v == v]
    finite = sorted(v for v in real if v - v == 0)
    x_lo, x_hi = (min(ts), max(ts)) if by_ts else (min(v[3] for v in mine), max(v[3] for v in mine))
    quantiles = _exact_quantiles(finite)
    return BandBucket(
        x_lo,
        x_hi,
        len(numbers),
        len(numbers) - len(real),
        len(real) - len(finite),
        min(real) if real else None,
        quantiles[0],
        quantiles[1],
        quantiles[2],
        max(real) if real else None,
        sum(finite) / len(finite) if finite else None,
    )


def _rank_values(
    values: Sequence[Value], generations: dict[tuple[str, int], int], shift: int
) -> list[tuple[str, float]]:
    """rank_outliers over stored values, in buckets of `shift` bits: every label ranked."""
    sums: dict[tuple[str, int, int], list[float]] = {}
    for label, epoch, _, x, _, value in values:
        if value - value == 0:
            held = sums.setdefault((label, generations.get((label, epoch), 1), x >> shift), [0.0, 0])
            held[0] += value
            held[1] += 1
    rows = [
        LabelBucket(label, 0, generation, bucket, [n, 0, 0, total, None, None, None, 0, 0, 0, 0.0, 0.0, 0])
        for (label, generation, bucket), (total, n) in sums.items()
    ]
    return rank_outliers(rows)


_SEQ = itemgetter(2)


def _band(
    buckets: Sequence[RunBucket],
    by_ts: bool,
    width: int,
    start: float | None,
    end: float | None,
) -> list[BandSegment]:
    """The band's segments, a generation each, from run buckets in (generation, bucket) order."""
    segments: list[BandSegment] = []
    for bucket in buckets:
        part = bucket.part
        if by_ts and not _overlaps(part, start, end):
            continue
        ps = rollups.quantiles(bucket.bins, QUANTILES, part[LO], part[HI])
        x_lo, x_hi = (part[TS_LO], part[TS_HI]) if by_ts else (part[X_LO], part[X_HI])
        row = BandBucket(
            x_lo, x_hi, part[N], part[NAN], part[INF], part[LO], ps[0], ps[1], ps[2], part[HI], _mean(part)
        )
        if not segments or segments[-1].generation != bucket.generation:
            segments.append(BandSegment(bucket.generation, [], []))
        segments[-1].buckets.append(row)
    for segment in segments:
        segment.gaps.extend(gaps([(b.x_lo, b.x_hi) for b in segment.buckets], 0 if by_ts else width))
    return segments


def _overlaps(part: Partial, start: float | None, end: float | None) -> bool:
    return (start is None or part[TS_HI] >= start) and (end is None or part[TS_LO] <= end)


def _mean(part: Partial) -> float | None:
    finite = part[N] - part[NAN] - part[INF]
    return part[TOTAL] / finite if finite > 0 and part[TOTAL] - part[TOTAL] == 0 else None


def _exact_quantiles(samples: list[float]) -> list[float | None]:
    if not samples:
        return [None] * len(QUANTILES)
    ordered = sorted(samples)
    count = len(ordered)
    return [ordered[min(count - 1, max(0, math.ceil(q * count) - 1))] for q in QUANTILES]


def gaps(ranges: Sequence[tuple[float, float]], width: float) -> list[tuple[float, float]]:
    """Holes between consecutive (x_lo, x_hi) ranges: longer than two widths and than three
    times the median distance between neighbours (so a key logged every 1000 steps has no gap
    every 1000 steps)."""
    distances = [b[0] - a[1] for a, b in pairwise(ranges)]
    if not distances:
        return []
    typical = sorted(distances)[len(distances) // 2]
    least = max(2 * width, 3 * typical)
    return [(a[1], b[0]) for a, b in pairwise(ranges) if b[0] - a[1] > least]


def _lines(rows: Sequence[LabelBucket], by_ts: bool, start: float | None, end: float | None) -> list[Line]:
    """Each label's line, a segment per epoch, from its buckets."""
    lines: dict[str, dict[int, LineSegment]] = {}
    for row in sorted(rows, key=lambda r: (r.label, r.epoch, r.bucket)):
        part = row.part
        if by_ts and not _overlaps(part, start, end):
            continue
        segments = lines.setdefault(row.label, {})
        segment = segments.get(row.epoch)
        if segment is None:
            segment = segments[row.epoch] = LineSegment(row.epoch, row.generation, [])
        x = part[TS_HI] if by_ts else part[X_HI]
        segment.points.append(LinePoint(x, part[LAST], _mean(part), part[LO], part[HI], part[N]))
    return [Line(label, list(lines[label].values())) for label in sorted(lines, key=natural_key)]


async def _ranking(
    reader: RollupReader,
    run_id: str,
    key: str,
    axis: int,
    lo: int,
    hi: int,
    open_rows: Sequence[LabelBucket] | None = None,
) -> list[tuple[str, float]]:
    """Every label by its distance from the median over lo..hi, furthest first: ranked on the
    widest buckets of which at most RANKING_BUCKETS cover the range."""
    width = WIDTHS[0]
    for candidate in WIDTHS:
        width = candidate
        if (hi >> _shift(candidate)) - (lo >> _shift(candidate)) + 1 <= RANKING_BUCKETS:
            break
    first, last = lo >> _shift(width), hi >> _shift(width)
    rows = await label_rows(reader, run_id, key, axis, width, first, last, None, open_rows)
    return rank_outliers(rows)


def label_means(rows: Iterable[LabelBucket], shift: int = 0) -> dict[tuple[int, int], dict[str, float]]:
    """Each label's mean of its finite values per (generation, bucket), its epochs together (at
    `shift` bits coarser than the rows' buckets)."""
    sums: dict[tuple[int, int], dict[str, list[float]]] = {}
    for row in rows:
        part = row.part
        finite = part[N] - part[NAN] - part[INF]
        if finite > 0 and part[TOTAL] - part[TOTAL] == 0:
            held = sums.setdefault((row.generation, row.bucket >> shift), {}).setdefault(row.label, [0.0, 0])
            held[0] += part[TOTAL]
            held[1] += finite
    return {cell: {label: total / n for label, (total, n) in by.items()} for cell, by in sums.items()}


def rank_outliers(
    rows: Iterable[LabelBucket], count: int | None = None, shift: int = 0
) -> list[tuple[str, float]]:
    """The `count` labels furthest from the median (all if None), with their distances, from
    label buckets taken `shift` bits coarser: per coarse bucket, each label's mean against the
    median label's, in units of the p10-p90 spread of the labels' means there, averaged over the
    buckets."""
    distances: dict[str, list[float]] = {}
    for means in label_means(rows, shift).values():
        ordered = sorted(means.values())
        if len(ordered) < 3:
            continue
        median = ordered[len(ordered) // 2]
        p10, _, p90 = _exact_quantiles(ordered)
        spread = (p90 or 0.0) - (p10 or 0.0)
        if spread <= 0:
            spread = max(abs(median), 1e-12) * 1e-3
        for label, mean in means.items():
            distances.setdefault(label, []).append(abs(mean - median) / spread)
    ranked = sorted(
        ((sum(d) / len(d), label) for label, d in distances.items()), key=lambda t: (-t[0], natural_key(t[1]))
    )
    return [(label, distance) for distance, label in ranked[:count]]


def _chosen(ranked: list[tuple[str, float]], outliers: int, shown: Sequence[str]) -> list[str]:
    """The labels drawn as lines: the `outliers` furthest of `ranked`, then the `shown` others."""
    outlying = [name for name, _ in ranked[:outliers]]
    return outlying + [name for name in shown if name not in outlying]


def _chosen_lines(
    rows: Sequence[LabelBucket],
    ranked: list[tuple[str, float]],
    outliers: int,
    shown: Sequence[str],
    by_ts: bool,
    start: float | None,
    end: float | None,
) -> list[Line]:
    """The lines of the outliers (the `outliers` furthest of `ranked`), furthest first, then of
    the `shown` labels in the order asked; each with its distance (None for a label not ranked:
    no finite value in the ranking's buckets)."""
    distance = dict(ranked)
    outlying = {name for name, _ in ranked[:outliers]}
    chosen = _chosen(ranked, outliers, shown)
    wanted = set(chosen)
    drawn = {line.label: line for line in _lines([r for r in rows if r.label in wanted], by_ts, start, end)}
    return [
        Line(name, drawn[name].segments, distance.get(name), name in outlying)
        for name in chosen
        if name in drawn
    ]


# -- step times ----------------------------------------------------------------------------------


async def stragglers(
    reader: Store,
    run_id: str,
    key: str,
    time_key: bool = False,
    start: int | None = None,
    end: int | None = None,
    buckets: int = DEFAULT_HEAT_BUCKETS,
) -> Stragglers | None:
    """Each label's step time per step bucket, over steps start..end in at most `buckets`
    buckets: `key`'s mean where `time_key` (a key whose values are step times, in seconds), else
    derived from when `key` was logged (the ts span between its steps over their step span: a
    key logged every step, such as the loss, gives each step's time). A key of few values
    (RAW_POINTS) is read as stored, in buckets as narrow as `buckets` allows (a step each for a
    short run); else from its rollups, in buckets of WIDTHS. None if never logged."""
    extent = await reader.key_extent(run_id, key)
    if extent is None:
        return None
    spans = extent.axis_spans(STEP_AXIS)
    source = f"{key}"
    if not spans:
        return Stragglers(run_id, source, not time_key, 0, [], [], [])
    lo, hi = min(s.x_lo for s in spans), max(s.x_hi for s in spans)
    lo = max(lo, start) if start is not None else lo
    hi = min(hi, end) if end is not None else hi
    if hi < lo:
        return Stragglers(run_id, source, not time_key, 0, [], [], [])
    total = sum(s.n for s in spans)
    width, cells = await _straggler_cells(reader, run_id, key, lo, hi, total, buckets, time_key)
    present = sorted({bucket for _, bucket in cells})
    times = _step_times(cells, present)
    median: list[float | None] = []
    for i in range(len(present)):
        found = sorted(t for t in (mine[i] for mine in times.values()) if t is not None)
        median.append(found[len(found) // 2] if found else None)
    names = list(times)
    ranges = [(max(lo, b << _shift(width)), min(hi, ((b + 1) << _shift(width)) - 1)) for b in present]
    step_counts = [last - first + 1 for first, last in ranges]
    labels = [_straggler(name, times[name], median, step_counts, ranges) for name in names]
    labels.sort(key=lambda s: (-(s.mean_ratio or 0.0), s.label))
    return Stragglers(run_id, source, not time_key, width, ranges, median, labels)


async def _straggler_cells(
    reader: Store, run_id: str, key: str, lo: int, hi: int, total: int, buckets: int, time_key: bool
) -> tuple[int, dict[tuple[str, int], list[float]]]:
    """The bucket width and stragglers' cells of steps lo..hi: (label, bucket) -> [seconds,
    steps] summed over the label's epochs, or [sum, count] of values where `time_key`."""
    if total <= RAW_POINTS:
        # As arrays, and of the chunks only those holding steps lo..hi.
        found = await reader.values(run_id, "metrics", [key], None, (lo, hi))
        # Whatever steps were logged, a bucket is a run of consecutive steps (as in the rollups).
        width = exact_width(buckets + 1, hi - lo + 1, buckets)
        return width, _value_cells(found, time_key, _shift(width))
    width = choose_width(hi - lo + 1, buckets)
    first, last = lo >> _shift(width), hi >> _shift(width)
    rows = await label_rows(reader, run_id, key, STEP_AXIS, width, first, last, None)
    return width, _rollup_cells(rows, time_key)


def _step_times(
    cells: dict[tuple[str, int], list[float]], present: list[int]
) -> dict[str, list[float | None]]:
    """Each label's (in natural order) time per step in each bucket of `present`, None where it
    has no steps."""
    names = sorted({label for label, _ in cells}, key=natural_key)
    column = {bucket: i for i, bucket in enumerate(present)}
    times: dict[str, list[float | None]] = {name: [None] * len(present) for name in names}
    for (label, bucket), (amount, steps) in cells.items():
        if steps > 0:
            times[label][column[bucket]] = amount / steps
    return times


def _value_cells(found: Values, time_key: bool, shift: int) -> dict[tuple[str, int], list[float]]:
    """Stragglers' cells from stored values of one key, each with a step
    (runbus.storage.steptimes.cells)."""
    cells = steptimes.cells(found.label, found.epoch, found.step, found.ts, found.value, time_key, shift)
    labels = found.labels
    return {
        (labels[c], bucket): [seconds, steps]
        for c, bucket, seconds, steps in zip(
            cells.label.tolist(),
            cells.bucket.tolist(),
            cells.seconds.tolist(),
            cells.steps.tolist(),
            strict=True,
        )
    }


def _rollup_cells(rows: Iterable[LabelBucket], time_key: bool) -> dict[tuple[str, int], list[float]]:
    """Stragglers' cells from label buckets: the values' sum and count where `time_key`, else the
    ts span and step span of each bucket's values."""
    cells: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        part = row.part
        cell = cells.setdefault((row.label, row.bucket), [0.0, 0.0])
        if time_key:
            finite = part[N] - part[NAN] - part[INF]
            if finite > 0 and part[TOTAL] - part[TOTAL] == 0:
                cell[0] += part[TOTAL]
                cell[1] += finite
        elif part[X_HI] > part[X_LO]:
            cell[0] += part[TS_HI] - part[TS_LO]
            cell[1] += part[X_HI] - part[X_LO]
    return cells


def _straggler(
    label: str,
    times: list[float | None],
    median: list[float | None],
    steps: list[int],
    ranges: list[tuple[int, int]],
) -> StragglerLabel:
    ratios = [(t / m, i) for i, (t, m) in enumerate(zip(times, median, strict=True)) if t is not None and m]
    shared = [
        (t, m, n) for t, m, n in zip(times, median, steps, strict=True) if t is not None and m is not None
    ]
    behind = sum((t - m) * n for t, m, n in shared)
    typical = sum(m * n for _, m, n in shared)  # the median label's seconds for the same steps
    slow = sum(1 for r, _ in ratios if r >= SLOW)
    worst = max(ratios, default=None)
    kind = _straggler_kind(len(ratios), slow, None if worst is None else worst[0], behind, typical)
    mean = sum(r for r, _ in ratios) / len(ratios) if ratios else None
    return StragglerLabel(
        label,
        times,
        mean,
        None if worst is None else worst[0],
        None if worst is None else ranges[worst[1]][0],
        slow,
        behind,
        kind,
    )


def _straggler_kind(
    buckets: int, slow: int, worst: float | None, behind: float, typical: float
) -> Literal["chronic", "one-off", "normal"]:
    """Chronic: slow in at least half of its `buckets` and `behind` the median label by SLOW
    times its `typical` seconds or more; one-off: behind, with one bucket STALL times slow."""
    if slow * 2 >= buckets and typical > 0 and behind >= (SLOW - 1) * typical:
        return "chronic"
    if worst is not None and worst >= STALL and behind > 0:
        return "one-off"
    return "normal"


def prefix_end(prefix: str) -> str | None:
    """The least text after every text that starts with `prefix` (in code point order, as both
    backends sort keys), or None if there is none (a prefix of U+10FFFF only)."""
    text = prefix.rstrip("\U0010ffff")
    if not text:
        return None
    after = ord(text[-1]) + 1
    if 0xD800 <= after <= 0xDFFF:  # surrogates are no text: the next code point is past them
        after = 0xE000
    return text[:-1] + chr(after)
