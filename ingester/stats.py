"""A worker's counters: plain attributes its hot path bumps, read by its log lines and, only when
scraped, by /metrics (ingester/telemetry.py turns them into Prometheus metrics there)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

BATCH_SIZE_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
WRITE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    """Observations counted into fixed upper bounds, as a Prometheus histogram."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value


def batch_size_histogram() -> Histogram:
    return Histogram(BATCH_SIZE_BUCKETS)


def write_seconds_histogram() -> Histogram:
    return Histogram(WRITE_SECONDS_BUCKETS)


@dataclass
class WorkerStats:
    """Counters reported in the stats and shutdown lines."""

    batches: int = 0
    entries: int = 0
    stored: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    claimed: int = 0
    poison: int = 0
    trimmed: int = 0
    crashed: int = 0
    store_retries: int = 0
    reconnects: int = 0
    # For /metrics: valid events written by kind, batch sizes, write times, and when each run was
    # last written to (time.time()).
    by_kind: dict[str, int] = field(default_factory=dict)
    batch_sizes: Histogram = field(default_factory=batch_size_histogram)
    write_seconds: Histogram = field(default_factory=write_seconds_histogram)
    runs_written: dict[str, float] = field(default_factory=dict)
