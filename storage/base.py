"""The storage interface every backend implements, and the records it reads back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from runbus.config import safe_url
from runbus.errors import StoreMissing
from runbus.storage.rules import Gap, lives_of
from runbus.storage.runlist import RunQuery
from runbus.wire import Event

if TYPE_CHECKING:
    from runbus.storage.beats import RunVitals
    from runbus.storage.values import Values

# The chart reads' defaults and bounds (storage/charts.py).
XUnit = Literal["step", "ts"]
DEFAULT_POINTS = 1500
MAX_POINTS = 10_000
DEFAULT_OUTLIERS = 3
MAX_OUTLIERS = 32
# Up to this many labels every label is a line (and no outliers are picked).
ALL_LINES_UP_TO = 16
MAX_LINES_UP_TO = 64
# Labels a chart may name to be drawn beside its band (the ones the user turned on).
MAX_SHOWN = 64
DEFAULT_HEAT_BUCKETS = 32
MAX_HEAT_BUCKETS = 256


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
    # What this label set (the latest value of each key): its config (at start and since),
    # summary, and the run's name and tags as it set them (None if it never did).
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    tags: list[str] | None = None
    # Its lease epochs (of the events stored), ascending: storage.rules.lives_of numbers them.
    epochs: tuple[int, ...] = ()

    @property
    def life(self) -> int:
        """Which life of the label its latest epoch is: 1 until it first restarts."""
        return self.lives[self.epoch]

    @property
    def lives(self) -> dict[int, int]:
        """Each lease epoch's life (storage.rules.lives_of), the latest epoch among them."""
        return lives_of((*self.epochs, self.epoch))


@dataclass(frozen=True, slots=True)
class SetBy:
    """Which label set each value a run shows: a key of its merged config and summary, its name
    and its tags (see storage.rules.merge_settings)."""

    config: dict[str, str] = field(default_factory=dict)
    summary: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    tags: str | None = None


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
    # The run's metadata, its labels' merged (set_by says which label set each value): config
    # is None until a label has started or set any.
    config: dict[str, Any] | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    set_by: SetBy = field(default_factory=SetBy)


@dataclass(frozen=True, slots=True)
class LabelBrief:
    """A label as the runs list shows it."""

    label: str
    state: str
    primary: bool


@dataclass(frozen=True, slots=True)
class RunPage:
    """A page of the runs a RunQuery matches (their event counts filled in, not their labels),
    how many match in all, and, when asked for, each listed run's labels (by run id)."""

    runs: list[RunSummary]
    total: int
    offset: int
    limit: int | None
    labels: dict[str, list[LabelBrief]] = field(default_factory=dict)


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
class KeyPage:
    """A page of a run's metric keys in code point order: `total` match the search in all."""

    total: int
    offset: int
    keys: list[str]


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


# -- what the rollups read back (storage/rollups.py, storage/charts.py) ----------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """What a key holds on one axis in one generation, from its widest rollups."""

    axis: int
    generation: int
    n: int
    x_lo: int
    x_hi: int
    ts_lo: float
    ts_hi: float


@dataclass(frozen=True, slots=True)
class KeyExtent:
    """A key of a run, as its widest rollups show it: spans, and the labels per axis."""

    spans: list[Span]
    labels: dict[int, int]

    def axis_spans(self, axis: int) -> list[Span]:
        return [s for s in self.spans if s.axis == axis]


@dataclass(frozen=True, slots=True)
class RunBucket:
    """One run_rollups bucket, its slots merged."""

    generation: int
    bucket: int
    part: list[Any]  # a rollups.Partial
    bins: dict[int, int]


@dataclass(frozen=True, slots=True)
class LabelBucket:
    """One label_rollups bucket of a label's epoch."""

    label: str
    epoch: int
    generation: int
    bucket: int
    part: list[Any]  # a rollups.Partial


@dataclass(frozen=True, slots=True)
class BandBucket:
    """One bucket of the band across labels: every value's count, min, max and mean; p10, p50
    and p90 of the labels' means over each 128-step bucket inside (where `exact`: of its values)."""

    x_lo: float
    x_hi: float
    n: int
    nan: int
    inf: int
    lo: float | None
    p10: float | None
    p50: float | None
    p90: float | None
    hi: float | None
    mean: float | None


@dataclass(frozen=True, slots=True)
class BandSegment:
    """The band over one generation (an incarnation of the run: elastic restarts begin new ones),
    and its gaps: x ranges inside it where no label logged the key."""

    generation: int
    buckets: list[BandBucket]
    gaps: list[tuple[float, float]]


@dataclass(frozen=True, slots=True)
class LinePoint:
    """A label's bucket: x of its last value, that value, and mean, min, max, count."""

    x: float
    value: float
    mean: float | None
    lo: float | None
    hi: float | None
    n: int


@dataclass(frozen=True, slots=True)
class LineSegment:
    epoch: int
    generation: int
    points: list[LinePoint]


@dataclass(frozen=True, slots=True)
class Line:
    """One label's line, a segment per epoch; `distance`, beside a band, how far it runs from the
    median (in band widths: |its mean - median| / (p90 - p10), averaged over the ranking buckets);
    `outlier`: drawn as one of the labels furthest from the median (not only because asked for)."""

    label: str
    segments: list[LineSegment]
    distance: float | None = None
    outlier: bool = False


@dataclass(frozen=True, slots=True)
class Envelope:
    """One key's chart data. `width`: x units per bucket (1 with exact values: a bucket per step);
    `lines`: every label's when `all_lines`, else the outliers'."""

    run_id: str
    key: str
    x: XUnit
    width: int
    exact: bool
    labels: int
    start: float | None
    end: float | None
    band: list[BandSegment]
    lines: list[Line]
    all_lines: bool
    other_axis: int = 0  # values of the key on the other axis (with a step when x is ts, or without)


@dataclass(frozen=True, slots=True)
class StragglerLabel:
    """One label's step times per heat bucket (None: no steps there) and how it compares with
    the median label: mean and worst ratio (and the first step of the worst bucket), buckets
    where it was slow, seconds lost overall."""

    label: str
    step_time: list[float | None]
    mean_ratio: float | None
    worst_ratio: float | None
    worst_step: int | None
    slow_buckets: int
    seconds_behind: float
    kind: Literal["chronic", "one-off", "normal"]


@dataclass(frozen=True, slots=True)
class Stragglers:
    """Step times per label and step bucket (a heat map), the median label's, and the labels by
    how slow they were, slowest first. `source`: the key whose values are step times
    (`time_key`), or whose logging times give them (ts span over step span)."""

    run_id: str
    source: str
    derived: bool
    width: int
    buckets: list[tuple[int, int]]
    median: list[float | None]
    labels: list[StragglerLabel]


def missing_store(url: str) -> StoreMissing:
    """The error of a reader that finds no runbus store at `url`."""
    return StoreMissing(f"no runbus store at {safe_url(url)}; `runbus ingest` creates it")


class RollupReader(Protocol):
    """The reads of stored values and rollups that the chart reads (storage/charts.py) are built
    on; a part of Store."""

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
        ...

    # The reads below read a metric key's rollups, or with `table` "system" a system sample
    # key's (rollups.series_run).

    async def key_values(
        self, run_id: str, key: str, table: PointTable = "metrics"
    ) -> list[tuple[str, int, int, int | None, float, float]]:
        """Every stored value of a key: (label, epoch, seq, step, ts, value), each label's
        in (epoch, seq) order, the labels in no order (a lean read for small keys' exact charts)."""
        ...

    async def key_extent(self, run_id: str, key: str, table: PointTable = "metrics") -> KeyExtent | None:
        """A key's spans per axis and generation, and its labels; None if never logged."""
        ...

    async def run_buckets(
        self, run_id: str, key: str, axis: int, width: int, lo: int, hi: int, table: PointTable = "metrics"
    ) -> list[RunBucket]:
        """A key's run_rollups buckets lo..hi at `width` on `axis`, every generation's, slots
        merged, in (generation, bucket) order."""
        ...

    async def label_buckets(
        self,
        run_id: str,
        key: str,
        axis: int,
        width: int,
        lo: int,
        hi: int,
        labels: Sequence[str] | None,
        table: PointTable = "metrics",
    ) -> list[LabelBucket]:
        """A key's label_rollups buckets lo..hi at `width` on `axis`, of `labels` (all if None)."""
        ...

    async def open_buckets(
        self, run_id: str, key: str, axis: int, labels: Sequence[str] | None, table: PointTable = "metrics"
    ) -> list[LabelBucket]:
        """Each label epoch's highest 128-step bucket of a key on `axis` (of `labels`, all if
        None): the open ones, not yet in the wider rows nor the sketch (storage/rollups.py)."""
        ...


class Store(RollupReader, Protocol):
    """What the ingester writes through and the CLI and API read through.

    A backend is built as `Backend(url, create=True)`; with `create=False` (the readers'), connect()
    creates and migrates nothing and raises StoreMissing where no runbus store exists. The
    RollupReader reads are a Store's too.
    """

    url: str

    async def connect(self) -> None:
        """Open connections and, unless opened with create=False, create or migrate the schema."""
        ...

    async def close(self) -> None:
        """Release every connection."""
        ...

    async def identity(self) -> str:
        """The store's id: random, made with its schema, the same through any URL that reaches
        it (the ingester's default consumer group is named after it)."""
        ...

    async def write(self, events: Sequence[Event], holders: Mapping[str, str | None] | None = None) -> int:
        """Store a batch in one transaction, applying storage.rules; return how many were new.

        An event already stored (same run, label, epoch, seq) is ignored. `holders` gives, per
        run, the label that held the producers' live primary claim when the ingester first saw
        the run's primary start (None: no claim was held), which decides a run's primary.
        """
        ...

    async def compact_due(self, limit: int = 64) -> int:
        """Move the head rows of up to `limit` label epochs already due (storage/chunking.py: a
        store migrated from rows, a head left full) into column chunks, in one transaction; how
        many label epochs are due still."""
        ...

    async def mark_crashed(self, silent_since: float) -> list[tuple[str, str]]:
        """Mark running labels not heard from (ingest time) since `silent_since` as crashed,
        with their runs where the label is the primary; return the (run, label)s marked."""
        ...

    async def runs(self) -> list[RunSummary]:
        """Every run, newest first (labels not filled in)."""
        ...

    async def run_page(self, query: RunQuery, labels: bool = False) -> RunPage:
        """The runs `query` matches, in its order, the page it asks for (with their event counts;
        with `labels`, their labels' names, states and primary, read just after), with how many
        match in all, read in one snapshot."""
        ...

    async def run(self, run_id: str) -> RunSummary | None:
        """One run with its labels and event counts, or None if unknown."""
        ...

    async def run_ids(self, prefix: str, limit: int) -> list[str]:
        """Up to `limit` ids of runs that start with `prefix` (not empty), in code point order
        (storage/lookup.py finds a run by its id or a unique prefix of it)."""
        ...

    async def metric_keys(self, run_id: str) -> list[str]:
        """The metric names logged in a run."""
        ...

    async def label_lives(self, run_id: str) -> dict[str, dict[int, int]]:
        """Each label of a run with its lives by lease epoch (LabelSummary.lives), read alone:
        what a table's `life` column needs, without the rest of the run's record; {} where no
        run has the id (not a prefix)."""
        ...

    async def system_keys(self, run_id: str) -> list[str]:
        """The system sample keys of a run (`gpu.0.util`, `proc.rss_mb` ...), from its rollups."""
        ...

    async def values(
        self,
        run_id: str,
        table: PointTable = "metrics",
        keys: Sequence[str] | None = None,
        labels: Sequence[str] | None = None,
        steps: tuple[int, int] | None = None,
    ) -> Values:
        """A run's values of `table` (of `keys`, of `labels`: None is all; metrics of the steps
        `steps`, first to last included, values.step_range's) as arrays, by label (natural
        order), key, epoch, seq: read from the chunks and head rows that hold them, and of the
        chunks only those that hold such values."""
        ...

    async def metrics(self, run_id: str, key: str | None = None, label: str | None = None) -> list[Point]:
        """Metric values ordered by label, key, step (then epoch, seq)."""
        ...

    async def system(self, run_id: str, key: str | None = None, label: str | None = None) -> list[Point]:
        """System samples ordered by label, key, ts."""
        ...

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
        ...

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
        ...

    async def key_page(
        self,
        run_id: str,
        prefix: str | None = None,
        contains: str | None = None,
        offset: int = 0,
        limit: int = 100,
    ) -> KeyPage:
        """A page of the run's metric keys that start with `prefix` and hold `contains` (ASCII
        letters in any case), in code point order, with how many match in all."""
        ...

    async def label_starts(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Each label's latest start event data (host, rank, hardware with GPUs, driver, CUDA,
        torch, argv ...), by label; {} for a label whose start never arrived."""
        ...

    async def envelope(
        self,
        run_id: str,
        key: str,
        x: XUnit | None = None,
        start: float | None = None,
        end: float | None = None,
        points: int = DEFAULT_POINTS,
        outliers: int = DEFAULT_OUTLIERS,
        all_lines_up_to: int = ALL_LINES_UP_TO,
        shown: Sequence[str] = (),
    ) -> Envelope | None:
        """One key's chart: charts.envelope."""
        ...

    async def save_beats(self, beats: Sequence[Event]) -> None:
        """Keep each label's latest heartbeat of `beats` (stored already): storage/beats.py."""

    async def health_inputs(self) -> list[RunVitals]:
        """The runs the health detector judges, with their labels' latest beats."""
        ...

    async def record_health(
        self, run: RunVitals, state: str, key: str, doc: dict[str, Any], now: float
    ) -> bool:
        """Record a run's verdict by compare and set; True if this call changed it."""
        ...

    async def health(self, run_id: str) -> dict[str, Any] | None:
        """A run's recorded health object, or None before any detector judged it."""

    async def last_lines(self, run_id: str, label: str, count: int = 10) -> list[str]:
        """A label's last `count` log lines, oldest first."""
        ...

    async def stragglers(
        self,
        run_id: str,
        key: str,
        time_key: bool = False,
        start: int | None = None,
        end: int | None = None,
        buckets: int = DEFAULT_HEAT_BUCKETS,
    ) -> Stragglers | None:
        """Step times per label and step bucket: charts.stragglers."""
        ...
