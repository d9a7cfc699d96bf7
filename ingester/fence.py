"""The fence: only an epoch's lease holder decides what its label's entries say.

Each producer process seals the entries of the epochs it writes (wire.seal) with a secret of its
own, whose hex its claim stores once per epoch in the label's seal hash (wire.seal_key). Before a
batch is stored, the worker checks every event against its label's fence (wire.fence_reason): the
seals and the epoch counter, read from Redis once per label and again only when an event of an
epoch the record cannot judge arrives. What fails is dead-lettered with the reason.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from itertools import chain, groupby
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, cast

from runbus import wire
from runbus.ingester.batch import Source, Stretch, as_dict
from runbus.ingester.deadletter import DeadEntry

if TYPE_CHECKING:
    from runbus.redis import AsyncClient

# Labels whose fence a worker remembers at most (then it reads them again as needed).
FENCES_REMEMBERED = 65536

LabelKey = tuple[str, str]
_EPOCH = attrgetter("epoch")
_KEY, _FIELDS = itemgetter(0), itemgetter(2)
_LISTS = frozenset({list})
_NUL = b"\0"


def fence_of(seals: dict[bytes, bytes] | None, counter: bytes | None) -> wire.Fence:
    """A label's Fence from its seal hash (HGETALL) and epoch counter (GET) as Redis gives them;
    fields or values written by hand that are no epoch or no secret are left out."""
    sealed: dict[int, bytes] = {}
    for epoch, secret in (seals or {}).items():
        try:
            sealed[int(epoch)] = bytes.fromhex(secret.decode())
        except (ValueError, UnicodeDecodeError):
            continue
    try:
        last = None if counter is None else int(counter)
    except ValueError:
        last = None
    return wire.Fence(sealed, last)


class Fences:
    """One worker's fences, per (run, label), read from Redis as events need them."""

    def __init__(self, require_seal: bool = False) -> None:
        self.require_seal = require_seal
        self._known: dict[LabelKey, wire.Fence] = {}

    async def screen(
        self,
        redis: AsyncClient,
        events: list[wire.Event],
        sources: Sequence[Source],
        dead: list[DeadEntry],
        stretches: list[Stretch] | None = None,
    ) -> tuple[list[wire.Event], Sequence[Source]]:
        """The events (and their sources) their epochs' lease holders wrote; the others join
        `dead` with the reason. `stretches`: the batch's streams as decoded (else found from
        `sources`)."""
        if stretches is None:
            stretches = [Stretch(stretch, None) for stretch in _stretches(sources)]
        # A stretch's events are of its stream's run and label (the decoders check): its epochs
        # are what is looked up, not a tuple per event.
        unknown = {
            (run, label)
            for run, label, epochs in (_places(events, stretch) for stretch in stretches)
            if (fence := self._known.get((run, label))) is None or not all(map(fence.knows, epochs))
        }
        if unknown:
            await self._read(redis, unknown)
        sealed = [self._all_sealed(events, sources, stretch) for stretch in stretches]
        if all(sealed):  # the common case: the batch as it is
            return events, sources
        kept: list[wire.Event] = []
        kept_sources: list[Source] = []
        for (where, _), all_sealed in zip(stretches, sealed, strict=True):
            mine, theirs = events[where], sources[where]
            if all_sealed:
                kept += mine
                kept_sources += theirs
                continue
            for event, source in zip(mine, theirs, strict=True):
                reason = self._reason(event, source)
                if reason is None:
                    kept.append(event)
                    kept_sources.append(source)
                else:
                    key, entry_id, fields = source
                    dead.append(DeadEntry(key, entry_id, as_dict(fields), reason))
        return kept, kept_sources

    def _all_sealed(self, events: list[wire.Event], sources: Sequence[Source], stretch: Stretch) -> bool:
        """Whether one stream's events (`stretch` of `events`), all of one sealed epoch and in the
        producers' field order, all carry their epoch's seal: checked a column at a time (the
        common case, and the ingester's hot path), on the cells the decoder read where it gives
        them (the stretch's Columns). False sends them one by one, which finds the reasons."""
        where, columns = stretch
        first = events[where.start]
        fence = self._known.get((first.run, first.label))
        secret = None if fence is None else fence.seals.get(first.epoch)
        if secret is None:
            return False
        if columns is not None and columns.seals is not None and columns.epoch == first.epoch:
            return _sealed_by(secret, columns.sealed, columns.seals)
        mine = events[where]
        if first.epoch != max(map(_EPOCH, mine)) or first.epoch != min(map(_EPOCH, mine)):
            return False
        found = _columns(list(map(_FIELDS, sources[where])))
        if found is None:
            return False
        width, cells = found
        steps = cells[15::width] if width == _WITH_STEP else [b""] * len(mine)
        sealed = (
            cells[3::width],
            cells[9::width],
            cells[11::width],
            cells[13::width],
            steps,
            cells[width - 3 :: width],
        )
        return _sealed_by(secret, sealed, cells[width - 1 :: width])

    def _reason(self, event: wire.Event, source: Source) -> str | None:
        fence = self._known.get((event.run, event.label), wire.Fence({}, None))
        sealed, stamp = sealed_fields(source[2])
        return wire.fence_reason(event, sealed, stamp, fence, self.require_seal)

    async def _read(self, redis: AsyncClient, labels: Iterable[LabelKey]) -> None:
        labels = list(labels)
        pipe = redis.pipeline(transaction=False)
        for run, label in labels:
            pipe.hgetall(wire.seal_key(run, label))
            pipe.get(wire.epoch_key(run, label))
        # A key of another type (written by hand) answers an error: no seals, or no counter.
        replies = [None if isinstance(r, Exception) else r for r in await pipe.execute(raise_on_error=False)]
        if len(self._known) + len(labels) > FENCES_REMEMBERED:
            self._known.clear()  # read again as needed: a seal never changes
        for at, key in enumerate(labels):
            self._known[key] = fence_of(replies[2 * at], replies[2 * at + 1])


def _columns(flats: list[dict[bytes, bytes] | wire.FlatEntry]) -> tuple[int, list[bytes]] | None:
    """(width, cells) of entries all flat, of one width, in the producers' field order with a
    seal (their cells one after another); None otherwise."""
    if not _LISTS.issuperset(map(type, flats)):
        return None
    lists = cast("list[list[bytes]]", flats)  # every one a list (checked above)
    widths = set(map(len, lists))
    width = widths.pop() if len(widths) == 1 else 0
    if width not in (_WITH_STEP, _WITHOUT_STEP):
        return None
    cells = list(chain.from_iterable(lists))
    names = [*_AT.items(), (b"data", width - 4), (wire.SEAL_FIELD, width - 2)]
    if width == _WITH_STEP:
        names.append((b"step", 14))
    if any(cells[at::width].count(name) != len(lists) for name, at in names):
        return None
    return width, cells


def _sealed_by(secret: bytes, sealed: tuple[list[bytes], ...], stamps: list[bytes]) -> bool:
    """Whether every entry's `seal` (`stamps`) is its epoch's seal under `secret` of its
    wire.SEALED_FIELDS (`sealed`: a column each, as read)."""
    if set(map(len, stamps)) != {wire.SEAL_LENGTH}:
        return False
    base = wire.keyed(secret)

    def digest(message: bytes) -> bytes:
        mac = base.copy()
        mac.update(message)
        return mac.digest()

    computed = b"".join(map(digest, map(_NUL.join, zip(*sealed, strict=True))))
    try:
        given = bytes.fromhex(b"".join(stamps).decode())
    except (ValueError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(computed, given)


def _stretches(sources: Sequence[Source]) -> list[slice]:
    """The stretches of `sources` from one stream each (a batch holds each stream's together)."""
    stretches, start = [], 0
    for _, group in groupby(map(_KEY, sources)):
        end = start + sum(1 for _ in group)
        stretches.append(slice(start, end))
        start = end
    return stretches


def _places(events: list[wire.Event], stretch: Stretch) -> tuple[str, str, set[int]]:
    """The run, label and epochs of one stream's events."""
    where, columns = stretch
    first = events[where.start]
    if columns is not None and columns.epoch is not None:
        return first.run, first.label, {columns.epoch}
    return first.run, first.label, set(map(_EPOCH, events[where]))


# Where a producer's entry holds the fields its seal covers (wire.XADD_MANY_SCRIPT's order, flat).
_AT = {b"kind": 2, b"epoch": 8, b"seq": 10, b"ts": 12}
_WITH_STEP, _WITHOUT_STEP = 20, 18


def sealed_fields(fields: dict[bytes, bytes] | wire.FlatEntry) -> tuple[list[bytes], bytes | None]:
    """An entry's wire.SEALED_FIELDS as read (a missing one as b"") and its `seal` (None without
    one): by position in the producers' order, else by name."""
    if (
        isinstance(fields, list)
        and len(fields) in (_WITH_STEP, _WITHOUT_STEP)
        and fields[-2] == wire.SEAL_FIELD
        and fields[-4] == b"data"
        and all(fields[at] == name for name, at in _AT.items())
        and (len(fields) == _WITHOUT_STEP or fields[14] == b"step")
    ):
        step = fields[15] if len(fields) == _WITH_STEP else b""
        return [fields[3], fields[9], fields[11], fields[13], step, fields[-3]], fields[-1]
    named = as_dict(fields)
    return [named.get(name, b"") for name in wire.SEALED_FIELDS], named.get(wire.SEAL_FIELD)
