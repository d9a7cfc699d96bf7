"""Which ranks hold the job back: pure rules over each label's compute (or step) times, tested
without servers.

Each step (a logged value: `perf/compute_s` is a mean over the steps since the last one), a
label's time is compared with the median time of the *other* labels at that step. Over the
sliding window of its last WINDOW values, a label is a **chronic** straggler when the median of
those ratios is CHRONIC or more and stands clear of its own spread (median and MAD: a noisy rank
that is sometimes slow is not chronic); it is a **one-off** when one value of the window took
ONE_OFF times the others' or more and stands far out of its own spread. The time the job lost to a
label is what the others spent waiting for it: over the whole run, the sum of its time above the
others' median, step by step (positive only).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runbus.storage.columns_numpy import Floats, Ints, Mask
from runbus.storage.steptimes import Times

WINDOW = 20  # values per label the chronic rule looks at
# Fewer values than this name no chronic straggler: half the window, so a median is never decided
# by a handful of values. A run's first steps are uneven (DDP's first iteration, ranks still
# starting): in bench/stragglers.py every rank's first two took 10-60% longer, and with 5 values a
# healthy rank slow in those two and one more was named chronic.
MIN_VALUES = WINDOW // 2
CHRONIC = 1.10  # median ratio to the others' median time
ONE_OFF = 2.0  # one value this many times the others' is a one-off
SPREAD = 3.0  # how many (scaled) MADs of its own ratios a label must stand clear of 1
ONE_OFF_SPREAD = 6.0
MAD_SCALE = 1.4826  # the MAD of a normal sample times this is its standard deviation
MIN_EXCESS_S = 0.001  # a value less than this above the others' is jitter


@dataclass(frozen=True, slots=True)
class StepTimes:
    """What the straggler rules read of a run: the key the times come from (`derived`: a
    logging time span, not a logged duration), each label's recent times (label -> step ->
    seconds per step, its last WINDOW values) and the seconds each label cost the others over
    the whole run (lost_seconds)."""

    source: str
    derived: bool
    recent: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    lost: Mapping[str, float] = field(default_factory=dict)


def latest(times: Times, count: int = WINDOW) -> dict[str, dict[int, float]]:
    """Each label's last `count` steps of `times`."""
    return times.latest(count).by_label()


def _at(times: Mapping[str, Mapping[int, float]], step: int) -> dict[str, float]:
    """Each label's finite time at `step`, of the labels that have one."""
    return {label: t for label, steps in times.items() if (t := steps.get(step)) is not None and t - t == 0}


def medians_of_others(have: Mapping[str, float]) -> dict[str, float]:
    """Each label's median of the *other* labels' values (at least two labels): one sort, then
    each label's answer read off it, instead of a median per label (a 512-label step took 512
    medians of 511 values)."""
    order = sorted(have.values())
    count = len(order) - 1  # the others of each label
    middle = count // 2
    # Where each value sits in `order` (equal values: any of their places gives the same answer).
    place = {value: index for index, value in enumerate(order)}
    found = {}
    for label, mine in have.items():
        skip = place[mine]  # the others are `order` without this place: later ones shift down one
        low = order[middle - 1 + (middle - 1 >= skip)] if middle else 0.0
        high = order[middle + (middle >= skip)]
        found[label] = high if count % 2 else (low + high) / 2
    return found


def ratios(recent: Mapping[str, Mapping[int, float]]) -> dict[str, list[tuple[int, float, float]]]:
    """Each label's (step, ratio, excess seconds) against the median of the other labels' times
    at the same step, for the steps at least two labels logged, in step order."""
    steps = sorted({step for times in recent.values() for step in times})
    found: dict[str, list[tuple[int, float, float]]] = {label: [] for label in recent}
    for step in steps:
        have = _at(recent, step)
        if len(have) < 2:
            continue
        medians = medians_of_others(have)
        for label, mine in have.items():
            others = medians[label]
            if others > 0:
                found[label].append((step, mine / others, mine - others))
    return found


def _mad(values: Sequence[float], centre: float) -> float:
    return MAD_SCALE * statistics.median(abs(v - centre) for v in values)


def classify(rows: Sequence[tuple[int, float, float]]) -> dict[str, Any] | None:
    """A label's straggler entry from its (step, ratio, excess) rows, or None: chronic (its
    median ratio, its median excess per step), else one-off (the worst value's ratio and step)."""
    rows = list(rows)[-WINDOW:]
    if not rows:
        return None
    ratio_values = [r for _, r, _ in rows]
    centre = statistics.median(ratio_values)
    spread = _mad(ratio_values, centre)
    if len(rows) >= MIN_VALUES and centre >= CHRONIC and centre - 1 > SPREAD * spread / math.sqrt(len(rows)):
        excess = statistics.median(e for _, _, e in rows)
        return {
            "kind": "chronic",
            "behind": round(centre, 3),
            "behind_s": round(excess, 6),
            "step": rows[-1][0],
        }
    step, worst, excess = max(rows, key=lambda row: row[1])
    if worst >= ONE_OFF and excess >= MIN_EXCESS_S and worst - centre > ONE_OFF_SPREAD * spread:
        return {"kind": "one-off", "behind": round(worst, 3), "behind_s": round(excess, 6), "step": step}
    return None


@dataclass(slots=True)
class Tally:
    """The seconds lost to each label so far, counted step by step as the steps come in: the
    steps up to `done` are counted; `last` is each label's last counted step (a value covers the
    steps since its label's previous one: `perf/*` figures are means over them)."""

    done: int = -1
    last: dict[str, int] = field(default_factory=dict)
    lost: dict[str, float] = field(default_factory=dict)

    def count(self, times: Times, block: int = 0) -> None:
        """Count the steps of `times` after `done` up to the last step every label of `times` has
        reached (a later one may still lack values): at each, each label with a finite time loses
        the others' waiting, its time above the median of the others' (at least two labels),
        times the steps since its previous one. `block`: steps x labels counted at once, at most
        (BLOCK_CELLS if 0)."""
        if not len(times):
            return
        upto = int(times.last_steps().min())
        fresh = times.take((times.step > self.done) & (times.step <= upto))
        if len(fresh):
            steps, row = np.unique(fresh.step, return_inverse=True)
            by_row = np.argsort(row, kind="stable")
            width = len(fresh.labels)
            per_block = max(1, (block or BLOCK_CELLS) // width)
            carried = _Carried.of(self, fresh.labels)
            for first in range(0, len(steps), per_block):
                end = min(first + per_block, len(steps))
                mine = by_row[np.searchsorted(row[by_row], first) : np.searchsorted(row[by_row], end)]
                table = np.full((end - first, width), np.nan)
                table[row[mine] - first, fresh.label[mine]] = fresh.time[mine]
                carried.count(steps[first:end], table)
            carried.keep(self, fresh.labels)
        self.done = max(self.done, upto)


BLOCK_CELLS = 1 << 20  # steps x labels counted at once, at most: a long first read in slices


@dataclass(slots=True)
class _Carried:
    """A tally's figures as columns, one per label, while a count runs block by block."""

    last: Ints
    lost: Floats
    seen: Mask  # the labels a step counted (with at least two labels): lost holds them
    logged: Mask  # the labels with a time at a step counted: last holds them

    @classmethod
    def of(cls, tally: Tally, labels: list[str]) -> _Carried:
        return cls(
            np.array([tally.last.get(label, -1) for label in labels], np.int64),
            np.array([tally.lost.get(label, 0.0) for label in labels], np.float64),
            np.array([label in tally.lost for label in labels], np.bool_),
            np.array([label in tally.last for label in labels], np.bool_),
        )

    def count(self, steps: Ints, table: Floats) -> None:
        """Count `steps` (rising), `table` their times (a row a step, a column a label, NaN where none)."""
        have = np.isfinite(table)
        judged = have & (have.sum(axis=1) >= 2)[:, None]
        # Each label's previous step with a time, for each step: what its value covers.
        logged = np.maximum.accumulate(np.where(have, steps[:, None], np.iinfo(np.int64).min), axis=0)
        before = np.vstack((self.last[None, :], logged[:-1]))
        np.maximum(before, self.last[None, :], out=before)
        excess = np.fmax(0.0, table - others_median(table, have)) * (steps[:, None] - before)
        # A running sum down each column, from the lost carried in: each label's additions in step order.
        running = np.cumsum(np.vstack((self.lost[None, :], np.where(judged, excess, 0.0))), axis=0)
        self.lost = running[-1]
        self.last = np.maximum(self.last, logged[-1])
        self.seen |= judged.any(axis=0)
        self.logged |= have.any(axis=0)

    def keep(self, tally: Tally, labels: list[str]) -> None:
        columns = (self.last.tolist(), self.lost.tolist(), self.seen.tolist(), self.logged.tolist())
        for label, last, lost, seen, logged in zip(labels, *columns, strict=True):
            if logged:
                tally.last[label] = last
            if seen:
                tally.lost[label] = lost


def others_median(table: Floats, have: Mask) -> Floats:
    """At each row of `table` (NaN where `have` is False), each finite value's median of the
    row's *other* finite values (NaN where fewer than two): medians_of_others, a row at a time."""
    order = np.argsort(np.where(have, table, np.inf), axis=1, kind="stable")
    ordered = np.take_along_axis(table, order, axis=1)
    place = np.empty_like(order)
    np.put_along_axis(place, order, np.arange(table.shape[1])[None, :], axis=1)
    others = have.sum(axis=1, keepdims=True) - 1
    middle = others // 2
    last = table.shape[1] - 1
    low = np.take_along_axis(ordered, np.clip(middle - 1 + (middle - 1 >= place), 0, last), axis=1)
    high = np.take_along_axis(ordered, np.clip(middle + (middle >= place), 0, last), axis=1)
    found: Floats = np.where(others % 2 == 1, high, (low + high) / 2)
    return np.where(have & (others >= 1), found, np.nan)


def find(times: StepTimes, beats: Mapping[str, Mapping[str, Any] | None]) -> list[dict[str, Any]]:
    """The run's stragglers, chronic first, then by the time lost to them: each with its kind,
    how far behind it is (`behind`: ratio to the others' median; `behind_s`: seconds per step),
    the step it was last judged at, the seconds lost to it (`lost_s`), the times' source, and
    where it runs (`host`, `pid`, from its heartbeat)."""
    found = []
    for label, rows in ratios(times.recent).items():
        entry = classify(rows)
        if entry is None:
            continue
        beat = beats.get(label) or {}
        entry = {
            "label": label,
            **entry,
            "lost_s": round(times.lost.get(label, 0.0), 3),
            "source": times.source,
            "host": beat.get("host"),
            "pid": beat.get("pid"),
        }
        found.append(entry)
    found.sort(key=lambda s: (s["kind"] != "chronic", -s["lost_s"], s["label"]))
    return found


def chronic(stragglers: Sequence[Mapping[str, Any]]) -> list[str]:
    """The labels of the chronic stragglers."""
    return [s["label"] for s in stragglers if s.get("kind") == "chronic"]
