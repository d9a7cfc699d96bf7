"""Why the SQLite store writes multi-row INSERTs, not executemany: a GIL convoy, measured.

The same metric rows (2-key metric events, one transaction per 8,000 events) are inserted with
`executemany` and with the store's multi-row INSERTs (`storage.sqlite._insert`), each alone and
then beside a thread that keeps the GIL busy in Python, as the ingester's asyncio thread does
while it decodes the next batch. executemany releases the GIL around every row's
`sqlite3_step` and must win it back, so beside a busy thread each row waits for a switch
interval; a multi-row statement waits once per statement.

    python bench/gil.py [--events 5000]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import threading
import time

from common import emit

from runbus.storage.sqlite import MIGRATIONS, _insert

BATCH = 8000
METRICS = "metrics (label_id, key, epoch, seq, step, ts, value)"


def insert(path: str, events: int, multi_row: bool) -> float:
    """Seconds to insert `events` 2-key metric events' rows, one transaction per batch."""
    con = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA synchronous = NORMAL")
    for statement in MIGRATIONS[0].split(";"):
        if statement.strip():
            con.execute(statement)
    now = time.time()
    events_rows = [(label, 1, seq, now + seq) for seq in range(1, events // 8 + 1) for label in range(8)]
    started = time.perf_counter()
    for first in range(0, len(events_rows), BATCH):
        rows = [
            (lid, key, epoch, seq, seq, ts, 1.0 / seq)
            for lid, epoch, seq, ts in events_rows[first : first + BATCH]
            for key in ("loss", "lr")
        ]
        con.execute("BEGIN")
        if multi_row:
            _insert(con, METRICS, 7, rows)
        else:
            con.executemany(f"INSERT OR IGNORE INTO {METRICS} VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        con.execute("COMMIT")
    elapsed = time.perf_counter() - started
    con.close()
    return elapsed


def beside_busy_thread(path: str, events: int, multi_row: bool) -> float:
    """insert() while another thread spins in Python."""
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=busy, daemon=True)
    spinner.start()
    try:
        return insert(path, events, multi_row)
    finally:
        stop.set()
        spinner.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=5_000)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, multi_row in (("executemany", False), ("multi_row", True)):
            alone = insert(f"{tmp}/{name}-alone.db", args.events, multi_row)
            beside = beside_busy_thread(f"{tmp}/{name}-beside.db", args.events, multi_row)
            results[name] = {
                "alone_s": round(alone, 3),
                "beside_busy_thread_s": round(beside, 3),
                "slowdown": round(beside / alone, 1),
            }
    emit("gil", {"events": args.events, **results})


if __name__ == "__main__":
    main()
