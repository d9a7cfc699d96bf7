"""Encoded events waiting for Redis: in memory up to a byte bound, then in a spool file on disk.

In memory as on disk, a record is one line of JSON (the spool's format), and the lines are kept
in chunks of up to a batch: a few bytes of overhead a record, where Python objects would cost
hundreds, so the byte bound holds three to four times more events. Only the shipper thread
touches a Backlog; a chunk being shipped is sealed, and read (decoded) by the courier.

Records are kept without their epoch when it is not known yet (Redis unreachable since init):
epoch 0 means "this process's epoch", filled in when shipped, or, for a spool left by a dead
process, from the epoch line the spool recorded (runbus.producer.sync takes one for a spool that
has none, and records it there before it ships anything).

A spool file's lines: `["spool", RUN, LABEL]` first (whose file it is: its name alone is
ambiguous, as run ids and labels may hold dots), `["epoch", EPOCH, SECRET_HEX]` once the epoch is
known, and records. A line that is none of these (written by hand, torn) is skipped, said once
in the log, never fatal.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple

import orjson

log = logging.getLogger("runbus.producer")

# Bytes beyond its line a record held in memory costs (a chunk's spare room as it grows; measured
# with bench/memory.py).
LINE_OVERHEAD = 24
MAX_DROP_RANGES = 1000
VITAL_KINDS = ("start", "finish", "meta")


class Record(NamedTuple):
    """One encoded event."""

    kind: str
    epoch: int  # 0 until known
    seq: int
    ts: float
    step: int | None
    data: str  # JSON text


def record_line(record: Record) -> bytes:
    """A record as one line of JSON, as the spool and the memory chunks hold it."""
    return orjson.dumps(list(record), option=orjson.OPT_APPEND_NEWLINE)


class Chunk:
    """Records held in memory as lines of one buffer, oldest first; shipped together, sealed
    (nothing more is added) once peeked."""

    __slots__ = ("count", "lines", "sealed", "size")

    def __init__(self) -> None:
        self.lines = bytearray()
        self.count = 0
        self.size = 0  # what the chunk counts for against the bound
        self.sealed = False

    def add(self, line: bytes, size: int) -> None:
        self.lines += line
        self.count += 1
        self.size += size

    def __len__(self) -> int:
        return self.count

    def rows(self) -> list[Any]:
        """Each record as a list in Record's order (decoded in one call)."""
        records: list[Any] = orjson.loads(b"[" + bytes(self.lines[:-1]).replace(b"\n", b",") + b"]")
        return records


def rows_of(batch: Chunk | list[Record]) -> list[Any]:
    """A peeked batch's records, each a sequence in Record's order."""
    return batch.rows() if isinstance(batch, Chunk) else batch


@dataclass
class DropLog:
    """Seq ranges dropped because every buffer was full (or an event could not be encoded), to
    explain gaps. Noted by the shipper thread, read by others."""

    count: int = 0
    ranges: list[list[int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def note(self, first: int, last: int | None = None) -> None:
        """Seqs `first` to `last` (default: just `first`) were dropped."""
        last = first if last is None else last
        with self._lock:
            self.count += last - first + 1
            ranges = self.ranges
            if ranges and ranges[-1][1] == first - 1:
                ranges[-1][1] = last
            elif len(ranges) >= MAX_DROP_RANGES:
                # Too many separate ranges to report: widen the last one to cover these seqs
                # (it may then cover seqs that did arrive, which only makes the explanation
                # generous, never wrong by omission).
                ranges[-1][0] = min(ranges[-1][0], first)
                ranges[-1][1] = max(ranges[-1][1], last)
            else:
                ranges.append([first, last])

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"dropped": self.count, "dropped_ranges": [list(r) for r in self.ranges]}


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _existing(path: str, flags: int) -> int:
    return os.open(path, flags & ~os.O_CREAT)


def parsed_line(line: bytes) -> Record | list[Any] | None:
    """A spool line as a Record, a header or epoch line (a list), or None if it is neither."""
    try:
        item = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(item, list) or not item:
        return None
    if item[0] in ("epoch", "spool"):
        return item
    if len(item) != len(Record._fields) or not isinstance(item[0], str):
        return None
    kind, epoch, seq, ts, step, data = item
    fine = type(epoch) is int and type(seq) is int and isinstance(ts, float | int)
    if not fine or not (step is None or type(step) is int) or not isinstance(data, str):
        return None
    return Record(kind, epoch, seq, float(ts), step, data)


def spool_path(spool_dir: str, run: str, label: str, pid: int) -> str:
    return os.path.join(spool_dir, f"{run}.{label}.{pid}.spool")


class Spool:
    """An append-only file of records, read back in order; locked while its process lives."""

    def __init__(self, path: str, owner: tuple[str, str] | None = None) -> None:
        self.path = path
        self.owner = owner  # (run, label): written as the file's first line
        self._file: BinaryIO | None = None
        self.read_offset = 0
        self.size = 0
        self.epoch: int | None = None
        self.secret = b""
        self.skipped = 0  # lines read that were no record (corrupt, or written by hand)
        self.held = 0  # records this process appended and has not shipped

    def open(self, blocking: bool = True, left: bool = False) -> bool:
        """Open and lock the file; False if another live process holds it (only when not
        blocking). `left`: a file another process left, never made here: False once it is gone
        (shipped and removed by whoever held it meanwhile); FileNotFoundError if it never was."""
        # Owner-only, the directory (where runbus makes it) and the file: it records the process's
        # seal secret (note_epoch), and what it logged.
        if not left:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        opener = _existing if left else _private
        handle = open(self.path, "a+b", opener=opener)  # noqa: SIM115 (held open for the life of the spool)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            return False
        if left and os.fstat(handle.fileno()).st_nlink == 0:
            handle.close()  # removed while we waited for the lock: shipped by its holder
            return False
        self._file = handle
        self.size = handle.seek(0, os.SEEK_END)
        if self.size == 0 and self.owner is not None:
            header = orjson.dumps(["spool", *self.owner]) + b"\n"
            handle.write(header)
            self.size = self.read_offset = len(header)
        if self.epoch is not None:
            self._write_epoch()
        return True

    @property
    def _opened(self) -> BinaryIO:
        assert self._file is not None, f"spool {self.path} used before open()"
        return self._file

    def append(self, record: Record) -> int:
        return self.append_lines(record_line(record))

    def append_lines(self, lines: bytes | bytearray) -> int:
        """Append records already written as lines (record_line)."""
        if self._file is None:
            self.open()
        self._opened.write(lines)
        self.size += len(lines)
        self.held += lines.count(b"\n")
        return len(lines)

    def note_epoch(self, epoch: int, secret: bytes = b"") -> None:
        """Record the epoch of this process and its seal secret (wire.seal), for whoever ships
        the file after it died: the file is this process's own, on its own disk."""
        self.epoch = epoch
        self.secret = secret
        if self._file is not None:
            self._write_epoch()

    def _write_epoch(self) -> None:
        line = orjson.dumps(["epoch", self.epoch, self.secret.hex()]) + b"\n"
        self._opened.write(line)
        self._opened.flush()  # in the file before any entry of the epoch leaves (a rerun reads it)
        self.size += len(line)

    def recorded_owner(self) -> tuple[str, str] | None:
        """The (run, label) the file's first line names, if it has that line."""
        file = self._opened
        file.seek(0)
        item = parsed_line(file.readline())
        if isinstance(item, list) and item[0] == "spool" and len(item) == 3:
            return str(item[1]), str(item[2])
        return None

    def first_record(self) -> Record | None:
        """The file's first record (its process's first event left here), if any."""
        file = self._opened
        file.seek(0)
        for line in file:
            item = parsed_line(line)
            if isinstance(item, Record):
                return item
        return None

    def recorded_epoch(self) -> int | None:
        """The epoch line a (dead) process wrote into this file, if any."""
        return self.recorded_seal()[0]

    def recorded_seal(self) -> tuple[int | None, bytes]:
        """The epoch and seal secret a (dead) process recorded in this file: (None, b"") if
        none, and an empty secret from a runbus that sealed nothing."""
        file = self._opened
        file.seek(0)
        for line in file:
            if line.startswith(b'["epoch",'):
                with contextlib.suppress(orjson.JSONDecodeError, IndexError, ValueError, TypeError):
                    item = orjson.loads(line)
                    return int(item[1]), bytes.fromhex(item[2]) if len(item) > 2 else b""
        return None, b""

    def read(self, limit: int) -> tuple[list[Record], int, int | None]:
        """Up to `limit` records from the read offset: (records, new offset, epoch seen)."""
        file = self._opened
        file.flush()
        file.seek(self.read_offset)
        records: list[Record] = []
        epoch: int | None = None
        offset = self.read_offset
        while len(records) < limit:
            line = file.readline()
            if not line.endswith(b"\n"):
                break  # end, or a torn last line from a crash
            offset += len(line)
            item = parsed_line(line)
            if isinstance(item, Record):
                records.append(item)
            elif item is None:
                self.skipped += 1
                log.error(
                    "runbus: skipping a line of spool %s at byte %d: not a runbus record",
                    self.path,
                    offset - len(line),
                )
            elif item[0] == "epoch":
                epoch = item[1]
        return records, offset, epoch

    def unread(self) -> bool:
        return self._file is not None and self.read_offset < self.size

    def reset(self) -> None:
        """Everything was shipped: empty the file, but for whose it is and its epoch (what a
        process that ships it after this one died needs)."""
        file = self._opened
        file.truncate(0)
        self.read_offset = self.size = self.held = 0
        if self.owner is not None:
            header = orjson.dumps(["spool", *self.owner]) + b"\n"
            file.write(header)
            self.size = len(header)
        if self.epoch is not None:
            self._write_epoch()
        self.read_offset = self.size

    def close(self, remove: bool) -> None:
        if self._file is None:
            return
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self._file.close()  # releases the lock
        self._file = None


class Backlog:
    """Records in order: memory first, then the spool once memory is full."""

    def __init__(
        self,
        max_bytes: int,
        spool: Spool | None,
        max_spool_bytes: int,
        drops: DropLog,
        chunk_records: int = 2000,
    ) -> None:
        self.max_bytes = max_bytes
        self.spool = spool
        self.max_spool_bytes = max_spool_bytes
        self.drops = drops
        self.chunk_records = chunk_records  # a batch: what peek() gives at most
        self.memory: deque[Chunk] = deque()
        self.held = 0  # records in memory
        self.bytes = 0
        self._spooling = False
        self._peeked_offset: int | None = None

    def add(self, record: Record, keep: bool = False) -> None:
        """Hold a record in order: in memory, else in the spool, else drop it (counted).

        `keep` (Redis answers: the shipper takes only what there is room for) and the vital
        kinds pass the bounds instead of being dropped.
        """
        line = record_line(record)
        size = len(line) + LINE_OVERHEAD
        # start and finish are never dropped: without them a label's state would be wrong,
        # and they are a few hundred bytes once per process; nor is run metadata (meta), which
        # nothing later repeats.
        keep = keep or record.kind in VITAL_KINDS
        if not self._spooling and (keep or self.bytes + size <= self.max_bytes):
            self._hold(line, size)
        elif self.spool is not None and (keep or self.spool.size + size <= self.max_spool_bytes):
            # Once spooling, records go to the spool until it is read back: memory is shipped
            # first, so a record held there now would overtake the spooled ones.
            if not self._spooling:
                log.warning(
                    "runbus: memory buffer full (%d bytes); spooling to %s", self.bytes, self.spool.path
                )
            try:
                self.spool.append_lines(line)
            except OSError as exc:  # disk full, or the directory went away
                log.error("runbus: cannot write the spool %s: %s", self.spool.path, exc)
                if keep:
                    self._hold(line, size)
                else:
                    self.drops.note(record.seq)
                return
            self._spooling = True
        else:
            self.drops.note(record.seq)

    def _hold(self, line: bytes, size: int) -> None:
        memory = self.memory
        if not memory or memory[-1].sealed or memory[-1].count >= self.chunk_records:
            memory.append(Chunk())
        memory[-1].add(line, size)
        self.held += 1
        self.bytes += size

    def has_room(self) -> bool:
        """Whether a record added now would find room within the bounds (memory or spool)."""
        if self._spooling and self.spool is not None:
            return self.spool.size < self.max_spool_bytes
        return self.bytes < self.max_bytes

    def add_first(self, record: Record) -> None:
        """Put a record ahead of all others (the start event, held until the handshake); never
        while a batch peeked from the front is being shipped."""
        line = record_line(record)
        chunk = Chunk()
        chunk.add(line, len(line) + LINE_OVERHEAD)
        self.memory.appendleft(chunk)
        self.held += 1
        self.bytes += chunk.size

    def peek(self, limit: int) -> Chunk | list[Record]:
        """The oldest records (up to `limit`, or the oldest chunk), not yet removed: ship them
        (rows_of), then call `shipped`. Empty when there are none."""
        if self.memory:
            chunk = self.memory[0]
            chunk.sealed = True
            return chunk
        spool = self._unread_spool()
        if spool is not None:
            records, self._peeked_offset, _ = spool.read(limit)
            if not records:
                self.shipped(records)  # what was left held no record (an epoch line): done with it
            return records
        return []

    def _unread_spool(self) -> Spool | None:
        """The spool, when records wait in it (they do only while spooling)."""
        spool = self.spool
        return spool if self._spooling and spool is not None and spool.unread() else None

    def shipped(self, batch: Chunk | list[Record]) -> None:
        if isinstance(batch, Chunk):
            if self.memory and self.memory[0] is batch:
                self.memory.popleft()
                self.held -= batch.count
                self.bytes -= batch.size
            return
        if self._peeked_offset is not None:
            spool = self.spool
            assert spool is not None, "records were peeked from a spool"
            spool.read_offset, self._peeked_offset = self._peeked_offset, None
            spool.held = max(0, spool.held - len(batch))
            if not spool.unread():
                spool.reset()
                self._spooling = False

    def persist(self) -> int:
        """Move what is in memory to the spool (at exit, when Redis could not take it)."""
        if self.spool is None:
            return 0
        moved = self.held
        while self.memory:  # a chunk leaves memory once in the file (OSError: it stays)
            chunk = self.memory[0]
            self.spool.append_lines(chunk.lines)
            self.memory.popleft()
            self.held -= chunk.count
            self.bytes -= chunk.size
        return moved

    def __len__(self) -> int:
        return self.held + (1 if self._unread_spool() is not None else 0)


def orphan_spools(spool_dir: str, run: str, label: str, own_pid: int) -> list[Spool]:
    """Spools of earlier processes of this run and label that are no longer alive, locked."""
    found = []
    for path in sorted(glob.glob(os.path.join(glob.escape(spool_dir), f"{run}.{label}.*.spool"))):
        if path == spool_path(spool_dir, run, label, own_pid):
            continue
        spool = Spool(path)
        try:
            if not spool.open(blocking=False, left=True):
                continue
        except OSError as exc:  # another user's file in a shared directory
            log.warning("runbus: cannot open the spool %s: %s", path, exc)
            continue
        owner = spool.recorded_owner()
        if owner is not None and owner != (run, label):  # run "a", label "b.c" for run "a.b"
            spool.close(remove=False)
            continue
        found.append(spool)
    return found


def ship_spool(
    spool: Spool,
    send: Callable[[list[Record], int], object],
    take_epoch: Callable[[], tuple[int, bytes]],
    batch_size: int,
    shipped: Callable[[int], object] | None = None,
) -> int:
    """Ship a spool another process left (locked, opened), in order, a batch at a time, through
    `send(records, epoch)`: records without an epoch (0) are of the epoch the spool recorded, else
    of a new one, `take_epoch()` -> (epoch, secret), which is written into the spool before any
    of its records is sent. So shipping it again after a crash midway (the same file, by anyone)
    sends the same (epoch, seq) pairs, which the ingester stores once. `shipped(n)` is told of
    each batch sent. Returns how many records were shipped; the caller removes the file."""
    epoch, _ = spool.recorded_seal()
    spool.read_offset = 0
    count = 0
    while True:
        records, offset, _ = spool.read(batch_size)
        if not records:
            return count
        if epoch is None and any(r.epoch == 0 for r in records):
            # That process never reached Redis: its events get an epoch of their own.
            epoch, secret = take_epoch()
            spool.note_epoch(epoch, secret)
        send(records, epoch or 0)
        spool.read_offset = offset
        count += len(records)
        if shipped is not None:
            shipped(len(records))
