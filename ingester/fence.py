"""The fence: only an epoch's lease holder decides what its label's entries say.

Each producer process seals the entries of the epochs it writes (wire.seal) with a secret of its
own, whose hex its claim stores once per epoch in the label's seal hash (wire.seal_key). Before a
batch is stored, the worker checks every event against its label's fence (wire.fence_reason): the
seals and the epoch counter, read from Redis once per label and again only when an event of an
epoch the record cannot judge arrives. What fails is dead-lettered with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from runbus import wire
from runbus.ingester.deadletter import DeadEntry

if TYPE_CHECKING:
    from runbus.redis import AsyncClient

# Labels whose fence a worker remembers at most (then it reads them again as needed).
FENCES_REMEMBERED = 65536

# Where a decoded event came from: (stream key, entry id, raw fields as a dict or a flat list).
Source = tuple[str, bytes, dict[bytes, bytes] | wire.FlatEntry]
LabelKey = tuple[str, str]


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
        self, redis: AsyncClient, events: list[wire.Event], sources: list[Source], dead: list[DeadEntry]
    ) -> tuple[list[wire.Event], list[Source]]:
        """The events (and their sources) their epochs' lease holders wrote; the others join
        `dead` with the reason."""
        unknown = {
            (e.run, e.label)
            for e in events
            if (fence := self._known.get((e.run, e.label))) is None or not fence.knows(e.epoch)
        }
        if unknown:
            await self._read(redis, unknown)
        kept: list[wire.Event] = []
        kept_sources: list[Source] = []
        for event, source in zip(events, sources, strict=True):
            reason = self._reason(event, source)
            if reason is None:
                kept.append(event)
                kept_sources.append(source)
            else:
                key, entry_id, fields = source
                dead.append(DeadEntry(key, entry_id, _as_dict(fields), reason))
        return kept, kept_sources

    def _reason(self, event: wire.Event, source: Source) -> str | None:
        fence = self._known.get((event.run, event.label), wire.Fence({}, None))
        data, stamp = _data_and_seal(source[2])
        return wire.fence_reason(event, data, stamp, fence, self.require_seal)

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


def _as_dict(fields: dict[bytes, bytes] | wire.FlatEntry) -> dict[bytes, bytes]:
    return fields if isinstance(fields, dict) else wire.fields_dict(fields)


def _data_and_seal(fields: dict[bytes, bytes] | wire.FlatEntry) -> tuple[bytes, bytes | None]:
    """An entry's raw `data` and `seal` (None without one): by position in the producers' order
    (data, then seal, last), else by name."""
    if (
        isinstance(fields, list)
        and len(fields) >= 4
        and fields[-2] == wire.SEAL_FIELD
        and fields[-4] == b"data"
    ):
        return fields[-3], fields[-1]
    named = _as_dict(fields)
    return named.get(b"data", b""), named.get(wire.SEAL_FIELD)
