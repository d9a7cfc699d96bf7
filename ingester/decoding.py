"""The ingester's fast path for decoding stream entries; the reference lives in runbus.wire.

runbus.wire holds the contract and its readable decoder (entry by entry, field by field). This
module gives exactly that decoder's results, errors and messages, faster: entries in the
producers' field order are decoded by position, a stream's plainly valid metric and system
entries a column at a time (loops in C rather than Python), and whatever is not plainly valid
goes to the reference, which converts it ("NaN" to a float) or says why it is invalid.

`decode_stream` is the path in use: the fast one, unless RUNBUS_DECODER=reference (read once, at
import, through runbus.config.decoder) makes it the reference's. Tests run both with `use()`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from itertools import chain, repeat
from operator import itemgetter
from typing import Any, NamedTuple, cast

import orjson

from runbus import config, wire
from runbus.errors import InvalidEntry
from runbus.wire import INT64, MAX_DATA_BYTES, TS_MAX, TS_MIN, Event, FlatEntry

# Decodes the entries of one stream: in each entry's place its Event or the InvalidEntry saying why.
Decoder = Callable[[str, Iterable[FlatEntry]], list[Event | InvalidEntry]]
# The same, with the stream's Columns where it was decoded a column at a time.
ColumnsDecoder = Callable[[str, Iterable[FlatEntry]], "tuple[list[Event | InvalidEntry], Columns | None]"]
# A stream key's run and label, as text and as the bytes its entries hold.
KeyNames = tuple[str, str, bytes, bytes]

# The order producers write fields in (wire.XADD_MANY_SCRIPT): an entry in this order is decoded
# by position, without building a dict.
_NAMES = [b"v", b"kind", b"run", b"label", b"epoch", b"seq", b"ts", b"data"]
_NAMES_WITH_STEP = [b"v", b"kind", b"run", b"label", b"epoch", b"seq", b"ts", b"step", b"data"]
_WITH_STEP = len(_NAMES_WITH_STEP) * 2  # a metric entry with a step, flat: 18 items
_WITHOUT_STEP = len(_NAMES) * 2
# The same, sealed (ingester/fence.py checks the seal): a trailing `seal` field.
_SEALED_NAMES = [*_NAMES, wire.SEAL_FIELD]
_SEALED_NAMES_WITH_STEP = [*_NAMES_WITH_STEP, wire.SEAL_FIELD]
# The column shapes: (flat width, sealed) -> field order.
_COLUMN_ORDERS = {
    (_WITH_STEP, False): _NAMES_WITH_STEP,
    (_WITHOUT_STEP, False): _NAMES,
    (_WITH_STEP + 2, True): _SEALED_NAMES_WITH_STEP,
    (_WITHOUT_STEP + 2, True): _SEALED_NAMES,
}
# Below this many entries, decoding entry by entry costs no more than by columns.
COLUMNS_FROM = 8

_VERSION = wire.VERSION.encode()
_KIND_BY_BYTES = {kind.encode(): kind for kind in wire.KINDS}
_TALLIED = frozenset({b"metric", b"system"})  # kinds whose data is name -> number
_DICT = frozenset({dict})
_INT = frozenset({int})
_FLOAT = frozenset({float})
_NUMBER_TYPES = frozenset({float, int})
_EMPTY_NAME = b'""'
_KIND_CELL = itemgetter(3)  # an entry's kind, flat in the producers' order
# A NamedTuple's generated __new__ runs in Python; tuple.__new__ builds the same Event in C, at
# a third of the cost (the ingester makes one per entry).
_new_event = tuple.__new__


class Columns(NamedTuple):
    """A stream's entries of one shape decoded a column at a time: their Events, and the cells
    their seals cover as read (wire.SEALED_FIELDS: kind, epoch, seq, ts, step, data; a column of
    b"" for steps where they have none) with their seals, for the fence (ingester/fence.py) to
    check without reading the entries again; `epoch` is the one epoch they all hold, else None."""

    events: list[Event]
    sealed: tuple[list[bytes], ...]
    seals: list[bytes] | None  # None: the entries are not sealed
    epoch: int | None


def decode_stream_fast(key: str, flats: Iterable[FlatEntry]) -> list[Event | InvalidEntry]:
    """wire.decode_stream's results, errors and messages, faster."""
    return decode_with_columns_fast(key, flats)[0]


def decode_with_columns_fast(
    key: str, flats: Iterable[FlatEntry]
) -> tuple[list[Event | InvalidEntry], Columns | None]:
    """decode_stream_fast's results, and their Columns where the stream's entries were all of
    one shape and decoded a column at a time."""
    names = _key_names(key)
    flats = list(flats)
    if names is not None and len(flats) >= COLUMNS_FROM:
        decoded = _decoded_by_columns(key, names, flats)
        if decoded is not None:
            return decoded
    return _decode_each(key, names, flats), None


def _decode_with_reference(key: str, flats: Iterable[FlatEntry]) -> tuple[list[Event | InvalidEntry], None]:
    return wire.decode_stream(key, flats), None


def _unsealed(flat: FlatEntry) -> FlatEntry:
    """An entry without its trailing `seal` field, where the producers write it: the seal is the
    fence's (ingester/fence.py), not the decoder's, which ignores it as the reference does."""
    if flat and len(flat) > 2 and flat[-2] == wire.SEAL_FIELD:
        return flat[:-2]
    return flat


DECODERS: dict[str, Decoder] = {"fast": decode_stream_fast, "reference": wire.decode_stream}
# The same, with the Columns of a stream decoded a column at a time (the reference: never).
_WITH_COLUMNS: dict[str, ColumnsDecoder] = {
    "fast": decode_with_columns_fast,
    "reference": _decode_with_reference,
}
decoder_in_use = config.decoder()
decode_stream: Decoder = DECODERS[decoder_in_use]
decode_with_columns: ColumnsDecoder = _WITH_COLUMNS[decoder_in_use]


def use(name: str) -> None:
    """Decode with the path named `name`, 'fast' or 'reference', from now on."""
    global decode_stream, decode_with_columns, decoder_in_use
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}: use one of {', '.join(DECODERS)}")
    decode_stream, decode_with_columns, decoder_in_use = DECODERS[name], _WITH_COLUMNS[name], name


@functools.lru_cache(maxsize=65536)
def _key_names(key: str) -> KeyNames | None:
    names = wire.parse_stream_key(key)
    return None if names is None else (*names, names[0].encode(), names[1].encode())


def _decode_each(key: str, names: KeyNames | None, flats: Sequence[FlatEntry]) -> list[Event | InvalidEntry]:
    """Entry by entry: by position when written in the producers' order, else from a dict; the
    reference for an entry that is not plainly valid."""
    decoded: list[Event | InvalidEntry] = []
    for flat in map(_unsealed, flats):
        event, in_order = None, False
        if names is not None and flat:
            order = flat[0::2]
            if order == _NAMES_WITH_STEP:
                v, kind, run, label, epoch, seq, ts, step, data = flat[1::2]
                event, in_order = _decode_values(names, v, kind, run, label, epoch, seq, ts, data, step), True
            elif order == _NAMES:
                v, kind, run, label, epoch, seq, ts, data = flat[1::2]
                event, in_order = _decode_values(names, v, kind, run, label, epoch, seq, ts, data, None), True
        decoded.append(event if event is not None else _decode_by_name(key, flat, in_order))
    return decoded


def _decode_by_name(key: str, flat: FlatEntry, in_order: bool) -> Event | InvalidEntry:
    """An entry from a dict of its fields: if it is plainly valid (and was not already found not
    to be, `in_order`), quickly; else by the reference, which converts it or says why not."""
    fields = wire.fields_dict(flat)
    event = None if in_order else _decode_plain(key, fields)
    return event if event is not None else _decode_by_reference(key, fields)


def _decode_by_reference(key: str, fields: dict[bytes, bytes]) -> Event | InvalidEntry:
    try:
        return wire.decode_entry(key, fields)
    except InvalidEntry as exc:
        return exc


def _decode_plain(key: str, fields: dict[bytes, bytes]) -> Event | None:
    """The common case, quickly: an entry that is valid as it stands. None sends the entry to
    the reference, which finds the reason (or the conversion, such as "NaN" to a float)."""
    names = _key_names(key)
    if names is None:
        return None
    try:
        v, kind, run, label, epoch, seq, ts, data = [fields[name] for name in _NAMES]
    except KeyError:
        return None
    return _decode_values(names, v, kind, run, label, epoch, seq, ts, data, fields.get(b"step"))


def _decode_values(
    names: KeyNames,
    v: bytes,
    kind_raw: bytes,
    run: bytes,
    label: bytes,
    epoch_raw: bytes,
    seq_raw: bytes,
    ts_raw: bytes,
    raw: bytes,
    step_raw: bytes | None,
) -> Event | None:
    """An entry's Event, checked by the rules wire.decode_entry applies; None if it is not
    plainly valid."""
    kind = _KIND_BY_BYTES.get(kind_raw)
    if kind is None or v != _VERSION or run != names[2] or label != names[3] or len(raw) > MAX_DATA_BYTES:
        return None
    try:
        epoch, seq, ts = int(epoch_raw), int(seq_raw), float(ts_raw)
        step = None if step_raw is None else int(step_raw)
        data = orjson.loads(raw)
    except ValueError:  # orjson.JSONDecodeError is a ValueError
        return None
    if not (0 < epoch < 2**63 and 0 < seq < 2**63 and TS_MIN <= ts < TS_MAX) or type(data) is not dict:
        return None
    if step is not None and (kind != "metric" or not 0 <= step < 2**63):
        return None
    data = _plain_data(kind, raw, data)
    return None if data is None else _new_event(Event, (names[0], names[1], kind, epoch, seq, ts, data, step))


def _plain_data(kind: str, raw: bytes, data: dict[str, Any]) -> dict[str, Any] | None:
    """`data` (decoded from `raw`) if it is valid for `kind` as it stands, else None."""
    if kind != "metric" and kind != "system":
        try:
            return wire.check_data(kind, data)
        except InvalidEntry:
            return None
    if not data:
        return None if kind == "metric" else data
    values = data.values()
    if not _FLOAT.issuperset(map(type, values)) and not _plain_numbers(values):
        return None
    # Keys are no longer than the JSON holding them, and an empty key is written `""`.
    if (len(raw) > 256 or b'""' in raw) and not 0 < min(map(len, data)) <= max(map(len, data)) <= 256:
        return None
    return data


def _plain_numbers(values: Collection[object]) -> bool:
    """Whether `values` are all floats and 64-bit integers, the metric values stored as they
    stand. Whole-collection checks in C (map, issuperset): this is the per-value hot path."""
    if _FLOAT.issuperset(map(type, values)):
        return True
    return _NUMBER_TYPES.issuperset(map(type, values)) and all(
        value in INT64 for value in values if type(value) is int
    )


def _decoded_by_columns(
    key: str, names: KeyNames, flats: list[FlatEntry]
) -> tuple[list[Event | InvalidEntry], Columns | None] | None:
    """Many entries decoded a column at a time, for the common case of plainly valid entries in
    the producers' field order: their results, with their Columns where the entries are all of
    one shape.

    Metrics at a step go by columns, and so do metrics and system figures without one; logs,
    start, heartbeat, finish and meta events go one by one. None when an entry of the first two kinds
    is not plainly valid: then every entry goes one by one, and the reason is found.
    """
    if None in flats:  # a deleted entry, among pending entries
        return None
    entries = cast("list[list[bytes]]", flats)
    order = _uniform_order(entries)
    if order is not None:  # the usual stream: sealed metrics at every step
        columns = _decode_columns(names, entries, order)
        return None if columns is None else (cast("list[Event | InvalidEntry]", columns.events), columns)
    shapes = [_shape(flat, len(flat)) for flat in entries]
    decoded: dict[tuple[int, bool] | None, Iterator[Event | InvalidEntry]] = {}
    for shape, order in _COLUMN_ORDERS.items():
        mine = [flat for flat, its in zip(entries, shapes, strict=True) if its == shape]
        by_columns = _decode_columns(names, mine, order) if mine else None
        if mine and by_columns is None:
            return None
        decoded[shape] = iter(by_columns.events if by_columns is not None else ())
    others = [flat for flat, its in zip(entries, shapes, strict=True) if its is None]
    decoded[None] = iter(_decode_each(key, names, others))
    return [next(decoded[shape]) for shape in shapes], None


def _uniform_order(entries: list[list[bytes]]) -> list[bytes] | None:
    """The field order of entries that are all of one column shape (_shape), else None."""
    width = len(entries[0])
    order = _COLUMN_ORDERS.get((width, entries[0][-2] == wire.SEAL_FIELD))
    if order is None or list(map(len, entries)).count(width) != len(entries):
        return None
    if b"step" not in order and sum(map(_TALLIED.__contains__, map(_KIND_CELL, entries))) != len(entries):
        return None  # stepless, but not all tallies: by shapes (logs and the like one by one)
    return order


def _shape(flat: list[bytes], width: int) -> tuple[int, bool] | None:
    """The column shape (width, sealed) an entry goes by, or None for one by one: a metric with
    a step, or a metric or system figure without one."""
    shape = (width, flat[-2] == wire.SEAL_FIELD)
    order = _COLUMN_ORDERS.get(shape)
    if order is None or (b"step" not in order and flat[3] not in _TALLIED):
        return None
    return shape


class _Places(NamedTuple):
    """The entries' epochs, seqs, timestamps and steps (None without), and their cells as read."""

    epochs: Iterable[int]
    seqs: list[int]
    stamps: list[float]
    steps: list[int] | None
    cells: tuple[list[bytes], list[bytes], list[bytes], list[bytes]]  # b"" for each step where none
    epoch: int | None  # the one epoch all hold, else None


def _decode_columns(names: KeyNames, flats: list[list[bytes]], order: list[bytes]) -> Columns | None:
    """Entries that all hold `order`'s fields, checked by the rules _decode_values applies
    entry by entry: their Columns, or None if any of them is not plainly valid."""
    count, width = len(flats), len(order) * 2
    cells = list(chain.from_iterable(flats))
    if not _hold_fields(cells, names, order, count):
        return None
    with_step = b"step" in order
    kinds_raw = cells[3::width]
    kinds = _kinds_column(kinds_raw, not with_step, count)
    raws = cells[2 * order.index(b"data") + 1 :: width]
    longest = max(map(len, raws))
    if kinds is None or longest > MAX_DATA_BYTES:
        return None
    places = _places_columns(cells, width, with_step, count)
    datas = None if places is None else _data_column(raws, longest)
    if places is None or datas is None:
        return None
    at_steps: Iterable[int | None] = repeat(None, count) if places.steps is None else places.steps
    rows = zip(
        repeat(names[0]),
        repeat(names[1]),
        kinds,
        places.epochs,
        places.seqs,
        places.stamps,
        datas,
        at_steps,
        strict=False,
    )
    events = list(map(_new_event, repeat(Event, count), rows))
    sealed = (kinds_raw, *places.cells, raws)
    seals = cells[width - 1 :: width] if order[-1] == wire.SEAL_FIELD else None
    return Columns(events, sealed, seals, places.epoch)


def _hold_fields(cells: list[bytes], names: KeyNames, order: list[bytes], count: int) -> bool:
    """Whether every one of `count` entries (flat, one after another in `cells`) holds `order`'s
    fields, this wire version, and its stream's run and label."""
    width = len(order) * 2
    return (
        cells[0::2] == order * count  # every name, in one comparison
        and cells[1::width].count(_VERSION) == count
        and cells[5::width].count(names[2]) == count
        and cells[7::width].count(names[3]) == count
    )


def _kinds_column(kinds_raw: list[bytes], stepless: bool, count: int) -> Iterable[str] | None:
    """The entries' kinds: all metrics, or (without steps) metrics and system figures; else None."""
    metrics = kinds_raw.count(b"metric")
    if metrics == count:
        return repeat("metric", count)
    if stepless and metrics + kinds_raw.count(b"system") == count:
        return map(_KIND_BY_BYTES.__getitem__, kinds_raw)
    return None  # a step on a non-metric, or log, start, heartbeat, finish and meta events


def _places_columns(cells: list[bytes], width: int, with_step: bool, count: int) -> _Places | None:
    """The entries' places, each in range, else None."""
    epochs_raw, seqs_raw, stamps_raw = cells[9::width], cells[11::width], cells[13::width]
    steps_raw = cells[15::width] if with_step else None
    epoch = _one_number(epochs_raw)  # the usual stream: one epoch, parsed once
    epochs = [epoch] if epoch is not None else _numbers(epochs_raw, _INT)
    seqs, stamps = _numbers(seqs_raw, _INT), _numbers(stamps_raw, _FLOAT)
    steps = _numbers(steps_raw, _INT) if steps_raw is not None else None
    if epochs is None or seqs is None or stamps is None or (with_step and steps is None):
        return None
    if not _in_range(epochs, seqs, stamps, steps):
        return None
    at_epochs = repeat(epoch, count) if epoch is not None else epochs
    read = (epochs_raw, seqs_raw, stamps_raw, [b""] * count if steps_raw is None else steps_raw)
    return _Places(at_epochs, seqs, stamps, steps, read, epoch)


def _in_range(epochs: list[int], seqs: list[int], stamps: list[float], steps: list[int] | None) -> bool:
    """Whether every epoch, seq, timestamp and step is in its range."""
    return (
        min(epochs) > 0
        and max(epochs) < 2**63
        and min(seqs) > 0
        and max(seqs) < 2**63
        and math.isfinite(sum(stamps))  # inf or NaN if any is (min and max can miss a NaN)
        and min(stamps) >= TS_MIN
        and max(stamps) < TS_MAX
        and (steps is None or (min(steps) >= 0 and max(steps) < 2**63))
    )


def _one_number(column: list[bytes]) -> int | None:
    """The integer every cell of `column` holds, where they all hold the same bytes; else None."""
    if column.count(column[0]) != len(column):
        return None
    numbers = _numbers(column[:1], _INT)
    return None if numbers is None else numbers[0]


def _data_column(raws: list[bytes], longest: int) -> list[dict[str, Any]] | None:
    """The entries' data, if every one is an object of 1 to 256-character names to floats and
    64-bit integers (at least one); else None. `longest`: the longest of `raws`."""
    try:
        datas = list(map(orjson.loads, raws))
    except orjson.JSONDecodeError:
        return None
    # An empty metric is invalid; an empty system event goes one by one.
    if not (_DICT.issuperset(map(type, datas)) and all(datas)):
        return None
    if not _FLOAT.issuperset(map(type, chain.from_iterable(map(dict.values, datas)))) and not _plain_numbers(
        list(chain.from_iterable(map(dict.values, datas)))
    ):
        return None
    # Keys are no longer than the JSON holding them, and an empty key is written `""`: names are
    # looked at one by one only where a data may hold a longer or an empty one.
    if longest <= 256 and _EMPTY_NAME not in b"".join(raws):
        return datas
    lengths = list(map(len, chain.from_iterable(datas)))
    return datas if min(lengths) > 0 and max(lengths) <= 256 else None


def _numbers(column: list[bytes], types: frozenset[type]) -> list[Any] | None:
    """A column of numbers in one orjson call, as a JSON array; None unless it holds exactly one
    number of `types` per cell (a cell holding a comma, bracket or quote cannot pass for one)."""
    try:
        numbers = orjson.loads(b"[" + b",".join(column) + b"]")
    except orjson.JSONDecodeError:
        return None
    return numbers if len(numbers) == len(column) and types.issuperset(map(type, numbers)) else None
