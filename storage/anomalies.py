"""Where a run went NaN or inf: each label's first non-finite value of each key, from stored data.

The rollups count every bucket's NaN and ±inf values (storage/rollups.py), so the search reads
little: a key whose run rows at a coarse width count none is passed over in one read; for the
others, the label rows of the flagged coarse buckets, in step order, name each label's first one
(until every label of the key is named), its 128-step rows narrow it to one bucket, and that
bucket's stored values give the exact step. Values logged without a step are searched the same
way by their second (their anomaly has no step). One implementation over RollupReader: SQLite
and PostgreSQL answer alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from runbus.storage import charts
from runbus.storage.base import LabelBucket, Point, RollupReader
from runbus.storage.rollups import FINE_SHIFT, FINE_WIDTH, FIRST_SEQ, INF, LAST_SEQ, NAN, STEP_AXIS, TS_AXIS
from runbus.storage.rules import natural_key

# The coarse pass reads a key's run rows in at most this many buckets.
COARSE_BUCKETS = 64
PAGE = 5000


@dataclass(frozen=True, slots=True)
class Anomaly:
    """A label's first non-finite value of a key: its step (None: logged without one), its ts and
    whether it was NaN or ±inf; or (kind "outlier", storage/outliers.py) the first step at which
    it left the cross-rank band, with its value there and the band (median, lo, hi) it left."""

    label: str
    key: str
    step: int | None
    ts: float
    kind: Literal["nan", "inf", "outlier"]
    value: float | None = None
    median: float | None = None
    lo: float | None = None
    hi: float | None = None

    def document(self) -> dict[str, Any]:
        """As `runbus show --json`, the API and the health object give it: the band's figures for
        an outlier only."""
        doc: dict[str, Any] = {"label": self.label, "key": self.key, "step": self.step, "kind": self.kind}
        doc["ts"] = self.ts
        if self.kind == "outlier":
            doc.update(value=self.value, median=self.median, band=[self.lo, self.hi])
        return doc


class KeyedReader(RollupReader, Protocol):
    async def metric_keys(self, run_id: str) -> list[str]: ...


def in_order(found: Iterable[Anomaly]) -> list[Anomaly]:
    """Anomalies by step (those without one last), then ts, label and key: the first went bad first."""
    return sorted(found, key=lambda a: (a.step is None, a.step or 0, a.ts, natural_key(a.label), a.key))


async def non_finite(reader: KeyedReader, run_id: str, keys: Sequence[str] | None = None) -> list[Anomaly]:
    """The first NaN or inf of each (label, key) of the run (of `keys`, all if None), in_order."""
    found: list[Anomaly] = []
    for key in await reader.metric_keys(run_id) if keys is None else keys:
        found.extend(await first_non_finite(reader, run_id, key))
    return in_order(found)


async def first_non_finite(
    reader: RollupReader,
    run_id: str,
    key: str,
    start: int | None = None,
    end: int | None = None,
    limit: int | None = None,
) -> list[Anomaly]:
    """Each label's first non-finite value of `key` (by step; without a step, by ts), of those
    from step `start` to step `end` (a chart's view: then values without a step are left out);
    in_order; with `limit`, the first `limit` of them, read from the labels whose first one lies
    in the lowest 128-step buckets (a chart names a few: a run whose labels went bad one after
    another is not read label by label)."""
    extent = await reader.key_extent(run_id, key)
    if extent is None:
        return []
    firsts: dict[str, Anomaly] = {}
    for axis in (STEP_AXIS, TS_AXIS) if start is None and end is None else (STEP_AXIS,):
        spans = extent.axis_spans(axis)
        if not spans:
            continue
        lo, hi = min(s.x_lo for s in spans), max(s.x_hi for s in spans)
        window = (lo if start is None else max(lo, start), hi if end is None else min(hi, end))
        if window[0] > window[1]:
            continue
        candidates = await _candidates(reader, run_id, key, axis, window, extent.labels.get(axis, 0))
        if limit is not None and len(candidates) > limit:
            # Labels whose first bucket is the same are told apart by their values only.
            last = candidates[limit - 1][1][0][0].bucket
            candidates = [c for c in candidates if c[1][0][0].bucket <= last]
        for label, rows in candidates:
            anomaly = await _first_in(reader, run_id, key, axis, window, label, rows)
            if anomaly is not None:
                firsts.setdefault(label, anomaly)  # a value with a step comes before one without
    return in_order(firsts.values())[:limit]


async def _candidates(
    reader: RollupReader, run_id: str, key: str, axis: int, window: tuple[int, int], labels: int
) -> list[tuple[str, list[list[LabelBucket]]]]:
    """The labels with a non-finite value in `window`, each with its flagged 128-step buckets in
    order, the labels whose first such bucket is lowest first."""
    lo, hi = window
    width = charts.choose_width(hi - lo + 1, COARSE_BUCKETS)
    shift = width.bit_length() - 1
    coarse = await reader.run_buckets(run_id, key, axis, width, lo >> shift, hi >> shift)
    flagged = sorted({b.bucket for b in coarse if b.part[NAN] or b.part[INF]})
    if not flagged:
        return []
    by_bucket: dict[int, list[str]] = {}
    for label, bucket in (await _first_buckets(reader, run_id, key, axis, width, flagged, labels)).items():
        by_bucket.setdefault(bucket, []).append(label)
    found: list[tuple[str, list[list[LabelBucket]]]] = []
    fine = shift - FINE_SHIFT
    for bucket, names in by_bucket.items():
        rows = await reader.label_buckets(
            run_id, key, axis, FINE_WIDTH, bucket << fine, ((bucket + 1) << fine) - 1, names
        )
        found.extend(_flagged(rows).items())
    return sorted(found, key=lambda item: (item[1][0][0].bucket, natural_key(item[0])))


async def _first_in(
    reader: RollupReader,
    run_id: str,
    key: str,
    axis: int,
    window: tuple[int, int],
    label: str,
    rows: list[list[LabelBucket]],
) -> Anomaly | None:
    """The label's first non-finite value in `window`, from its flagged 128-step buckets in order
    (one at the window's edges may hold its non-finite values outside)."""
    for bucket_rows in rows:
        anomaly = await _exact(reader, run_id, key, axis, window, label, bucket_rows)
        if anomaly is not None:
            return anomaly
    return None


async def _first_buckets(
    reader: RollupReader, run_id: str, key: str, axis: int, width: int, flagged: list[int], labels: int
) -> dict[str, int]:
    """Each label's first coarse bucket of `flagged` (in order) holding a non-finite value, read
    until every one of the key's `labels` is named."""
    open_rows = await reader.open_buckets(run_id, key, axis, None)
    first: dict[str, int] = {}
    for bucket in flagged:
        for row in await charts.label_rows(reader, run_id, key, axis, width, bucket, bucket, None, open_rows):
            if row.part[NAN] or row.part[INF]:
                first.setdefault(row.label, bucket)
        if len(first) >= labels:
            break
    return first


def _flagged(rows: Iterable[LabelBucket]) -> dict[str, list[list[LabelBucket]]]:
    """Each label's 128-step buckets holding a non-finite value, in order, a bucket's rows (an
    epoch each) together."""
    by_label: dict[str, dict[int, list[LabelBucket]]] = {}
    for row in rows:
        if row.part[NAN] or row.part[INF]:
            by_label.setdefault(row.label, {}).setdefault(row.bucket, []).append(row)
    return {label: [buckets[b] for b in sorted(buckets)] for label, buckets in by_label.items()}


async def _exact(
    reader: RollupReader,
    run_id: str,
    key: str,
    axis: int,
    window: tuple[int, int],
    label: str,
    rows: list[LabelBucket],
) -> Anomaly | None:
    """The label's first non-finite value in its 128-step bucket `rows` (read as stored)."""
    bucket, on_steps = rows[0].bucket, axis == STEP_AXIS
    bad: list[tuple[int, float, float]] = []
    for row in rows:
        for p in await stored_in(reader, run_id, key, label, row):
            if (p.step is not None) != on_steps or p.value - p.value == 0:
                continue
            x = p.step if p.step is not None else math.floor(p.ts)
            if x >> FINE_SHIFT == bucket and window[0] <= x <= window[1]:
                bad.append((x, p.ts, p.value))
    if not bad:
        return None
    x, ts, value = min(bad, key=lambda b: b[:2])
    return Anomaly(label, key, x if on_steps else None, ts, "nan" if value != value else "inf")


async def stored_in(reader: RollupReader, run_id: str, key: str, label: str, row: LabelBucket) -> list[Point]:
    """The label's stored values of `key` in the seq range of its rollup row `row`."""
    values: list[Point] = []
    after: tuple[str, int, int] = (key, row.epoch, row.part[FIRST_SEQ] - 1)
    while True:
        page = await reader.point_page("metrics", run_id, label, after, PAGE, key=key)
        mine = [p for p in page if p.epoch == row.epoch and p.seq <= row.part[LAST_SEQ]]
        values.extend(mine)
        if len(mine) < len(page) or len(page) < PAGE:
            return values
        after = (key, page[-1].epoch, page[-1].seq)
