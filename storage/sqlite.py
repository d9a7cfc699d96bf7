"""The embedded SQLite backend (WAL), driven from one dedicated thread per store."""

from __future__ import annotations

import asyncio
import functools
import math
import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import orjson

from runbus.errors import StoreError, StoreRejected, StoreUnavailable
from runbus.storage import rows
from runbus.storage.base import (
    LabelSummary,
    LogLine,
    Point,
    PointTable,
    RunSummary,
    missing_store,
    point_table,
)
from runbus.storage.rules import LabelState, apply_events, crash, run_state
from runbus.wire import Event, level_number

T = TypeVar("T")
BUSY_TIMEOUT_MS = 1000

# SQLite's primary result codes for data the store refuses, whoever asks again: a constraint, a
# string or blob too big, a value of the wrong type, a parameter out of range. Every other error
# (locked, busy, full, read-only, I/O, cannot open) is about the store, not the data.
REJECTED_CODES = frozenset(
    {sqlite3.SQLITE_CONSTRAINT, sqlite3.SQLITE_TOOBIG, sqlite3.SQLITE_MISMATCH, sqlite3.SQLITE_RANGE}
)

MIGRATIONS: list[str] = [
    """
    CREATE TABLE runs (
        run_id TEXT PRIMARY KEY,
        state TEXT NOT NULL DEFAULT 'running',
        primary_label TEXT,
        exit_code INTEGER,
        started_ts REAL,
        ended_ts REAL,
        last_ts REAL,
        config TEXT
    );
    CREATE TABLE labels (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        label TEXT NOT NULL,
        state TEXT NOT NULL DEFAULT 'running',
        exit_code INTEGER,
        state_epoch INTEGER NOT NULL DEFAULT 0,
        state_seq INTEGER NOT NULL DEFAULT 0,
        state_ts REAL,
        is_primary INTEGER NOT NULL DEFAULT 0,
        start_epoch INTEGER NOT NULL DEFAULT 0,
        start_seq INTEGER NOT NULL DEFAULT 0,
        start_data TEXT,
        epoch INTEGER NOT NULL DEFAULT 0,
        last_seq INTEGER NOT NULL DEFAULT 0,
        first_ts REAL,
        last_ts REAL,
        UNIQUE (run_id, label)
    );
    CREATE TABLE events (
        label_id INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        ts REAL NOT NULL,
        PRIMARY KEY (label_id, epoch, seq)
    ) WITHOUT ROWID;
    CREATE TABLE metrics (
        label_id INTEGER NOT NULL,
        key TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        step INTEGER,
        ts REAL NOT NULL,
        value REAL,
        PRIMARY KEY (label_id, key, epoch, seq)
    ) WITHOUT ROWID;
    CREATE TABLE system (
        label_id INTEGER NOT NULL,
        key TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        ts REAL NOT NULL,
        value REAL,
        PRIMARY KEY (label_id, key, epoch, seq)
    ) WITHOUT ROWID;
    CREATE TABLE logs (
        label_id INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        ts REAL NOT NULL,
        stream TEXT NOT NULL,
        level TEXT NOT NULL,
        levelno INTEGER NOT NULL,
        text TEXT NOT NULL,
        PRIMARY KEY (label_id, epoch, seq)
    ) WITHOUT ROWID;
    CREATE INDEX logs_by_ts ON logs (label_id, ts);
    """,
    """
    ALTER TABLE labels ADD COLUMN seen_at REAL;
    ALTER TABLE labels ADD COLUMN dropped TEXT;
    CREATE INDEX labels_running ON labels (state, seen_at);
    """,
    # One row per run of consecutive seqs received, instead of one `events` row per event.
    """
    CREATE TABLE seen (
        label_id INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        PRIMARY KEY (label_id, epoch, last_seq)
    ) WITHOUT ROWID;
    """
    + rows.SEEN_MIGRATION,
    # Refused primary claims per label; the store's own id, which names its consumer group.
    """
    ALTER TABLE labels ADD COLUMN primary_refused_ts REAL;
    CREATE TABLE store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    INSERT INTO store_meta (name, value) VALUES ('id', lower(hex(randomblob(8))))
    """,
]

_LABEL_COLUMNS = (
    "id, label, state, exit_code, state_epoch, state_seq, state_ts, is_primary, start_epoch, "
    "start_seq, start_data, epoch, last_seq, first_ts, last_ts, dropped, primary_refused_ts"
)


# Rows per INSERT statement, at most: a power of two, so any count splits into a few statement
# sizes that stay in the connection's statement cache. 4096 rows of 8 columns stay inside
# SQLite's default limit of 32,766 bound parameters.
MAX_ROWS_PER_INSERT = 4096
# Label rows per statement when a batch's labels are read or updated together: 1024 of 20 columns.
MAX_LABELS_PER_STATEMENT = 1024


def _insert(
    con: sqlite3.Connection, table: str, width: int, values: list[tuple], verb: str = "INSERT OR IGNORE"
) -> None:
    """`verb` INTO `table` ("name (col, ...)") `values` as multi-row VALUES statements.

    Not executemany, and as few statements as the parameter limit allows: each call takes the GIL
    back after releasing it (executemany after every row), and beside the ingester's busy asyncio
    thread each taking back can wait out a switch interval (bench/gil.py). One statement runs all
    its rows in a single sqlite3_step with the GIL released, beside that thread rather than after it.
    """
    flat = list(chain.from_iterable(values))
    done = 0
    for size in _statement_sizes(len(values)):
        con.execute(_values_sql(verb, table, width, size), flat[done * width : (done + size) * width])
        done += size


def _statement_sizes(count: int) -> list[int]:
    """`count` as full MAX_ROWS_PER_INSERT statements plus its remainder's powers of two."""
    full, rest = divmod(count, MAX_ROWS_PER_INSERT)
    return [MAX_ROWS_PER_INSERT] * full + [
        1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1
    ]


@functools.lru_cache(maxsize=256)
def _values_sql(verb: str, table: str, width: int, size: int) -> str:
    return f"{verb} INTO {table} VALUES " + _rows_sql(width, size)


@functools.lru_cache(maxsize=256)
def _rows_sql(width: int, size: int) -> str:
    """`size` rows of `width` parameters: "(?, ?), (?, ?)"."""
    row = "(" + ", ".join("?" * width) + ")"
    return ", ".join([row] * size)


def _chunks(values: list, size: int) -> list[list]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def _given_rows(name: str, columns: str, count: int, statement: str) -> str:
    """`statement` with `count` rows of parameters as a table `name` (`columns`): a CTE."""
    return f"WITH {name}({columns}) AS (VALUES {_rows_sql(columns.count(',') + 1, count)}) {statement}"


@functools.lru_cache(maxsize=64)
def _update_labels_sql(count: int) -> str:
    """UPDATE `count` labels from rows of (id, rows.label_columns, seen_at, rows.kind_counts)."""
    return _given_rows(
        "v",
        "id, state, exit_code, state_epoch, state_seq, state_ts, is_primary, start_epoch, start_seq, "
        "start_data, epoch, last_seq, first_ts, last_ts, dropped, primary_refused_ts, seen_at, "
        "metric_events, log_events, system_events",
        count,
        "UPDATE labels SET state = v.state, exit_code = v.exit_code, state_epoch = v.state_epoch, "
        "state_seq = v.state_seq, state_ts = v.state_ts, is_primary = v.is_primary, "
        "start_epoch = v.start_epoch, start_seq = v.start_seq, start_data = v.start_data, "
        "epoch = v.epoch, last_seq = v.last_seq, first_ts = v.first_ts, last_ts = v.last_ts, "
        "dropped = v.dropped, primary_refused_ts = v.primary_refused_ts, seen_at = v.seen_at, "
        "metric_events = labels.metric_events + v.metric_events, "
        "log_events = labels.log_events + v.log_events, "
        "system_events = labels.system_events + v.system_events "
        "FROM v WHERE labels.id = v.id",
    )


@functools.lru_cache(maxsize=64)
def _near_ranges_sql(count: int) -> str:
    """The `seen` ranges touching `count` (label id, epoch, lowest, highest seq) bounds."""
    return _given_rows(
        "u",
        "label_id, epoch, lo, hi",
        count,
        "SELECT s.label_id, s.epoch, s.first_seq, s.last_seq FROM u JOIN seen s ON s.label_id = "
        "u.label_id AND s.epoch = u.epoch AND s.last_seq >= u.lo AND s.first_seq <= u.hi",
    )


@functools.lru_cache(maxsize=64)
def _delete_ranges_sql(count: int) -> str:
    """DELETE `count` `seen` ranges given as (label id, epoch, last seq)."""
    # Through a CTE: with `IN (VALUES …)` SQLite scans the whole table instead of searching its key.
    return _given_rows(
        "u",
        "label_id, epoch, last_seq",
        count,
        "DELETE FROM seen WHERE (label_id, epoch, last_seq) IN (SELECT * FROM u)",
    )


def _path(url: str) -> str:
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise ValueError(
            f"sqlite store URL {url!r} names no file: use sqlite:///relative.db or "
            "sqlite:////absolute/path.db"
        )
    return unquote(urlsplit(url).path[1:])


def _label_state(run: str, row: sqlite3.Row) -> LabelState:
    return LabelState(
        run=run,
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
        dropped=rows.dropped_from_json(row["dropped"]),
        primary_refused_ts=row["primary_refused_ts"],
    )


def _unreal(value: float | None) -> float:
    # SQLite cannot keep NaN (it stores NULL); values are never NULL otherwise, so NULL is NaN.
    return math.nan if value is None else float(value)


def _log_filters(where: list[str], args: list[str | int], level: str | None, grep: str | None) -> None:
    """Add the log reads' level and text filters to `where`, their values to `args`."""
    if level is not None:
        where.append("g.levelno >= ?")
        args.append(level_number(level))
    if grep is not None:
        where.append("instr(g.text, ?) > 0")
        args.append(rows.storable_text(grep))


class SQLiteStore:
    """`sqlite:///relative/path.db` or `sqlite:////absolute/path.db`."""

    def __init__(self, url: str, create: bool = True) -> None:
        self.url = url
        self.path = _path(url)
        self.create = create
        self._con: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runbus-sqlite")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._thread, fn, *args)
        except (sqlite3.Error, OverflowError, OSError) as exc:
            raise self._error(exc) from exc

    def _error(self, exc: Exception) -> StoreError:
        """`exc` as StoreRejected when it comes from the data, else as StoreUnavailable."""
        where = f"sqlite {self.path}"
        code = getattr(exc, "sqlite_errorcode", None)
        primary = None if code is None else code & 0xFF
        if isinstance(exc, OverflowError):  # the sqlite3 module binds at most 64-bit integers
            return StoreRejected(f"{where} rejected the data: an integer beyond 64 bits ({exc})")
        if isinstance(exc, sqlite3.IntegrityError | sqlite3.DataError) or primary in REJECTED_CODES:
            return StoreRejected(f"{where} rejected the data: {exc}")
        if primary == sqlite3.SQLITE_FULL:
            return StoreUnavailable(
                f"{where}: the disk is full ({exc}); writes are retried once there is room again"
            )
        return StoreUnavailable(f"{where}: {exc}")

    async def connect(self) -> None:
        await self._call(self._connect)

    def _connect(self) -> None:
        if not self.create:
            self._con = self._open_existing()
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        con = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        con.row_factory = sqlite3.Row
        # Short on purpose: a locked database surfaces as StoreUnavailable within a second, and the
        # ingester retries (and honours its drain timeout) instead of blocking inside SQLite.
        con.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._use_wal(con)
        con.execute("PRAGMA synchronous = NORMAL")
        # A 64 MiB page cache and checkpoints every ~40 MB of WAL rather than 4 MB: with the
        # defaults a growing store spends its time re-reading index pages and checkpointing
        # (bench/ingest.py, 1M events: 45k -> 53k events/s).
        con.execute("PRAGMA cache_size = -65536")
        con.execute("PRAGMA wal_autocheckpoint = 10000")
        self._con = con
        self._migrate()

    def _open_existing(self) -> sqlite3.Connection:
        """A connection to the store as it is: no file, directory, table or journal change made."""
        if not os.path.isfile(self.path):
            raise missing_store(self.url)
        # mode=rw: a file that vanished since is an error here, not a new empty database.
        uri = Path(os.path.abspath(self.path)).as_uri() + "?mode=rw"
        con = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        try:
            con.row_factory = sqlite3.Row
            con.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            version = con.execute("PRAGMA user_version").fetchone()[0]
        except BaseException:
            con.close()
            raise
        if version == 0:
            con.close()
            raise missing_store(self.url)
        if version < len(MIGRATIONS):
            con.close()
            raise StoreError(
                f"sqlite {self.path}: schema version {version} is older than this runbus's "
                f"({len(MIGRATIONS)}): `runbus ingest` upgrades it"
            )
        return con

    @staticmethod
    def _use_wal(con: sqlite3.Connection, timeout: float = 30.0) -> None:
        # Switching a new file to WAL ignores busy_timeout: two stores opening the same new file
        # at once would see "database is locked", so the switch is retried for a while.
        deadline = time.monotonic() + timeout
        while con.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            try:
                con.execute("PRAGMA journal_mode = WAL")
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _migrate(self) -> None:
        # Checked outside a write transaction first: a worker starting while another holds the
        # write lock must not wait for it just to learn there is nothing to migrate.
        if self._db().execute("PRAGMA user_version").fetchone()[0] < len(MIGRATIONS):
            self._in_transaction(self._apply_migrations)

    def _apply_migrations(self, con: sqlite3.Connection) -> None:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            for statement in script.split(";"):
                if statement.strip():
                    con.execute(statement)
            con.execute(f"PRAGMA user_version = {int(number)}")

    def _in_transaction(self, work: Callable[..., T], *args: Any) -> T:
        """Run `work(connection, *args)` in one write transaction."""
        con = self._db()
        con.execute("BEGIN IMMEDIATE")
        try:
            result = work(con, *args)
            con.execute("COMMIT")
            return result
        except BaseException as exc:
            # SQLite rolls back by itself on some errors (a full disk): a ROLLBACK then fails
            # with "no transaction is active", which must not hide the error that caused it.
            if con.in_transaction:
                try:
                    con.execute("ROLLBACK")
                except sqlite3.Error as failed:
                    exc.add_note(f"and the rollback failed: {failed}")
            raise

    def _db(self) -> sqlite3.Connection:
        if self._con is None:
            raise StoreUnavailable(f"sqlite {self.path}: store is not connected: call connect() first")
        return self._con

    async def close(self) -> None:
        if self._con is not None:
            await self._call(self._con.close)
            self._con = None
        self._thread.shutdown(wait=True)

    async def identity(self) -> str:
        return await self._call(self._identity)

    def _identity(self) -> str:
        row = self._db().execute("SELECT value FROM store_meta WHERE name = 'id'").fetchone()
        if row is None:
            raise StoreError(f"sqlite {self.path}: the store has no id (store_meta was emptied)")
        return str(row[0])

    async def write(self, events: Sequence[Event], holders: Mapping[str, str | None] | None = None) -> int:
        if not events:
            return 0
        return await self._call(self._in_transaction, self._write_in_transaction, events, holders or {})

    def _write_in_transaction(
        self, con: sqlite3.Connection, events: Sequence[Event], holders: Mapping[str, str | None]
    ) -> int:
        # A statement for all the batch's labels at each step rather than a few per label: every
        # statement takes the GIL back once per row it returns (see _insert).
        by_label = rows.group_by_label(events)
        runs = sorted({run for run, _ in by_label})
        _insert(con, "runs (run_id)", 1, [(run,) for run in runs])
        _insert(con, "labels (run_id, label)", 2, list(by_label))
        # Every label of the batch's runs: the batch's own to fold its events into, all of them
        # to derive each run's state.
        stored = {
            (row["run_id"], row["label"]): row
            for chunk in _chunks(runs, MAX_LABELS_PER_STATEMENT)
            for row in con.execute(
                f"SELECT run_id, {_LABEL_COLUMNS} FROM labels "
                f"WHERE run_id IN (VALUES {_rows_sql(1, len(chunk))})",
                chunk,
            )
        }
        fresh = self._take_new(con, rows.spans(by_label, {key: stored[key]["id"] for key in by_label}))
        seen_at = time.time()
        labels = {key: _label_state(key[0], row) for key, row in stored.items()}
        for key, group in by_label.items():
            labels[key] = apply_events(labels[key], group)
        primaries = rows.settle_primaries(by_label, labels, self._primaries(con, runs), holders)
        updates = []
        for key in by_label:
            updates.append(
                (stored[key]["id"], *rows.label_columns(labels[key]), seen_at, *rows.kind_counts(fresh[key]))
            )
        for chunk in _chunks(updates, MAX_LABELS_PER_STATEMENT):
            con.execute(_update_labels_sql(len(chunk)), list(chain.from_iterable(chunk)))
        metric_rows, system_rows, log_rows = rows.value_rows(
            (stored[key]["id"], new) for key, new in fresh.items()
        )
        _insert(con, "metrics (label_id, key, epoch, seq, step, ts, value)", 7, metric_rows)
        _insert(con, "system (label_id, key, epoch, seq, ts, value)", 6, system_rows)
        _insert(con, "logs (label_id, epoch, seq, ts, stream, level, levelno, text)", 8, log_rows)
        for run in runs:
            mine = [label for (owner, _), label in labels.items() if owner == run]
            self._update_run(con, run, mine, primaries[run])
        return sum(map(len, fresh.values()))

    @staticmethod
    def _primaries(con: sqlite3.Connection, runs: list[str]) -> dict[str, str | None]:
        """The primary decided for each of `runs` (None where none is yet)."""
        return {
            row[0]: row[1]
            for chunk in _chunks(runs, MAX_LABELS_PER_STATEMENT)
            for row in con.execute(
                f"SELECT run_id, primary_label FROM runs WHERE run_id IN (VALUES {_rows_sql(1, len(chunk))})",
                chunk,
            )
        }

    @staticmethod
    def _take_new(con: sqlite3.Connection, batch: list[rows.Span]) -> dict[tuple[str, str], list[Event]]:
        """Each label's events never stored before; their seqs join the labels' `seen` ranges."""
        near: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for chunk in _chunks(rows.near_bounds(batch), MAX_LABELS_PER_STATEMENT):
            for label_id, epoch, first, last in con.execute(
                _near_ranges_sql(len(chunk)), list(chain.from_iterable(chunk))
            ):
                near.setdefault((label_id, epoch), []).append((first, last))
        changes = rows.seen_changes(batch, near)
        for chunk in _chunks(changes.replaced, MAX_LABELS_PER_STATEMENT):
            con.execute(_delete_ranges_sql(len(chunk)), list(chain.from_iterable(chunk)))
        _insert(con, "seen (label_id, epoch, first_seq, last_seq)", 4, changes.ranges, verb="INSERT")
        return changes.fresh

    def _update_run(
        self,
        con: sqlite3.Connection,
        run: str,
        labels: list[LabelState] | None = None,
        primary: str | None = None,
    ) -> None:
        """Derive a run's state from its labels and primary (both read here unless given)."""
        if labels is None:
            labels = [
                _label_state(run, row)
                for row in con.execute(f"SELECT {_LABEL_COLUMNS} FROM labels WHERE run_id = ?", (run,))
            ]
            primary = self._primaries(con, [run]).get(run)
        derived = run_state(labels, primary)
        con.execute(
            "UPDATE runs SET state = ?, primary_label = ?, exit_code = ?, ended_ts = ?, "
            "started_ts = ?, last_ts = ?, config = ? WHERE run_id = ?",
            (*rows.run_columns(derived, labels), run),
        )

    async def mark_crashed(self, silent_since: float) -> list[tuple[str, str]]:
        return await self._call(self._in_transaction, self._mark_crashed, silent_since)

    def _mark_crashed(self, con: sqlite3.Connection, silent_since: float) -> list[tuple[str, str]]:
        silent = con.execute(
            f"SELECT run_id, {_LABEL_COLUMNS} FROM labels WHERE state = 'running' AND seen_at < ?",
            (silent_since,),
        ).fetchall()
        for row in silent:
            crashed = crash(_label_state(row["run_id"], row))
            con.execute(
                "UPDATE labels SET state = ?, state_epoch = ?, state_seq = ?, state_ts = ? WHERE id = ?",
                (crashed.state, *crashed.state_pos, crashed.state_ts, row["id"]),
            )
        for run in {row["run_id"] for row in silent}:
            self._update_run(con, run)
        return [(row["run_id"], row["label"]) for row in silent]

    # -- reads ---------------------------------------------------------------------------------

    async def runs(self) -> list[RunSummary]:
        return await self._call(self._runs)

    def _runs(self) -> list[RunSummary]:
        query = (
            "SELECT r.*, (SELECT count(*) FROM labels l WHERE l.run_id = r.run_id) AS label_count "
            "FROM runs r ORDER BY r.started_ts DESC NULLS LAST, r.run_id"
        )
        return [rows.run_summary(dict(row)) for row in self._db().execute(query)]

    async def run(self, run_id: str) -> RunSummary | None:
        return await self._call(self._run, run_id)

    def _run(self, run_id: str) -> RunSummary | None:
        con = self._db()
        row = con.execute(
            "SELECT r.*, (SELECT count(*) FROM labels l WHERE l.run_id = r.run_id) AS label_count "
            "FROM runs r WHERE r.run_id = ?",
            (run_id,),
        ).fetchone()
        if row is None:
            return None
        epochs = con.execute(rows.EPOCHS_SQL.format(param="?"), (run_id,)).fetchall()
        counts = con.execute(rows.KIND_COUNTS_SQL.format(param="?"), (run_id,)).fetchone()
        missing = con.execute(
            rows.MISSING_RANGES_SQL.format(param="?", limit=rows.MAX_GAPS_SHOWN), (run_id,)
        ).fetchall()
        labels: list[LabelSummary] = []
        for label_row in con.execute(
            f"SELECT {_LABEL_COLUMNS} FROM labels WHERE run_id = ? ORDER BY label", (run_id,)
        ):
            mine = [(e["epoch"], e["top"], e["seen"]) for e in epochs if e["label_id"] == label_row["id"]]
            gaps = [(m["epoch"], m["first"], m["last"]) for m in missing if m["label_id"] == label_row["id"]]
            label = _label_state(run_id, label_row)
            labels.append(rows.label_summary(label, mine, gaps, row["primary_label"]))
        return rows.run_summary(dict(row), labels=labels, counts=dict(counts))

    async def metric_keys(self, run_id: str) -> list[str]:
        return await self._call(self._metric_keys, run_id)

    def _metric_keys(self, run_id: str) -> list[str]:
        query = (
            "SELECT DISTINCT m.key FROM metrics m JOIN labels l ON l.id = m.label_id "
            "WHERE l.run_id = ? ORDER BY m.key"
        )
        return [row[0] for row in self._db().execute(query, (run_id,))]

    async def metrics(self, run_id: str, key: str | None = None, label: str | None = None) -> list[Point]:
        return await self._call(self._points, "metrics", run_id, key, label)

    async def system(self, run_id: str, key: str | None = None, label: str | None = None) -> list[Point]:
        return await self._call(self._points, "system", run_id, key, label)

    def _points(self, table: str, run_id: str, key: str | None, label: str | None) -> list[Point]:
        step = "m.step" if table == "metrics" else "NULL"
        order = "m.step NULLS FIRST, m.epoch, m.seq" if table == "metrics" else "m.ts, m.epoch, m.seq"
        where, args = ["l.run_id = ?"], [run_id]
        if key is not None:
            where.append("m.key = ?")
            args.append(rows.storable_text(key))
        if label is not None:
            where.append("l.label = ?")
            args.append(label)
        query = (
            f"SELECT l.label, m.key, {step} AS step, m.epoch, m.seq, m.ts, m.value "
            f"FROM {table} m JOIN labels l ON l.id = m.label_id WHERE {' AND '.join(where)} "
            f"ORDER BY l.label, m.key, {order}"
        )
        return [
            Point(r[0], r[1], r[2], r[3], r[4], r[5], _unreal(r[6])) for r in self._db().execute(query, args)
        ]

    async def logs(
        self,
        run_id: str,
        label: str | None = None,
        level: str | None = None,
        grep: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[LogLine]:
        return await self._call(self._logs, run_id, label, level, grep, limit, offset)

    def _logs(
        self,
        run_id: str,
        label: str | None,
        level: str | None,
        grep: str | None,
        limit: int | None,
        offset: int,
    ) -> list[LogLine]:
        where: list[str] = ["l.run_id = ?"]
        args: list[str | int] = [run_id]
        if label is not None:
            where.append("l.label = ?")
            args.append(label)
        _log_filters(where, args, level, grep)
        query = (
            "SELECT l.label, g.epoch, g.seq, g.ts, g.stream, g.level, g.text FROM logs g "
            f"JOIN labels l ON l.id = g.label_id WHERE {' AND '.join(where)} "
            "ORDER BY g.ts, l.label, g.epoch, g.seq LIMIT ? OFFSET ?"
        )
        args += [-1 if limit is None else limit, offset]
        return [LogLine(*row) for row in self._db().execute(query, args)]

    async def point_page(
        self,
        table: PointTable,
        run_id: str,
        label: str,
        after: tuple[str, int, int] | None,
        limit: int,
        key: str | None = None,
    ) -> list[Point]:
        return await self._call(self._point_page, point_table(table), run_id, label, after, limit, key)

    def _point_page(
        self,
        table: str,
        run_id: str,
        label: str,
        after: tuple[str, int, int] | None,
        limit: int,
        key: str | None,
    ) -> list[Point]:
        where: list[str] = ["m.label_id = (SELECT id FROM labels WHERE run_id = ? AND label = ?)"]
        args: list[str | int] = [run_id, label]
        if after is not None:
            where.append("(m.key, m.epoch, m.seq) > (?, ?, ?)")
            args += [rows.storable_text(after[0]), after[1], after[2]]
        if key is not None:
            where.append("m.key = ?")
            args.append(rows.storable_text(key))
        step = "m.step" if table == "metrics" else "NULL"
        query = (
            f"SELECT m.key, {step}, m.epoch, m.seq, m.ts, m.value FROM {table} m "
            f"WHERE {' AND '.join(where)} ORDER BY m.key, m.epoch, m.seq LIMIT ?"
        )
        return [
            Point(label, r[0], r[1], r[2], r[3], r[4], _unreal(r[5]))
            for r in self._db().execute(query, [*args, limit])
        ]

    async def log_page(
        self,
        run_id: str,
        label: str,
        after: tuple[int, int] | None,
        limit: int,
        level: str | None = None,
        grep: str | None = None,
    ) -> list[LogLine]:
        return await self._call(self._log_page, run_id, label, after, limit, level, grep)

    def _log_page(
        self,
        run_id: str,
        label: str,
        after: tuple[int, int] | None,
        limit: int,
        level: str | None,
        grep: str | None,
    ) -> list[LogLine]:
        where: list[str] = ["g.label_id = (SELECT id FROM labels WHERE run_id = ? AND label = ?)"]
        args: list[str | int] = [run_id, label]
        if after is not None:
            where.append("(g.epoch, g.seq) > (?, ?)")
            args += [after[0], after[1]]
        _log_filters(where, args, level, grep)
        query = (
            "SELECT g.epoch, g.seq, g.ts, g.stream, g.level, g.text FROM logs g "
            f"WHERE {' AND '.join(where)} ORDER BY g.epoch, g.seq LIMIT ?"
        )
        return [LogLine(label, *row) for row in self._db().execute(query, [*args, limit])]
