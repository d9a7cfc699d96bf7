"""The dead-letter stream: what goes in (an entry with its reason), listing, and replay."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from runbus import wire
from runbus.ingester.discovery import is_event_stream
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


# How long one replay holds its claim on a dead letter: another replay leaves it alone meanwhile.
REPLAY_CLAIM_S = 300


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", "replace")


def _deliveries(value: bytes | None) -> int:
    try:
        return int(value or 1)
    except ValueError:  # a dead letter written by hand
        return 1


async def dead_letters(redis: AsyncClient, count: int | None = None) -> list[DeadLetter]:
    """The dead letters, oldest first."""
    entries = stream_entries(await redis.xrange(wire.DEAD_LETTER_KEY, count=count))
    return [
        DeadLetter(
            dead_id=entry_id.decode(),
            reason=_text(fields.get(b"reason")),
            source_stream=_text(fields.get(b"source_stream")),
            source_id=_text(fields.get(b"source_id")),
            deliveries=_deliveries(fields.get(b"deliveries")),
            fields={_text(k): _text(v) for k, v in original_fields(fields).items()},
        )
        for entry_id, fields in entries
    ]


@dataclass
class Replay:
    """What `replay` did: how many dead letters it put back, which it left and why."""

    replayed: int = 0
    taken: int = 0  # claimed by another replay running at the same time
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (dead id, why)


def unreplayable(fields: Mapping[bytes, bytes]) -> str | None:
    """Why a dead letter cannot go back on its stream, or None if it can."""
    source = fields.get(b"source_stream")
    if not source:
        return "it names no source stream"
    try:
        key = source.decode()
    except UnicodeDecodeError:
        return "its source stream is not UTF-8"
    if not is_event_stream(key):
        return f"its source {key[:200]!r} is not a runbus stream"
    if not original_fields(fields):
        return "it holds no fields of the original entry"
    return None


async def replay(redis: AsyncClient) -> Replay:
    """Put every dead letter back on its source stream as a new entry, then drop it from
    runbus:dead; one that cannot go back is left there, with the reason.

    Each is first claimed (wire.replay_claim_key, SET NX with a TTL), so replays running at once
    never put one back twice; a crash between putting it back and dropping it gives a duplicate
    once the claim lapses (stored once, by identity), never a loss.
    """
    done, token = Replay(), secrets.token_hex(8)
    for entry_id, fields in stream_entries(await redis.xrange(wire.DEAD_LETTER_KEY)):
        dead_id = entry_id.decode()
        why = unreplayable(fields)
        if why is not None:
            done.skipped.append((dead_id, why))
            continue
        claim = wire.replay_claim_key(dead_id)
        if not await redis.set(claim, token, nx=True, ex=REPLAY_CLAIM_S):
            done.taken += 1
            continue
        if not await redis.xrange(wire.DEAD_LETTER_KEY, entry_id, entry_id):
            done.taken += 1  # put back by a replay that listed it before us
            continue
        # A copy typed as redis-py's xadd wants it: a dict of any encodable types (invariant).
        original: dict[FieldT, EncodableT] = dict(original_fields(fields).items())
        try:
            await redis.xadd(fields[b"source_stream"], original)
        except ResponseError as exc:  # the key holds another type now, or the fields are refused
            done.skipped.append((dead_id, f"its source stream refused it: {exc}"))
            await redis.delete(claim)
            continue
        await redis.xdel(wire.DEAD_LETTER_KEY, entry_id)
        done.replayed += 1
    return done
