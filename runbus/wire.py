"""The runbus wire contract v1: key names, entry fields, kinds, their validation, the encoder
and the reference decoder.

Both sides import this module and nothing else spells a key name; docs/wire.md is its prose twin.
The decoder here is the readable one (entry by entry, field by field); the ingester's fast path,
runbus.ingester.decoding, is tested to give exactly its results and errors.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import re
import secrets
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from operator import attrgetter, eq
from typing import Any, NamedTuple

import orjson

from runbus.errors import InvalidEntry, InvalidName

VERSION = "1"
PREFIX = "runbus"
DEAD_LETTER_KEY = f"{PREFIX}:dead"
# Every stream a producer creates is announced here (a set of stream keys), so ingesters find
# it within a poll instead of a keyspace scan.
REGISTRY_KEY = f"{PREFIX}:streams"
# Per consumer group made with `runbus ingest --from now`: the stream id it starts new streams
# at (a hash, group -> id), fixed by the group's first such ingest, so restarts keep it.
GROUP_STARTS_KEY = f"{PREFIX}:group-starts"

KINDS = frozenset({"start", "metric", "log", "system", "heartbeat", "finish", "meta"})
LOG_STREAMS = frozenset({"stdout", "stderr", "logging"})
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME = re.compile(NAME_PATTERN)
_STREAM_KEY = re.compile(rf"{PREFIX}:\{{({NAME_PATTERN})\}}:({NAME_PATTERN})")

# The `ts` accepted: wall-clock seconds since the Unix epoch from 2000-01-01 to 2200-01-01 UTC.
# Outside it a ts is a unit or clock mistake (milliseconds, a monotonic clock, seconds since the
# job began) or garbage that no date can show (1e300 overflows every time conversion).
TS_MIN, TS_MAX = 946_684_800.0, 7_258_118_400.0

# Biggest `data` field accepted, encoded. A log line or config larger than this is an error at
# the producer and a dead letter at the ingester, never a silent truncation.
MAX_DATA_BYTES = 1 << 20

# Run metadata (kind `meta`): what one event may set, and the bounds both sides check. A config
# or summary update sets top-level keys (each replaces its whole value); name and tags are set
# whole. MAX_META_KEYS bounds one update, and the keys a producer's label sets in all.
META_FIELDS = ("config", "summary", "name", "tags")
MAX_META_KEYS = 10_000
MAX_KEY_LENGTH = 256  # a metric name, or a config or summary key
MAX_RUN_NAME = 128
MAX_TAGS = 32
TAG_PATTERN = r"[\w.:/=+@-]{1,64}"
_TAG = re.compile(TAG_PATTERN)
# Unicode categories a run name may not hold: controls, formatting (bidi overrides, zero-width
# characters), surrogates, line and paragraph separators. Such a name would print as something
# other than what it is.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

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


def check_run_name(name: object) -> str:
    """Return `name` if it is a valid run name (what people read, unlike the run id), else raise
    InvalidName saying why."""
    if not isinstance(name, str):
        raise InvalidName(f"a run name must be a string, not {type(name).__name__}")
    if not 0 < len(name) <= MAX_RUN_NAME:
        raise InvalidName(f"a run name must have 1 to {MAX_RUN_NAME} characters, not {len(name)}")
    if name.strip() != name:
        raise InvalidName(f"run name {name[:40]!r} starts or ends with white space")
    bad = next((c for c in name if unicodedata.category(c) in _UNPRINTABLE), None)
    if bad is not None:
        raise InvalidName(f"run name {name[:40]!r} holds the control character U+{ord(bad):04X}")
    return name


def check_tags(tags: object) -> list[str]:
    """`tags` as a list of valid tags, each once, in their first order; else raise InvalidName
    saying why (a single string is refused: it is one tag, not a list of them)."""
    if isinstance(tags, (set, frozenset)):
        tags = sorted(tags, key=str)
    if not isinstance(tags, (list, tuple)):
        raise InvalidName(f"tags must be a list of strings, not {type(tags).__name__}")
    for tag in tags:
        if not isinstance(tag, str) or not _TAG.fullmatch(tag):
            shown = tag[:40] if isinstance(tag, str) else tag
            raise InvalidName(
                f"invalid tag {shown!r}: must match {TAG_PATTERN} (1 to 64 letters, digits, "
                "'_', '.', ':', '/', '=', '+', '@', '-'; no spaces or commas)"
            )
    unique = list(dict.fromkeys(tags))
    if len(unique) > MAX_TAGS:
        raise InvalidName(f"a run has at most {MAX_TAGS} tags, not {len(unique)}")
    return unique


RUN_ID_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
# 40 random bits: a thousand jobs started in the same second on many machines share an id with a
# chance under one in two million (the birthday bound, n^2 / 2^41).
RUN_ID_RANDOM = 8


def new_run_id(now: float | None = None) -> str:
    """A fresh run id, where no launcher and no user names the run: `run-` and the UTC time
    (`run-20261127-024300-`: ids sort by when they were made, whatever the machine's time zone),
    then RUN_ID_RANDOM characters of lowercase Crockford base32 (no i, l, o or u to misread)."""
    stamp = time.strftime("run-%Y%m%d-%H%M%S-", time.gmtime(now))
    return stamp + "".join(secrets.choice(RUN_ID_ALPHABET) for _ in range(RUN_ID_RANDOM))


def stream_key(run: str, label: str) -> str:
    """The stream of one run and label; `{run}` is a Redis Cluster hash tag."""
    return f"{PREFIX}:{{{run}}}:{label}"


def epoch_key(run: str, label: str) -> str:
    """The counter a producer INCRs at init to take its label's epoch."""
    return f"{PREFIX}:{{{run}}}:epoch:{label}"


def primary_key(run: str) -> str:
    """Holds the label of the run's live primary (with a TTL its heartbeats refresh)."""
    return f"{PREFIX}:{{{run}}}:meta:primary"


def claim_holder(held: bytes | str | None) -> str | None:
    """The label a primary claim key (primary_key) holds, as its producer writes it; None for no
    claim, or a value that is no label name (a key written by hand)."""
    if held is None:
        return None
    try:
        return check_name("label", held.decode() if isinstance(held, bytes) else held)
    except (UnicodeDecodeError, InvalidName):
        return None


def seal_key(run: str, label: str) -> str:
    """A hash of the label's sealed epochs: field EPOCH holds the hex secret its producer seals
    that epoch's entries with (written by its claim; kept FINISHED_TTL). Outside the
    `runbus:{RUN}:*` keys (though in the run's slot: `{run}` is its hash tag), so that ACLs can let
    producers write seals without reading them (README, Operations)."""
    return f"{PREFIX}:seal:{{{run}}}:{label}"


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


def replay_claim_key(dead_id: str) -> str:
    """Held (with a TTL) by the `runbus dead --replay` putting dead letter `dead_id` back."""
    return f"{DEAD_LETTER_KEY}:replaying:{dead_id}"


def store_group(store_id: str) -> str:
    """The consumer group of the store whose id is `store_id` (the ingester's default): every
    store receives every event, and the workers of one store share them."""
    return f"{PREFIX}:{store_id}"


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


_KIND = attrgetter("kind")


def of_kind(events: Sequence[Event], kind: str) -> list[Event]:
    """The events of `kind`, in order, picked out in C (compress over maps): the ingester filters
    every stored batch so, where a loop in Python over its events cost a share of its CPU."""
    return list(compress(events, map(eq, map(_KIND, events), repeat(kind))))


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
# run, label, then (kind, epoch, seq, ts, step or "", data, seal) per entry. One call replaces a
# pipeline of XADDs, which costs the producer several times more CPU per event in redis-py.
XADD_MANY_SCRIPT = """
local key, version, run, label = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV, 7 do
  if ARGV[i + 4] == '' then
    redis.call('XADD', key, '*', 'v', version, 'kind', ARGV[i], 'run', run, 'label', label,
      'epoch', ARGV[i + 1], 'seq', ARGV[i + 2], 'ts', ARGV[i + 3], 'data', ARGV[i + 5],
      'seal', ARGV[i + 6])
  else
    redis.call('XADD', key, '*', 'v', version, 'kind', ARGV[i], 'run', run, 'label', label,
      'epoch', ARGV[i + 1], 'seq', ARGV[i + 2], 'ts', ARGV[i + 3], 'step', ARGV[i + 4],
      'data', ARGV[i + 5], 'seal', ARGV[i + 6])
  end
end
return (#ARGV - 3) / 7
"""


# An entry as XADD_MANY_SCRIPT takes it: (kind, epoch, seq, ts, step, data), data JSON.
EntryArgs = tuple[str, int, int, float, int | None, bytes | str]


def xadd_many_args(
    run: str, label: str, entries: Iterable[EntryArgs], secrets_by_epoch: dict[int, bytes]
) -> list[str | int | bytes]:
    """ARGV for XADD_MANY_SCRIPT from (kind, epoch, seq, ts, step, data) tuples, each sealed with
    its epoch's secret (`seal`); an epoch without a secret is sent with an empty seal."""
    args: list[str | int | bytes] = [VERSION, run, label]
    for kind, epoch, seq, ts, step, data in entries:
        raw = data if isinstance(data, bytes) else data.encode()
        secret = secrets_by_epoch.get(epoch)
        stamp = b"" if secret is None else seal_event(secret, kind, epoch, seq, ts, step, raw)
        args += (kind, epoch, seq, repr(ts), "" if step is None else step, raw, stamp)
    return args


# -- fencing: which entries an epoch's lease holder wrote ------------------------------------------

SEAL_FIELD = b"seal"
# The fields a seal covers, in this order (a step-less entry's step as b"").
SEALED_FIELDS = (b"kind", b"epoch", b"seq", b"ts", b"step", b"data")
SEAL_LENGTH = 32  # hex digits: 128 bits


def new_seal_secret() -> bytes:
    """A fresh secret for the epochs one producer process writes (kept in its memory; its hex is
    stored once per epoch in seal_key, for ingesters)."""
    return secrets.token_bytes(32)


def seal(secret: bytes, fields: Iterable[bytes]) -> bytes:
    """The `seal` field of an entry: keyed BLAKE2b (a MAC; 128 bits, as 32 hex digits) under its
    epoch's secret of its SEALED_FIELDS' bytes as written, joined by NUL (`data`, last, is the only
    one that may hold a NUL). The run and label are the stream's, the epoch is the secret's."""
    mac = keyed(secret).copy()
    mac.update(b"\0".join(fields))
    return mac.hexdigest().encode()


@functools.lru_cache(maxsize=1024)
def keyed(secret: bytes) -> hashlib.blake2b:
    """BLAKE2b keyed with `secret`, before any input: copied for each seal (keying costs as much
    as sealing a short entry)."""
    return hashlib.blake2b(key=secret, digest_size=SEAL_LENGTH // 2)


def seal_event(
    secret: bytes, kind: str, epoch: int, seq: int, ts: float, step: int | None, data: bytes
) -> bytes:
    """seal() of an entry as encode_fields and XADD_MANY_SCRIPT write it (ts by repr)."""
    head = f"{kind}\0{epoch}\0{seq}\0{ts!r}\0{'' if step is None else step}".encode()
    return seal(secret, (head, data))


class Fence(NamedTuple):
    """What an ingester knows of one label's epochs from Redis: the epochs sealed by a claim
    (epoch -> secret), and the label's epoch counter (the last epoch issued; None if absent)."""

    seals: dict[int, bytes]
    counter: int | None

    def knows(self, epoch: int) -> bool:
        """Whether this record can judge entries of `epoch` without reading Redis again."""
        if epoch in self.seals:
            return True
        return self.counter is not None and epoch <= self.counter and not self.sealed_from(epoch)

    def sealed_from(self, epoch: int) -> bool:
        """Whether the label's producers sealed `epoch` or an earlier epoch (the label was
        written by a sealing runbus by then: its entries must carry seals)."""
        return bool(self.seals) and min(self.seals) <= epoch


def fence_reason(
    event: Event, sealed: Iterable[bytes], stamp: bytes | None, fence: Fence, require_seal: bool
) -> str | None:
    """Why `event` (decoded from an entry whose SEALED_FIELDS and `seal` field read `sealed` and
    `stamp`) is not its epoch's lease holder's, or None if it may be stored.

    An epoch the label's producers sealed takes only entries with that epoch's seal. An epoch
    above the label's counter was never issued. An unsealed entry is taken (as from an older
    runbus, or written by hand) only below the label's first sealed epoch, and not at all under
    `require_seal`.
    """
    secret = fence.seals.get(event.epoch)
    if secret is not None:
        if stamp is None or not stamp:
            return f"entry of sealed epoch {event.epoch} carries no seal: not written by its lease holder"
        if not hmac.compare_digest(seal(secret, sealed), stamp):
            return f"seal does not match epoch {event.epoch}'s lease: not written by its lease holder"
        return None
    if fence.counter is not None and event.epoch > fence.counter:
        return f"epoch {event.epoch} was never issued to this label (its counter is at {fence.counter})"
    if fence.sealed_from(event.epoch):
        return f"epoch {event.epoch} was not sealed by a lease of this label"
    if require_seal:
        return f"entry of epoch {event.epoch} carries no seal (the ingester requires seals)"
    return None


# An entry as a raw XREADGROUP reply holds it: [name, value, name, value, ...] in the order it
# was written; None for an entry deleted while it was pending.
FlatEntry = list[bytes] | None


def fields_dict(flat: FlatEntry) -> dict[bytes, bytes]:
    """A reply's flat [name, value, ...] list as a dict (a deleted entry's None as {})."""
    if not flat:
        return {}
    it = iter(flat)
    return dict(zip(it, it, strict=False))


# The reference decoder: entry by entry, field by field, in the order docs/wire.md lists them,
# raising at the first rule an entry breaks. The ingester's fast path (runbus.ingester.decoding)
# gives the same Events, and for a bad entry calls this decoder for its reason.


def decode_entry(key: str, fields: dict[bytes, bytes]) -> Event:
    """Validate one raw stream entry read from `key`; raises InvalidEntry saying what is wrong."""
    run, label = _key_names(key)
    kind = _kind(fields)
    _check_names(fields, key, run, label)
    epoch, seq, ts = _int(fields, "epoch", 1), _int(fields, "seq", 1), _timestamp(fields)
    step = _step(fields, kind)
    return Event(run, label, kind, epoch, seq, ts, check_data(kind, _data(fields)), step)


def decode_flat(key: str, flat: FlatEntry) -> Event:
    """decode_entry for an entry as a raw reply holds it: [name, value, name, value, ...]."""
    return decode_entry(key, fields_dict(flat))


def decode_stream(key: str, flats: Iterable[FlatEntry]) -> list[Event | InvalidEntry]:
    """decode_flat for many entries of one stream: in each entry's place its Event, or the
    InvalidEntry saying why it breaks the contract."""
    decoded: list[Event | InvalidEntry] = []
    for flat in flats:
        try:
            decoded.append(decode_flat(key, flat))
        except InvalidEntry as exc:
            decoded.append(exc)
    return decoded


def check_data(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """The `data` object of an event of `kind` (one of KINDS) as stored: checked against its
    kind's rules, metric and system values converted (see number_from_wire); raises InvalidEntry."""
    return _DATA_RULES[kind](data)


def _key_names(key: str) -> tuple[str, str]:
    names = parse_stream_key(key)
    if names is None:
        raise InvalidEntry(f"key {key!r} is not a runbus stream")
    return names


def _kind(fields: dict[bytes, bytes]) -> str:
    version = _text(fields, "v")
    if version != VERSION:
        raise InvalidEntry(f"unknown wire version {version[:16]!r}")
    kind = _text(fields, "kind")
    if kind not in KINDS:
        raise InvalidEntry(f"unknown kind {kind[:32]!r}")
    return kind


def _check_names(fields: dict[bytes, bytes], key: str, run: str, label: str) -> None:
    written = _text(fields, "run"), _text(fields, "label")
    if written != (run, label):
        raise InvalidEntry(f"run/label {written[0][:140]!r}/{written[1][:140]!r} do not match key {key!r}")


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


def _timestamp(fields: dict[bytes, bytes]) -> float:
    text = _text(fields, "ts")
    try:
        ts = float(text)
    except ValueError:
        raise InvalidEntry(f"field 'ts' is not a number: {text[:40]!r}") from None
    if not math.isfinite(ts):
        raise InvalidEntry("field 'ts' must be finite")
    if not TS_MIN <= ts < TS_MAX:
        raise InvalidEntry(
            f"field 'ts' must be seconds since the Unix epoch, from year 2000 to 2200, got {text[:40]}"
        )
    return ts


def _step(fields: dict[bytes, bytes], kind: str) -> int | None:
    if b"step" not in fields:
        return None
    if kind != "metric":
        raise InvalidEntry(f"field 'step' is only for metric events, not {kind}")
    return _int(fields, "step", 0)


def _data(fields: dict[bytes, bytes]) -> dict[str, Any]:
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
    return data


def _metric_data(data: dict[str, Any]) -> dict[str, Any]:
    if not data:
        raise InvalidEntry("metric data is empty")
    return _system_data(data)


def _system_data(data: dict[str, Any]) -> dict[str, Any]:
    return {_metric_key(k): _metric_value(k, v) for k, v in data.items()}


def _metric_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidEntry(f"metric name {key!r} must be a non-empty string of at most {MAX_KEY_LENGTH}")
    return key


def _metric_value(key: str, value: object) -> float | int:
    if type(value) is bool:
        return int(value)
    try:
        return number_from_wire(value)
    except InvalidEntry:
        raise InvalidEntry(f"metric {key!r}: value {value!r} is not a number") from None


def _log_data(data: dict[str, Any]) -> dict[str, Any]:
    stream = data.get("stream")
    if not isinstance(stream, str) or stream not in LOG_STREAMS:  # a list or object is unhashable
        raise InvalidEntry(f"log stream must be one of {sorted(LOG_STREAMS)}")
    if not isinstance(data.get("text"), str):
        raise InvalidEntry("log text must be a string")
    if not isinstance(data.get("level", "INFO"), str):
        raise InvalidEntry("log level must be a string")
    return data


def _start_data(data: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(data.get("primary"), bool):
        raise InvalidEntry("start data needs a boolean 'primary'")
    if not isinstance(data.get("config", {}), dict):
        raise InvalidEntry("start config must be an object")
    return data


def _finish_data(data: dict[str, Any]) -> dict[str, Any]:
    code = data.get("exit_code")
    if code is None and "exit_code" in data:  # ended, its exit status unknown (a keeper's notice)
        return data
    if type(code) is not int:
        raise InvalidEntry("finish data needs an integer 'exit_code', or null")
    if code not in INT64:
        raise InvalidEntry(f"finish exit_code {code} does not fit in 64 bits")
    return data


def _heartbeat_data(data: dict[str, Any]) -> dict[str, Any]:
    return data  # any object: drop counters and the like ride along


def _meta_data(data: dict[str, Any]) -> dict[str, Any]:
    if not data:
        raise InvalidEntry(f"meta data is empty: it sets one or more of {', '.join(META_FIELDS)}")
    unknown = sorted(set(data) - set(META_FIELDS))
    if unknown:
        raise InvalidEntry(f"meta data field {unknown[0][:40]!r} is unknown: use {', '.join(META_FIELDS)}")
    checked = dict(data)
    for field in ("config", "summary"):
        if field in data:
            _meta_values(field, data[field])
    try:
        if "name" in data:
            check_run_name(data["name"])
        if "tags" in data:
            checked["tags"] = check_tags(data["tags"])
    except InvalidName as exc:
        raise InvalidEntry(f"meta: {exc}") from None
    return checked


def _meta_values(field: str, values: object) -> None:
    if not isinstance(values, dict):
        raise InvalidEntry(f"meta {field} must be an object")
    if len(values) > MAX_META_KEYS:
        raise InvalidEntry(f"meta {field} sets {len(values)} keys, over the limit of {MAX_META_KEYS}")
    for key in values:
        if not 0 < len(key) <= MAX_KEY_LENGTH:
            raise InvalidEntry(f"meta {field} key {key[:40]!r} must have 1 to {MAX_KEY_LENGTH} characters")


_DATA_RULES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "metric": _metric_data,
    "system": _system_data,
    "log": _log_data,
    "start": _start_data,
    "finish": _finish_data,
    "heartbeat": _heartbeat_data,
    "meta": _meta_data,
}


LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50}


def level_number(level: str) -> int:
    """The `logging` number of a level name (unknown names count as INFO)."""
    return LEVELS.get(level.upper(), 20)
