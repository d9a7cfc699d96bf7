"""Each label's time per step from a key's stored values, as arrays: what the straggler rules
(runbus.storage.stragglers) count and judge, and the stragglers chart's exact path (per bucket of
steps) shows.

A label's time at a step, for a key whose values are step times (`perf/compute_s`), is the mean of
its finite values there (over its epochs); for any other key it is derived from when the key was
logged: between each two steps a label epoch logged one after the other, the seconds between
their logging times (a step's latest, never below 0) over the steps between them, at the later
step (so a label epoch's first step has none). Over a bucket of steps, the seconds and the steps
of the bucket's values are summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from runbus.storage.columns_numpy import Floats, Ints
from runbus.storage.rollups import STEP_AXIS
from runbus.storage.values import Codes

if TYPE_CHECKING:
    from runbus.storage.base import Store


@dataclass(frozen=True, slots=True)
class Times:
    """Label -> step -> seconds per step as columns in (label, step) order, a (label, step) once:
    `label` indexes `labels` (each with a time at least)."""

    labels: list[str]
    label: Codes
    step: Ints
    time: Floats

    def __len__(self) -> int:
        return len(self.step)

    @classmethod
    def of(cls, times: Mapping[str, Mapping[int, float]]) -> Times:
        """`times` (label -> step -> seconds) as columns."""
        labels = [label for label, steps in times.items() if steps]
        pairs = [
            (code, step, t) for code, label in enumerate(labels) for step, t in sorted(times[label].items())
        ]
        return cls(
            labels,
            np.array([p[0] for p in pairs], np.int32),
            np.array([p[1] for p in pairs], np.int64),
            np.array([p[2] for p in pairs], np.float64),
        )

    def by_label(self) -> dict[str, dict[int, float]]:
        """The times as label -> step -> seconds."""
        found: dict[str, dict[int, float]] = {label: {} for label in self.labels}
        for code, step, t in zip(self.label.tolist(), self.step.tolist(), self.time.tolist(), strict=True):
            found[self.labels[code]][step] = t
        return found

    def take(self, index: Any) -> Times:
        """The times at `index` (a mask or positions, kept in order); labels left with none dropped."""
        label = self.label[index]
        kept = np.unique(label)
        codes = np.zeros(len(self.labels), np.int32)
        codes[kept] = np.arange(len(kept), dtype=np.int32)
        return Times(
            [self.labels[c] for c in kept.tolist()], codes[label], self.step[index], self.time[index]
        )

    def last_steps(self) -> Ints:
        """Each label's last step, in the order of `labels`."""
        return self.step[_group_ends(self.label) - 1]

    def latest(self, count: int) -> Times:
        """Each label's last `count` steps."""
        ends = _group_ends(self.label)
        starts = np.concatenate(([0], ends[:-1]))
        place = np.arange(len(self)) - np.repeat(starts, ends - starts)
        from_end = np.repeat(ends - starts, ends - starts) - place
        return self.take(from_end <= count)


def _group_ends(codes: Ints | Codes) -> Ints:
    """The end (exclusive) of each run of equal codes, of sorted codes."""
    return np.append(np.flatnonzero(codes[1:] != codes[:-1]) + 1, len(codes)).astype(np.int64)


def _groups(*columns: Ints | Codes) -> tuple[Ints, Ints]:
    """Each row's group of equal (column, ...) values, numbered in their sorted order; and each
    group's first row."""
    order = np.lexsort(columns[::-1])
    change = np.zeros(len(order), np.bool_)
    change[:1] = True
    for column in columns:
        ordered = column[order]
        change[1:] |= ordered[1:] != ordered[:-1]
    ids = np.empty(len(order), np.int64)
    ids[order] = np.cumsum(change) - 1
    return ids, order[change]


@dataclass(frozen=True, slots=True)
class Cells:
    """Each label bucket that has values: its label code, bucket, summed seconds and steps (values
    where the key's values are step times), in (label, bucket) order; steps 0 where none counts."""

    label: Codes
    bucket: Ints
    seconds: Floats
    steps: Floats


def cells(
    label: Codes, epoch: Ints, step: Ints, ts: Floats, value: Floats, time_key: bool, shift: int
) -> Cells:
    """The cells of values (one a row, in (label, epoch, seq) order, each with a step) in buckets
    of 2**shift steps: `time_key`'s finite values summed and counted, else the derived seconds and
    steps between each label epoch's logged steps."""
    bucket = step >> shift
    ids, first = _groups(label, bucket)
    count = len(first)
    if time_key:
        finite = np.isfinite(value)
        seconds, steps = _sums(ids, np.where(finite, value, 0.0), count), _sums(ids, finite, count)
    else:
        seconds, steps = _derived(label, epoch, step, ts, ids, count)
    return Cells(label[first], bucket[first], seconds, steps)


def _derived(
    label: Codes, epoch: Ints, step: Ints, ts: Floats, ids: Ints, count: int
) -> tuple[Floats, Floats]:
    """Each cell's seconds and steps between the steps each label epoch logged, at the later one."""
    if not len(label):
        return np.zeros(0), np.zeros(0)
    order = np.lexsort((step, epoch, label))
    label, epoch, step, ts, ids = label[order], epoch[order], step[order], ts[order], ids[order]
    same_step = (label[1:] == label[:-1]) & (epoch[1:] == epoch[:-1]) & (step[1:] == step[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~same_step)))
    # A step's logging time: its latest (a clock lacking a seq, NaN, is passed over).
    logged = np.fmax.reduceat(ts, starts)
    label, epoch, step, ids = label[starts], epoch[starts], step[starts], ids[starts]
    follows = np.flatnonzero((label[1:] == label[:-1]) & (epoch[1:] == epoch[:-1])) + 1
    seconds = _sums(ids[follows], np.fmax(0.0, logged[follows] - logged[follows - 1]), count)
    return seconds, _sums(ids[follows], step[follows] - step[follows - 1], count)


def _sums(ids: Ints, amounts: Any, count: int) -> Floats:
    """The sum of `amounts` of each of `count` cells (`ids`), added in row order as a running sum
    would (bincount: not pairwise, so the same float as adding them one by one)."""
    found: Floats = np.bincount(ids, amounts, count).astype(np.float64, copy=False)
    return found


def times_of(labels: Sequence[str], found: Cells) -> Times:
    """The time per step of each cell that counts a step (`labels`: the names of the cells' codes)."""
    counted = found.steps > 0
    present = np.unique(found.label[counted])
    codes = np.zeros(len(labels), np.int32)
    codes[present] = np.arange(len(present), dtype=np.int32)
    return Times(
        [labels[int(c)] for c in present.tolist()],
        codes[found.label[counted]],
        found.bucket[counted],
        found.seconds[counted] / found.steps[counted],
    )


async def read(
    store: Store, run_id: str, key: str, time_key: bool, recent: int, since: int | None = None
) -> Times:
    """Each label's time per step at each step it logged `key`, from step `since` on, and at least
    its last `recent` logged steps (as far as the key's spacing tells): the health detector's read."""
    extent = await store.key_extent(run_id, key)
    spans = extent.axis_spans(STEP_AXIS) if extent is not None else []
    if extent is None or not spans:
        return Times.of({})
    lo, hi = min(s.x_lo for s in spans), max(s.x_hi for s in spans)
    per_label = max(1, sum(s.n for s in spans) // max(1, extent.labels.get(STEP_AXIS, 1)))
    gap = max(1, (hi - lo + 1) // per_label)
    start = max(lo, hi - (recent + 1) * gap)
    if since is not None:
        start = max(lo, min(start, since))
    # Values at steps start..hi only: the chunks of the steps before are not read.
    found = await store.values(run_id, "metrics", [key], None, (start, hi))
    return times_of(
        found.labels, cells(found.label, found.epoch, found.step, found.ts, found.value, time_key, 0)
    )
