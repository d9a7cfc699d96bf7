"""The embedded SQLite backend (WAL), driven from one dedicated thread per store."""

from __future__ import annotations

import asyncio
import functools
import math
import operator
import os
import sqlite3
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from runbus.errors import StoreError, StoreRejected, StoreUnavailable
from runbus.storage import (
    backfill,
    base,
    beats,
    charts,
    chunking,
    metadata,
    reads,
    rollup_blocks,
    rollups,
    rows,
    values,
)
from runbus.storage.base import (
    Point,
    PointTable,
    missing_store,
    point_table,
)
from runbus.storage.dialect import SQLITE
from runbus.storage.rules import RUNNING, LabelState, Setting, apply_events, crash, out_of_reach, run_state
from runbus.wire import Event

T = TypeVar("T")
BUSY_TIMEOUT_MS = 1000
PAGE_SIZE = 4096

# SQLite's primary result codes for data the store refuses, whoever asks again: a constraint, a
# string or blob too big, a value of the wrong type, a parameter out of range. Every other error
# (locked, busy, full, read-only, I/O, cannot open) is about the store, not the data.
REJECTED_CODES = frozenset(
    {sqlite3.SQLITE_CONSTRAINT, sqlite3.SQLITE_TOOBIG, sqlite3.SQLITE_MISMATCH, sqlite3.SQLITE_RANGE}
)

# The label rollups (storage/rollup_blocks.py): an open row per label series (of a running label,
# from schema 11), blocks of the rest.
LABEL_ROLLUPS = """
    CREATE TABLE IF NOT EXISTS label_open (
        key_id INTEGER NOT NULL,
        axis INTEGER NOT NULL,
        label_id INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        bucket INTEGER NOT NULL,
        n INTEGER NOT NULL,
        nan INTEGER NOT NULL,
        inf INTEGER NOT NULL,
        total REAL,
        lo REAL,
        hi REAL,
        last REAL,
        last_seq INTEGER NOT NULL,
        x_lo INTEGER NOT NULL,
        x_hi INTEGER NOT NULL,
        ts_lo REAL NOT NULL,
        ts_hi REAL NOT NULL,
        first_seq INTEGER NOT NULL,
        PRIMARY KEY (key_id, axis, label_id, epoch)
    ) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS label_blocks (
        key_id INTEGER NOT NULL,
        kind INTEGER NOT NULL,
        axis INTEGER NOT NULL,
        label_id INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        block INTEGER NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (key_id, kind, axis, label_id, epoch, block)
    ) WITHOUT ROWID;
"""

# Migration 6, rollups (storage/rollups.py): a run's metric keys with ids, each label epoch's
# generation, the per-label buckets (open rows and blocks: storage/rollup_blocks.py; up to schema 9
# a row per bucket, label_rollups, which migration 10 converts) and the cross-label bucket rows;
# DATA_MIGRATIONS[6] rolls up the metrics already stored.
ROLLUPS_SCHEMA = f"""
    CREATE TABLE series (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        key TEXT NOT NULL,
        UNIQUE (run_id, key)
    );
    CREATE TABLE label_epochs (
        label_id INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        generation INTEGER NOT NULL,
        PRIMARY KEY (label_id, epoch)
    ) WITHOUT ROWID;
{LABEL_ROLLUPS}    CREATE TABLE run_rollups (
        key_id INTEGER NOT NULL,
        width INTEGER NOT NULL,
        axis INTEGER NOT NULL,
        generation INTEGER NOT NULL,
        bucket INTEGER NOT NULL,
        slot INTEGER NOT NULL,
        n INTEGER NOT NULL,
        nan INTEGER NOT NULL,
        inf INTEGER NOT NULL,
        total REAL,
        lo REAL,
        hi REAL,
        x_lo INTEGER NOT NULL,
        x_hi INTEGER NOT NULL,
        ts_lo REAL NOT NULL,
        ts_hi REAL NOT NULL,
        samples INTEGER NOT NULL,
        bins BLOB NOT NULL,
        PRIMARY KEY (key_id, width, axis, generation, bucket, slot)
    ) WITHOUT ROWID
"""

# Migration 8, column chunks (storage/chunking.py): values move from the metrics and system rows
# (the head) into chunks. Every label epoch already stored is marked due, so workers compact the
# store a label epoch at a time (compact_due), while they go on taking batches.
CHUNKS_SCHEMA = f"""
    CREATE TABLE chunks (
        label_id INTEGER NOT NULL,
        series_id INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        points INTEGER NOT NULL,
        min_step INTEGER,
        max_step INTEGER,
        first_ts REAL NOT NULL,
        last_ts REAL NOT NULL,
        data BLOB NOT NULL
    );
    CREATE UNIQUE INDEX chunks_by_series ON chunks (label_id, series_id, epoch, first_seq);
    ALTER TABLE label_epochs ADD COLUMN head INTEGER NOT NULL DEFAULT 0;
    UPDATE label_epochs SET head = {chunking.COMPACT_EVENTS} WHERE EXISTS (
        SELECT 1 FROM metrics m WHERE m.label_id = label_epochs.label_id AND m.epoch = label_epochs.epoch
    ) OR EXISTS (
        SELECT 1 FROM system m WHERE m.label_id = label_epochs.label_id AND m.epoch = label_epochs.epoch
    );
    CREATE INDEX label_epochs_due ON label_epochs (head) WHERE head > 0
"""

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
    # Run metadata: what each label set (config and summary keys, the run's name and tags), and
    # the run's merged view of it; DATA_MIGRATIONS[5] fills both from the stored starts' configs.
    """
    CREATE TABLE label_values (
        label_id INTEGER NOT NULL,
        field TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        ts REAL NOT NULL,
        PRIMARY KEY (label_id, field, key)
    ) WITHOUT ROWID;
    ALTER TABLE runs ADD COLUMN name TEXT;
    ALTER TABLE runs ADD COLUMN tags TEXT;
    ALTER TABLE runs ADD COLUMN summary TEXT;
    ALTER TABLE runs ADD COLUMN set_by TEXT
    """,
    ROLLUPS_SCHEMA,
    # System samples' rollups, in the rollup tables (rollups.series_run); DATA_MIGRATIONS[7]
    # rolls up the samples already stored.
    "",
    CHUNKS_SCHEMA,
    # Health (storage/beats.py): each label's latest heartbeat, each run's verdict.
    beats.SCHEMA,
    # Label rollups as open rows and blocks (storage/rollup_blocks.py): the tables as migration 6
    # now makes them; DATA_MIGRATIONS[10] converts a schema-9 store's label_rollups rows.
    LABEL_ROLLUPS,
    # The open buckets of ended labels' series in their fine blocks (storage/rollup_blocks.py):
    # DATA_MIGRATIONS[11] moves them there. An index to find a label's open rows by when it ends.
    "CREATE INDEX IF NOT EXISTS label_open_by_label ON label_open (label_id)",
]


_LABEL_COLUMNS = (
    "id, label, state, exit_code, state_epoch, state_seq, state_ts, is_primary, start_epoch, "
    "start_seq, start_data, epoch, last_seq, first_ts, last_ts, dropped, primary_refused_ts"
)


# Rows per INSERT statement, at most: a power of two, so any count splits into a few statement
# sizes that stay in the connection's statement cache. 4096 rows of 8 columns stay inside
# SQLite's default limit of 32,766 bound parameters.
MAX_ROWS_PER_INSERT = 4096
MAX_PARAMETERS = 32766
# Label rows per statement when a batch's labels are read or updated together: 1024 of 20 columns.
MAX_LABELS_PER_STATEMENT = 1024


def _insert(
    con: sqlite3.Connection,
    table: str,
    width: int,
    values: list[rows.Params],
    verb: str = "INSERT OR IGNORE",
    tail: str = "",
) -> None:
    """`verb` INTO `table` ("name (col, ...)") `values` as multi-row VALUES statements.

    Not executemany, and as few statements as the parameter limit allows: each call takes the GIL
    back after releasing it (executemany after every row), and beside the ingester's busy asyncio
    thread each taking back can wait out a switch interval (bench/gil.py). One statement runs all
    its rows in a single sqlite3_step with the GIL released, beside that thread rather than after it.
    """
    flat = list(chain.from_iterable(values))
    done = 0
    for size in _statement_sizes(len(values), _most_rows(width)):
        con.execute(_values_sql(verb, table, width, size, tail), flat[done * width : (done + size) * width])
        done += size


def _statement_sizes(count: int, most: int = MAX_ROWS_PER_INSERT) -> list[int]:
    """`count` as full statements of `most` rows plus its remainder's powers of two."""
    full, rest = divmod(count, most)
    return [most] * full + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


def _most_rows(width: int) -> int:
    """Rows of `width` columns per statement: MAX_ROWS_PER_INSERT, or for wider rows the largest
    power of two that stays within SQLite's limit of 32,766 parameters."""
    if width * MAX_ROWS_PER_INSERT <= MAX_PARAMETERS:
        return MAX_ROWS_PER_INSERT
    return 1 << ((MAX_PARAMETERS // width).bit_length() - 1)


@functools.lru_cache(maxsize=256)
def _values_sql(verb: str, table: str, width: int, size: int, tail: str = "") -> str:
    return f"{verb} INTO {table} VALUES " + _rows_sql(width, size) + tail


@functools.lru_cache(maxsize=256)
def _rows_sql(width: int, size: int) -> str:
    """`size` rows of `width` parameters: "(?, ?), (?, ?)"."""
    row = "(" + ", ".join("?" * width) + ")"
    return ", ".join([row] * size)


def _chunks(values: list[T], size: int) -> list[list[T]]:
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


# Stored metric rows read per step of the rollups migration: its memory stays bounded.
MIGRATION_PAGE = 100_000


def _roll_up_stored_metrics(con: sqlite3.Connection) -> None:
    """Migration 6's data: every stored metric rolled up, a page of rows at a time."""
    _roll_up_stored(con, "metrics")


def _roll_up_stored_system(con: sqlite3.Connection) -> None:
    """Migration 7's data: every stored system sample rolled up, a page of rows at a time."""
    _roll_up_stored(con, "system")


def _roll_up_stored(con: sqlite3.Connection, table: PointTable) -> None:
    """Every stored value of `table` rolled up, a page of rows at a time."""
    labels = backfill.stored_labels(con.execute(backfill.STORED_LABELS_SQL))
    query = backfill.stored_page_sql(table)
    after: tuple[int, str, int, int] = (-1, "", 0, 0)
    while True:
        page = con.execute(query, (*after, MIGRATION_PAGE)).fetchall()
        if not page:
            return
        after = tuple(page[-1][:4])
        if table == "metrics":
            fine = rollups.fine_partials_from_rows((*r[:6], _unreal(r[6])) for r in page)
        else:
            fine = rollups.fold_system((*r[:5], _unreal(r[5])) for r in page)
        _roll_up(con, fine, *backfill.page_labels(labels, fine, table))


def _label_rollups_to_blocks(con: sqlite3.Connection) -> None:
    """Migration 10's data: a schema-9 store's label_rollups rows as open rows and blocks, read
    a label series at a time (sorted by SQLite, in temporary files if need be) and written so;
    the table then dropped."""
    if not con.execute("SELECT 1 FROM sqlite_schema WHERE name = 'label_rollups'").fetchone():
        return
    found = con.execute(
        f"SELECT {rollups.LABEL_KEY_COLUMNS}, {rollups.LABEL_VALUE_COLUMNS} FROM label_rollups "
        f"ORDER BY {rollup_blocks.CONVERTED_ORDER}"
    )
    for open_rows, blocks in rollup_blocks.converted(found):
        _insert(con, "label_open", 18, open_rows, verb="INSERT")
        _insert(con, "label_blocks", 7, blocks, verb="INSERT")
    con.execute("DROP TABLE label_rollups")


def _label_open_to_blocks(con: sqlite3.Connection) -> None:
    """Migration 11's data: the label_open rows of the labels that have ended into their blocks."""
    _fold_open_rows(con, [row[0] for row in con.execute(f"SELECT id FROM labels WHERE state != '{RUNNING}'")])


def _fold_open_rows(con: sqlite3.Connection, labels: Sequence[int]) -> None:
    """The label_open rows of `labels` (which have ended: their open buckets are final) into the
    fine blocks their buckets fall in (rollup_blocks.folded), then deleted. A series has one open
    row, and it one block: no block is read twice."""
    for chunk in _chunks(list(labels), MAX_LABELS_PER_STATEMENT):
        chosen = _rows_sql(1, len(chunk))
        found = con.execute(f"{rollup_blocks.FOLDED_ROWS} IN ({chosen})", chunk).fetchall()
        if found:
            _insert(con, "label_blocks", 7, list(rollup_blocks.folded(found)), verb="INSERT OR REPLACE")
            con.execute(f"DELETE FROM label_open WHERE label_id IN ({chosen})", chunk)


def _roll_up(
    con: sqlite3.Connection,
    fine: dict[rollups.FineKey, rollups.Partial],
    run_of: Mapping[int, str],
    starts: Mapping[int, tuple[int, int | None]],
    ended: Container[int] = (),
) -> None:
    """Fold a batch's 128-step partials into the rollup tables: `run_of` names each label id's
    run, `starts` gives each its latest start's (epoch, restart count); the labels of `ended`
    have ended (their open buckets go into blocks: rollup_blocks.placed). SQLite has one writer
    at a time, so its run_rollups rows are all of slot 0."""
    key_id = _series_ids(con, fine, run_of)
    generation = _generations(con, fine, starts)
    stored, opens, blocks = _stored_fine_rows(con, rollups.fine_ranges(fine, key_id))
    plan = rollups.plan(fine, key_id, generation, stored)
    blocks.update(_stored_blocks(con, {rollup_blocks.place_of(key)[0] for key in plan.wide_deltas}))
    placed = rollup_blocks.placed(plan, stored, opens, blocks, ended)
    for chunk in _chunks(placed.closed, MAX_ROWS_PER_INSERT):
        con.execute(
            _given_rows(
                "u",
                "key_id, axis, label_id, epoch",
                len(chunk),
                "DELETE FROM label_open WHERE (key_id, axis, label_id, epoch) IN (SELECT * FROM u)",
            ),
            list(chain.from_iterable(chunk)),
        )
    _insert(con, "label_open", 18, placed.opens, verb="INSERT OR REPLACE")
    _insert(con, "label_blocks", 7, placed.blocks, verb="INSERT OR REPLACE")
    held = _stored_run_rows(con, list(plan.run_deltas))
    merged = []
    for key, delta in plan.run_deltas.items():
        part, bins, samples = rollups.merged_run_row(held.get(key), delta)
        merged.append(rollups.run_row(key, 0, part, bins, samples))
    _insert(con, "run_rollups", 18, merged, verb="INSERT OR REPLACE")


def _series_ids(
    con: sqlite3.Connection, fine: Iterable[rollups.FineKey], run_of: Mapping[int, str]
) -> dict[tuple[int, str], int]:
    """The `series` id of each (label id, key) of a batch, new keys added."""
    wanted = {(label_id, key) for label_id, key, *_ in fine}
    ids = _series_id_map(con, {(run_of[label_id], rows.storable_text(key)) for label_id, key in wanted})
    return {(label_id, key): ids[run_of[label_id], rows.storable_text(key)] for label_id, key in wanted}


def _series_id_map(con: sqlite3.Connection, wanted: Iterable[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """The `series` id of each (series run, stored key), new ones added."""
    pairs = sorted(wanted)
    _insert(con, "series (run_id, key)", 2, pairs)
    ids: dict[tuple[str, str], int] = {}
    for chunk in _chunks(pairs, MAX_ROWS_PER_INSERT):
        statement = _given_rows(
            "u",
            "run_id, key",
            len(chunk),
            "SELECT s.run_id, s.key, s.id FROM u JOIN series s USING (run_id, key)",
        )
        for run, key, id_ in con.execute(statement, list(chain.from_iterable(chunk))):
            ids[run, key] = id_
    return ids


def _generations(
    con: sqlite3.Connection, fine: Iterable[rollups.FineKey], starts: Mapping[int, tuple[int, int | None]]
) -> dict[tuple[int, int], int]:
    """The generation of each (label id, epoch) of a batch; an epoch met the first time gets one."""
    wanted = {(label_id, epoch) for label_id, _, epoch, _, _ in fine}
    known: dict[int, dict[int, int]] = {label_id: {} for label_id, _ in wanted}
    for chunk in _chunks(sorted(known), MAX_LABELS_PER_STATEMENT):
        query = "SELECT label_id, epoch, generation FROM label_epochs WHERE label_id IN ({})"
        for label_id, epoch, gen in con.execute(query.format(_rows_sql(1, len(chunk))), chunk):
            known[label_id][epoch] = gen
    new = []
    for label_id, epoch in sorted(wanted):
        mine = known[label_id]
        if epoch not in mine:
            start_epoch, restarts = starts.get(label_id, (0, None))
            mine[epoch] = rollups.generation_of(epoch, mine, restarts if start_epoch == epoch else None)
            new.append((label_id, epoch, mine[epoch]))
    _insert(con, "label_epochs (label_id, epoch, generation)", 3, new, verb="INSERT")
    return {(label_id, epoch): known[label_id][epoch] for label_id, epoch in wanted}


def _stored_fine_rows(
    con: sqlite3.Connection, ranges: list[tuple[int, int, int, int, int]]
) -> tuple[
    dict[rollups.LabelRowKey, rollups.Partial],
    dict[rollups.SeriesKey, int],
    dict[rollup_blocks.BlockKey, rollup_blocks.Places],
]:
    """The 128-step rows of each (key id, axis, label id, epoch, lowest bucket): its label_open
    row and the buckets of its fine blocks from that bucket's block up, or from its open bucket's
    (its label_open row's, else its highest block's) if lower (rollups.fine_ranges); the open
    bucket of each series with a label_open row; and those blocks as read (rollup_blocks.placed
    rewrites them)."""
    found: dict[rollups.LabelRowKey, rollups.Partial] = {}
    opened: dict[rollups.SeriesKey, int] = {}
    held: dict[rollup_blocks.BlockKey, rollup_blocks.Places] = {}
    opens = (
        "SELECT x.key_id, x.axis, x.label_id, x.epoch, x.bucket, "
        f"x.{rollups.LABEL_VALUE_COLUMNS.replace(', ', ', x.')} FROM u JOIN label_open x "
        "USING (key_id, axis, label_id, epoch)"
    )
    blocks = (
        "SELECT b.key_id, b.kind, b.axis, b.label_id, b.epoch, b.block, b.data FROM u "
        "LEFT JOIN label_open x USING (key_id, axis, label_id, epoch) JOIN label_blocks b "
        f"ON b.key_id = u.key_id AND b.kind = {rollup_blocks.FINE} AND b.axis = u.axis "
        "AND b.label_id = u.label_id AND b.epoch = u.epoch "
        "AND b.block >= (min(u.lo, coalesce(x.bucket, (SELECT max(t.block) FROM label_blocks t "
        f"WHERE t.key_id = u.key_id AND t.kind = {rollup_blocks.FINE} AND t.axis = u.axis "
        f"AND t.label_id = u.label_id AND t.epoch = u.epoch) << {rollup_blocks.FINE_BITS})) "
        f">> {rollup_blocks.FINE_BITS})"
    )
    for chunk in _chunks(ranges, MAX_ROWS_PER_INSERT):
        flat = list(chain.from_iterable(chunk))
        read = con.execute(_given_rows("u", "key_id, axis, label_id, epoch, lo", len(chunk), blocks), flat)
        held.update(rollup_blocks.decoded(read))
        for row in con.execute(
            _given_rows("u", "key_id, axis, label_id, epoch, lo", len(chunk), opens), flat
        ):
            found[(row[0], rollups.FINE_WIDTH, *row[1:5])] = rollup_blocks.open_part(row[5:])
            opened[row[:4]] = row[4]
    return {**rollup_blocks.fine_rows(held), **found}, opened, held


def _stored_blocks(
    con: sqlite3.Connection, keys: set[rollup_blocks.BlockKey]
) -> dict[rollup_blocks.BlockKey, rollup_blocks.Places]:
    """The label_blocks at `keys`, those there are, decoded."""
    found: dict[rollup_blocks.BlockKey, rollup_blocks.Places] = {}
    for chunk in _chunks(sorted(keys), MAX_ROWS_PER_INSERT):
        statement = _given_rows(
            "u",
            "key_id, kind, axis, label_id, epoch, block",
            len(chunk),
            "SELECT b.key_id, b.kind, b.axis, b.label_id, b.epoch, b.block, b.data FROM u "
            "JOIN label_blocks b USING (key_id, kind, axis, label_id, epoch, block)",
        )
        found.update(rollup_blocks.decoded(con.execute(statement, list(chain.from_iterable(chunk)))))
    return found


def _stored_run_rows(
    con: sqlite3.Connection, keys: list[rollups.RunRowKey], slot: int = 0
) -> dict[rollups.RunRowKey, tuple[rollups.Partial, dict[int, int]]]:
    """This slot's run_rollups rows at `keys`: (partial, sketch bins) each."""
    found: dict[rollups.RunRowKey, tuple[rollups.Partial, dict[int, int]]] = {}
    for chunk in _chunks(keys, MAX_ROWS_PER_INSERT):
        statement = _given_rows(
            "u",
            rollups.RUN_KEY_COLUMNS,
            len(chunk),
            f"SELECT r.{rollups.RUN_KEY_COLUMNS.replace(', ', ', r.')}, "
            f"r.{rollups.RUN_VALUE_COLUMNS.replace(', ', ', r.')} FROM u JOIN run_rollups r "
            "USING (key_id, width, axis, generation, bucket) WHERE r.slot = ?",
        )
        for row in con.execute(statement, [*chain.from_iterable(chunk), slot]):
            part = rollups.run_part(row[5:15])
            part[rollups.TOTAL] = _unreal(part[rollups.TOTAL])
            found[tuple(row[:5])] = (part, rollups.decode_bins(row[16]))
    return found


def _stored_labels(
    con: sqlite3.Connection, runs: list[str], batch: list[tuple[str, str]]
) -> dict[tuple[str, str], sqlite3.Row]:
    """Every label of the batch's runs, the batch's own (`batch`) added where new: the batch's
    to fold its events into, all of them to derive each run's state."""
    _insert(con, "runs (run_id)", 1, [(run,) for run in runs])
    _insert(con, "labels (run_id, label)", 2, batch)
    return {
        (row["run_id"], row["label"]): row
        for chunk in _chunks(runs, MAX_LABELS_PER_STATEMENT)
        for row in con.execute(
            f"SELECT run_id, {_LABEL_COLUMNS} FROM labels "
            f"WHERE run_id IN (VALUES {_rows_sql(1, len(chunk))})",
            chunk,
        )
    }


def _update_labels(con: sqlite3.Connection, changed: list[tuple[int, LabelState, list[Event]]]) -> None:
    """Store each (label id, its state, its new events): the state, the time it was seen, its counts."""
    seen_at = time.time()
    updates = [
        (label_id, *rows.label_columns(label), seen_at, *rows.kind_counts(new))
        for label_id, label, new in changed
    ]
    for chunk in _chunks(updates, MAX_LABELS_PER_STATEMENT):
        con.execute(_update_labels_sql(len(chunk)), list(chain.from_iterable(chunk)))


def _store_values(
    con: sqlite3.Connection, fresh: Mapping[int, tuple[str, list[Event], LabelState]], ended: set[int]
) -> None:
    """A batch's new events' values, logs and rollups, given by label id as (run, new events,
    label state): values join their label epochs' heads, or with them go into chunks where the
    head is due (chunking.is_due), `ended` labels' included."""
    metric_columns, fine = rollups.fold_metrics((label_id, new) for label_id, (_, new, _) in fresh.items())
    system_rows, log_rows = rows.value_rows((label_id, new) for label_id, (_, new, _) in fresh.items())
    _insert(con, "logs (label_id, epoch, seq, ts, stream, level, levelno, text)", 8, log_rows)
    runs = {label_id: run for label_id, (run, _, _) in fresh.items()}
    starts = {label_id: _latest_start(label) for label_id, (_, _, label) in fresh.items()}
    if fine:
        _roll_up(con, fine, runs, starts, ended)
    if system_rows:
        system_runs = {label_id: rollups.series_run(run, "system") for label_id, run in runs.items()}
        _roll_up(con, rollups.fold_system(system_rows), system_runs, starts, ended)
    # The ended labels' series this batch brought no value: their open buckets too.
    _fold_open_rows(con, sorted(ended))
    heads = chunking.head_events((label_id, new) for label_id, (_, new, _) in fresh.items())
    due = set(_grow_heads(con, heads, ended))
    metric_rows, system_head, direct = chunking.split_due(
        metric_columns, chunking.row_columns(system_rows, steps=False), due
    )
    _insert(con, "metrics (label_id, key, epoch, seq, step, ts, value)", 7, _exact(metric_rows))
    _insert(con, "system (label_id, key, epoch, seq, ts, value)", 6, _exact(system_head))
    _compact(con, sorted(due), direct)


def _exact(value_rows: list[rows.Params]) -> list[rows.Params]:
    """Head rows (value last) with each -0.0 as chunking.NEGATIVE_ZERO: SQLite stores the REAL
    -0.0 as 0, and a head row must give back the value it was given."""
    return [
        (*r[:-1], chunking.NEGATIVE_ZERO) if r[-1] == 0 and math.copysign(1.0, r[-1]) < 0 else r
        for r in value_rows
    ]


def _grow_heads(
    con: sqlite3.Connection, heads: Mapping[tuple[int, int], int], ended: set[int]
) -> list[tuple[int, int]]:
    """Add a batch's value events to their label epochs' heads: the label epochs now due for
    compaction, those of `ended` labels (ended now or before) and those the batch brings events
    enough to go into chunks at once (chunking.direct_heads) included."""
    heads, direct = chunking.direct_heads(heads)
    due = []
    for chunk in _chunks([(*key, count) for key, count in heads.items()], MAX_ROWS_PER_INSERT):
        statement = _given_rows(
            "u",
            "label_id, epoch, added",
            len(chunk),
            "UPDATE label_epochs SET head = head + u.added FROM u "
            "WHERE label_epochs.label_id = u.label_id AND label_epochs.epoch = u.epoch "
            "RETURNING label_epochs.label_id, label_epochs.epoch, label_epochs.head",
        )
        due += [
            (label_id, epoch)
            for label_id, epoch, head in con.execute(statement, list(chain.from_iterable(chunk))).fetchall()
            if chunking.is_due(head, heads[label_id, epoch], label_id in ended)
        ]
    for ids in _chunks(sorted(ended), MAX_LABELS_PER_STATEMENT):
        due += con.execute(
            "SELECT label_id, epoch FROM label_epochs "
            f"WHERE head > 0 AND label_id IN ({_rows_sql(1, len(ids))})",
            ids,
        ).fetchall()
    return sorted(set(map(tuple, due)).union(direct))


# The head tables, and what each holds as a value's step.
_HEADS: tuple[tuple[PointTable, str], ...] = (("metrics", "step"), ("system", "NULL"))


def _compact(
    con: sqlite3.Connection,
    due: Sequence[tuple[int, int]],
    fresh: Sequence[tuple[PointTable, rollups.KeyColumns]] = (),
) -> None:
    """Move the heads of `due` label epochs, and with them `fresh` values (of their table) of
    the same label epochs that never were head rows, into column chunks (storage/chunking.py)."""
    if not due:
        return
    label_ids = sorted({label_id for label_id, _ in due})
    runs = dict(
        con.execute(f"SELECT id, run_id FROM labels WHERE id IN ({_rows_sql(1, len(label_ids))})", label_ids)
    )
    found = list(fresh)
    for label_id, epoch in due:
        where = (label_id, epoch)
        for table, step in _HEADS:
            query = (
                f"SELECT label_id, key, epoch, seq, {step}, ts, value FROM {table} "
                "WHERE label_id = ? AND epoch = ?"
            )
            found.extend((table, c) for c in chunking.row_columns(con.execute(query, where), steps=True))
            con.execute(f"DELETE FROM {table} WHERE label_id = ? AND epoch = ?", where)
    ids = _series_id_map(con, chunking.series_wanted(found, runs))
    parts = chunking.parts_of(found, runs, ids)
    _insert(con, "chunks", 11, [tuple(row) for row in chunking.chunk_rows(parts)], verb="INSERT")
    for chunk in _chunks(list(due), MAX_LABELS_PER_STATEMENT):
        con.execute(
            _given_rows(
                "u",
                "label_id, epoch",
                len(chunk),
                "UPDATE label_epochs SET head = 0 FROM u "
                "WHERE label_epochs.label_id = u.label_id AND label_epochs.epoch = u.epoch "
                "AND label_epochs.head <> 0",
            ),
            list(chain.from_iterable(chunk)),
        )


# label_values rows (rows.setting_rows) replace the stored value of their key only if later in
# the label's order: a redelivered or late event never overwrites a newer value.
_SETTINGS_TABLE = "label_values (label_id, field, key, value, epoch, seq, ts)"
_LATER_SETTING = (
    " ON CONFLICT (label_id, field, key) DO UPDATE SET value = excluded.value, epoch = excluded.epoch, "
    "seq = excluded.seq, ts = excluded.ts "
    "WHERE (excluded.epoch, excluded.seq) > (label_values.epoch, label_values.seq)"
)


def _path(url: str) -> str:
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise ValueError(
            f"sqlite store URL {url!r} names no file: use sqlite:///relative.db or "
            "sqlite:////absolute/path.db"
        )
    return unquote(urlsplit(url).path[1:])


def _latest_start(label: LabelState) -> tuple[int, int | None]:
    """(epoch, restart count) of a label's latest start, for the generation of its epochs."""
    return label.start_pos[0], rollups.restart_count(label.start_data)


def _unreal(value: float | None) -> float:
    # SQLite cannot keep NaN (it stores NULL); values are never NULL otherwise, so NULL is NaN.
    return math.nan if value is None else float(value)


_KIND = operator.attrgetter("kind")


def _run_settings(con: sqlite3.Connection, runs: Sequence[str]) -> dict[str, list[Setting]]:
    """Each run's stored settings that stand (every label's latest value per key)."""
    found = [
        row
        for chunk in _chunks(list(runs), MAX_LABELS_PER_STATEMENT)
        for row in con.execute(
            rows.RUN_SETTINGS_SQL.format(runs=f"IN (VALUES {_rows_sql(1, len(chunk))})"), chunk
        )
    ]
    return rows.run_settings(found, runs)


def _derive_metadata(con: sqlite3.Connection, primaries: Mapping[str, str | None]) -> None:
    """Merge the stored settings of the runs `primaries` names (each with its primary) into the
    runs' config, summary, name, tags and set_by columns."""
    if not primaries:
        return
    settings = _run_settings(con, sorted(primaries))
    con.executemany(metadata.UPDATE_METADATA_SQL, metadata.metadata_rows(settings, primaries))


def _start_configs_to_settings(con: sqlite3.Connection) -> None:
    """Migration 5's data: the stored starts' configs become their labels' settings, and every
    run's metadata is derived from them (its config as before, its primary's, plus the keys
    only other labels set)."""
    found = metadata.start_setting_rows(con.execute(metadata.START_CONFIGS_SQL))
    _insert(con, _SETTINGS_TABLE, 7, found, verb="INSERT", tail=_LATER_SETTING)
    _derive_metadata(con, {row[0]: row[1] for row in con.execute(metadata.STARTED_RUNS_SQL)})


# Data migrations, run after the schema migration of the same number, in its transaction.
DATA_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    5: _start_configs_to_settings,
    6: _roll_up_stored_metrics,
    7: _roll_up_stored_system,
    10: _label_rollups_to_blocks,
    11: _label_open_to_blocks,
}


# label_open's value columns, of `r`.
_OPEN_VALUES = f"r.{rollups.LABEL_VALUE_COLUMNS.replace(', ', ', r.')}"


class SQLiteStore(reads.SharedReads, beats.SharedHealth):
    """`sqlite:///relative/path.db` or `sqlite:////absolute/path.db`."""

    dialect = SQLITE

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
        # A new store's pages (an existing one keeps its own). A chunk of noisy values is 10 to
        # 30 kB: a row larger than a page goes into overflow pages that SQLite fills whole, where
        # pages that hold a few such rows each leave the rest of each page empty
        # (bench/history.py, 2.56M points in chunks of up to 4,096: the chunks table 4.29 bytes
        # a point at 4 kB, 4.99 at 32 kB and 4.61 at 64 kB, of 4.06 of chunks).
        con.execute(f"PRAGMA page_size = {PAGE_SIZE}")
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
            if number in DATA_MIGRATIONS:
                DATA_MIGRATIONS[number](con)
            con.execute(f"PRAGMA user_version = {int(number)}")

    def _in_snapshot(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` in one read transaction, so that its statements see one state of the
        store: a read of chunks and then of head rows must not see a compaction (of another
        process, committed between them) move values from one to the other."""
        con = self._db()
        if con.in_transaction:  # within this store's own write: its state already
            return work(*args)
        con.execute("BEGIN")
        try:
            return work(*args)
        finally:
            if con.in_transaction:
                con.execute("COMMIT")

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

    async def _fetch(self, query: reads.Query) -> list[sqlite3.Row]:
        return await self._call(self._rows, query)

    async def _fetch_together(self, queries: Sequence[reads.Query]) -> list[list[sqlite3.Row]]:
        return await self._call(self._in_snapshot, lambda: [self._rows(query) for query in queries])

    async def _execute(self, queries: Sequence[reads.Query]) -> list[int]:
        return await self._call(
            self._in_transaction, lambda con: [con.execute(q.sql, q.args).rowcount for q in queries]
        )

    def _rows(self, query: reads.Query) -> list[sqlite3.Row]:
        return self._db().execute(query.sql, query.args).fetchall()

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
        stored = _stored_labels(con, runs, list(by_label))
        labels = {key: rows.label_state(row, key[0]) for key, row in stored.items()}
        for key, group in by_label.items():
            beyond = out_of_reach(labels[key], group)
            if beyond is not None:  # the worker isolates the event and dead-letters it
                raise StoreRejected(f"{key[0]}/{key[1]}: {beyond}")
        fresh = self._take_new(con, rows.spans(by_label, {key: stored[key]["id"] for key in by_label}))
        for key, group in by_label.items():
            labels[key] = apply_events(labels[key], group)
        primaries = rows.settle_primaries(by_label, labels, self._primaries(con, runs), holders)
        _update_labels(con, [(stored[key]["id"], labels[key], fresh[key]) for key in by_label])
        ids = {stored[key]["id"]: key for key, new in fresh.items() if new}
        ended = {stored[key]["id"] for key in by_label if labels[key].state != RUNNING}
        _store_values(
            con, {label_id: (key[0], fresh[key], labels[key]) for label_id, key in ids.items()}, ended
        )
        settings = rows.setting_rows((stored[key]["id"], new) for key, new in fresh.items())
        _insert(con, _SETTINGS_TABLE, 7, settings, verb="INSERT", tail=_LATER_SETTING)
        for run in runs:
            mine = [label for (owner, _), label in labels.items() if owner == run]
            self._update_run(con, run, mine, primaries[run])
        # A start may decide the primary (whose values win), a start or meta event sets values.
        _derive_metadata(
            con,
            {
                run: primaries[run]
                for (run, _), group in by_label.items()
                if not rows.SETTING_KINDS.isdisjoint(map(_KIND, group))
            },
        )
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
        for replaced in _chunks(changes.replaced, MAX_LABELS_PER_STATEMENT):
            con.execute(_delete_ranges_sql(len(replaced)), list(chain.from_iterable(replaced)))
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
                rows.label_state(row, run)
                for row in con.execute(f"SELECT {_LABEL_COLUMNS} FROM labels WHERE run_id = ?", (run,))
            ]
            primary = self._primaries(con, [run]).get(run)
        derived = run_state(labels, primary)
        con.execute(
            "UPDATE runs SET state = ?, primary_label = ?, exit_code = ?, ended_ts = ?, "
            "started_ts = ?, last_ts = ? WHERE run_id = ?",
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
            crashed = crash(rows.label_state(row))
            con.execute(
                "UPDATE labels SET state = ?, state_epoch = ?, state_seq = ?, state_ts = ? WHERE id = ?",
                (crashed.state, *crashed.state_pos, crashed.state_ts, row["id"]),
            )
        for run in {row["run_id"] for row in silent}:
            self._update_run(con, run)
        _compact(con, _grow_heads(con, {}, {row["id"] for row in silent}))
        return [(row["run_id"], row["label"]) for row in silent]

    async def compact_due(self, limit: int = 64) -> int:
        return await self._call(self._in_transaction, self._compact_due, limit)

    def _compact_due(self, con: sqlite3.Connection, limit: int) -> int:
        due = chunking.DUE_SQL
        _compact(con, con.execute(f"SELECT e.label_id, e.epoch {due} LIMIT ?", (limit,)).fetchall())
        left: int = con.execute(f"SELECT count(*) {due}").fetchone()[0]
        return left

    # -- reads ---------------------------------------------------------------------------------

    async def point_page(
        self,
        table: PointTable,
        run_id: str,
        label: str,
        after: tuple[str, int, int] | None,
        limit: int,
        key: str | None = None,
    ) -> list[Point]:
        return await self._call(
            self._in_snapshot, self._point_page, point_table(table), run_id, label, after, limit, key
        )

    def _point_page(
        self,
        table: PointTable,
        run_id: str,
        label: str,
        after: tuple[str, int, int] | None,
        limit: int,
        key: str | None,
    ) -> list[Point]:
        con = self._db()
        found = con.execute(reads.LABEL_ID_SQL, (run_id, label)).fetchone()
        if found is None:
            return []
        past = None if after is None else (rows.storable_text(after[0]), after[1], after[2])
        stored = None if key is None else rows.storable_text(key)
        chunk_query, clock_query, head_query = reads.page_queries(
            SQLITE, table, run_id, found[0], stored, past
        )
        chunks = (
            ((label, key_, epoch, first, data), points)
            for key_, epoch, first, data, points in con.execute(chunk_query.sql, chunk_query.args)
        )
        clocks = [(label, epoch, data) for epoch, data in con.execute(clock_query.sql, clock_query.args)]
        head = [(label, *row) for row in con.execute(head_query.sql, head_query.args)]
        return values.page(chunks, clocks, head, limit, past).points()

    # -- rollup reads (storage/charts.py composes them) -------------------------------------------

    async def key_extent(self, run_id: str, key: str, table: PointTable = "metrics") -> base.KeyExtent | None:
        return await self._call(self._key_extent, run_id, key, table)

    def _key_extent(self, run_id: str, key: str, table: PointTable) -> base.KeyExtent | None:
        con = self._db()
        found = con.execute(
            reads.SERIES_ID_SQL, (rollups.series_run(run_id, table), rows.storable_text(key))
        ).fetchone()
        if found is None:
            return None
        widest = rollups.WIDTHS[-1]
        spans = [
            base.Span(*row)
            for row in con.execute(
                "SELECT axis, generation, sum(n), min(x_lo), max(x_hi), min(ts_lo), max(ts_hi) "
                "FROM run_rollups WHERE key_id = ? AND width = ? "
                "GROUP BY axis, generation ORDER BY axis, generation",
                (found[0], widest),
            )
        ]
        # The labels with a row of the key on each axis: a probe per label epoch, each a seek in
        # the primary key, rather than a count over every bucket of every label.
        labels = {
            axis: count
            for axis, count in con.execute(
                "SELECT a.axis, count(*) FROM (SELECT 0 AS axis UNION ALL SELECT 1) a CROSS JOIN labels l "
                "WHERE l.run_id = ? AND EXISTS (SELECT 1 FROM label_epochs e CROSS JOIN label_open r "
                "WHERE e.label_id = l.id AND r.key_id = ? AND r.axis = a.axis "
                "AND r.label_id = l.id AND r.epoch = e.epoch UNION ALL "
                "SELECT 1 FROM label_epochs e CROSS JOIN label_blocks r "
                f"WHERE e.label_id = l.id AND r.key_id = ? AND r.kind = {rollup_blocks.FINE} "
                "AND r.axis = a.axis AND r.label_id = l.id AND r.epoch = e.epoch) GROUP BY a.axis",
                (run_id, found[0], found[0]),
            )
        }
        return base.KeyExtent(spans, labels)

    async def open_buckets(
        self, run_id: str, key: str, axis: int, labels: Sequence[str] | None, table: PointTable = "metrics"
    ) -> list[base.LabelBucket]:
        return await self._call(self._open_buckets, run_id, key, axis, labels, table)

    def _open_buckets(
        self, run_id: str, key: str, axis: int, labels: Sequence[str] | None, table: PointTable
    ) -> list[base.LabelBucket]:
        chosen = ""
        if labels is not None:
            chosen = f" AND l.label IN ({_rows_sql(1, len(labels))})" if labels else " AND 0"
        # Each label epoch's label_open row, else its highest fine block (which then holds its
        # open bucket).
        series = (
            "WITH k(id) AS (SELECT id FROM series WHERE run_id = ? AND key = ?) SELECT {columns} "
            "FROM k CROSS JOIN labels l CROSS JOIN label_epochs e CROSS JOIN {table} r "
            f"WHERE l.run_id = ?{chosen} AND e.label_id = l.id AND r.key_id = k.id AND r.axis = ? "
            "AND r.label_id = l.id AND r.epoch = e.epoch"
        )
        opens = series.format(
            columns=f"l.label, e.epoch, e.generation, r.bucket, {_OPEN_VALUES}",
            table="label_open",
        )
        blocks = series.format(
            columns="l.label, e.epoch, e.generation, r.block, r.data", table="label_blocks"
        ) + (
            f" AND r.kind = {rollup_blocks.FINE} AND r.block = (SELECT max(t.block) FROM label_blocks t "
            f"WHERE t.key_id = k.id AND t.kind = {rollup_blocks.FINE} AND t.axis = r.axis "
            "AND t.label_id = l.id AND t.epoch = e.epoch) AND NOT EXISTS (SELECT 1 FROM label_open o "
            "WHERE o.key_id = k.id AND o.axis = r.axis AND o.label_id = l.id AND o.epoch = e.epoch)"
        )
        args: list[Any] = [
            rollups.series_run(run_id, table),
            rows.storable_text(key),
            run_id,
            *(labels or []),
            axis,
        ]
        con = self._db()
        found = [base.LabelBucket(*row) for row in rollup_blocks.opened(con.execute(blocks, args).fetchall())]
        found += [
            base.LabelBucket(row[0], row[1], row[2], row[3], rollup_blocks.open_part(row[4:]))
            for row in con.execute(opens, args)
        ]
        return found

    async def run_buckets(
        self, run_id: str, key: str, axis: int, width: int, lo: int, hi: int, table: PointTable = "metrics"
    ) -> list[base.RunBucket]:
        return await self._call(self._run_buckets, run_id, key, axis, width, lo, hi, table)

    def _run_buckets(
        self, run_id: str, key: str, axis: int, width: int, lo: int, hi: int, table: PointTable
    ) -> list[base.RunBucket]:
        # The generations first, each then a range of the primary key.
        query = (
            "WITH k(id) AS (SELECT id FROM series WHERE run_id = ? AND key = ?) "
            "SELECT r.generation, r.bucket, r.n, r.nan, r.inf, r.total, r.lo, r.hi, r.x_lo, r.x_hi, "
            "r.ts_lo, r.ts_hi, r.bins FROM k, run_rollups r "
            "WHERE r.key_id = k.id AND r.width = ? AND r.axis = ? AND r.generation IN ("
            "SELECT DISTINCT generation FROM run_rollups, k WHERE key_id = k.id AND width = ? AND axis = ?) "
            "AND r.bucket BETWEEN ? AND ? ORDER BY r.generation, r.bucket"
        )
        series = rollups.series_run(run_id, table)
        args = (series, rows.storable_text(key), width, axis, rollups.WIDTHS[-1], axis, lo, hi)
        found = []
        for row in self._db().execute(query, args):
            part = rollups.run_part(row[2:12])
            part[rollups.TOTAL] = _unreal(part[rollups.TOTAL])
            found.append((row[0], row[1], part, row[12]))
        return charts.merge_slots(found)

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
    ) -> list[base.LabelBucket]:
        return await self._call(self._label_buckets, run_id, key, axis, width, lo, hi, labels, table)

    def _label_buckets(
        self,
        run_id: str,
        key: str,
        axis: int,
        width: int,
        lo: int,
        hi: int,
        labels: Sequence[str] | None,
        table: PointTable,
    ) -> list[base.LabelBucket]:
        # Each label epoch's rows are a range of the primary key: labels, then epochs, drive the join.
        chosen = ""
        args: list[Any] = [rollups.series_run(run_id, table), rows.storable_text(key), run_id]
        if labels is not None:
            chosen = f" AND l.label IN ({_rows_sql(1, len(labels))})" if labels else " AND 0"
            args += list(labels)
        shape = (
            "WITH k(id) AS (SELECT id FROM series WHERE run_id = ? AND key = ?) "
            "SELECT l.label, r.epoch, e.generation, {columns} "
            "FROM k CROSS JOIN labels l CROSS JOIN label_epochs e CROSS JOIN {table} r "
            f"WHERE l.run_id = ?{chosen} AND e.label_id = l.id AND r.key_id = k.id "
            "AND r.axis = ? AND r.label_id = l.id AND r.epoch = e.epoch AND {where}"
        )
        con = self._db()
        blocks = shape.format(
            columns="r.block, r.data", table="label_blocks", where="r.kind = ? AND r.block BETWEEN ? AND ?"
        )
        kind, first, last = rollup_blocks.block_range(width, lo, hi)
        read = con.execute(blocks, [*args, axis, kind, first, last]).fetchall()
        found = [base.LabelBucket(*row) for row in rollup_blocks.buckets_in(read, kind, width, lo, hi)]
        if width == rollups.FINE_WIDTH:
            opens = shape.format(
                columns=f"r.bucket, r.{rollups.LABEL_VALUE_COLUMNS.replace(', ', ', r.')}",
                table="label_open",
                where="r.bucket BETWEEN ? AND ?",
            )
            for row in con.execute(opens, [*args, axis, lo, hi]):
                found.append(
                    base.LabelBucket(row[0], row[1], row[2], row[3], rollup_blocks.open_part(row[4:]))
                )
        return found
