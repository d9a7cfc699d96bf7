"""The health tables both backends keep alike: each label's latest heartbeat (`beats`) and each
run's health verdict (`health`), their migration, SQL (with `?` placeholders, storage/dialect.py)
and the reads and writes over a backend's statements (Executor).

A verdict is recorded by compare and set: it replaces the one a detector read (by its key, the
state and culprits) or, for a run without one, is inserted only if none is there yet. Of several
ingesters that judge the same change, one records it, and only that one alerts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from runbus.storage.health import ENDED_KEY, LabelVitals
from runbus.storage.reads import Fetcher, Query
from runbus.wire import Event

# Migration 9, the same text for both backends: TEXT holds JSON in both.
SCHEMA = """
    CREATE TABLE beats (
        label_id BIGINT PRIMARY KEY,
        epoch BIGINT NOT NULL,
        seq BIGINT NOT NULL,
        ts DOUBLE PRECISION NOT NULL,
        seen_at DOUBLE PRECISION NOT NULL,
        data TEXT NOT NULL
    );
    CREATE TABLE health (
        run_id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        since DOUBLE PRECISION,
        key TEXT NOT NULL,
        doc TEXT NOT NULL,
        checked_at DOUBLE PRECISION NOT NULL
    )
"""

# A label's beat replaces the stored one only if it comes later in the label's history.
SAVE_BEAT_SQL = """
    INSERT INTO beats (label_id, epoch, seq, ts, seen_at, data)
    SELECT id, ?, ?, ?, ?, ? FROM labels WHERE run_id = ? AND label = ?
    ON CONFLICT (label_id) DO UPDATE SET epoch = excluded.epoch, seq = excluded.seq,
        ts = excluded.ts, seen_at = excluded.seen_at, data = excluded.data
    WHERE excluded.epoch > beats.epoch OR (excluded.epoch = beats.epoch AND excluded.seq > beats.seq)
"""
# What the detector judges: the runs still running, and the ended ones it judged while they ran
# (until it records that they ended: storage/postmortem.py); a running run's running or crashed
# labels, an ended run's every label, with their beats.
INPUTS_SQL = f"""
    SELECT r.run_id, r.state AS run_state, h.key AS health_key, h.since AS health_since,
        l.label, l.seen_at AS heard_at, b.seen_at AS beat_seen_at, b.data AS beat,
        l.state AS label_state, l.exit_code, l.state_ts, l.last_ts
    FROM runs r
    LEFT JOIN health h ON h.run_id = r.run_id
    LEFT JOIN labels l ON l.run_id = r.run_id
        AND (r.state <> 'running' OR l.state IN ('running', 'crashed'))
    LEFT JOIN beats b ON b.label_id = l.id
    WHERE r.state = 'running' OR (h.key IS NOT NULL AND h.key <> '{ENDED_KEY}')
    ORDER BY r.run_id, l.label
"""
INSERT_HEALTH_SQL = """
    INSERT INTO health (run_id, state, since, key, doc, checked_at) VALUES (?, ?, ?, ?, ?, ?)
    ON CONFLICT (run_id) DO NOTHING
"""
CHANGE_HEALTH_SQL = (
    "UPDATE health SET state = ?, since = ?, key = ?, doc = ?, checked_at = ? WHERE run_id = ? AND key = ?"
)
REFRESH_HEALTH_SQL = "UPDATE health SET doc = ?, checked_at = ? WHERE run_id = ? AND key = ?"
HEALTH_SQL = "SELECT doc FROM health WHERE run_id = ?"
LAST_LINES_SQL = """
    SELECT g.text FROM logs g JOIN labels l ON l.id = g.label_id
    WHERE l.run_id = ? AND l.label = ? ORDER BY g.ts DESC, g.epoch DESC, g.seq DESC LIMIT ?
"""


@dataclass(frozen=True, slots=True)
class RunVitals:
    """One run as the detector reads it: its stored state, its recorded health's key and since
    (None before the first verdict), and its labels' vitals: a running run's running (or crashed)
    labels, an ended run's every label."""

    run_id: str
    state: str
    health_key: str | None
    health_since: float | None
    labels: list[LabelVitals] = field(default_factory=list)


class Executor(Fetcher, Protocol):
    """What the writes below need of a store besides its reads: statements run in one
    transaction, each statement's count of rows changed."""

    async def _execute(self, queries: Sequence[Query]) -> list[int]:
        """Run `queries` in one write transaction; how many rows each changed."""
        ...


def _query(store: Fetcher, sql: str, *args: Any) -> Query:
    return Query(store.dialect.sql(sql), list(args))


async def save_beats(store: Executor, beats: Sequence[Event]) -> None:
    """Keep each label's latest heartbeat of `beats` (events of kind heartbeat, already stored)."""
    now = time.time()
    latest: dict[tuple[str, str], Event] = {}
    for beat in beats:
        held = latest.get((beat.run, beat.label))
        if held is None or beat.position > held.position:
            latest[(beat.run, beat.label)] = beat
    queries = [
        _query(store, SAVE_BEAT_SQL, b.epoch, b.seq, b.ts, now, orjson.dumps(b.data).decode(), b.run, b.label)
        for _, b in sorted(latest.items())
    ]
    if queries:
        await store._execute(queries)


async def health_inputs(store: Executor) -> list[RunVitals]:
    """Every run the detector judges now, with its labels' vitals."""
    runs: dict[str, RunVitals] = {}
    for row in await store._fetch(_query(store, INPUTS_SQL)):
        run = runs.get(row["run_id"])
        if run is None:
            run = runs[row["run_id"]] = RunVitals(
                row["run_id"], row["run_state"], row["health_key"], row["health_since"]
            )
        if row["label"] is None:
            continue
        beat = orjson.loads(row["beat"]) if row["beat"] else None
        beat_seen = row["beat_seen_at"]
        heard = max(x for x in (row["heard_at"], beat_seen, 0.0) if x is not None)
        run.labels.append(
            LabelVitals(
                row["label"],
                beat,
                beat_seen,
                heard or None,
                state=row["label_state"],
                exit_code=row["exit_code"],
                state_ts=row["state_ts"],
                last_ts=row["last_ts"],
            )
        )
    return list(runs.values())


async def record_health(
    store: Executor, run: RunVitals, state: str, key: str, doc: dict[str, Any], now: float
) -> bool:
    """Record a run's verdict over the one `run` was read with: True if this call changed the
    state or culprits (the caller alone then alerts), False if the key is the same (the document
    is refreshed) or another ingester recorded a change first."""
    text = orjson.dumps(doc).decode()
    if run.health_key is None:
        query = _query(store, INSERT_HEALTH_SQL, run.run_id, state, doc["since"], key, text, now)
    elif run.health_key != key:
        query = _query(
            store, CHANGE_HEALTH_SQL, state, doc["since"], key, text, now, run.run_id, run.health_key
        )
    else:
        await store._execute([_query(store, REFRESH_HEALTH_SQL, text, now, run.run_id, key)])
        return False
    return (await store._execute([query]))[0] == 1


async def health(store: Fetcher, run_id: str) -> dict[str, Any] | None:
    """A run's recorded health object, or None before any detector judged it."""
    found = await store._fetch(_query(store, HEALTH_SQL, run_id))
    return orjson.loads(found[0][0]) if found else None


async def last_lines(store: Fetcher, run_id: str, label: str, count: int = 10) -> list[str]:
    """A label's last `count` console or log lines, oldest first."""
    found = await store._fetch(_query(store, LAST_LINES_SQL, run_id, label, count))
    return [row[0] for row in reversed(found)]


class SharedHealth:
    """The health reads and writes above, as methods of each store (which gives `_execute`)."""

    save_beats = save_beats
    health_inputs = health_inputs
    record_health = record_health
    health = health
    last_lines = last_lines
