"""A worker's `/metrics`: its counters as Prometheus metrics, through prometheus_client.

The worker only bumps plain attributes (ingester/stats.py); a custom collector reads them when
scraped, so ingesting never calls into prometheus_client. Each worker has a registry of its own,
never the library's global default, so several workers in one process (as in the tests) do not
clash.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from runbus.ingester.stats import Histogram, WorkerStats
from runbus.storage.health import ANOMALY, DEAD, OK, SILENT, STALLED, STRAGGLING

# The states a live run's health gauge has a series for (one is 1, the others 0).
RUN_STATES = (OK, STALLED, DEAD, SILENT, ANOMALY, STRAGGLING, "unknown")
# Live runs with series of their own at most: those that need attention first.
MAX_RUN_SERIES = 500


@dataclass(frozen=True, slots=True)
class StreamBacklog:
    """One stream as the group sees it: entries not yet delivered (None where Redis cannot tell)
    and entries delivered but not acknowledged."""

    stream: str
    lag: int | None
    pending: int


# The counters of WorkerStats: (metric name, attribute, help).
COUNTERS = (
    ("runbus_stored_events_total", "stored", "Events new to the store."),
    (
        "runbus_duplicate_events_total",
        "duplicates",
        "Events the store already had (redeliveries), stored once.",
    ),
    ("runbus_entries_total", "entries", "Stream entries processed and acknowledged."),
    ("runbus_batches_total", "batches", "Batches written and acknowledged."),
    ("runbus_dead_lettered_total", "dead_lettered", "Entries copied to runbus:dead."),
    ("runbus_poison_total", "poison", "Dead-lettered because delivered more than --max-deliveries times."),
    ("runbus_claimed_total", "claimed", "Entries claimed from idle consumers."),
    (
        "runbus_reconnects_total",
        "reconnects",
        "Retries while Redis (or the store, when connecting) was unreachable.",
    ),
    (
        "runbus_store_retries_total",
        "store_retries",
        "Store writes retried while the store was unavailable.",
    ),
    ("runbus_trimmed_total", "trimmed", "Stored entries trimmed from the streams."),
    ("runbus_crashed_labels_total", "crashed", "Labels this worker marked crashed."),
)


def histogram_family(name: str, help_text: str, histogram: Histogram) -> HistogramMetricFamily:
    cumulative = accumulate(histogram.counts)
    buckets = [
        (floatToGoString(bound), count)  # type: ignore[no-untyped-call]  # prometheus_client has no annotations here
        for bound, count in zip((*histogram.bounds, math.inf), cumulative, strict=True)
    ]
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=histogram.total)


class WorkerCollector(Collector):
    """One worker's figures, read from its WorkerStats at each scrape.

    The scrape handler sets `backlog` (None when Redis could not be asked) and `missing` (None
    until first computed) before collecting. Only the `max_streams` streams with the most lag
    and pending get a series of their own; the totals cover every stream.
    """

    def __init__(self, stats: WorkerStats, consumer: str, group: str, max_streams: int) -> None:
        self.stats = stats
        self.consumer, self.group = consumer, group
        self.max_streams = max_streams
        self.backlog: list[StreamBacklog] | None = None
        self.missing: Mapping[str, int] | None = None
        # Each live run's health object, as the worker's detector last judged it (HealthKeeper.live).
        self.health: Mapping[str, Mapping[str, Any]] = {}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        info = GaugeMetricFamily(
            "runbus_ingester_info", "This worker's consumer name and group.", labels=["consumer", "group"]
        )
        info.add_metric([self.consumer, self.group], 1)
        yield info
        by_kind = CounterMetricFamily(
            "runbus_ingested_events_total",
            "Valid events written in committed batches, by kind (a redelivered event counts again).",
            labels=["kind"],
        )
        for kind, count in sorted(stats.by_kind.items()):
            by_kind.add_metric([kind], count)
        yield by_kind
        for name, attribute, help_text in COUNTERS:
            yield CounterMetricFamily(name, help_text, value=getattr(stats, attribute))
        yield histogram_family("runbus_batch_size_entries", "Entries per batch.", stats.batch_sizes)
        yield histogram_family(
            "runbus_store_write_seconds",
            "Time of one successful store write (one transaction).",
            stats.write_seconds,
        )
        yield from self._backlog()
        if self.missing is not None:
            missing = GaugeMetricFamily(
                "runbus_missing_events",
                "Gaps: seq numbers never stored, per run this worker wrote to in the last hour.",
                labels=["run"],
            )
            for run, count in sorted(self.missing.items()):
                missing.add_metric([run], count)
            yield missing
        yield from run_health(self.health)
        yield from process_setup()

    def _backlog(self) -> Iterator[Metric]:
        backlog = self.backlog
        if backlog is None:
            return
        yield GaugeMetricFamily("runbus_streams", "Streams this worker reads.", value=len(backlog))
        yield GaugeMetricFamily(
            "runbus_lag_entries",
            "Entries the group has not read yet, all streams.",
            value=sum(b.lag or 0 for b in backlog),
        )
        yield GaugeMetricFamily(
            "runbus_pending_entries",
            "Entries read but not acknowledged, all streams.",
            value=sum(b.pending for b in backlog),
        )
        top = sorted(backlog, key=lambda b: (-((b.lag or 0) + b.pending), b.stream))[: self.max_streams]
        lag = GaugeMetricFamily(
            "runbus_stream_lag_entries", "Entries of a stream the group has not read yet.", labels=["stream"]
        )
        pending = GaugeMetricFamily(
            "runbus_stream_pending_entries", "Entries of a stream read, not acknowledged.", labels=["stream"]
        )
        for b in top:
            if b.lag is not None:
                lag.add_metric([b.stream], b.lag)
            pending.add_metric([b.stream], b.pending)
        yield lag
        yield pending


def run_health(health: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """Gauges per live run from its health object (an ended run's series go with it)."""
    state = GaugeMetricFamily(
        "runbus_run_health", "1 for the live run's health state, 0 for the others.", labels=["run", "state"]
    )
    culprits = GaugeMetricFamily("runbus_run_culprits", "Labels at fault in a live run.", labels=["run"])
    slow = GaugeMetricFamily("runbus_run_stragglers", "Chronic stragglers of a live run.", labels=["run"])
    anomalies = GaugeMetricFamily(
        "runbus_run_anomalies",
        "Labels of a live run that logged NaN or inf or left the cross-rank band.",
        labels=["run"],
    )
    stalled = GaugeMetricFamily(
        "runbus_run_stalled_seconds", "Seconds a live run has been stalled (0 if not).", labels=["run"]
    )
    lost = GaugeMetricFamily(
        "runbus_run_lost_seconds", "Seconds a live run's ranks waited for its stragglers.", labels=["run"]
    )
    now = time.time()
    chosen = sorted(health.items(), key=lambda item: (item[1].get("state") == OK, item[0]))
    for run, doc in chosen[:MAX_RUN_SERIES]:
        current = doc.get("state")
        for name in RUN_STATES:
            state.add_metric([run, name], 1 if name == current else 0)
        culprits.add_metric([run], len(doc.get("culprits") or []))
        stragglers = doc.get("stragglers") or []
        slow.add_metric([run], sum(1 for s in stragglers if s.get("kind") == "chronic"))
        anomalies.add_metric([run], len({a.get("label") for a in doc.get("anomalies") or []}))
        since = doc.get("since")
        stalled.add_metric([run], max(0.0, now - since) if current == STALLED and since else 0.0)
        lost.add_metric([run], sum(s.get("lost_s") or 0.0 for s in stragglers))
    yield from (state, culprits, slow, anomalies, stalled, lost)


def process_setup() -> Iterator[Metric]:
    """The garbage collector's setup of this process (ingester/process.py tunes a worker's)."""
    thresholds = GaugeMetricFamily(
        "runbus_gc_threshold", "The garbage collector's threshold, per generation.", labels=["generation"]
    )
    for generation, threshold in enumerate(gc.get_threshold()):
        thresholds.add_metric([str(generation)], threshold)
    yield thresholds
    yield GaugeMetricFamily(
        "runbus_gc_frozen_objects",
        "Objects frozen out of the garbage collector's sweeps (gc.freeze at start-up).",
        value=gc.get_freeze_count(),
    )


def worker_registry(collector: WorkerCollector) -> CollectorRegistry:
    """A registry of the worker's own: its figures, and its process's CPU, memory, open files,
    garbage collections and Python version (prometheus_client's standard collectors)."""
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
