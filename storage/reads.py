"""The reads both backends write alike but for their dialect: each read's SQL and arguments built
from its filters (storage/dialect.py), the stored rows turned into records, and the reads that need
no more of a backend than its rows for a statement (Fetcher), each a method of both stores."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import orjson

from runbus.errors import BadQuery
from runbus.storage import charts, chunking, rollups, rows, values
from runbus.storage.base import (
    KeyPage,
    LabelBrief,
    LabelSummary,
    LogLine,
    Point,
    PointTable,
    RunPage,
    RunSummary,
    Store,
    point_table,
)
from runbus.storage.dialect import SQLITE_MEMBER_MISSING, Dialect
from runbus.storage.rules import lives_of
from runbus.storage.runlist import RunQuery, config_texts
from runbus.wire import level_number


class Query(NamedTuple):
    """A statement in its backend's placeholder style, and its arguments."""

    sql: str
    args: list[Any]


RUN_WITH_LABEL_COUNT = (
    "SELECT r.*, (SELECT count(*) FROM labels l WHERE l.run_id = r.run_id) AS label_count FROM runs r"
)
RUNS_SQL = f"{RUN_WITH_LABEL_COUNT} ORDER BY r.started_ts DESC NULLS LAST, r.run_id"
RUN_SQL = f"{RUN_WITH_LABEL_COUNT} WHERE r.run_id = ?"
# The rollups' list of the run's keys (its index), not a scan of every value.
RUN_KEYS_SQL = "SELECT key FROM series WHERE run_id = ? ORDER BY key"
SERIES_ID_SQL = "SELECT id FROM series WHERE run_id = ? AND key = ?"
LABEL_ID_SQL = "SELECT id FROM labels WHERE run_id = ? AND label = ?"
LABEL_STARTS_SQL = "SELECT label, start_data FROM labels WHERE run_id = ? ORDER BY label"
# A run's labels, each with its lease epoch and those of its events seen: their lives.
LABEL_EPOCHS_SQL = (
    "SELECT DISTINCT l.label, l.epoch, s.epoch FROM labels l LEFT JOIN seen s ON s.label_id = l.id "
    "WHERE l.run_id = ?"
)
# A label's columns for rows.label_state, of `labels l`.
LABEL_COLUMNS = (
    "l.id, l.run_id, l.label, l.state, l.exit_code, l.state_epoch, l.state_seq, l.state_ts, "
    "l.is_primary, l.start_epoch, l.start_seq, l.start_data, l.epoch, l.last_seq, l.first_ts, "
    "l.last_ts, l.dropped, l.primary_refused_ts"
)
# A run's reads, each of the run id alone: its row, its labels' epochs, counts, missing seqs,
# the labels themselves, and their settings.
_RUN_READS = (
    RUN_SQL,
    rows.EPOCHS_SQL.format(param="?"),
    rows.KIND_COUNTS_SQL.format(param="?"),
    rows.MISSING_RANGES_SQL.format(param="?", limit=rows.MAX_GAPS_SHOWN),
    f"SELECT {LABEL_COLUMNS} FROM labels l WHERE l.run_id = ? ORDER BY l.label",
    rows.RUN_SETTINGS_SQL.format(runs="= ?"),
)


def label_summaries(
    run_id: str,
    label_rows: Iterable[rows.Row],
    epochs: Sequence[rows.Row],
    missing: Sequence[rows.Row],
    settings: Mapping[str, dict[str, Any]],
    primary: str | None,
) -> list[LabelSummary]:
    """A run's label summaries from its label rows, the rows of rows.EPOCHS_SQL and
    rows.MISSING_RANGES_SQL, its labels' settings (rows.label_settings) and its primary."""
    labels: list[LabelSummary] = []
    for label_row in label_rows:
        mine = [(e["epoch"], e["top"], e["seen"]) for e in epochs if e["label_id"] == label_row["id"]]
        gaps = [(m["epoch"], m["first"], m["last"]) for m in missing if m["label_id"] == label_row["id"]]
        label = rows.label_state(label_row, run_id)
        labels.append(rows.label_summary(label, mine, gaps, primary, settings.get(label.label)))
    return labels


def log_filters(
    dialect: Dialect, where: list[str], args: list[Any], level: str | None, grep: str | None
) -> None:
    """Add the log reads' level and text filters to `where`, their values to `args`."""
    if level is not None:
        where.append("g.levelno >= ?")
        args.append(level_number(level))
    if grep is not None:
        where.append(dialect.contains("g.text"))
        args.append(rows.storable_text(grep))


def logs_query(
    dialect: Dialect,
    run_id: str,
    label: str | None,
    level: str | None,
    grep: str | None,
    limit: int | None,
    offset: int,
) -> Query:
    """A run's log lines by time, `label`, `level` and `grep` filtering them when given."""
    where: list[str] = ["l.run_id = ?"]
    args: list[Any] = [run_id]
    if label is not None:
        where.append("l.label = ?")
        args.append(rows.storable_text(label))
    log_filters(dialect, where, args, level, grep)
    query = (
        "SELECT l.label, g.epoch, g.seq, g.ts, g.stream, g.level, g.text FROM logs g "
        f"JOIN labels l ON l.id = g.label_id WHERE {' AND '.join(where)} "
        "ORDER BY g.ts, l.label, g.epoch, g.seq LIMIT ? OFFSET ?"
    )
    # A negative offset counts as 0, as SQLite reads one.
    return Query(dialect.sql(query), [*args, dialect.limit(limit), max(offset, 0)])


def log_page_query(
    dialect: Dialect,
    run_id: str,
    label: str,
    after: tuple[int, int] | None,
    limit: int,
    level: str | None,
    grep: str | None,
) -> Query:
    """A page of a label's log lines in (epoch, seq) order, those past `after`."""
    # The label as a value the planner knows before it plans (not a join): the table's primary
    # key (label_id, ...) then gives the rows in order and the LIMIT stops the scan.
    where = [f"g.label_id = ({LABEL_ID_SQL})"]
    args: list[Any] = [run_id, label]
    if after is not None:
        where.append("(g.epoch, g.seq) > (?, ?)")
        args += [after[0], after[1]]
    log_filters(dialect, where, args, level, grep)
    query = (
        "SELECT g.epoch, g.seq, g.ts, g.stream, g.level, g.text FROM logs g "
        f"WHERE {' AND '.join(where)} ORDER BY g.epoch, g.seq LIMIT ?"
    )
    return Query(dialect.sql(query), [*args, limit])


# A run's label count, of `runs r`.
_LABEL_COUNT = "(SELECT count(*) FROM labels l WHERE l.run_id = r.run_id)"
# What each of runlist.SORTS orders by, `{text}` the collation of the texts.
_RUN_SORTS = {
    "started": "r.started_ts",
    "ended": "r.ended_ts",
    "last": "r.last_ts",
    "labels": _LABEL_COUNT,
    "id": "r.run_id",
    "name": "r.name COLLATE {text}",
    "state": "r.state COLLATE {text}",
}
# A page's runs with their label count and events by kind, read for the page's rows alone (not
# for every run the page skips: a late page costs what the first does).
_PAGE_COLUMNS = ", ".join(
    [
        f"r.*, {_LABEL_COUNT} AS label_count",
        *(
            f"(SELECT CAST(coalesce(sum(l.{kind}_events), 0) AS BIGINT) FROM labels l "
            f"WHERE l.run_id = r.run_id) AS {kind}_count"
            for kind in rows.KINDS_COUNTED
        ),
    ]
)


class PageQueries(NamedTuple):
    """A page's two statements: the count of the runs that match, and the page of them."""

    total: Query
    rows: Query


def run_page_queries(dialect: Dialect, query: RunQuery) -> PageQueries:
    """The reads of the runs `query` matches: how many, and its page of them, sorted."""
    where: list[str] = []
    args: list[Any] = []
    _run_search(dialect, where, args, query.search)
    _run_filters(dialect, where, args, query)
    condition = f" WHERE {' AND '.join(where)}" if where else ""
    way = "DESC" if query.descending else "ASC"
    order = f"{_RUN_SORTS[query.sort].format(text=dialect.bytewise)} {way} NULLS LAST, r.run_id {way}"
    page = f"SELECT r.* FROM runs r{condition} ORDER BY {order} LIMIT ? OFFSET ?"
    return PageQueries(
        Query(dialect.sql(f"SELECT count(*) FROM runs r{condition}"), args),
        Query(
            dialect.sql(f"SELECT {_PAGE_COLUMNS} FROM ({page}) r ORDER BY {order}"),
            [*args, dialect.limit(query.limit), query.offset],
        ),
    )


def labels_of_runs_query(dialect: Dialect, run_ids: Sequence[str]) -> Query:
    """The labels (run id, label, state, is_primary) of `run_ids` (not empty)."""
    listed = ", ".join("?" * len(run_ids))
    query = f"SELECT run_id, label, state, is_primary FROM labels WHERE run_id IN ({listed})"
    return Query(dialect.sql(query), list(run_ids))


def _run_search(dialect: Dialect, where: list[str], args: list[Any], search: str | None) -> None:
    """A run whose id, name, a tag or a label holds `search` (ASCII letters in any case)."""
    if not search:
        return

    def holds(text: str) -> str:
        return dialect.contains(dialect.fold.format(text))

    tags = dialect.strings.format(doc="r.tags")
    where.append(
        f"({holds('r.run_id')} OR {holds('r.name')} "
        f"OR EXISTS (SELECT 1 FROM ({tags}) s WHERE {holds('s.value')}) "
        f"OR EXISTS (SELECT 1 FROM labels l WHERE l.run_id = r.run_id AND {holds('l.label')}))"
    )
    args.extend([_ascii_lower(rows.storable_text(search))] * 4)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _ascii_lower(text: str) -> str:
    """`text` with its ASCII letters in lower case, as Dialect.fold writes a column's."""
    return text.translate(_ASCII_LOWER)


def _run_filters(dialect: Dialect, where: list[str], args: list[Any], query: RunQuery) -> None:
    """The conditions of `query`'s states, start bounds, tags, labels and config values."""
    if query.states:
        where.append(f"r.state IN ({', '.join('?' * len(query.states))})")
        args.extend(query.states)
    for bound, test in ((query.since, "r.started_ts >= ?"), (query.until, "r.started_ts < ?")):
        if bound is not None:
            where.append(test)
            args.append(bound)
    tags = dialect.strings.format(doc="r.tags")
    for tag in query.tags:
        where.append(f"EXISTS (SELECT 1 FROM ({tags}) s WHERE s.value = ?)")
        args.append(rows.storable_text(tag))
    for label in query.labels:
        where.append("EXISTS (SELECT 1 FROM labels l WHERE l.run_id = r.run_id AND l.label = ?)")
        args.append(rows.storable_text(label))
    if query.config and not dialect.member:
        raise BadQuery(SQLITE_MEMBER_MISSING)
    for key, value in query.config:
        texts = config_texts(value)
        where.append(f"{dialect.member.format(doc='r.config')} IN ({', '.join('?' * len(texts))})")
        args += [dialect.member_name(rows.storable_text(key)), *texts]


class KeyPageQueries(NamedTuple):
    """A key page's two statements: the count of the keys that match, and the page of them."""

    total: Query
    keys: Query


def key_page_queries(
    dialect: Dialect, run_id: str, prefix: str | None, contains: str | None, offset: int, limit: int
) -> KeyPageQueries:
    """The reads of a page of a run's keys in order, those starting with `prefix` and containing
    `contains` (whatever its case) when given."""
    where, args = ["run_id = ?"], [run_id]
    if prefix:
        where.append("key >= ?")
        args.append(rows.storable_text(prefix))
        end = charts.prefix_end(rows.storable_text(prefix))
        if end is not None:
            where.append("key < ?")
            args.append(end)
    if contains:
        where.append(dialect.contains("lower(key)", "lower(?)"))
        args.append(rows.storable_text(contains))
    condition = " AND ".join(where)
    return KeyPageQueries(
        Query(dialect.sql(f"SELECT count(*) FROM series WHERE {condition}"), args),
        Query(
            dialect.sql(f"SELECT key FROM series WHERE {condition} ORDER BY key LIMIT ? OFFSET ?"),
            [*args, limit, max(offset, 0)],
        ),
    )


class Fetcher(Store, Protocol):
    """What the shared reads below need of a store."""

    dialect: Dialect

    async def _fetch(self, query: Query) -> list[Any]:
        """The rows of `query`."""
        ...

    async def _fetch_together(self, queries: Sequence[Query]) -> list[list[Any]]:
        """The rows of each of `queries`, read in one snapshot: a compaction that commits between
        them moves no value from the head rows one reads into the chunks another read before."""
        ...


def _query(reader: Fetcher, sql: str, *args: Any) -> Query:
    return Query(reader.dialect.sql(sql), list(args))


async def runs(reader: Fetcher) -> list[RunSummary]:
    return [rows.run_summary(dict(row)) for row in await reader._fetch(_query(reader, RUNS_SQL))]


async def run_page(reader: Fetcher, query: RunQuery, labels: bool = False) -> RunPage:
    total, listed = await reader._fetch_together(run_page_queries(reader.dialect, query))
    runs = [rows.run_summary(dict(row), counts=_kind_counts(row)) for row in listed]
    briefs: dict[str, list[LabelBrief]] = {run.run_id: [] for run in runs} if labels else {}
    # Read after the page, by id: the page's filters are not applied twice.
    found = await reader._fetch(labels_of_runs_query(reader.dialect, list(briefs))) if briefs else []
    for run_id, label, state, primary in found:
        briefs[run_id].append(LabelBrief(label, state, bool(primary)))
    return RunPage(runs, total[0][0], query.offset, query.limit, briefs)


def _kind_counts(row: rows.Row) -> dict[str, int]:
    return {kind: row[f"{kind}_count"] for kind in rows.KINDS_COUNTED}


async def run(reader: Fetcher, run_id: str) -> RunSummary | None:
    found = await reader._fetch_together([_query(reader, sql, run_id) for sql in _RUN_READS])
    run_rows, epochs, counts, missing, label_rows, stored = found
    if not run_rows:
        return None
    settings = rows.label_settings(rows.run_settings(stored, [run_id])[run_id])
    labels = label_summaries(run_id, label_rows, epochs, missing, settings, run_rows[0]["primary_label"])
    return rows.run_summary(dict(run_rows[0]), labels=labels, counts=dict(counts[0]))


async def run_ids(reader: Fetcher, prefix: str, limit: int) -> list[str]:
    query = rows.RUN_IDS_SQL.format(lo="?", hi="?", limit="?")
    found = await reader._fetch(_query(reader, query, *rows.prefix_bounds(prefix), limit))
    return [row[0] for row in found]


async def metric_keys(reader: Fetcher, run_id: str) -> list[str]:
    return [row[0] for row in await reader._fetch(_query(reader, RUN_KEYS_SQL, run_id))]


async def label_lives(reader: Fetcher, run_id: str) -> dict[str, dict[int, int]]:
    found: dict[str, set[int]] = {}
    for label, epoch, seen in await reader._fetch(_query(reader, LABEL_EPOCHS_SQL, run_id)):
        epochs = found.setdefault(label, set())
        epochs.add(epoch)
        if seen is not None:
            epochs.add(seen)
    return {label: lives_of(epochs) for label, epochs in found.items()}


async def system_keys(reader: Fetcher, run_id: str) -> list[str]:
    return await metric_keys(reader, rollups.series_run(run_id, "system"))


async def metrics(
    reader: Fetcher, run_id: str, key: str | None = None, label: str | None = None
) -> list[Point]:
    return values.by_step(await _values_of(reader, "metrics", run_id, key, label)).points()


async def system(
    reader: Fetcher, run_id: str, key: str | None = None, label: str | None = None
) -> list[Point]:
    return values.by_time(await _values_of(reader, "system", run_id, key, label)).points()


def values_queries(
    dialect: Dialect,
    run_id: str,
    table: PointTable,
    keys: Sequence[str] | None,
    labels: Sequence[str] | None,
    steps: tuple[int, int] | None,
) -> list[Query]:
    """Store.values' statements (values.assemble takes their rows): the chunk rows of `keys` of
    `labels` (None: all) that hold a step of `steps` (None: every chunk); the clock chunks of
    those chunks' label epochs that hold their seqs, not the others (a read of a few steps of a
    long run reads its own clock chunks, not the run's); the head rows chosen alike."""
    with_label, label_args = dialect.one_of("l.label", labels)
    stored = None if keys is None else [rows.storable_text(k) for k in keys]
    with_key, key_args = dialect.one_of("s.key", stored)
    in_steps = "" if steps is None else " AND c.max_step >= ? AND c.min_step <= ?"
    # SQLite keeps the joins in this order (CROSS JOIN): a run's labels, its series, their chunks.
    chosen = (
        f"FROM labels l CROSS JOIN series s CROSS JOIN chunks c WHERE l.run_id = ?{with_label} "
        f"AND s.run_id = ?{with_key} AND c.label_id = l.id AND c.series_id = s.id{in_steps}"
    )
    chunk_args = [run_id, *label_args, rollups.series_run(run_id, table), *key_args, *(steps or ())]
    clocks = (
        f"WITH wanted AS (SELECT c.label_id, c.epoch, min(c.first_seq) AS lo, max(c.last_seq) AS hi {chosen} "
        "GROUP BY c.label_id, c.epoch) SELECT l.label, k.epoch, k.data FROM wanted w CROSS JOIN chunks k "
        f"CROSS JOIN labels l WHERE k.label_id = w.label_id AND k.series_id = {chunking.CLOCK} "
        "AND k.epoch = w.epoch AND k.first_seq <= w.hi AND k.last_seq >= w.lo AND l.id = w.label_id"
    )
    clock_args = chunk_args
    if keys is None and steps is None:  # every chunk of the labels: their every clock chunk, found directly
        clocks = (
            "SELECT l.label, k.epoch, k.data FROM labels l CROSS JOIN chunks k WHERE l.run_id = ?"
            f"{with_label} AND k.label_id = l.id AND k.series_id = {chunking.CLOCK}"
        )
        clock_args = [run_id, *label_args]
    step = "m.step" if table == "metrics" else "CAST(NULL AS BIGINT)"
    head = (
        f"SELECT l.label, m.key, m.epoch, m.seq, {step}, m.ts, m.value FROM labels l CROSS JOIN {table} m "
        f"WHERE l.run_id = ?{with_label}{with_key.replace('s.key', 'm.key')} AND m.label_id = l.id"
        + ("" if steps is None else " AND m.step BETWEEN ? AND ?")
    )
    return [
        Query(dialect.sql(f"SELECT l.label, s.key, c.epoch, c.first_seq, c.data {chosen}"), chunk_args),
        Query(dialect.sql(clocks), clock_args),
        Query(dialect.sql(head), [run_id, *label_args, *key_args, *(steps or ())]),
    ]


def page_queries(
    dialect: Dialect,
    table: PointTable,
    run_id: str,
    label_id: int,
    key: str | None,
    past: tuple[str, int, int] | None,
) -> tuple[Query, Query, Query]:
    """Store.point_page's statements for one label (by id), values.page takes their rows: its
    chunks of `key` (None: every key) past `past` (stored key, epoch, seq; None: from the first),
    in (key, epoch, first seq) order with their point counts; its clock chunks; its head rows
    chosen alike."""
    with_key, key_args = dialect.one_of("s.key", None if key is None else [key])
    after, after_args = "", []
    if past is not None:
        after, after_args = " AND (s.key, c.epoch, c.last_seq) > (?, ?, ?)", list(past)
    chunks = (
        "SELECT s.key, c.epoch, c.first_seq, c.data, c.points FROM chunks c CROSS JOIN series s "
        f"WHERE c.label_id = ? AND c.series_id = s.id AND s.run_id = ?{with_key}{after} "
        "ORDER BY s.key, c.epoch, c.first_seq"
    )
    clocks = f"SELECT epoch, data FROM chunks WHERE label_id = ? AND series_id = {chunking.CLOCK}"
    step = "s.step" if table == "metrics" else "CAST(NULL AS BIGINT)"
    head = (
        f"SELECT s.key, s.epoch, s.seq, {step}, s.ts, s.value FROM {table} s WHERE s.label_id = ?{with_key}"
        + after.replace("c.epoch, c.last_seq", "s.epoch, s.seq")
    )
    return (
        Query(dialect.sql(chunks), [label_id, rollups.series_run(run_id, table), *key_args, *after_args]),
        Query(dialect.sql(clocks), [label_id]),
        Query(dialect.sql(head), [label_id, *key_args, *after_args]),
    )


async def stored_values(
    reader: Fetcher,
    run_id: str,
    table: PointTable = "metrics",
    keys: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    steps: tuple[int, int] | None = None,
) -> values.Values:
    """Store.values: its rows read in one snapshot (a compaction that commits meanwhile moves no
    point past the read), decoded off the event loop (a dashboard serving others goes on)."""
    table = point_table(table)
    in_range = values.step_range(steps, table)
    chunks, clocks, head = await reader._fetch_together(
        values_queries(reader.dialect, run_id, table, keys, labels, in_range)
    )
    found = await asyncio.to_thread(values.assemble, chunks, clocks, head)
    return values.in_steps(found, in_range)


async def _values_of(
    reader: Fetcher, table: PointTable, run_id: str, key: str | None, label: str | None
) -> values.Values:
    return await reader.values(
        run_id, table, None if key is None else [key], None if label is None else [label]
    )


async def key_values(
    reader: Fetcher, run_id: str, key: str, table: PointTable = "metrics"
) -> list[tuple[str, int, int, int | None, float, float]]:
    found = await reader.values(run_id, table, [key])
    return [(p.label, p.epoch, p.seq, p.step, p.ts, p.value) for p in found.points()]


async def logs(
    reader: Fetcher,
    run_id: str,
    label: str | None = None,
    level: str | None = None,
    grep: str | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> list[LogLine]:
    found = await reader._fetch(logs_query(reader.dialect, run_id, label, level, grep, limit, offset))
    return [LogLine(*row) for row in found]


async def log_page(
    reader: Fetcher,
    run_id: str,
    label: str,
    after: tuple[int, int] | None,
    limit: int,
    level: str | None = None,
    grep: str | None = None,
) -> list[LogLine]:
    found = await reader._fetch(log_page_query(reader.dialect, run_id, label, after, limit, level, grep))
    return [LogLine(label, *row) for row in found]


async def key_page(
    reader: Fetcher,
    run_id: str,
    prefix: str | None = None,
    contains: str | None = None,
    offset: int = 0,
    limit: int = 100,
) -> KeyPage:
    total, keys = await reader._fetch_together(
        key_page_queries(reader.dialect, run_id, prefix, contains, offset, limit)
    )
    return KeyPage(total[0][0], offset, [row[0] for row in keys])


async def label_starts(reader: Fetcher, run_id: str) -> dict[str, dict[str, Any]]:
    """Each label's start data ({} before its start)."""
    found = await reader._fetch(_query(reader, LABEL_STARTS_SQL, run_id))
    return {label: orjson.loads(data) if data else {} for label, data in found}


class SharedReads:
    """The reads above and the chart reads (storage/charts.py), as methods of each store: a store
    that inherits them gives `dialect`, `_fetch` and `_fetch_together` (Fetcher), and the rollup
    reads (base.RollupReader) the chart reads compose."""

    run = run
    runs = runs
    run_page = run_page
    run_ids = run_ids
    metric_keys = metric_keys
    label_lives = label_lives
    system_keys = system_keys
    metrics = metrics
    system = system
    values = stored_values
    key_values = key_values
    logs = logs
    log_page = log_page
    key_page = key_page
    label_starts = label_starts
    envelope = charts.envelope
    stragglers = charts.stragglers
