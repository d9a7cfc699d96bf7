"""Where a label left the cross-rank band of a key (storage/bands.py), from stored rollups.

The labels' means come from their closed 128-step label_rollups rows (an open bucket, a label's
highest, holds a part of its steps only: a rank ahead or behind the others would stand apart
for that alone), a row per label and bucket. A key whose rows are few is read whole; a longer
one is first read at a coarse width (at most COARSE_BUCKETS buckets), and only around the
coarse buckets where a label's mean goes outside the coarse band are the 128-step rows read.
The departure's bucket and the one before give the exact step: that label's stored values there,
each against its bucket's band. Only values with a step are judged. One implementation over
RollupReader: SQLite and PostgreSQL answer alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from runbus.storage import charts
from runbus.storage.anomalies import Anomaly, KeyedReader, in_order, non_finite, stored_in
from runbus.storage.bands import MIN_LABELS, Band, Cell, Departure, bands, departures, going_out, split
from runbus.storage.base import LabelBucket, RollupReader
from runbus.storage.rollups import FINE_SHIFT, FINE_WIDTH, STEP_AXIS
from runbus.storage.rules import natural_key

# A key whose 128-step rows (labels x buckets) are at most this many is read whole.
FINE_ROWS = 20_000
COARSE_BUCKETS = 64
# Ranges of 128-step rows read after the coarse pass, at most (the first: anomalies go by step).
MAX_WINDOWS = 16

Means = dict[Cell, dict[str, float]]


async def every_anomaly(reader: KeyedReader, run_id: str, keys: Sequence[str] | None = None) -> list[Anomaly]:
    """The run's NaN/inf anomalies (storage/anomalies.py) and band leavers, in_order."""
    keys = await reader.metric_keys(run_id) if keys is None else keys
    return in_order([*await non_finite(reader, run_id, keys), *await outliers(reader, run_id, keys)])


async def outliers(reader: KeyedReader, run_id: str, keys: Sequence[str] | None = None) -> list[Anomaly]:
    """Each label's first departure from the band of each key (of `keys`, all if None), in_order."""
    return (await band_leavers(reader, run_id, keys))[0]


async def band_leavers(
    reader: KeyedReader, run_id: str, keys: Sequence[str] | None = None
) -> tuple[list[Anomaly], int | None]:
    """outliers(), and the last step up to which every band leaver is known (`band_to`): a
    departure is named once the label's bucket after it has closed too, so up to the step before
    the slowest label's last closed bucket; a first anomaly found past it (a NaN, say) may yet be
    preceded by one. None where no key has a band (fewer than MIN_LABELS labels)."""
    found: list[Anomaly] = []
    reach: int | None = None
    for key in await reader.metric_keys(run_id) if keys is None else keys:
        leavers, open_rows = await _key_outliers(reader, run_id, key, FINE_ROWS)
        found.extend(leavers)
        if len({row.label for row in open_rows}) >= MIN_LABELS:
            judged = (min(row.bucket for row in open_rows) - 1) * FINE_WIDTH - 1
            reach = judged if reach is None else min(reach, judged)
    return in_order(found), reach


async def first_outliers(
    reader: RollupReader, run_id: str, key: str, fine_rows: int = FINE_ROWS
) -> list[Anomaly]:
    """Each label's first departure from the band of `key`, in_order; the coarse pass first if
    the key has more than `fine_rows` 128-step rows."""
    return (await _key_outliers(reader, run_id, key, fine_rows))[0]


async def _key_outliers(
    reader: RollupReader, run_id: str, key: str, fine_rows: int
) -> tuple[list[Anomaly], list[LabelBucket]]:
    """first_outliers(), and the key's open 128-step buckets it read (none without a band)."""
    extent = await reader.key_extent(run_id, key)
    labels = 0 if extent is None else extent.labels.get(STEP_AXIS, 0)
    spans = [] if extent is None else extent.axis_spans(STEP_AXIS)
    if labels < MIN_LABELS or not spans:
        return [], []
    lo, hi = min(s.x_lo for s in spans) >> FINE_SHIFT, max(s.x_hi for s in spans) >> FINE_SHIFT
    if labels * (hi - lo + 1) <= fine_rows:
        windows = [(lo, hi)]
    else:
        windows = await _coarse_windows(reader, run_id, key, lo, hi)
    open_rows = await reader.open_buckets(run_id, key, STEP_AXIS, None)
    open_keys = {(r.label, r.epoch, r.bucket) for r in open_rows}
    found: dict[str, Anomaly] = {}
    for window in windows:
        rows = await reader.label_buckets(run_id, key, STEP_AXIS, FINE_WIDTH, *window, None)
        closed = [r for r in rows if (r.label, r.epoch, r.bucket) not in open_keys]
        for anomaly in await _in_window(reader, run_id, key, closed, set(found)):
            found[anomaly.label] = anomaly
    return in_order(found.values()), open_rows


async def _coarse_windows(
    reader: RollupReader, run_id: str, key: str, lo: int, hi: int
) -> list[tuple[int, int]]:
    """The ranges of 128-step buckets to read: around each coarse bucket where a label's mean
    goes outside the coarse band, from the coarse bucket before (where it left, if its mean
    there was still inside) to the one after (where it must still be outside)."""
    width = charts.choose_width((hi - lo + 1) << FINE_SHIFT, COARSE_BUCKETS)
    shift = width.bit_length() - 1 - FINE_SHIFT
    if shift == 0:
        return [(lo, hi)]
    coarse = await reader.label_buckets(run_id, key, STEP_AXIS, width, lo >> shift, hi >> shift, None)
    means = charts.label_means(coarse)
    starts = {bucket for _, bucket in going_out(means, bands(means))}
    windows: list[tuple[int, int]] = []
    for bucket in sorted(starts):
        # One 128-step bucket more on the left: whether the label was inside just before.
        first, last = max(lo, ((bucket - 1) << shift) - 1), min(hi, ((bucket + 2) << shift) - 1)
        if windows and first <= windows[-1][1] + 1:
            windows[-1] = (windows[-1][0], max(windows[-1][1], last))
        else:
            windows.append((first, last))
    return windows[:MAX_WINDOWS]


async def _in_window(
    reader: RollupReader, run_id: str, key: str, rows: list[LabelBucket], skip: set[str]
) -> list[Anomaly]:
    """Each label's (but `skip`'s) first departure from the band in closed 128-step `rows`."""
    means = charts.label_means(rows)
    band = bands(means)
    by_label: dict[str, list[LabelBucket]] = {}
    for row in rows:
        by_label.setdefault(row.label, []).append(row)
    # Most labels are inside everywhere: only those outside somewhere can have left.
    outside = {label for cell, at in band.items() for label, mean in means[cell].items() if at.side(mean)}
    found: list[Anomaly] = []
    for label in sorted(outside - skip, key=natural_key):
        for departure in departures(label, means, band):
            anomaly = await _exact(reader, run_id, key, by_label[label], departure, band)
            if anomaly is not None:
                found.append(anomaly)
                break
    return found


async def _exact(
    reader: RollupReader,
    run_id: str,
    key: str,
    rows: list[LabelBucket],
    departure: Departure,
    band: dict[Cell, Band],
) -> Anomaly | None:
    """The step at which a label left the band, from its stored values in the departure's bucket
    and the one before (each value against its own bucket's band); None if it was outside from
    its first value there on and not inside before (it never left)."""
    generation, bucket = departure.cell
    cells = {(generation, bucket - 1), departure.cell} & set(band)
    values: list[tuple[int, int, int, float, float]] = []  # (step, epoch, seq, ts, value)
    for row in rows:
        if (row.generation, row.bucket) in cells:
            for p in await stored_in(reader, run_id, key, row.label, row):
                inside = p.step is not None and (generation, p.step >> FINE_SHIFT) in cells
                if inside and p.value - p.value == 0:
                    values.append((p.step or 0, p.epoch, p.seq, p.ts, p.value))
    if not values:
        return None
    values.sort()
    at = split([band[generation, v[0] >> FINE_SHIFT].side(v[4]) for v in values], departure.side)
    if at == 0 and not departure.was_inside:
        return None
    step, _, _, ts, value = values[at]
    there = band[generation, step >> FINE_SHIFT]
    return Anomaly(
        rows[0].label,
        key,
        step,
        ts,
        "outlier",
        value,
        there.median,
        there.median - there.margin,
        there.median + there.margin,
    )
