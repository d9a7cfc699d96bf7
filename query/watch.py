"""`runbus watch RUN`: follow a run's health live on a terminal, a line each time it changes (its
state, culprits, stragglers, first anomaly), or with `--json` the health object as a JSON line;
it ends with the run (exit 0), or on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import orjson

from runbus.cli import add_store_option
from runbus.errors import CommandError
from runbus.query.cli import known_run, read
from runbus.query.health import change_key, health_lines, read_health
from runbus.storage import Store
from runbus.terminal import json_printable

POLL = 1.0  # seconds between two reads of the store (the detector judges every second)
ENDED_WAIT = 5.0  # seconds an ended run's last verdict is waited for


def add_watch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run")
    add_store_option(parser)
    parser.add_argument("--json", action="store_true", help="print each health object as a JSON line")
    parser.add_argument(
        "--every", type=float, default=POLL, metavar="S", help="seconds between reads (default %(default)s)"
    )
    parser.set_defaults(handler=cmd_watch)


def cmd_watch(args: argparse.Namespace) -> int:
    if not args.every > 0:
        raise CommandError(f"--every must be a positive number of seconds, got {args.every}")

    async def watching(store: Store) -> int:
        run = await known_run(store, args.run)
        shown, ended_at = None, None
        while True:
            run = await store.run(run.run_id) or run
            health = await read_health(store, run)
            key = change_key(health)
            if key != shown:
                shown = key
                _print(run.run_id, health, args.json)
            # The run ended: its last verdict (what it ended with) comes a detector's tick later.
            if run.state != "running":
                ended_at = ended_at or time.monotonic() + ENDED_WAIT
                if health.get("ended") or time.monotonic() >= ended_at:
                    return 0
            await asyncio.sleep(args.every)

    return read(args.store, watching)


def _print(run_id: str, health: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json_printable(orjson.dumps({"run": run_id, **health}).decode()))
    else:
        # health_lines neutralises what came from the bus (runbus.terminal.printable).
        lines = health_lines(health)
        print(time.strftime("%H:%M:%S"), lines[0].removeprefix("health   "))
        for line in lines[1:]:
            print(line)
    sys.stdout.flush()
