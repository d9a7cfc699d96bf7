"""When a label leaves the cross-rank band: pure rules over bucket means and values, no servers.

The band at a 128-step bucket is the labels' means there: its median, and a margin of K robust
standard deviations (the median absolute deviation, scaled to a normal's sigma) or REL of the
median's size, whichever is more. The floor keeps ranks that log identical values (a spread of
0) from flagging float noise, and keeps healthy ranks that drift apart from being named: ranks
whose losses decay at their own rates (bench/columns.py's noisy keys) end up to 30% from the
median, and a few ranks clustered together make a small MAD.
A label has left it where its mean is outside on one side for two buckets in a row (one noisy
bucket is no anomaly) after it was inside; a label outside from its first value on never left:
ranks that differ by design (rank 0 does more work) are not anomalies. The exact step is the one
that best splits the label's values there into inside before and outside from it on.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# Robust standard deviations a mean must lie from the median: 6 keeps healthy ranks' noise in
# (for 8 labels' 128-step means, a false alarm needs two buckets in a row past 6 sigmas).
K = 6.0
MAD_SIGMA = 1.4826  # a normal's sigma per median absolute deviation
# The margin's floor, of |median|: above the 32% that 1,000 simulated healthy runs of 4 to 16
# labels reached (bench/columns.py's noisy keys: none named), far below a rank gone 5x.
REL = 0.4
TINY = 1e-12  # the margin when every label logs 0
# Fewer labels make no band: with 2 neither is the odd one out, with 3 one rank's noise alone
# sets the spread; from 4 on, one rank leaving moves neither the median nor the MAD much.
MIN_LABELS = 4

# A bucket of a run's key: (generation, 128-step bucket).
Cell = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Band:
    """The labels' median at a bucket and how far from it a mean may lie."""

    median: float
    margin: float

    def side(self, value: float) -> int:
        """-1 below the band, 1 above it, 0 inside."""
        if value > self.median + self.margin:
            return 1
        if value < self.median - self.margin:
            return -1
        return 0


def band_of(means: Iterable[float]) -> Band | None:
    """The band of the labels' means at one bucket; None with fewer than MIN_LABELS."""
    values = list(means)
    if len(values) < MIN_LABELS:
        return None
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return Band(median, max(K * MAD_SIGMA * mad, REL * abs(median), TINY))


def bands(means: Mapping[Cell, Mapping[str, float]]) -> dict[Cell, Band]:
    """Each bucket's band, of the buckets with enough labels."""
    found = {cell: band_of(by_label.values()) for cell, by_label in means.items()}
    return {cell: band for cell, band in found.items() if band is not None}


def side_of(
    label: str, cell: Cell, means: Mapping[Cell, Mapping[str, float]], band: Mapping[Cell, Band]
) -> int | None:
    """Where `label`'s mean lies against the band at `cell` (Band.side); None without either."""
    mean, at = means.get(cell, {}).get(label), band.get(cell)
    return None if mean is None or at is None else at.side(mean)


def going_out(means: Mapping[Cell, Mapping[str, float]], band: Mapping[Cell, Band]) -> set[Cell]:
    """The buckets where a label's mean is outside the band and was not, on that side, in the
    bucket before."""
    found: set[Cell] = set()
    for cell, by_label in means.items():
        for label in by_label:
            side = side_of(label, cell, means, band)
            if side and side_of(label, (cell[0], cell[1] - 1), means, band) != side:
                found.add(cell)
                break
    return found


@dataclass(frozen=True, slots=True)
class Departure:
    """Where a label's means went outside and stayed: the first bucket outside, the side, and
    whether its bucket before was inside."""

    cell: Cell
    side: int
    was_inside: bool


def departures(
    label: str, means: Mapping[Cell, Mapping[str, float]], band: Mapping[Cell, Band]
) -> list[Departure]:
    """Every bucket at which `label`'s mean goes outside the band and stays outside (on the same
    side) in the next bucket, in order; not one whose bucket before was outside on that side."""
    found: list[Departure] = []
    for cell in sorted(means):
        now = side_of(label, cell, means, band)
        if not now:
            continue
        generation, bucket = cell
        before = side_of(label, (generation, bucket - 1), means, band)
        if before != now and side_of(label, (generation, bucket + 1), means, band) == now:
            found.append(Departure(cell, now, before == 0))
    return found


def split(sides: Sequence[int], side: int) -> int:
    """The index of the value from which a label is outside on `side`, of its values' sides in
    order: the split with the fewest values on the wrong side of it (outside before, or not
    outside after), the earliest of equals (0: outside from its first value on)."""
    outside = [s == side for s in sides]
    errors = sum(1 for o in outside if not o)  # the split at 0: every value not outside is wrong
    best, best_errors = 0, errors
    for i, out in enumerate(outside[:-1], start=1):
        errors += 1 if out else -1
        if errors < best_errors:
            best, best_errors = i, errors
    return best
