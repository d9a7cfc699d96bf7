"""The runbus wire contract v1: key names, entry fields, kinds and their validation.

Both sides import this module and nothing else spells a key name; docs/wire.md is its prose twin.
"""

from __future__ import annotations

import functools
import math
import re
import secrets
import time
from collections.abc import Iterable
from itertools import chain, repeat
from typing import Any, NamedTuple

import orjson

from runbus.errors import InvalidEntry, InvalidName

VERSION = "1"
PREFIX = "runbus"
DEFAULT_GROUP = "runbus"
DEAD_LETTER_KEY = f"{PREFIX}:dead"
# Every stream a producer creates is announced here (a set of stream keys), so ingesters find
# it within a poll instead of a keyspace scan.
REGISTRY_KEY = f"{PREFIX}:streams"

KINDS = frozenset({"start", "metric", "log", "system", "heartbeat", "finish"})
LOG_STREAMS = frozenset({"stdout", "stderr", "logging"})
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME = re.compile(NAME_PATTERN)
_STREAM_KEY = re.compile(rf"{PREFIX}:\{{({NAME_PATTERN})\}}:({NAME_PATTERN})")

# Biggest `data` field accepted, encoded. A log line or config larger than this is an error at
# the producer and a dead letter at the ingester, never a silent truncation.
MAX_DATA_BYTES = 1 << 20

NON_FINITE_TO_WIRE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
WIRE_TO_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def check_name(what: str, name: object) -> str:
    """Return `name` if it is a valid run id or label, else raise InvalidName saying why."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidName(
            f"invalid {what} {name!r}: must match {NAME_PATTERN} "
            "(letters, digits, '.', '_', '-'; starting with a letter or digit; at most 128)"
        )
    return name


def new_run_id() -> str:
    """A fresh run id, for a single process that was given none (and for the demo)."""
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def stream_key(run: str, label: str) -> str:
    """The stream of one run and label; `{run}` is a Redis Cluster hash tag."""
    return f"{PREFIX}:{{{run}}}:{label}"


def epoch_key(run: str, label: str) -> str:
    """The counter a producer INCRs at init to take its label's epoch."""
    return f"{PREFIX}:{{{run}}}:epoch:{label}"


def primary_key(run: str) -> str:
    """Holds the label of the run's live primary (with a TTL its heartbeats refresh)."""
    return f"{PREFIX}:{{{run}}}:meta:primary"


def lease_key(run: str, label: str) -> str:
    """A hash naming the one live process that writes this label (token, host, pid, …), with a
    TTL its heartbeats renew; deleted when it finishes."""
    return f"{PREFIX}:{{{run}}}:lease:{label}"


def finished_key(run: str) -> str:
    """Set when the run's primary finishes (JSON: label, exit code, time), kept FINISHED_TTL: a
    new job naming the run finds it there."""
    return f"{PREFIX}:{{{run}}}:meta:finished"


def created_key(run: str) -> str:
    """The Redis time (ms) when a first label of the run took an epoch: the run exists."""
    return f"{PREFIX}:{{{run}}}:meta:created"


# How long the finished marker is kept: a re-used run id is recognised for this long.
FINISHED_TTL = 30 * 24 * 3600


def parse_stream_key(key: str) -> tuple[str, str] | None:
    """(run, label) of a stream key, or None if `key` is not a runbus event stream."""
    match = _STREAM_KEY.fullmatch(key)
    return (match.group(1), match.group(2)) if match else None


def scan_pattern() -> str:
    """A SCAN MATCH pattern covering every event stream (also other keys: parse to filter)."""
    return f"{PREFIX}:{{*}}:*"


def finite_to_wire(value: float) -> float | str:
    """A float as the wire writes it: non-finite values become 'NaN', 'Infinity', '-Infinity'."""
    if math.isfinite(value):
        return value
    return NON_FINITE_TO_WIRE[repr(value)]


INT64 = range(-(2**63), 2**63)
_NUMBER_TYPES = frozenset({float, int})
_FLOAT = frozenset({float})


def number_from_wire(value: object) -> float | int:
    """A metric value as read from the wire; raises InvalidEntry if it is no number.

    Integers beyond 64 bits (JSON allows them) come back as floats, as the producer sends them.
    """
    if type(value) is float:
        return value
    if type(value) is int:
        return value if value in INT64 else float(value)
    if isinstance(value, str) and value in WIRE_TO_NON_FINITE:
        return WIRE_TO_NON_FINITE[value]
    raise InvalidEntry(f"value {value!r} is not a number")


class Event(NamedTuple):
    """One decoded, validated stream entry (a NamedTuple: an ingester makes one per entry, and
    a frozen dataclass costs several times more to build)."""

    run: str
    label: str
    kind: str
    epoch: int
    seq: int
    ts: float
    data: dict[str, Any]
    step: int | None = None

    @property
    def position(self) -> tuple[int, int]:
        """Where this event stands in its label's history: (epoch, seq)."""
        return (self.epoch, self.seq)


# A NamedTuple's generated __new__ runs in Python; tuple.__new__ builds the same Event in C, at
# a third of the cost (the ingester makes one per entry).
_new_event = tuple.__new__


def encode_fields(
    kind: str, run: str, label: str, epoch: int, seq: int, ts: float, data: bytes, step: int | None
) -> dict[str, bytes | str | int | float]:
    """The flat XADD fields of one event, in the order producers write them (ingesters decode
    that order fastest); `data` is already JSON-encoded."""
    fields: dict[str, bytes | str | int | float] = {
        "v": VERSION,
        "kind": kind,
        "run": run,
        "label": label,
        "epoch": epoch,
        "seq": seq,
        "ts": repr(ts),
    }
    if step is not None:
        fields["step"] = step
    fields["data"] = data
    return fields


# Adds many entries to one stream in one round trip: KEYS[1] is the stream, ARGV is the version,
# run, label, then (kind, epoch, seq, ts, step or "", data) per entry. One call replaces a
# pipeline of XADDs, which costs the producer several times more CPU per event in redis-py.
XADD_MANY_SCRIPT = """
local key, version, run, label = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV, 6 do
  if ARGV[i + 4] == '' then
    redis.call('XADD', key, '*', 'v', version, 'kind', ARGV[i], 'run', run, 'label', label,
      'epoch', ARGV[i + 1], 'seq', ARGV[i + 2], 'ts', ARGV[i + 3], 'data', ARGV[i + 5])
  else
    redis.call('XADD', key, '*', 'v', version, 'kind', ARGV[i], 'run', run, 'label', label,
      'epoch', ARGV[i + 1], 'seq', ARGV[i + 2], 'ts', ARGV[i + 3], 'step', ARGV[i + 4],
      'data', ARGV[i + 5])
  end
end
return (#ARGV - 3) / 6
"""


def xadd_many_args(run: str, label: str, entries) -> list:
    """ARGV for XADD_MANY_SCRIPT from (kind, epoch, seq, ts, step, data) tuples."""
    args: list = [VERSION, run, label]
    for kind, epoch, seq, ts, step, data in entries:
        args += (kind, epoch, seq, repr(ts), "" if step is None else step, data)
    return args


def _text(fields: dict[bytes, bytes], name: str) -> str:
    raw = fields.get(name.encode())
    if raw is None:
        raise InvalidEntry(f"missing field {name!r}")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise InvalidEntry(f"field {name!r} is not UTF-8") from None


def _int(fields: dict[bytes, bytes], name: str, minimum: int) -> int:
    text = _text(fields, name)
    try:
        value = int(text)
    except ValueError:
        raise InvalidEntry(f"field {name!r} is not an integer: {text[:40]!r}") from None
    if value < minimum or value not in INT64:
        raise InvalidEntry(f"field {name!r} must be >= {minimum} and fit in 64 bits, got {text[:40]}")
    return value


def _check_data(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    if kind == "metric":
        if not data:
            raise InvalidEntry("metric data is empty")
        return {_metric_key(k): _metric_value(k, v) for k, v in data.items()}
    if kind == "system":
        return {_metric_key(k): _metric_value(k, v) for k, v in data.items()}
    if kind == "log":
        if data.get("stream") not in LOG_STREAMS:
            raise InvalidEntry(f"log stream must be one of {sorted(LOG_STREAMS)}")
        if not isinstance(data.get("text"), str):
            raise InvalidEntry("log text must be a string")
        level = data.get("level", "INFO")
        if not isinstance(level, str):
            raise InvalidEntry("log level must be a string")
        return data
    if kind == "start":
        if not isinstance(data.get("primary"), bool):
            raise InvalidEntry("start data needs a boolean 'primary'")
        if not isinstance(data.get("config", {}), dict):
            raise InvalidEntry("start config must be an object")
        return data
    if kind == "finish":
        exit_code = data.get("exit_code")
        if type(exit_code) is not int:
            raise InvalidEntry("finish data needs an integer 'exit_code'")
        return data
    return data  # heartbeat: any object (drop counters and the like ride along)


def _metric_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > 256:
        raise InvalidEntry(f"metric name {key!r} must be a non-empty string of at most 256")
    return key


def _metric_value(key: str, value: object) -> float | int:
    if type(value) is bool:
        return int(value)
    try:
        return number_from_wire(value)
    except InvalidEntry:
        raise InvalidEntry(f"metric {key!r}: value {value!r} is not a number") from None


_VERSION_BYTES = VERSION.encode()
_KIND_BY_BYTES = {kind.encode(): kind for kind in KINDS}


@functools.lru_cache(maxsize=65536)
def _key_names(key: str) -> tuple[str, str, bytes, bytes] | None:
    names = parse_stream_key(key)
    return None if names is None else (*names, names[0].encode(), names[1].encode())


def _decode_plain(key: str, fields: dict[bytes, bytes]) -> Event | None:
    """The common case, quickly: an entry that is valid as it stands. None sends the entry to
    the checked path, which finds the reason (or the conversion, such as "NaN" to a float)."""
    names = _key_names(key)
    try:
        values = [fields[name] for name in _NAMES]
    except KeyError:
        return None
    return None if names is None else _decode_values(names, *values, fields.get(b"step"))


# The order producers write fields in (XADD_MANY_SCRIPT): a reply's flat list in this order is
# decoded by position, without building a dict per entry.
_NAMES = [b"v", b"kind", b"run", b"label", b"epoch", b"seq", b"ts", b"data"]
_NAMES_WITH_STEP = [b"v", b"kind", b"run", b"label", b"epoch", b"seq", b"ts", b"step", b"data"]


def decode_flat(key: str, flat: list[bytes] | None) -> Event:
    """decode_entry for an entry as a raw reply holds it: [name, value, name, value, ...]."""
    (decoded,) = decode_stream(key, [flat])
    if isinstance(decoded, InvalidEntry):
        raise decoded
    return decoded


def decode_stream(key: str, flats: Iterable[list[bytes] | None]) -> list[Event | InvalidEntry]:
    """decode_flat for many entries of one stream, its names looked up once: in each entry's
    place its Event, or the InvalidEntry saying why it breaks the contract."""
    names = _key_names(key)
    flats = list(flats)
    if names is not None and len(flats) >= COLUMNS_FROM:
        decoded = _decode_by_columns(key, names, flats)
        if decoded is not None:
            return decoded
    return _decode_each(key, names, flats)


def _decode_each(
    key: str, names: tuple[str, str, bytes, bytes] | None, flats: list[list[bytes] | None]
) -> list[Event | InvalidEntry]:
    decoded: list[Event | InvalidEntry] = []
    for flat in flats:
        event, in_order = None, False
        if names is not None and flat:
            order = flat[0::2]
            if order == _NAMES_WITH_STEP:
                v, kind, run, label, epoch, seq, ts, step, data = flat[1::2]
                event, in_order = _decode_values(names, v, kind, run, label, epoch, seq, ts, data, step), True
            elif order == _NAMES:
                event, in_order = _decode_values(names, *flat[1::2], None), True
        if event is None:
            fields = fields_dict(flat)
            if not in_order:  # written in another field order (by hand, another client)
                event = _decode_plain(key, fields)
            if event is None:
                try:
                    event = decode_checked(key, fields)
                except InvalidEntry as exc:
                    event = exc
        decoded.append(event)
    return decoded


# Below this many entries, decoding entry by entry costs no more than by columns.
COLUMNS_FROM = 8
_WITH_STEP = len(_NAMES_WITH_STEP) * 2  # a metric entry with a step, flat: 18 items
_WITHOUT_STEP = len(_NAMES) * 2
_DICT = frozenset({dict})
_TALLIED = frozenset({b"metric", b"system"})  # kinds whose data is name -> number
_INT = frozenset({int})


def _decode_by_columns(
    key: str, names: tuple[str, str, bytes, bytes], flats: list[list[bytes] | None]
) -> list[Event | InvalidEntry] | None:
    """Many entries decoded a column at a time (slices, map, count: loops in C rather than
    Python), for the common case of plainly valid entries in the producers' field order.

    Metrics at a step go by columns, and so do metrics and system figures without one; logs,
    start, heartbeat and finish events go one by one. None when an entry of the first two kinds
    is not plainly valid: then every entry goes one by one, and the reason is found.
    """
    try:
        widths = list(map(len, flats))
    except TypeError:  # a deleted entry's None, among pending entries
        return None
    if widths.count(_WITH_STEP) == len(flats):  # the usual stream: metrics at every step
        return _decode_columns(names, flats, _NAMES_WITH_STEP)
    shapes = [
        w if w == _WITH_STEP or (w == _WITHOUT_STEP and flat[3] in _TALLIED) else 0
        for flat, w in zip(flats, widths, strict=True)
    ]
    decoded = {}
    for shape, order in ((_WITH_STEP, _NAMES_WITH_STEP), (_WITHOUT_STEP, _NAMES)):
        mine = [flat for flat, its in zip(flats, shapes, strict=True) if its == shape]
        by_columns = _decode_columns(names, mine, order) if mine else []
        if by_columns is None:
            return None
        decoded[shape] = iter(by_columns)
    decoded[0] = iter(
        _decode_each(key, names, [flat for flat, its in zip(flats, shapes, strict=True) if its == 0])
    )
    return [next(decoded[shape]) for shape in shapes]


def _decode_columns(
    names: tuple[str, str, bytes, bytes], flats: list[list[bytes]], order: list[bytes]
) -> list[Event] | None:
    """Entries that all hold `order`'s fields, checked by the rules _decode_values applies
    entry by entry: their Events, or None if any of them is not plainly valid."""
    count, width = len(flats), len(order) * 2
    cells = list(chain.from_iterable(flats))
    for at, name in enumerate(order):
        if cells[2 * at :: width].count(name) != count:
            return None
    if (
        cells[1::width].count(_VERSION_BYTES) != count
        or cells[5::width].count(names[2]) != count
        or cells[7::width].count(names[3]) != count
    ):
        return None
    kinds_raw = cells[3::width]
    metrics = kinds_raw.count(b"metric")
    if metrics == count:
        kinds = repeat("metric", count)
    elif order is _NAMES and metrics + kinds_raw.count(b"system") == count:
        kinds = map(_KIND_BY_BYTES.__getitem__, kinds_raw)
    else:
        return None  # a step on a non-metric, or log, start, heartbeat and finish events
    raws = cells[width - 1 :: width]
    if max(map(len, raws)) > MAX_DATA_BYTES:
        return None
    epochs, seqs = _numbers(cells[9::width], _INT), _numbers(cells[11::width], _INT)
    stamps = _numbers(cells[13::width], _FLOAT)
    steps = _numbers(cells[15::width], _INT) if order is _NAMES_WITH_STEP else repeat(None, count)
    if epochs is None or seqs is None or stamps is None or steps is None:
        return None
    try:
        datas = list(map(orjson.loads, raws))
    except orjson.JSONDecodeError:
        return None
    if not (
        min(epochs) > 0
        and max(epochs) < 2**63
        and min(seqs) > 0
        and max(seqs) < 2**63
        and math.isfinite(sum(stamps))  # inf or NaN if any is; a finite sum that overflows errs safe
        and (order is _NAMES or (min(steps) >= 0 and max(steps) < 2**63))
        and _DICT.issuperset(map(type, datas))
        and all(datas)  # an empty metric is invalid; an empty system event takes the slow path
    ):
        return None
    values = list(chain.from_iterable(map(dict.values, datas)))
    if not _FLOAT.issuperset(map(type, values)):
        if not _NUMBER_TYPES.issuperset(map(type, values)):
            return None  # bools, "NaN" and the like: converted (or refused) entry by entry
        if not all(v in INT64 for v in values if type(v) is int):
            return None
    lengths = list(map(len, chain.from_iterable(datas)))
    if not (min(lengths) > 0 and max(lengths) <= 256):
        return None
    run, label = names[0], names[1]
    fields = zip(repeat(run), repeat(label), kinds, epochs, seqs, stamps, datas, steps, strict=False)
    return list(map(_new_event, repeat(Event, count), fields))


def fields_dict(flat: list[bytes] | None) -> dict[bytes, bytes]:
    """A reply's flat [name, value, ...] list as a dict (a deleted entry's None as {})."""
    if not flat:
        return {}
    it = iter(flat)
    return dict(zip(it, it, strict=False))


def _decode_values(
    names: tuple[str, str, bytes, bytes],
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
    kind = _KIND_BY_BYTES.get(kind_raw)
    if kind is None or v != _VERSION_BYTES or run != names[2] or label != names[3]:
        return None
    if len(raw) > MAX_DATA_BYTES:
        return None
    try:
        epoch, seq, ts = int(epoch_raw), int(seq_raw), float(ts_raw)
        step = None if step_raw is None else int(step_raw)
        data = orjson.loads(raw)
    except ValueError:  # orjson.JSONDecodeError is a ValueError
        return None
    if not (0 < epoch < 2**63 and 0 < seq < 2**63 and math.isfinite(ts)) or type(data) is not dict:
        return None
    if step is not None and (kind != "metric" or not 0 <= step < 2**63):
        return None
    if kind == "metric" or kind == "system":
        if not data and kind == "metric":
            return None
        # Whole-dict checks in C (map, issuperset): this is the ingester's per-value hot path.
        values = data.values()
        if not _FLOAT.issuperset(map(type, values)):
            if not _NUMBER_TYPES.issuperset(map(type, values)):
                return None
            if not all(v in INT64 for v in values if type(v) is int):
                return None
        # Keys are no longer than the JSON holding them, and an empty key is written `""`.
        if (
            (len(raw) > 256 or b'""' in raw)
            and data
            and not 0 < min(map(len, data)) <= max(map(len, data)) <= 256
        ):
            return None
    else:
        try:
            data = _check_data(kind, data)
        except InvalidEntry:
            return None
    return _new_event(Event, (names[0], names[1], kind, epoch, seq, ts, data, step))


def _numbers(column: list[bytes], types: frozenset[type]) -> list | None:
    """A column of numbers in one orjson call, as a JSON array; None unless it holds exactly one
    number of `types` per cell (a cell holding a comma, bracket or quote cannot pass for one)."""
    try:
        numbers = orjson.loads(b"[" + b",".join(column) + b"]")
    except orjson.JSONDecodeError:
        return None
    return numbers if len(numbers) == len(column) and types.issuperset(map(type, numbers)) else None


def decode_entry(key: str, fields: dict[bytes, bytes]) -> Event:
    """Validate one raw stream entry read from `key`; raises InvalidEntry with the reason."""
    event = _decode_plain(key, fields)
    return event if event is not None else decode_checked(key, fields)


def decode_checked(key: str, fields: dict[bytes, bytes]) -> Event:
    """decode_entry, field by field: slower, and says exactly what is wrong."""
    names = parse_stream_key(key)
    if names is None:
        raise InvalidEntry(f"key {key!r} is not a runbus stream")
    version = _text(fields, "v")
    if version != VERSION:
        raise InvalidEntry(f"unknown wire version {version[:16]!r}")
    kind = _text(fields, "kind")
    if kind not in KINDS:
        raise InvalidEntry(f"unknown kind {kind[:32]!r}")
    run, label = _text(fields, "run"), _text(fields, "label")
    if (run, label) != names:
        raise InvalidEntry(f"run/label {run[:140]!r}/{label[:140]!r} do not match key {key!r}")
    epoch, seq = _int(fields, "epoch", 1), _int(fields, "seq", 1)
    ts_text = _text(fields, "ts")
    try:
        ts = float(ts_text)
    except ValueError:
        raise InvalidEntry(f"field 'ts' is not a number: {ts_text[:40]!r}") from None
    if not math.isfinite(ts):
        raise InvalidEntry("field 'ts' must be finite")
    step = None
    if b"step" in fields:
        if kind != "metric":
            raise InvalidEntry(f"field 'step' is only for metric events, not {kind}")
        step = _int(fields, "step", 0)
    raw = fields.get(b"data")
    if raw is None:
        raise InvalidEntry("missing field 'data'")
    if len(raw) > MAX_DATA_BYTES:
        raise InvalidEntry(f"data is {len(raw)} bytes, over the limit of {MAX_DATA_BYTES}")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidEntry(f"data is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidEntry("data must be a JSON object")
    return Event(run, label, kind, epoch, seq, ts, _check_data(kind, data), step)


LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50}


def level_number(level: str) -> int:
    """The `logging` number of a level name (unknown names count as INFO)."""
    return LEVELS.get(level.upper(), 20)
