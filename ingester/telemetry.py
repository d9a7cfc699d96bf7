"""A worker's figures for `/metrics`, written in Prometheus' text exposition format (0.0.4).

Hand-written rather than through prometheus_client: a dozen series, one registry per worker (so
several workers can share a test process), and no dependency for it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runbus.ingester.worker import WorkerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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


@dataclass(frozen=True, slots=True)
class StreamBacklog:
    """One stream as the group sees it: entries not yet delivered (None where Redis cannot tell)
    and entries delivered but not acknowledged."""

    stream: str
    lag: int | None
    pending: int


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in labels.items()) + "}"


class Exposition:
    """Lines of the text format, one metric family at a time."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self, name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, str], float]]
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        self.lines.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)

    def single(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.family(name, kind, help_text, [({}, value)])

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, count in zip((*histogram.bounds, math.inf), histogram.counts, strict=True):
            cumulative += count
            self.lines.append(f'{name}_bucket{{le="{_number(float(bound))}"}} {cumulative}')
        self.lines.append(f"{name}_sum {_number(histogram.total)}")
        self.lines.append(f"{name}_count {histogram.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(
    stats: WorkerStats,
    consumer: str,
    group: str,
    backlog: list[StreamBacklog] | None,
    missing: Mapping[str, int] | None,
    max_streams: int,
) -> str:
    """The `/metrics` page of one worker.

    `backlog` is None when Redis could not be asked; `missing` is None until first computed.
    Only the `max_streams` streams with the most lag and pending get a series of their own; the
    totals cover every stream.
    """
    out = Exposition()
    out.family(
        "runbus_ingester_info",
        "gauge",
        "This worker's consumer name and group.",
        [({"consumer": consumer, "group": group}, 1)],
    )
    out.family(
        "runbus_ingested_events_total",
        "counter",
        "Valid events written in committed batches, by kind (a redelivered event counts again).",
        [({"kind": kind}, count) for kind, count in sorted(stats.by_kind.items())],
    )
    out.single("runbus_stored_events_total", "counter", "Events new to the store.", stats.stored)
    out.single(
        "runbus_duplicate_events_total",
        "counter",
        "Events the store already had (redeliveries), stored once.",
        stats.duplicates,
    )
    out.single("runbus_entries_total", "counter", "Stream entries processed and acknowledged.", stats.entries)
    out.single("runbus_batches_total", "counter", "Batches written and acknowledged.", stats.batches)
    out.histogram("runbus_batch_size_entries", "Entries per batch.", stats.batch_sizes)
    out.histogram(
        "runbus_store_write_seconds",
        "Time of one successful store write (one transaction).",
        stats.write_seconds,
    )
    out.single("runbus_dead_lettered_total", "counter", "Entries copied to runbus:dead.", stats.dead_lettered)
    out.single(
        "runbus_poison_total",
        "counter",
        "Dead-lettered because delivered more than --max-deliveries times.",
        stats.poison,
    )
    out.single("runbus_claimed_total", "counter", "Entries claimed from idle consumers.", stats.claimed)
    out.single(
        "runbus_reconnects_total",
        "counter",
        "Retries while Redis (or the store, when connecting) was unreachable.",
        stats.reconnects,
    )
    out.single(
        "runbus_store_retries_total",
        "counter",
        "Store writes retried while the store was unavailable (StoreUnavailable).",
        stats.store_retries,
    )
    out.single("runbus_trimmed_total", "counter", "Stored entries trimmed from the streams.", stats.trimmed)
    out.single("runbus_crashed_labels_total", "counter", "Labels this worker marked crashed.", stats.crashed)
    if backlog is not None:
        out.single("runbus_streams", "gauge", "Streams this worker reads.", len(backlog))
        out.single(
            "runbus_lag_entries",
            "gauge",
            "Entries the group has not read yet, all streams.",
            sum(b.lag or 0 for b in backlog),
        )
        out.single(
            "runbus_pending_entries",
            "gauge",
            "Entries read but not acknowledged, all streams.",
            sum(b.pending for b in backlog),
        )
        top = sorted(backlog, key=lambda b: (-((b.lag or 0) + b.pending), b.stream))[:max_streams]
        out.family(
            "runbus_stream_lag_entries",
            "gauge",
            "Entries of a stream the group has not read yet.",
            [({"stream": b.stream}, b.lag) for b in top if b.lag is not None],
        )
        out.family(
            "runbus_stream_pending_entries",
            "gauge",
            "Entries of a stream read, not acknowledged.",
            [({"stream": b.stream}, b.pending) for b in top],
        )
    if missing is not None:
        out.family(
            "runbus_missing_events",
            "gauge",
            "Gaps: seq numbers never stored, per run this worker wrote to in the last hour.",
            [({"run": run}, count) for run, count in sorted(missing.items())],
        )
    return out.text()
