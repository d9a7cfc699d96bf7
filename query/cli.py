"""`runbus runs`, `show`, `metrics` and `logs`: the store read back, as text tables or JSON.

These commands only read: the store is opened with create=False, so where there is none they say
so in one line and create nothing. A run, key or label that is not there is an error that lists
what is.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from runbus import config, wire
from runbus.cli import add_redis_option, add_store_option, level_argument
from runbus.errors import CommandError, RunNotFound, StoreMissing
from runbus.query import catchup, documents, tables
from runbus.redact import redact_text
from runbus.storage import Store, open_store, outliers, runlist, safe_url
from runbus.storage.anomalies import Anomaly
from runbus.storage.base import LogLine, Point, RunPage, RunSummary
from runbus.storage.lookup import run_id_of
from runbus.storage.rules import FAILED, FINISHED, natural_key
from runbus.terminal import printable

T = TypeVar("T")
RECENT_RUNS = 5  # runs an unknown run's error names
REDIS_HELP = "asked, for a run not in the store (or not ended there), whether its events wait there"
LISTED_NAMES = 20  # keys or labels an unknown one's error names
# A run its producer ended: no event of it waits that a read should store first.
ENDED = frozenset({FINISHED, FAILED})
NAME_WIDTH, TAGS_WIDTH = 40, 30  # what `runbus runs` shows of a run's name and tags, at most


def add_runs(parser: argparse.ArgumentParser) -> None:
    add_store_option(parser)
    parser.add_argument(
        "--search", metavar="TEXT", help="runs whose id, name, a tag or a label holds TEXT (any case)"
    )
    parser.add_argument(
        "--state",
        action="append",
        default=[],
        metavar="STATE",
        help=f"runs in this state ({', '.join(runlist.STATES)}); again or with commas for several",
    )
    parser.add_argument(
        "--since",
        metavar="TIME",
        help="runs started at or after TIME (2026-11-27, 2026-11-27T14:30, epoch s)",
    )
    parser.add_argument("--until", metavar="TIME", help="runs started before TIME (a date: through that day)")
    parser.add_argument("--tag", action="append", default=[], help="runs with this tag (again: all of them)")
    parser.add_argument(
        "--label", action="append", default=[], help="runs with this label (again: all of them)"
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="runs whose config KEY is VALUE (read as JSON where it is: lr=0.1, amp=true, model=resnet)",
    )
    parser.add_argument("--sort", choices=list(runlist.SORTS), default="started", help="what to sort by")
    parser.add_argument(
        "--order", choices=runlist.ORDERS, help="asc or desc (default: desc for times and labels, else asc)"
    )
    parser.add_argument("--limit", type=_count, help="at most this many runs")
    parser.add_argument("--offset", type=_count, default=0, help="skip this many runs first")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=cmd_runs)


def add_show(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(handler=cmd_show)


def add_metrics(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--key", help="only this metric")
    parser.add_argument("--label", help="only this label")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=cmd_metrics)


def add_logs(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--label", help="only this label")
    parser.add_argument(
        "--level", type=level_argument, help="at least this level (DEBUG, INFO, WARNING, ERROR)"
    )
    parser.add_argument("--grep", help="only lines containing this text")
    parser.add_argument("--limit", type=_count, help="at most this many lines")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(handler=cmd_logs)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """What every command that reads one run takes: the run, --store, --redis, and
    `--no-catch-up` (leave the run's waiting events in Redis: query/catchup.py)."""
    parser.add_argument("run")
    add_store_option(parser)
    add_redis_option(parser, REDIS_HELP)
    parser.add_argument(
        "--no-catch-up",
        dest="catch_up",
        action="store_false",
        help="leave the run's events that wait in Redis there, even with no ingester running "
        f"(default: store them first, unless {config.CATCH_UP_ENV}=0)",
    )


def catching_up(args: argparse.Namespace) -> bool:
    """Whether this command stores the run's waiting events first: --no-catch-up and
    RUNBUS_CATCH_UP=0 say not to."""
    return bool(getattr(args, "catch_up", True)) and config.catch_up()


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


# -- reading -------------------------------------------------------------------------------------


def read(url: str, action: Callable[[Store], Awaitable[T]]) -> T:
    """`action(store)` on the store at `url`, opened for reading only, then closed."""

    async def reading() -> T:
        store = open_store(url, create=False)
        try:
            await store.connect()
            return await action(store)
        finally:
            await store.close()

    return asyncio.run(reading())


def read_run(args: argparse.Namespace, action: Callable[[Store], Awaitable[T]]) -> T:
    """`read(args.store, action)` for a command that reads the run `args.run`: where there is no
    store yet but the run's events wait in Redis, they are stored first (creating the store)."""
    try:
        return read(args.store, action)
    except StoreMissing:
        if not catching_up(args) or catchup.store_waiting(args.store, args.redis, args.run, None) is None:
            raise
    return read(args.store, action)


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:LISTED_NAMES])
    return shown + (f", ... ({len(names)} in all)" if len(names) > LISTED_NAMES else "")


async def known_run(
    store: Store, run_id: str, redis_url: str | None = None, catch_up: bool = False
) -> RunSummary:
    """The run `run_id` names (its id or a unique prefix of it: storage.lookup), or RunNotFound.

    With `redis_url`, where the run is not in the store (or not finished there) and its events
    wait in Redis: with `catch_up` and no ingester running, they are stored first
    (query/catchup.py), and with one busy storing a run not in the store yet, the read waits for
    it (up to catchup.BUSY_WAIT); else the error says that they wait, and what stores them.
    Without, the error names the store's most recent runs."""
    run = await _stored(store, run_id)
    if run is not None and (redis_url is None or not catch_up or run.state in ENDED):
        return run
    waiting = None
    if redis_url is not None:
        run, waiting = await _caught_up(store, run, run_id, redis_url, catch_up)
        if run is not None:
            return run
    raise await _not_found(store, run_id, redis_url, waiting, catch_up)


async def _caught_up(
    store: Store, run: RunSummary | None, run_id: str, redis_url: str, catch_up: bool
) -> tuple[RunSummary | None, catchup.Backlog | None]:
    """The run once what of it waits in Redis is stored (with `catch_up`), and what waits."""
    group = wire.store_group(await store.identity())
    if not catch_up:  # a run not in the store: only say what of it waits
        return run, await asyncio.to_thread(catchup.backlog, redis_url, run_id, group)
    target = run_id if run is None else run.run_id
    waiting = await asyncio.to_thread(catchup.store_waiting, store.url, redis_url, target, group)
    if waiting is None:
        return run, None
    if waiting.live is not None and run is None:
        return await _stored_soon(store, run_id), waiting  # a busy ingester is storing it
    return await _stored(store, run_id) or run, waiting


async def _stored(store: Store, run_id: str) -> RunSummary | None:
    found = await run_id_of(store, run_id)
    return None if found is None else await store.run(found)


async def _stored_soon(store: Store, run_id: str) -> RunSummary | None:
    """The run once the store has it, looked for until catchup.BUSY_WAIT has passed (another
    process writes it: nothing here can be awaited but the store itself)."""
    for _ in range(round(catchup.BUSY_WAIT / catchup.BUSY_POLL)):
        run = await _stored(store, run_id)
        if run is not None:
            return run
        await asyncio.sleep(catchup.BUSY_POLL)
    return await _stored(store, run_id)


async def _not_found(
    store: Store, run_id: str, redis_url: str | None, waiting: catchup.Backlog | None, catch_up: bool
) -> RunNotFound:
    """The error for a run the store does not have, saying what of it waits in Redis, if any."""
    where = f"unknown run {run_id!r} in {safe_url(store.url)}"
    if waiting is not None:
        return RunNotFound(f"{where}: {_waiting_text(waiting, redis_url or '', catch_up)}")
    page = await store.run_page(runlist.RunQuery(limit=RECENT_RUNS))
    if not page.total:
        return RunNotFound(f"{where}: it has no runs yet")
    recent = ", ".join(r.run_id for r in page.runs)
    if page.total <= RECENT_RUNS:
        return RunNotFound(f"{where}; its runs: {recent}")
    return RunNotFound(
        f"{where}; the {RECENT_RUNS} most recent of its {page.total} runs: {recent} (`runbus runs` lists all)"
    )


def _waiting_text(waiting: catchup.Backlog, redis_url: str, catch_up: bool) -> str:
    held = f"Redis at {safe_url(redis_url)} holds {waiting.streams} stream(s) of it"
    if waiting.live is not None:
        return (
            f"its events wait in Redis at {safe_url(redis_url)} ({waiting.entries} entries), and an "
            f"ingester (consumer {waiting.live}) is storing them: try again in a moment"
        )
    if waiting.entries == 0:
        return f"{held}, with nothing this store's ingesters have not read (dead letters: `runbus dead`)"
    off = "" if catch_up else f" ({config.CATCH_UP_ENV}=0 or --no-catch-up: reads leave them there)"
    return (
        f"its events wait in Redis at {safe_url(redis_url)} ({waiting.streams} stream(s), "
        f"{waiting.entries} entries); `runbus ingest --burst --run {waiting.run_id}` stores them "
        f"(or keep `runbus ingest` running){off}"
    )


def _check_label(run: RunSummary, label: str | None) -> None:
    names = [lab.label for lab in run.labels]
    if label is not None and label not in names:
        raise CommandError(f"run {run.run_id!r} has no label {label!r}; its labels: {_listing(names)}")


async def _check_key(store: Store, run: RunSummary, key: str | None) -> None:
    if key is None:
        return
    keys = await store.metric_keys(run.run_id)
    if key not in keys:
        known = f"its metrics: {_listing(keys)}" if keys else "it has no metrics"
        raise CommandError(f"run {run.run_id!r} has no metric {key!r}; {known}")


# -- the commands ----------------------------------------------------------------------------------


def runs_query(args: argparse.Namespace) -> runlist.RunQuery:
    """`runbus runs`' filters, order and page as a RunQuery (BadQuery where one is wrong)."""
    return runlist.run_query(
        search=args.search,
        states=args.state,
        since=args.since,
        until=args.until,
        tags=args.tag,
        labels=args.label,
        config=args.config,
        sort=args.sort,
        order=args.order,
        limit=args.limit,
        offset=args.offset,
    )


def page_note(page: RunPage) -> str | None:
    """What a page leaves out, for stderr: None if it holds every run that matches."""
    shown = len(page.runs)
    if page.offset == 0 and shown == page.total:
        return None
    if not shown:
        return f"no runs past the first {page.offset} of {page.total} that match"
    note = f"runs {page.offset + 1}-{page.offset + shown} of {page.total} that match"
    if page.offset + shown < page.total:
        note += f"; --offset {page.offset + shown} for the next"
    return note


def cmd_runs(args: argparse.Namespace) -> int:
    query = runs_query(args)
    page = read(args.store, lambda store: store.run_page(query))
    runs = page.runs
    note = page_note(page)
    if note is not None:
        print(f"runbus: {note}", file=sys.stderr)
    if args.json:
        print(documents.dumps(documents.runs_document(runs)))
        return 0
    rows = [
        (
            r.run_id,
            None if r.name is None else tables.clipped(redact_text(r.name), NAME_WIDTH),
            tables.clipped(tables.tags_text(r.tags), TAGS_WIDTH) if r.tags else None,
            tables.state_text(r),
            r.primary,
            r.label_count,
            tables.when(r.started_ts),
            tables.when(r.last_ts),
        )
        for r in runs
    ]
    print(tables.table(("RUN", "NAME", "TAGS", "STATE", "PRIMARY", "LABELS", "STARTED", "LAST EVENT"), rows))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from runbus.query.health import health_lines, read_health

    async def showing(store: Store) -> tuple[RunSummary, dict[str, Any], list[Anomaly]]:
        run = await known_run(store, args.run, args.redis, catching_up(args))
        return run, await read_health(store, run), await outliers.every_anomaly(store, run.run_id)

    run, health, found = read_run(args, showing)
    if args.json:
        document = {**documents.run_document(run), "health": health}
        document["anomalies"] = [documents.anomaly_document(a) for a in found]
        print(documents.dumps(document))
    else:
        print("\n".join([*health_lines(health), tables.show_text(run, found)]))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    async def points(store: Store) -> tuple[RunSummary, list[Point]]:
        run = await known_run(store, args.run, args.redis, catching_up(args))
        _check_label(run, args.label)
        await _check_key(store, run, args.key)
        found = await store.metrics(run.run_id, key=args.key, label=args.label)
        # The store orders labels as text; stable, this keeps each label's key and step order.
        return run, sorted(found, key=lambda p: natural_key(p.label))

    run, found = read_run(args, points)
    if args.json:
        print(documents.dumps([documents.point_document(p) for p in found]))
        return 0
    lives = {lab.label: lab.lives for lab in run.labels}
    rows = [
        (p.label, p.key, p.step, lives.get(p.label, {}).get(p.epoch), p.seq, tables.number_text(p.value))
        for p in found
    ]
    print(tables.table(("LABEL", "KEY", "STEP", "LIFE", "SEQ", "VALUE"), rows))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    async def lines(store: Store) -> list[LogLine]:
        run = await known_run(store, args.run, args.redis, catching_up(args))
        _check_label(run, args.label)
        found = await store.logs(
            run.run_id, label=args.label, level=args.level, grep=args.grep, limit=args.limit
        )
        # Lines logged at one time keep their labels' natural order (and each label's own order).
        return sorted(found, key=lambda line: (line.ts, natural_key(line.label)))

    found = documents.shown_log_lines(read_run(args, lines))
    if args.json:
        print(documents.dumps([documents.log_document(line) for line in found]))
        return 0
    width = max((len(line.label) for line in found), default=0)
    for line in found:
        for text in line.text.splitlines() or [""]:
            print(printable(f"{line.label.ljust(width)} | {tables.when(line.ts)} {line.level:<7} {text}"))
    return 0
