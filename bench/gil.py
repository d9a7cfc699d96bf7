"""Why the SQLite store's thread cannot use a second core: a GIL convoy, measured.

The same `executemany` of event and metric rows (the store's schema, 2-key metric events in
batches of 8,000) is timed alone, then beside a thread that keeps the GIL busy in Python, as the
ingester's asyncio thread does while it decodes the next batch. Every `sqlite3_step` releases
the GIL and must win it back, so beside a busy thread each row waits for a switch interval.

    python bench/gil.py [--events 5000]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import threading
import time

from common import emit

from storage.sqlite import MIGRATIONS

BATCH = 8000


def insert(path: str, events: int) -> float:
    """Seconds to insert `events` 2-key metric events' rows, one transaction per batch."""
    con = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA synchronous = NORMAL")
    for statement in MIGRATIONS[0].split(";"):
        if statement.strip():
            con.execute(statement)
    now = time.time()
    rows = [(label, 1, seq, now + seq) for seq in range(1, events // 8 + 1) for label in range(8)]
    started = time.perf_counter()
    for first in range(0, len(rows), BATCH):
        batch = rows[first : first + BATCH]
        con.execute("BEGIN")
        con.executemany(
            "INSERT INTO events (label_id, epoch, seq, kind, ts) VALUES (?, ?, ?, 'metric', ?)", batch
        )
        con.executemany(
            "INSERT INTO metrics (label_id, key, epoch, seq, step, ts, value) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (lid, key, epoch, seq, seq, ts, 1.0 / seq)
                for lid, epoch, seq, ts in batch
                for key in ("loss", "lr")
            ],
        )
        con.execute("COMMIT")
    elapsed = time.perf_counter() - started
    con.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=5_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        alone = insert(f"{tmp}/alone.db", args.events)
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                sum(range(1000))

        spinner = threading.Thread(target=busy, daemon=True)
        spinner.start()
        try:
            beside = insert(f"{tmp}/beside.db", args.events)
        finally:
            stop.set()
            spinner.join()
    emit(
        "gil",
        {
            "events": args.events,
            "alone_s": round(alone, 3),
            "beside_busy_thread_s": round(beside, 3),
            "slowdown": round(beside / alone, 1),
        },
    )


if __name__ == "__main__":
    main()
