"""Conversions between events, rule records and table rows that every backend shares."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from typing import Any, Protocol

import orjson

from runbus.redact import LineRedactor, redact_line
from runbus.storage.base import LabelSummary, RunSummary, SetBy
from runbus.storage.rules import (
    LabelState,
    RunState,
    Setting,
    by_epoch,
    decide_primary,
    explain_gaps,
    latest_settings,
    merge_settings,
    missing_count,
    natural_key,
    primary_claims,
    refuse,
    refused_claims,
    settings_of,
    standing_settings,
    take_new,
)
from runbus.wire import Event, level_number

KINDS_COUNTED = ("metric", "log", "system")
MAX_GAPS_SHOWN = 1000

# The schema change from one `events` row per event to per-label seq ranges (`seen`) and kind
# counters: the same statements on SQLite and PostgreSQL (a migration splits them at ";").
SEEN_MIGRATION = """
    INSERT INTO seen (label_id, epoch, first_seq, last_seq)
        SELECT label_id, epoch, min(seq), max(seq) FROM (
            SELECT label_id, epoch, seq,
                   seq - ROW_NUMBER() OVER (PARTITION BY label_id, epoch ORDER BY seq) AS island
            FROM events
        ) AS numbered
        GROUP BY label_id, epoch, island;
    ALTER TABLE labels ADD COLUMN metric_events BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE labels ADD COLUMN log_events BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE labels ADD COLUMN system_events BIGINT NOT NULL DEFAULT 0;
    UPDATE labels SET
        metric_events = (SELECT count(*) FROM events e WHERE e.label_id = labels.id AND e.kind = 'metric'),
        log_events = (SELECT count(*) FROM events e WHERE e.label_id = labels.id AND e.kind = 'log'),
        system_events = (SELECT count(*) FROM events e WHERE e.label_id = labels.id AND e.kind = 'system');
    DROP TABLE events
"""

# The ids of runs that start with a prefix: a range of the primary key (both backends compare ids
# by code point), from the prefix up to its successor (prefix_bounds).
RUN_IDS_SQL = "SELECT run_id FROM runs WHERE run_id >= {lo} AND run_id < {hi} ORDER BY run_id LIMIT {limit}"


def prefix_bounds(prefix: str) -> tuple[str, str]:
    """The range of ids that start with `prefix` (not empty): from it, up to and not including
    the prefix with its last character's successor."""
    return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


# Per label and epoch of a run: the highest seq received and how many distinct seqs were.
EPOCHS_SQL = """
    SELECT s.label_id, s.epoch, max(s.last_seq) AS top,
           CAST(sum(s.last_seq - s.first_seq + 1) AS BIGINT) AS seen
    FROM seen s JOIN labels l ON l.id = s.label_id WHERE l.run_id = {param}
    GROUP BY s.label_id, s.epoch
"""

# A run's events by kind, from its labels' counters.
KIND_COUNTS_SQL = """
    SELECT CAST(coalesce(sum(metric_events), 0) AS BIGINT) AS metric,
           CAST(coalesce(sum(log_events), 0) AS BIGINT) AS log,
           CAST(coalesce(sum(system_events), 0) AS BIGINT) AS system
    FROM labels WHERE run_id = {param}
"""

# Seq ranges that never arrived, per label and epoch: the holes between received ranges.
MISSING_RANGES_SQL = """
    SELECT label_id, epoch, prev + 1 AS first, first_seq - 1 AS last FROM (
        SELECT label_id, epoch, first_seq,
               COALESCE(LAG(last_seq) OVER (PARTITION BY label_id, epoch ORDER BY last_seq), 0) AS prev
        FROM seen WHERE label_id IN (SELECT id FROM labels WHERE run_id = {param})
    ) AS numbered
    WHERE first_seq - prev > 1
    ORDER BY label_id, epoch, first
    LIMIT {limit}
"""


def group_by_label(events: Sequence[Event]) -> dict[tuple[str, str], list[Event]]:
    """Events grouped by (run, label), each group in (epoch, seq) order."""
    groups: dict[tuple[str, str], list[Event]] = {}
    # A batch holds each stream's events together: grouped a stretch at a time, in C.
    for names, stretch in groupby(events, _LABEL_OF):
        groups.setdefault(names, []).extend(stretch)
    for group in groups.values():
        # By seq, then (a stable sort) by epoch: int keys, cheaper than (epoch, seq) tuples.
        group.sort(key=_SEQ)
        group.sort(key=_EPOCH)
    return groups


_LABEL_OF = attrgetter("run", "label")
_EPOCH, _SEQ, _KIND = attrgetter("epoch"), attrgetter("seq"), attrgetter("kind")


# Rows as the tables declare their columns: a `system` row (label id, key, epoch, seq, ts, value),
# a `logs` row (label id, epoch, seq, ts, stream, level, levelno, text) and a `label_values` row
# (label id, field, key, value JSON, epoch, seq, ts).
SystemRow = tuple[int, str, int, int, float, Any]
LogRow = tuple[int, int, int, float, str, str, int, str]
SettingRow = tuple[int, str, str, str, int, int, float]
# The parameters of one row of a statement, in the order it names its columns: each of its
# column's type, so Any.
Params = tuple[Any, ...]


# One label's events of one epoch in a batch: ((run, label), label id, epoch, events in seq order).
Span = tuple[tuple[str, str], int, int, list[Event]]


def spans(by_label: dict[tuple[str, str], list[Event]], ids: dict[tuple[str, str], int]) -> list[Span]:
    """A batch's events (grouped by label, each group in order) split by label and epoch."""
    return [
        (key, ids[key], epoch, mine)
        for key, group in by_label.items()
        for epoch, mine in by_epoch(group).items()
    ]


def near_bounds(batch: Iterable[Span]) -> list[tuple[int, int, int, int]]:
    """(label id, epoch, lowest, highest seq) to read the stored `seen` ranges a span touches:
    those that overlap it or end or start right beside it."""
    return [(label_id, epoch, mine[0].seq - 1, mine[-1].seq + 1) for _, label_id, epoch, mine in batch]


@dataclass
class SeenChanges:
    """What a batch does to `seen` (rules.take_new per span), as rows for every backend."""

    fresh: dict[tuple[str, str], list[Event]]  # per label, the events never stored before
    replaced: list[tuple[int, int, int]]  # (label id, epoch, last seq) of ranges to delete
    ranges: list[tuple[int, int, int, int]]  # (label id, epoch, first, last seq) to insert


def seen_changes(batch: Sequence[Span], near: dict[tuple[int, int], list[tuple[int, int]]]) -> SeenChanges:
    """The new events of each span and the `seen` rows to replace, given the stored ranges
    near each span (by label id and epoch, as near_bounds asked for them)."""
    changes = SeenChanges({key: [] for key, _, _, _ in batch}, [], [])
    for key, label_id, epoch, mine in batch:
        seen = take_new(mine, near.get((label_id, epoch), ()))
        if seen.fresh:
            changes.replaced += [(label_id, epoch, last) for _, last in seen.replaced]
            changes.ranges += [(label_id, epoch, first, last) for first, last in seen.ranges]
            changes.fresh[key] += seen.fresh
    return changes


def settle_primaries(
    by_label: dict[tuple[str, str], list[Event]],
    labels: dict[tuple[str, str], LabelState],
    stored: Mapping[str, str | None],
    holders: Mapping[str, str | None],
) -> dict[str, str | None]:
    """Each batch run's primary (rules.decide_primary from the `stored` one, the batch's primary
    claims and the live claim's `holders`, per run); a refused claim is noted on its label in
    `labels` (replaced in place)."""
    claims: dict[str, list[Event]] = {}
    for (run, _), group in by_label.items():
        if "start" in map(_KIND, group):
            claims.setdefault(run, []).extend(primary_claims(group))
    primaries = {}
    for run in {run for run, _ in by_label}:
        mine = claims.get(run, [])
        primary = primaries[run] = decide_primary(stored.get(run), mine, holders.get(run))
        for label, ts in refused_claims(primary, mine).items():
            labels[run, label] = refuse(labels[run, label], ts)
    return primaries


def kind_counts(fresh: Iterable[Event]) -> tuple[int, int, int]:
    """How many metric, log and system events there are among `fresh`."""
    counts = Counter(map(_KIND, fresh))
    metric, log, system = (counts[kind] for kind in KINDS_COUNTED)
    return metric, log, system


def value_rows(fresh: Iterable[tuple[int, Sequence[Event]]]) -> tuple[list[SystemRow], list[LogRow]]:
    """The system and logs rows of new events, given as (label id, its events) pairs, in the
    column order the tables declare (metrics rows come with their rollups: rollups.fold_metrics).
    Inline rather than through helpers: this runs once per stored value. Values stay as decoded
    (NaN included: SQLite stores it as NULL, PostgreSQL as NaN)."""
    system: list[SystemRow] = []
    logs: list[LogRow] = []
    for label_id, events in fresh:
        system += [
            (label_id, k if "\x00" not in k else storable_text(k), e.epoch, e.seq, e.ts, v)
            for e in events
            if e.kind == "system"
            for k, v in e.data.items()
        ]
        # A private key written a line per entry is hidden within the batch (runbus.redact).
        redactors: dict[str, LineRedactor] = {}
        for e in events:
            if e.kind == "log":
                stream = e.data["stream"]
                redactor = redactors.get(stream) or redactors.setdefault(stream, LineRedactor())
                logs.append((label_id, e.epoch, e.seq, e.ts, *log_columns(e, redactor)))
    return system, logs


def label_columns(label: LabelState) -> Params:
    """The mutable label columns, in the order both backends' UPDATE statements name them."""
    return (
        label.state,
        label.exit_code,
        label.state_pos[0],
        label.state_pos[1],
        label.state_ts,
        label.primary,
        label.start_pos[0],
        label.start_pos[1],
        None if label.start_data is None else orjson.dumps(label.start_data).decode(),
        label.epoch,
        label.last_seq,
        label.first_ts,
        label.last_ts,
        dropped_json(label.dropped),
        label.primary_refused_ts,
    )


def dropped_json(dropped: dict[int, tuple[tuple[int, int], ...]]) -> str | None:
    return orjson.dumps({str(e): r for e, r in dropped.items()}).decode() if dropped else None


def dropped_from_json(text: str | bytes | None) -> dict[int, tuple[tuple[int, int], ...]]:
    if not text:
        return {}
    return {int(e): tuple((a, b) for a, b in r) for e, r in orjson.loads(text).items()}


def run_columns(derived: RunState, labels: Iterable[LabelState]) -> Params:
    """(state, primary, exit_code, ended_ts, started_ts, last_ts) of a run."""
    labels = list(labels)
    firsts = [lab.first_ts for lab in labels if lab.first_ts is not None]
    lasts = [lab.last_ts for lab in labels if lab.last_ts is not None]
    return (
        derived.state,
        derived.primary,
        derived.exit_code,
        derived.ended_ts,
        min(firsts, default=None),
        max(lasts, default=None),
    )


# -- run metadata ----------------------------------------------------------------------------------

# Kinds whose events set run metadata: a start (its config) and meta.
SETTING_KINDS = frozenset({"start", "meta"})

# Runs' stored settings, each label's latest per key, with the position of the label's latest
# start ({runs}: the test of a run id, "= ?").
RUN_SETTINGS_SQL = """
    SELECT l.run_id, l.label, v.field, v.key, v.value, v.epoch, v.seq, v.ts, l.start_epoch, l.start_seq
    FROM label_values v JOIN labels l ON l.id = v.label_id WHERE l.run_id {runs}
"""


def setting_rows(fresh: Iterable[tuple[int, Sequence[Event]]]) -> list[SettingRow]:
    """The label_values rows (label id, field, key, value JSON, epoch, seq, ts) of what new start
    and meta events set, given as (label id, its events) pairs: the latest per key of each label
    (a row replaces a stored one only if later, see the backends' upserts)."""
    found: list[SettingRow] = []
    for label_id, events in fresh:
        if SETTING_KINDS.isdisjoint(map(_KIND, events)):
            continue  # the usual batch: metrics, logs and samples only (a check in C)
        setting = [e for e in events if e.kind in SETTING_KINDS]
        if setting:
            found += [
                (
                    label_id,
                    s.field,
                    storable_text(s.key),
                    orjson.dumps(s.value).decode(),
                    s.epoch,
                    s.seq,
                    s.ts,
                )
                for s in latest_settings(settings_of(setting)).values()
            ]
    return found


def run_settings(found: Iterable[Sequence[Any]], runs: Iterable[str]) -> dict[str, list[Setting]]:
    """Each of `runs`' settings that stand (rules.standing_settings), from RUN_SETTINGS_SQL rows."""
    by_run: dict[str, list[Setting]] = {run: [] for run in runs}
    starts: dict[str, dict[str, tuple[int, int]]] = {run: {} for run in by_run}
    for row in found:
        by_run[row[0]].append(Setting(row[1], row[2], row[3], orjson.loads(row[4]), row[5], row[6], row[7]))
        starts[row[0]][row[1]] = (row[8], row[9])
    return {run: standing_settings(mine, starts[run]) for run, mine in by_run.items()}


def meta_columns(settings: Iterable[Setting], primary: str | None) -> Params:
    """(config, summary, name, tags, set_by) of a run from its labels' stored settings, merged
    by rules.merge_settings; JSON text but for the name."""
    merged = merge_settings(settings, primary)
    config = {key: s.value for (field, key), s in merged.items() if field == "config"}
    summary = {key: s.value for (field, key), s in merged.items() if field == "summary"}
    name, tags = merged.get(("name", "")), merged.get(("tags", ""))
    set_by = {
        "config": {key: s.label for (field, key), s in merged.items() if field == "config"},
        "summary": {key: s.label for (field, key), s in merged.items() if field == "summary"},
        "name": None if name is None else name.label,
        "tags": None if tags is None else tags.label,
    }
    return (
        orjson.dumps(config).decode(),
        orjson.dumps(summary).decode(),
        None if name is None else storable_text(str(name.value)),
        None if tags is None else orjson.dumps(tags.value).decode(),
        orjson.dumps(set_by).decode(),
    )


def start_event(run: str, label: LabelState, ts: float | None) -> list[Event]:
    """A stored label's latest start as an event at `ts` (none if it has none): for the data
    migration that fills label_values in stores made before run metadata, which kept no start's
    ts (the label's first ts stands in for it)."""
    if label.start_data is None:
        return []
    return [Event(run, label.label, "start", *label.start_pos, ts or 0.0, label.start_data)]


def label_settings(settings: Iterable[Setting]) -> dict[str, dict[str, Any]]:
    """Per label, what it set as LabelSummary holds it: config, summary, name, tags."""
    found: dict[str, dict[str, Any]] = {}
    for s in settings:
        mine = found.setdefault(s.label, {"config": {}, "summary": {}})
        if s.field in ("config", "summary"):
            mine[s.field][s.key] = s.value
        else:
            mine[s.field] = s.value
    return found


def storable_text(value: str) -> str:
    """`value` with NUL as U+FFFD: PostgreSQL text cannot hold NUL, and every backend must
    store the same thing (refusing it would fail the batch on every retry)."""
    return value.replace("\x00", "\ufffd") if "\x00" in value else value


def log_columns(event: Event, redacted: Callable[[str], str] = redact_line) -> tuple[str, str, int, str]:
    """(stream, level, levelno, text) of a log event, its text `redacted`: the producer redacts
    its own lines, not a line written by hand or by an older runbus."""
    level = str(event.data.get("level", "INFO"))
    text = storable_text(redacted(event.data["text"]))
    return event.data["stream"], storable_text(level), level_number(level), text


class Row(Protocol):
    """A stored row read by column name: sqlite3.Row or asyncpg.Record."""

    def __getitem__(self, key: str, /) -> Any: ...


def label_state(row: Row, run: str | None = None) -> LabelState:
    """A label's rule record from its stored row (reads.LABEL_COLUMNS), of `run` or else of the
    row's run_id."""
    return LabelState(
        run=row["run_id"] if run is None else run,
        label=row["label"],
        state=row["state"],
        exit_code=row["exit_code"],
        state_pos=(row["state_epoch"], row["state_seq"]),
        state_ts=row["state_ts"],
        primary=bool(row["is_primary"]),
        start_pos=(row["start_epoch"], row["start_seq"]),
        start_data=orjson.loads(row["start_data"]) if row["start_data"] else None,
        epoch=row["epoch"],
        last_seq=row["last_seq"],
        first_ts=row["first_ts"],
        last_ts=row["last_ts"],
        dropped=dropped_from_json(row["dropped"]),
        primary_refused_ts=row["primary_refused_ts"],
    )


def label_summary(
    label: LabelState,
    epochs: Iterable[tuple[int, int, int]],
    missing: Iterable[tuple[int, int, int]] = (),
    run_primary: str | None = None,
    values: dict[str, Any] | None = None,
) -> LabelSummary:
    """A label's summary from its rule record, (epoch, max seq, distinct seqs) per epoch, its
    missing (epoch, first, last) seq ranges, its run's primary, and what it set (label_settings)."""
    epochs = list(epochs)
    values = values or {}
    return LabelSummary(
        label=label.label,
        primary=label.label == run_primary,
        state=label.state,
        exit_code=label.exit_code,
        epoch=label.epoch,
        last_seq=label.last_seq,
        events=sum(seen for _, _, seen in epochs),
        missing=missing_count({e: top for e, top, _ in epochs}, {e: seen for e, _, seen in epochs}),
        first_ts=label.first_ts,
        last_ts=label.last_ts,
        start=label.start_data,
        gaps=explain_gaps(missing, label.dropped),
        primary_refused_ts=label.primary_refused_ts,
        config=values.get("config", {}),
        summary=values.get("summary", {}),
        name=values.get("name"),
        tags=values.get("tags"),
        epochs=tuple(sorted(e for e, _, _ in epochs)),
    )


def run_summary(
    row: dict[str, Any],
    labels: list[LabelSummary] | None = None,
    counts: dict[str, int] | None = None,
) -> RunSummary:
    """A RunSummary from a `runs` row (with a label_count column)."""
    config, tags, summary, set_by = (_json(row.get(name)) for name in ("config", "tags", "summary", "set_by"))
    return RunSummary(
        run_id=row["run_id"],
        state=row["state"],
        primary=row["primary_label"],
        exit_code=row["exit_code"],
        started_ts=row["started_ts"],
        ended_ts=row["ended_ts"],
        last_ts=row["last_ts"],
        label_count=row["label_count"],
        counts={kind: (counts or {}).get(kind, 0) for kind in KINDS_COUNTED},
        labels=sorted(labels or [], key=lambda lab: natural_key(lab.label)),
        config=config,
        name=row.get("name"),
        tags=tags or [],
        summary=summary or {},
        set_by=_set_by(set_by),
    )


def _set_by(stored: Any) -> SetBy:
    if not isinstance(stored, dict):
        return SetBy()
    return SetBy(
        config=dict(stored.get("config") or {}),
        summary=dict(stored.get("summary") or {}),
        name=stored.get("name"),
        tags=stored.get("tags"),
    )


def _json(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, (str, bytes)) else value
