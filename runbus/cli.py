"""The `runbus` command: ingest, inspect runs, and the demo. The only place logging is configured."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

import redis

from runbus import config, storage, wire
from runbus.config import DEFAULT_REDIS_URL
from runbus.dashboard import cli as dashboard_cli
from runbus.errors import CommandError
from runbus.ingester import output

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, process: str | None = None) -> None:
    """Log to stderr; a worker process of `ingest --workers N` puts its consumer name first."""
    prefix = f"[{process.replace('%', '%%')}] " if process else ""
    logging.basicConfig(level=level.upper(), format=prefix + LOG_FORMAT, stream=sys.stderr)


def _ops_address(text: str) -> tuple[str, int]:
    from runbus.ingester.http import parse_address  # aiohttp only for the commands that serve

    return parse_address(text)


def _redis_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis",
        default=os.environ.get("RUNBUS_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL, redis+cluster://host:port,... for a cluster (RUNBUS_REDIS_URL; default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runbus", description="Log every rank of a distributed training job into one run."
    )
    parser.add_argument(
        "--store", default=config.default_store_url(), help="store URL (RUNBUS_STORE; default %(default)s)"
    )
    parser.add_argument("--log-level", default=None, help="logging level (default INFO for ingest)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ingest = commands.add_parser("ingest", help="consume the streams into the store")
    _redis_option(ingest)
    ingest.add_argument("--group", default=wire.DEFAULT_GROUP, help="consumer group (default %(default)s)")
    ingest.add_argument("--consumer", default=None, help="consumer name (default host-pid)")
    ingest.add_argument("--burst", action="store_true", help="process what is there, then exit 0")
    ingest.add_argument("--batch-size", type=int, default=1000, help="entries per stream per read")
    ingest.add_argument(
        "--claim-idle",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="claim other consumers' entries pending this long (default %(default)s)",
    )
    ingest.add_argument(
        "--max-deliveries",
        type=int,
        default=5,
        help="dead-letter an entry delivered more often (default %(default)s)",
    )
    ingest.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, finish the batches in flight for at most this (default %(default)s)",
    )
    ingest.add_argument(
        "--retain",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="trim stored entries older than this from the streams (default %(default)s)",
    )
    ingest.add_argument(
        "--crash-after",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="a label silent this long without a finish is crashed (default %(default)s)",
    )
    ingest.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes in the group, crashed ones restarted (default %(default)s)",
    )
    ingest.add_argument(
        "--http",
        type=_ops_address,
        default=None,
        metavar="[HOST:]PORT",
        help="serve /healthz, /readyz, /metrics (host 127.0.0.1 unless given; "
        "with --workers N, worker i on PORT+i)",
    )

    dead = commands.add_parser("dead", help="list (or replay) dead-lettered entries")
    _redis_option(dead)
    dead.add_argument("--json", action="store_true")
    dead.add_argument("--replay", action="store_true", help="put them back on their streams")

    runs = commands.add_parser("runs", help="list runs")
    runs.add_argument("--json", action="store_true")

    show = commands.add_parser("show", help="one run: state, labels, counts")
    show.add_argument("run")
    show.add_argument("--json", action="store_true")

    metrics = commands.add_parser("metrics", help="a run's metric values")
    metrics.add_argument("run")
    metrics.add_argument("--key")
    metrics.add_argument("--label")
    metrics.add_argument("--json", action="store_true")

    logs = commands.add_parser("logs", help="a run's log lines, every label")
    logs.add_argument("run")
    logs.add_argument("--label")
    logs.add_argument("--level", help="at least this level (DEBUG, INFO, WARNING, ERROR)")
    logs.add_argument("--grep", help="only lines containing this text")
    logs.add_argument("--limit", type=int)
    logs.add_argument("--json", action="store_true")

    demo = commands.add_parser("demo", help="a small multi-rank job logged into one run")
    _redis_option(demo)
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--steps", type=int, default=40)
    dashboard_cli.add_commands(commands)
    return parser


async def _with_store(url: str, action):
    store = storage.open_store(url)
    await store.connect()
    try:
        return await action(store)
    finally:
        await store.close()


async def _known_run(store: storage.Store, run_id: str, url: str) -> storage.RunSummary:
    run = await store.run(run_id)
    if run is None:
        raise CommandError(f"unknown run {run_id!r} in {storage.safe_url(url)}")
    return run


def cmd_ingest(args: argparse.Namespace) -> int:
    from runbus.ingester.supervisor import ingest
    from runbus.ingester.worker import WorkerSettings

    settings = WorkerSettings(
        redis_url=args.redis,
        store_url=args.store,
        group=args.group,
        burst=args.burst,
        batch_size=args.batch_size,
        claim_idle=args.claim_idle,
        max_deliveries=args.max_deliveries,
        drain_timeout=args.drain_timeout,
        retain=args.retain,
        crash_after=args.crash_after,
    )
    if args.consumer:
        settings.consumer = args.consumer
    setup = functools.partial(configure_logging, args.log_level or "INFO")
    return ingest(settings, args.workers, args.http, setup)


def cmd_runs(args: argparse.Namespace) -> int:
    runs = asyncio.run(_with_store(args.store, lambda store: store.runs()))
    if args.json:
        print(output.dumps(output.runs_document(runs)))
        return 0
    rows = [
        (
            r.run_id,
            output.state_text(r),
            r.primary,
            r.label_count,
            output.when(r.started_ts),
            output.when(r.last_ts),
        )
        for r in runs
    ]
    print(output.table(("RUN", "STATE", "PRIMARY", "LABELS", "STARTED", "LAST EVENT"), rows))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    run = asyncio.run(_with_store(args.store, lambda store: _known_run(store, args.run, args.store)))
    print(output.dumps(output.run_document(run)) if args.json else output.show_text(run))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    async def read(store):
        await _known_run(store, args.run, args.store)
        return await store.metrics(args.run, key=args.key, label=args.label)

    points = asyncio.run(_with_store(args.store, read))
    if args.json:
        print(output.dumps([output.point_document(p) for p in points]))
        return 0
    rows = [(p.label, p.key, p.step, p.epoch, p.seq, output.number_text(p.value)) for p in points]
    print(output.table(("LABEL", "KEY", "STEP", "EPOCH", "SEQ", "VALUE"), rows))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    async def read(store):
        await _known_run(store, args.run, args.store)
        return await store.logs(
            args.run, label=args.label, level=args.level, grep=args.grep, limit=args.limit
        )

    lines = asyncio.run(_with_store(args.store, read))
    if args.json:
        print(output.dumps([asdict(line) for line in lines]))
        return 0
    width = max((len(line.label) for line in lines), default=0)
    for line in lines:
        for text in line.text.splitlines() or [""]:
            print(f"{line.label.ljust(width)} | {output.when(line.ts)} {line.level:<7} {text}")
    return 0


def cmd_dead(args: argparse.Namespace) -> int:
    from runbus.ingester import deadletter
    from runbus.redis import async_client

    async def act():
        async with async_client(args.redis, socket_connect_timeout=5) as client:
            if args.replay:
                return await deadletter.replay(client)
            return await deadletter.dead_letters(client)

    result = asyncio.run(act())
    if args.replay:
        print(f"replayed {result} dead-lettered entries onto their streams")
    elif args.json:
        print(output.dumps([asdict(letter) for letter in result]))
    else:
        rows = [(d.dead_id, d.source_stream, d.source_id, d.deliveries, d.reason) for d in result]
        print(output.table(("DEAD ID", "STREAM", "ENTRY", "DELIVERIES", "REASON"), rows))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from runbus.ingester.demo import run_demo

    return run_demo(redis_url=args.redis, store_url=args.store, ranks=args.ranks, steps=args.steps)


COMMANDS = {
    "ingest": cmd_ingest,
    "runs": cmd_runs,
    "show": cmd_show,
    "metrics": cmd_metrics,
    "logs": cmd_logs,
    "dead": cmd_dead,
    "demo": cmd_demo,
    "serve": dashboard_cli.cmd_serve,
    "tail": dashboard_cli.cmd_tail,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level or ("INFO" if args.command in ("ingest", "demo") else "WARNING")
    configure_logging(level)
    try:
        return COMMANDS[args.command](args)
    except (CommandError, ValueError, storage.StoreError, redis.RedisError) as exc:
        print(f"runbus: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
