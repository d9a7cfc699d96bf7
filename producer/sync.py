"""`runbus sync`: ship to Redis, once, the runs that spool files hold (logged while Redis was away).

A process that never reached Redis leaves its events in its spool file (runbus.producer.backlog)
and ends; each rank has its own file, on its own machine. `runbus sync` ships every file in the
spool directory (or the runs named) to Redis, each in order, and removes it once shipped; an
ingester then stores them (`runbus ingest --burst`).

Exactly once: a file is locked while it is shipped (a live process holds its own; a second sync
skips it), and a file whose process never had an epoch gets one from the label's counter in
Redis, above every epoch the label was given, recorded in the file before anything is sent. A
sync killed midway leaves the file with that epoch: shipping it again (a sync, or the next
process of the label) sends the same (epoch, seq) pairs, which the ingester stores once. The
epoch is the file's own, so its events are never taken for another process's; a label another
process wrote since is said (its events then order after the synced ones).
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runbus import config, wire
from runbus.cli import add_redis_option
from runbus.errors import CommandError, InvalidName
from runbus.producer.backlog import Record, Spool, parsed_line, ship_spool
from runbus.producer.lease import LabelLease
from runbus.progress import Progress
from runbus.terminal import printable

if TYPE_CHECKING:
    from runbus.redis import SyncClient

log = logging.getLogger("runbus.producer")

BATCH = 2000  # records a round trip
CONNECT_TIMEOUT = 5.0


@dataclass
class Spooled:
    """One spool file found, locked: whose it is, its recorded epoch and first record."""

    spool: Spool
    run: str
    label: str
    epoch: int | None
    secret: bytes
    first: Record | None

    def order(self) -> tuple[int, float]:
        """Files of one label in the order their processes ran: those with an epoch by it, then
        those without, by their first event's time."""
        if self.epoch is not None:
            return 0, float(self.epoch)
        return 1, self.first.ts if self.first is not None else float("inf")


@dataclass
class Outcome:
    """What a sync did: events shipped, files shipped, and what it could not ship."""

    events: int = 0
    files: int = 0
    labels: int = 0
    problems: int = 0


def add_sync(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="*", metavar="RUN", help="only these runs (default: every run spooled)")
    parser.add_argument(
        "--spool-dir",
        metavar="DIR",
        help=f"where the spool files are ({config.SPOOL_DIR_ENV}; default "
        f"{(config.spool_dir() or 'none').replace('%', '%%')})",
    )
    add_redis_option(parser, "where the events go")
    parser.set_defaults(handler=cmd_sync)


def cmd_sync(args: argparse.Namespace) -> int:
    directory = args.spool_dir or config.spool_dir()
    if directory is None:
        raise CommandError(f"{config.SPOOL_DIR_ENV}=off: name the spool directory with --spool-dir DIR")
    if not os.path.isdir(directory):
        print(f"runbus sync: nothing to sync: no spool directory {printable(directory)}")
        return 0
    found, problems = find_spools(directory, set(args.runs))
    try:
        outcome = sync(found, args.redis)
    finally:
        for item in found:
            item.spool.close(remove=False)  # those not shipped: left as they are, unlocked
    outcome.problems += problems
    where = config.safe_url(args.redis)
    print(
        f"runbus sync: shipped {outcome.events:,} events of {outcome.labels} label(s) from "
        f"{outcome.files} file(s) to Redis at {where}"
        + ("; `runbus ingest --burst` stores them" if outcome.events else "")
        + (f"; {outcome.problems} file(s) not shipped (said above)" if outcome.problems else "")
    )
    return 1 if outcome.problems else 0


def find_spools(directory: str, runs: set[str]) -> tuple[list[Spooled], int]:
    """The spool files in `directory` (of `runs`, if any named), opened and locked; and how many
    could not be (each said on stderr)."""
    found: list[Spooled] = []
    problems = 0
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), "*.spool"))):
        if runs and _owner_named(path) not in (None, *runs):
            continue  # another run's: not even looked at (it may be in use)
        try:
            item = _opened(path)
        except SpoolSkipped as exc:
            print(f"runbus sync: {printable(str(exc))}", file=sys.stderr)
            problems += 1
            continue
        if item is None:
            continue
        if runs and item.run not in runs:
            item.spool.close(remove=False)
            continue
        found.append(item)
    return found, problems


class SpoolSkipped(Exception):
    """A spool file sync cannot ship now (said why); the others are shipped."""


def _opened(path: str) -> Spooled | None:
    """The file at `path`, locked, and what it records; None for one that is gone (another sync
    shipped it) or empty (a process only just made it)."""
    spool = Spool(path)
    try:
        if not spool.open(blocking=False, left=True):
            if not os.path.exists(path):
                return None  # shipped and removed by another sync meanwhile
            raise SpoolSkipped(f"{path} is in use (a live process logging, or another sync): skipped")
    except FileNotFoundError:
        return None  # shipped and removed by another sync since it was listed
    except OSError as exc:
        raise SpoolSkipped(f"cannot open {path}: {exc.strerror or exc}") from None
    if spool.size == 0:
        spool.close(remove=False)
        return None
    owner = spool.recorded_owner() or owner_from_name(path)
    if owner is None:
        spool.close(remove=False)
        raise SpoolSkipped(
            f"{path} names no run and label (not a runbus spool, or from an old runbus): skipped"
        )
    epoch, secret = spool.recorded_seal()
    return Spooled(spool, owner[0], owner[1], epoch, secret, spool.first_record())


def _owner_named(path: str) -> str | None:
    """The run a spool file is of, read without locking it (its first line, else its name);
    None if neither says."""
    try:
        with open(path, "rb") as file:
            item = parsed_line(file.readline(4096))
    except OSError:
        return None
    if isinstance(item, list) and item[0] == "spool" and len(item) == 3:
        return str(item[1])
    owner = owner_from_name(path)
    return None if owner is None else owner[0]


def owner_from_name(path: str) -> tuple[str, str] | None:
    """(run, label) from a spool file's name, RUN.LABEL.PID.spool, where that is unambiguous."""
    parts = os.path.basename(path).removesuffix(".spool").split(".")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    try:
        return wire.check_name("run id", parts[0]), wire.check_name("label", parts[1])
    except InvalidName:
        return None


def sync(found: list[Spooled], redis_url: str) -> Outcome:
    """Ship every file of `found` in order, label by label, removing each once shipped."""
    outcome = Outcome()
    if not found:
        return outcome
    from runbus.redis import sync_client

    client = sync_client(redis_url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=30.0)
    labels: dict[tuple[str, str], list[Spooled]] = {}
    for item in found:
        labels.setdefault((item.run, item.label), []).append(item)
    try:
        with Progress("sync", total=len(found), unit="files") as progress:
            for _, items in sorted(labels.items()):
                items.sort(key=Spooled.order)
                files = outcome.files
                for item in items:
                    _ship_file(client, item, progress, outcome)
                outcome.labels += outcome.files > files
    finally:
        client.close()
    return outcome


def _ship_file(client: SyncClient, item: Spooled, progress: Progress, outcome: Outcome) -> None:
    run, label, spool = item.run, item.label, item.spool
    if _held_by_another(client, run, label):
        progress.say(
            f"runbus sync: {run}/{label} is being logged by a live process now: {spool.path} is "
            "skipped (sync it once that process has finished)",
            sys.stderr,
        )
        outcome.problems += 1
        return
    secrets: dict[int, bytes] = {}
    if item.epoch is not None and item.secret:
        secrets[item.epoch] = item.secret
    client.sadd(wire.REGISTRY_KEY, wire.stream_key(run, label))
    note = f"{run}/{label}"

    def shipped(count: int) -> None:
        outcome.events += count
        progress.update(note=f"{note}: {outcome.events:,} events")

    count = ship_spool(
        spool,
        _sender(client, run, label, secrets),
        _epoch_taker(client, item, secrets, progress),
        BATCH,
        shipped,
    )
    spool.close(remove=True)
    outcome.files += 1
    progress.advance()
    epoch = spool.epoch if spool.epoch is not None else item.epoch
    progress.say(f"runbus sync: {run}/{label}: {count:,} events (epoch {epoch}) from {printable(spool.path)}")
    if spool.skipped:
        progress.say(
            f"runbus sync: {spool.skipped} line(s) of {printable(spool.path)} were no runbus record "
            "and were skipped",
            sys.stderr,
        )


def _held_by_another(client: SyncClient, run: str, label: str) -> bool:
    """Whether a live process holds the label's lease now (it writes the label under the newest
    epoch: what sync ships would take a newer one and be taken for its latest events)."""
    return bool(client.exists(wire.lease_key(run, label)))


def _sender(
    client: SyncClient, run: str, label: str, secrets: dict[int, bytes]
) -> Callable[[list[Record], int], None]:
    """send(records, epoch): one XADD_MANY round trip, each entry sealed with its epoch's secret."""
    script = client.register_script(wire.XADD_MANY_SCRIPT)
    key = wire.stream_key(run, label)

    def send(records: list[Record], epoch: int) -> None:
        entries = ((kind, ep or epoch, seq, ts, step, data) for kind, ep, seq, ts, step, data in records)
        script(keys=[key], args=wire.xadd_many_args(run, label, entries, secrets))

    return send


def _epoch_taker(
    client: SyncClient, item: Spooled, secrets: dict[int, bytes], progress: Progress
) -> Callable[[], tuple[int, bytes]]:
    """take_epoch() for a file without one: a new epoch of the label, sealed with a new secret."""

    def take() -> tuple[int, bytes]:
        _say_later_writer(client, item, progress)
        lease = LabelLease(item.run, item.label, 0, "allow", ttl=30.0, primary_ttl=30.0)
        epoch = lease.earlier_epoch(client)  # none spare: the label's next epoch, sealed
        secrets[epoch] = lease.secret
        return epoch, lease.secret

    return take


def _say_later_writer(client: SyncClient, item: Spooled, progress: Progress) -> None:
    """Say so when the label was given an epoch after this file's process began: the synced
    events take a newer epoch, so they order after that process's."""
    last: Any = client.get(wire.epoch_key(item.run, item.label))
    began = item.first.ts if item.first is not None else None
    try:
        later = last is not None and began is not None and int(last) > began * 1000
    except ValueError:
        return
    if later:
        progress.say(
            f"runbus sync: {item.run}/{item.label} was logged by another process after "
            f"{printable(item.spool.path)} was written: the file's events take a newer epoch, so they "
            "are ordered after that process's",
            sys.stderr,
        )
