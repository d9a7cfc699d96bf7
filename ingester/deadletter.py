"""The dead-letter stream: what goes in (an entry with its reason), listing, and replay."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runbus import wire
from runbus.redis import stream_entries

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

    from runbus.redis import AsyncClient

METADATA = ("reason", "source_stream", "source_id", "deliveries")
RENAMED = "orig."


@dataclass
class DeadEntry:
    """An entry that will not be stored, with the reason."""

    stream: str
    entry_id: bytes
    fields: dict[bytes, bytes]
    reason: str
    deliveries: int = 1


@dataclass(frozen=True)
class DeadLetter:
    """One entry of runbus:dead, as listed."""

    dead_id: str
    reason: str
    source_stream: str
    source_id: str
    deliveries: int
    fields: dict[str, str]


def dead_letter_fields(dead: DeadEntry) -> dict[FieldT, EncodableT]:
    """The reason and source, then the original fields; a colliding original name gets `orig.`."""
    fields: dict[FieldT, EncodableT] = {
        "reason": dead.reason,
        "source_stream": dead.stream,
        "source_id": dead.entry_id,
        "deliveries": dead.deliveries,
    }
    for name, value in dead.fields.items():
        key = name.decode("utf-8", "replace")
        fields[f"{RENAMED}{key}" if key in METADATA else name] = value
    return fields


def original_fields(fields: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
    """The source entry's own fields, as they were, from a dead letter's fields."""
    original = {}
    for name, value in fields.items():
        text = name.decode("utf-8", "replace")
        if text in METADATA:
            continue
        if text.startswith(RENAMED) and text[len(RENAMED) :] in METADATA:
            name = text[len(RENAMED) :].encode()
        original[name] = value
    return original


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", "replace")


async def dead_letters(redis: AsyncClient, count: int | None = None) -> list[DeadLetter]:
    """The dead letters, oldest first."""
    entries = stream_entries(await redis.xrange(wire.DEAD_LETTER_KEY, count=count))
    return [
        DeadLetter(
            dead_id=entry_id.decode(),
            reason=_text(fields.get(b"reason")),
            source_stream=_text(fields.get(b"source_stream")),
            source_id=_text(fields.get(b"source_id")),
            deliveries=int(fields.get(b"deliveries") or 1),
            fields={_text(k): _text(v) for k, v in original_fields(fields).items()},
        )
        for entry_id, fields in entries
    ]


async def replay(redis: AsyncClient) -> int:
    """Put every dead letter back on its source stream as a new entry, then drop it from
    runbus:dead (in that order: a crash between gives a duplicate, never a loss)."""
    replayed = 0
    for entry_id, fields in stream_entries(await redis.xrange(wire.DEAD_LETTER_KEY)):
        source = fields.get(b"source_stream")
        if not source:
            continue
        # A copy typed as redis-py's xadd wants it: a dict of any encodable types (invariant).
        original: dict[FieldT, EncodableT] = dict(original_fields(fields).items())
        await redis.xadd(source, original)
        await redis.xdel(wire.DEAD_LETTER_KEY, entry_id)
        replayed += 1
    return replayed
