"""`runbus ingest`, `runbus dead` and `runbus demo`: the commands that drive the ingester.

Redis, the worker, the store and aiohttp are imported when a command runs, not when it is parsed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from dataclasses import asdict

from runbus import wire
from runbus.cli import add_redis_option, add_store_option, name_argument
from runbus.config import safe_url
from runbus.errors import CommandError


def _ops_address(text: str) -> tuple[str, int]:
    from runbus.ingester.http import parse_address  # aiohttp only for the commands that serve

    return parse_address(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return value


def add_ingest(parser: argparse.ArgumentParser) -> None:
    add_redis_option(parser, "redis+cluster://host:port,... for a cluster")
    add_store_option(parser)
    parser.add_argument(
        "--group",
        default="",
        help="consumer group (default: the store's own, runbus:<store id>, so that every store "
        "receives every event; `runbus` was the default of every store before)",
    )
    parser.add_argument("--consumer", default=None, help="consumer name (default host-pid)")
    parser.add_argument(
        "--burst",
        action="store_true",
        help="process what is there (nothing new, nothing of its own pending), then exit 0",
    )
    parser.add_argument(
        "--run",
        dest="runs",
        action="append",
        type=name_argument,
        metavar="RUN",
        help="read only this run's streams (repeat for several; default: every run's), as "
        "`runbus show` does for a run whose events wait with no ingester running",
    )
    parser.add_argument(
        "--give-up-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="with --burst: exit 1 with one error line once Redis or the store has been unreachable "
        "this long (default %(default)s; 0: never); without --burst workers retry for ever",
    )
    parser.add_argument(
        "--from",
        dest="start_from",
        choices=("start", "now"),
        default="start",
        help="where a stream new to the group is read from: `start`, its first entry (the "
        "default: a fresh store ingests every run still in Redis), or `now`, entries written "
        "after the group's first `--from now` (kept in Redis: restarts keep it); a group "
        "already on a stream keeps its position",
    )
    parser.add_argument("--batch-size", type=int, default=4096, help="entries per stream per read")
    parser.add_argument(
        "--batch-rows",
        type=_positive,
        default=200_000,
        metavar="ROWS",
        help="rows one store transaction writes at most (an event's values, plus one per event); "
        "a bigger read is written in several, acknowledged after the last (default %(default)s)",
    )
    parser.add_argument(
        "--claim-idle",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="claim other consumers' entries pending this long, never the worker's own in "
        "flight, which it keeps alive (default %(default)s)",
    )
    parser.add_argument(
        "--max-deliveries",
        type=int,
        default=5,
        help="dead-letter an entry delivered more often (default %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, finish the batches in flight for at most this (default %(default)s)",
    )
    parser.add_argument(
        "--retain",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="trim stored entries older than this from the streams (default %(default)s)",
    )
    parser.add_argument(
        "--crash-after",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="a label silent this long without a finish is crashed (default %(default)s)",
    )
    parser.add_argument(
        "--stall-after",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="the least time without a step that makes a live run stalled; a run whose steps "
        "take long waits five of its median step times (default %(default)s; docs/health.md)",
    )
    parser.add_argument(
        "--on-alert",
        default=None,
        metavar="CMD",
        help="run CMD (a shell command) with the alert as JSON on its stdin each time a run's "
        "health turns stalled or dead, or its culprits change; one worker of the group runs it",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes in the group, crashed ones restarted (default %(default)s)",
    )
    parser.add_argument(
        "--http",
        type=_ops_address,
        default=None,
        metavar="[HOST:]PORT",
        help="serve /healthz, /readyz, /metrics (host 127.0.0.1 unless given; "
        "with --workers N, worker i on PORT+i)",
    )
    parser.set_defaults(handler=cmd_ingest)


def add_dead(parser: argparse.ArgumentParser) -> None:
    add_redis_option(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument("--replay", action="store_true", help="put them back on their streams")
    parser.set_defaults(handler=cmd_dead)


def add_demo(parser: argparse.ArgumentParser) -> None:
    add_redis_option(parser, "a private redis-server is started where none answers")
    add_store_option(parser)
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the job (default %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default %(default)s)")
    parser.set_defaults(handler=cmd_demo)


def cmd_ingest(args: argparse.Namespace) -> int:
    from runbus.ingester.worker import WorkerSettings
    from runbus.storage.health import HealthSettings

    settings = WorkerSettings(
        redis_url=args.redis,
        store_url=args.store,
        group=args.group or "",
        burst=args.burst,
        batch_size=args.batch_size,
        batch_rows=args.batch_rows,
        give_up_after=args.give_up_after,
        start_from=args.start_from,
        claim_idle=args.claim_idle,
        max_deliveries=args.max_deliveries,
        drain_timeout=args.drain_timeout,
        retain=args.retain,
        crash_after=args.crash_after,
        health=HealthSettings(floor=args.stall_after),
        on_alert=args.on_alert,
        only_runs=frozenset(args.runs) if args.runs else None,
    )
    if args.consumer:
        settings.consumer = args.consumer
    from runbus.cli import configure_logging, known_secrets
    from runbus.ingester.supervisor import ingest

    setup = functools.partial(configure_logging, args.log_level, known=known_secrets(args))
    return ingest(settings, args.workers, args.http, setup)


def cmd_dead(args: argparse.Namespace) -> int:
    from redis import exceptions as redis_errors

    from runbus.ingester import deadletter
    from runbus.query import documents, tables
    from runbus.redact import redact
    from runbus.redis import async_client

    async def act() -> deadletter.Replay | list[deadletter.DeadLetter]:
        async with async_client(args.redis, socket_connect_timeout=5) as client:
            if args.replay:
                return await deadletter.replay(client)
            return await deadletter.dead_letters(client)

    unreachable = (
        redis_errors.ConnectionError,
        redis_errors.TimeoutError,
        redis_errors.RedisClusterException,
    )
    try:
        result = asyncio.run(act())
    except unreachable as exc:
        raise CommandError(f"cannot reach Redis at {safe_url(args.redis)}: {exc}") from exc
    if isinstance(result, deadletter.Replay):
        print(f"replayed {result.replayed} dead-lettered entries onto their streams")
        if result.taken:
            print(f"{result.taken} were being replayed by another `runbus dead --replay`")
        for dead_id, why in result.skipped:
            print(f"left {dead_id} in {wire.DEAD_LETTER_KEY}: {why}", file=sys.stderr)
    elif args.json:
        # The entries' fields as written, but for secrets of a recognisable shape (a start event's
        # config written by hand): listing is for reading; replay works on Redis's copy.
        print(documents.dumps([redact(asdict(letter)) for letter in result]))
    else:
        rows = [(d.dead_id, d.source_stream, d.source_id, d.deliveries, d.reason) for d in result]
        print(tables.table(("DEAD ID", "STREAM", "ENTRY", "DELIVERIES", "REASON"), rows))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from runbus.ingester.demo import run_demo

    return run_demo(redis_url=args.redis, store_url=args.store, ranks=args.ranks, steps=args.steps)
