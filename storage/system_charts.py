"""Chart reads of system samples: a figure's band across labels (or across one host's labels),
and its lines, from the rollups the store keeps of every system key (rollups.series_run), by the
metric charts' code (charts.envelope over FigureRollups).

A figure is a system key with its GPU index taken out: `gpu.0.util` and `gpu.3.util` are both
of the figure `gpu.util`, so one chart shows every GPU of every label. Each key of a figure is a
series of its own, so the band's p10/p50/p90 are across every GPU's means, and a line is one
label's key: `rank3`, or `rank3 · gpu0` in a GPU figure. x is the wall time (ts): system samples
have no step.

Narrowed to one host's labels, the band is made from those labels' rollup rows instead of the
run's (there are at most a few per bucket): its quantiles are across their lines' means in each
bucket.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

from runbus.storage import charts, rollups
from runbus.storage.base import (
    ALL_LINES_UP_TO,
    DEFAULT_OUTLIERS,
    DEFAULT_POINTS,
    Envelope,
    KeyExtent,
    LabelBucket,
    Point,
    PointTable,
    RunBucket,
    Span,
    Store,
)
from runbus.storage.rules import natural_key

_GPU_KEY = re.compile(r"gpu\.(\d+)\.(.+)")


def figure_of(key: str) -> str:
    """The figure a system key shows: `gpu.{i}.{name}` is `gpu.{name}`, any other key itself."""
    gpu = _GPU_KEY.fullmatch(key)
    return f"gpu.{gpu[2]}" if gpu else key


def figures(keys: Iterable[str]) -> dict[str, list[str]]:
    """The keys of each figure, by figure, both sorted."""
    found: dict[str, list[str]] = {}
    for key in sorted(keys):
        found.setdefault(figure_of(key), []).append(key)
    return dict(sorted(found.items()))


def line_suffix(key: str) -> str:
    """What a key adds to a label's name to name its line: its GPU, if it has one."""
    gpu = _GPU_KEY.fullmatch(key)
    return f" · gpu{gpu[1]}" if gpu else ""


@dataclass(frozen=True)
class FigureRollups:
    """One figure's rollups read as one key's (charts.RollupReader): its keys' rows together, a
    line per label and key. `labels`: only these labels' (all if None). Every read ignores the
    key and table it is given: it is the figure, in the system table."""

    store: Store
    keys: Sequence[str]
    labels: Sequence[str] | None = None

    def _named(self, row: LabelBucket, key: str) -> LabelBucket:
        return LabelBucket(row.label + line_suffix(key), row.epoch, row.generation, row.bucket, row.part)

    def _chosen(self, key: str, names: Sequence[str] | None) -> list[str] | None:
        """The labels of `key` whose lines are `names` (all if None), of self.labels only."""
        if names is None:
            return None if self.labels is None else list(self.labels)
        suffix = line_suffix(key)
        mine = [name[: len(name) - len(suffix)] for name in names if name.endswith(suffix)]
        return mine if self.labels is None else [label for label in mine if label in self.labels]

    def _line(self, name: str) -> tuple[str, str]:
        """(key, label) of a line's name."""
        for key in self.keys:
            suffix = line_suffix(key)
            if name.endswith(suffix) and (suffix or len(self.keys) == 1):
                return key, name[: len(name) - len(suffix)]
        raise ValueError(f"no line of this figure is named {name!r}")

    async def key_extent(self, run_id: str, key: str, table: PointTable = "system") -> KeyExtent | None:
        extents = [await self.store.key_extent(run_id, mine, "system") for mine in self.keys]
        found = [extent for extent in extents if extent is not None]
        if not found:
            return None
        spans: dict[tuple[int, int], Span] = {}
        for span in chain.from_iterable(extent.spans for extent in found):
            held = spans.get((span.axis, span.generation))
            spans[span.axis, span.generation] = span if held is None else _merged_span(held, span)
        labels: dict[int, int] = {}
        for axis in {span.axis for span in spans.values()}:
            if self.labels is None:
                labels[axis] = sum(extent.labels.get(axis, 0) for extent in found)
            else:
                opened = await self.open_buckets(run_id, key, axis, None)
                labels[axis] = len({row.label for row in opened})
        return KeyExtent([spans[place] for place in sorted(spans)], labels)

    async def run_buckets(
        self, run_id: str, key: str, axis: int, width: int, lo: int, hi: int, table: PointTable = "system"
    ) -> list[RunBucket]:
        if self.labels is not None:
            return await self._labels_run_buckets(run_id, key, axis, width, lo, hi)
        found = [
            await self.store.run_buckets(run_id, mine, axis, width, lo, hi, "system") for mine in self.keys
        ]
        return _merged_buckets(chain.from_iterable(found))

    async def _labels_run_buckets(
        self, run_id: str, key: str, axis: int, width: int, lo: int, hi: int
    ) -> list[RunBucket]:
        """Run buckets of self.labels only, as run_rollups would hold them: every value in the
        counts, and in the sketch the mean of each closed label bucket (the open ones' means are
        added by the reads, charts.run_rows)."""
        stored = await self.label_buckets(run_id, key, axis, width, lo, hi, None)
        opened = await self.open_buckets(run_id, key, axis, None)
        open_keys = {(row.label, row.epoch, row.bucket) for row in opened}
        shift = width.bit_length() - 1 - rollups.FINE_SHIFT
        found: dict[tuple[int, int], RunBucket] = {}
        for row in stored:
            held = _bucket(found, row.generation, row.bucket)
            rollups.merge(held.part, row.part)
            mean = rollups.finite_mean(row.part)
            if mean is not None and (shift > 0 or (row.label, row.epoch, row.bucket) not in open_keys):
                rollups.add_bins(held.bins, {rollups.bin_of(mean): 1})
        if shift > 0:  # the wider rows hold closed buckets only: the open ones' values are added
            for row in opened:
                if lo <= row.bucket >> shift <= hi:
                    rollups.merge(_bucket(found, row.generation, row.bucket >> shift).part, row.part)
        return [found[place] for place in sorted(found)]

    async def label_buckets(
        self,
        run_id: str,
        key: str,
        axis: int,
        width: int,
        lo: int,
        hi: int,
        labels: Sequence[str] | None,
        table: PointTable = "system",
    ) -> list[LabelBucket]:
        found: list[LabelBucket] = []
        for mine in self.keys:
            chosen = self._chosen(mine, labels)
            if chosen is None or chosen:
                rows = await self.store.label_buckets(run_id, mine, axis, width, lo, hi, chosen, "system")
                found += [self._named(row, mine) for row in rows]
        return found

    async def open_buckets(
        self, run_id: str, key: str, axis: int, labels: Sequence[str] | None, table: PointTable = "system"
    ) -> list[LabelBucket]:
        found: list[LabelBucket] = []
        for mine in self.keys:
            chosen = self._chosen(mine, labels)
            if chosen is None or chosen:
                rows = await self.store.open_buckets(run_id, mine, axis, chosen, "system")
                found += [self._named(row, mine) for row in rows]
        return found

    async def key_values(
        self, run_id: str, key: str, table: PointTable = "system"
    ) -> list[tuple[str, int, int, int | None, float, float]]:
        found: list[tuple[str, int, int, int | None, float, float]] = []
        chosen = None if self.labels is None else set(self.labels)
        for mine in self.keys:
            suffix = line_suffix(mine)
            found += [
                (label + suffix, epoch, seq, step, ts, value)
                for label, epoch, seq, step, ts, value in await self.store.key_values(run_id, mine, "system")
                if chosen is None or label in chosen
            ]
        return found

    async def point_page(
        self,
        table: PointTable,
        run_id: str,
        label: str,
        after: tuple[str, int, int] | None,
        limit: int,
        key: str | None = None,
    ) -> list[Point]:
        # The chart reads page through a line's values by the figure's name, from either table:
        # they are its key's system samples.
        mine, owner = self._line(label)
        since = None if after is None else (mine, after[1], after[2])
        return await self.store.point_page("system", run_id, owner, since, limit, key=mine)


def _merged_span(a: Span, b: Span) -> Span:
    return Span(
        a.axis,
        a.generation,
        a.n + b.n,
        min(a.x_lo, b.x_lo),
        max(a.x_hi, b.x_hi),
        min(a.ts_lo, b.ts_lo),
        max(a.ts_hi, b.ts_hi),
    )


def _bucket(found: dict[tuple[int, int], RunBucket], generation: int, bucket: int) -> RunBucket:
    """The run bucket at (generation, bucket) of `found`, added empty if it has none."""
    held = found.get((generation, bucket))
    if held is None:
        held = found[generation, bucket] = RunBucket(generation, bucket, rollups.empty_part(), {})
    return held


def _merged_buckets(buckets: Iterable[RunBucket]) -> list[RunBucket]:
    """Run buckets of several keys as one key's: those at the same (generation, bucket) added."""
    found: dict[tuple[int, int], RunBucket] = {}
    for bucket in buckets:
        held = found.get((bucket.generation, bucket.bucket))
        if held is None:
            found[bucket.generation, bucket.bucket] = bucket
        else:
            rollups.merge(held.part, bucket.part)
            rollups.add_bins(held.bins, bucket.bins)
    return [found[place] for place in sorted(found)]


async def host_labels(store: Store, run_id: str, host: str) -> list[str]:
    """The labels of a run whose latest start names `host`."""
    starts: Mapping[str, Mapping[str, object]] = await store.label_starts(run_id)
    return sorted((label for label, start in starts.items() if start.get("host") == host), key=natural_key)


async def system_envelope(
    store: Store,
    run_id: str,
    figure: str,
    host: str | None = None,
    start: float | None = None,
    end: float | None = None,
    points: int = DEFAULT_POINTS,
    outliers: int = DEFAULT_OUTLIERS,
    all_lines_up_to: int = ALL_LINES_UP_TO,
) -> Envelope | None:
    """A figure's band and lines over ts (charts.envelope), across every label or `host`'s; None
    if the run has no sample of the figure (on that host)."""
    keys = figures(await store.system_keys(run_id)).get(figure)
    if not keys:
        return None
    labels = None
    if host is not None:
        labels = await host_labels(store, run_id, host)
        if not labels:
            return None
    reader = FigureRollups(store, keys, labels)
    found = await charts.envelope(reader, run_id, figure, "ts", start, end, points, outliers, all_lines_up_to)
    if found is None or (labels is not None and found.labels == 0):
        return None
    return found
