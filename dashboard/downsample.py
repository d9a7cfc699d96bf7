"""Cutting a long series down to a few thousand buckets per line without hiding its spikes.

A series of N points sorted by x becomes at most `limit` buckets of consecutive points (equal
counts, so a dense stretch keeps its detail). Each bucket is one row of COLUMNS:

- `x`, `value`: the x and the value of the bucket's last point: a real logged point, so a line
  through them is the series itself, sampled;
- `mean`, `min`, `max`: over the bucket's values; NaN is left out, ±inf counts for min and max
  (a spike to infinity stays visible) but not for the mean; null when nothing is left;
- `n`: how many points the bucket holds.

Non-finite values are written as the wire writes them: "NaN", "Infinity", "-Infinity".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runbus.wire import finite_to_wire

COLUMNS = ("x", "value", "mean", "min", "max", "n")
DEFAULT_POINTS = 2000
MIN_POINTS = 10
MAX_POINTS = 10_000

Row = list[float | int | str | None]


def json_number(value: float | int) -> float | int | str:
    """A value for a JSON document: non-finite floats become the wire's strings."""
    return finite_to_wire(value) if isinstance(value, float) else value


def _bucket(xs: Sequence[float], values: Sequence[float]) -> Row:
    real = [v for v in values if not math.isnan(v)]
    finite = [v for v in real if math.isfinite(v)]
    mean = math.fsum(finite) / len(finite) if finite else None
    low = min(real) if real else None
    high = max(real) if real else None
    return [
        xs[-1],
        json_number(values[-1]),
        mean,
        None if low is None else json_number(low),
        None if high is None else json_number(high),
        len(values),
    ]


def downsample(xs: Sequence[float], values: Sequence[float], limit: int = DEFAULT_POINTS) -> list[Row]:
    """At most `limit` rows of COLUMNS for the points (xs[i], values[i]), xs sorted."""
    if len(xs) != len(values):
        raise ValueError("xs and values differ in length")
    if limit < 1:
        raise ValueError("limit must be at least 1")
    count = len(xs)
    if count <= limit:
        return [_bucket(xs[i : i + 1], values[i : i + 1]) for i in range(count)]
    rows = []
    for index in range(limit):
        start, end = index * count // limit, (index + 1) * count // limit
        rows.append(_bucket(xs[start:end], values[start:end]))
    return rows
