"""The storage interface every backend implements, and the records it reads back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from runbus.config import safe_url
from runbus.errors import StoreMissing
from runbus.storage.rules import Gap
from runbus.wire import Event


@dataclass(frozen=True, slots=True)
class LabelSummary:
    """One label of a run, as `runbus show` prints it."""

    label: str
    primary: bool  # it is the run's primary
    state: str
    exit_code: int | None
    epoch: int
    last_seq: int
    events: int
    missing: int
    first_ts: float | None = None
    last_ts: float | None = None
    start: dict[str, Any] | None = None
    gaps: list[Gap] = field(default_factory=list)
    # When it last claimed the primary role while another label held it (refused), if ever.
    primary_refused_ts: float | None = None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run, with its labels' summaries when read with `Store.run`."""

    run_id: str
    state: str
    primary: str | None
    exit_code: int | None
    started_ts: float | None
    ended_ts: float | None
    last_ts: float | None
    label_count: int
    counts: dict[str, int] = field(default_factory=dict)
    labels: list[LabelSummary] = field(default_factory=list)
    config: dict[str, Any] | None = None


# The two tables of numbers a run keeps: its metrics and its system samples.
PointTable = Literal["metrics", "system"]


def point_table(name: str) -> PointTable:
    """`name` checked to be a PointTable, as a backend must before it writes it into a query."""
    if name == "metrics":
        return "metrics"
    if name == "system":
        return "system"
    raise ValueError(f"no table of values named {name!r}: use 'metrics' or 'system'")


@dataclass(frozen=True, slots=True)
class Point:
    """One stored metric or system value."""

    label: str
    key: str
    step: int | None
    epoch: int
    seq: int
    ts: float
    value: float


@dataclass(frozen=True, slots=True)
class LogLine:
    """One stored log event."""

    label: str
    epoch: int
    seq: int
    ts: float
    stream: str
    level: str
    text: str


def missing_store(url: str) -> StoreMissing:
    """The error of a reader that finds no runbus store at `url`."""
    return StoreMissing(f"no runbus store at {safe_url(url)}; `runbus ingest` creates it")


class Store(Protocol):
    """What the ingester writes through and the CLI and API read through.

    A backend is built as `Backend(url, create=True)`; with `create=False` (the readers'), connect()
    creates and migrates nothing and raises StoreMissing where no runbus store exists.
    """

    url: str

    async def connect(self) -> None:
        """Open connections and, unless opened with create=False, create or migrate the schema."""

    async def close(self) -> None:
        """Release every connection."""

    async def identity(self) -> str:
        """The store's id: random, made with its schema, the same through any URL that reaches
        it (the ingester's default consumer group is named after it)."""

    async def write(self, events: Sequence[Event], holders: Mapping[str, str | None] | None = None) -> int:
        """Store a batch in one transaction, applying storage.rules; return how many were new.

        An event already stored (same run, label, epoch, seq) is ignored. `holders` gives, per
        run, the label that held the producers' live primary claim when the ingester first saw
        the run's primary start (None: no claim was held), which decides a run's primary.
        """

    async def mark_crashed(self, silent_since: float) -> list[tuple[str, str]]:
        """Mark running labels not heard from (ingest time) since `silent_since` as crashed,
        with their runs where the label is the primary; return the (run, label)s marked."""

    async def runs(self) -> list[RunSummary]:
        """Every run, newest first (labels not filled in)."""

    async def run(self, run_id: str) -> RunSummary | None:
        """One run with its labels and event counts, or None if unknown."""

    async def metric_keys(self, run_id: str) -> list[str]:
        """The metric names logged in a run."""

    async def metrics(self, run_id: str, key: str | None = None, label: str | None = None) -> list[Point]:
        """Metric values ordered by label, key, step (then epoch, seq)."""

    async def system(self, run_id: str, key: str | None = None, label: str | None = None) -> list[Point]:
        """System samples ordered by label, key, ts."""

    async def logs(
        self,
        run_id: str,
        label: str | None = None,
        level: str | None = None,
        grep: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[LogLine]:
        """Log lines ordered by ts (then label, epoch, seq), filtered and paged."""

    async def point_page(
        self,
        table: PointTable,
        run_id: str,
        label: str,
        after: tuple[str, int, int] | None,
        limit: int,
        key: str | None = None,
    ) -> list[Point]:
        """Up to `limit` of one label's values in `table` (of one `key` if given), in (key, epoch,
        seq) order, from just after the (key, epoch, seq) `after` (from the first if None): a whole
        run read a page at a time, each page a range of the table's primary key."""

    async def log_page(
        self,
        run_id: str,
        label: str,
        after: tuple[int, int] | None,
        limit: int,
        level: str | None = None,
        grep: str | None = None,
    ) -> list[LogLine]:
        """Up to `limit` of one label's log lines, in (epoch, seq) order, from just after the
        (epoch, seq) `after` (from the first if None), filtered as `logs` filters them."""
