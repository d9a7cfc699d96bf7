"""Property-based fuzzing of stream entries: the worker never crashes, every bad entry is
dead-lettered with a reason, every good one is stored; the ingester's fast decoding path gives
exactly the reference decoder's results and errors (runbus.wire), and both paths run every test
here that decodes (the `decoder` fixture)."""

from __future__ import annotations

import json
import tempfile
from typing import Any

import orjson
import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runbus import config, wire
from runbus.ingester import decoding
from tests.helpers import ingest, pending_count, read_store

RUN, LABEL = "fuzz", "rank0"
junk = st.one_of(st.binary(max_size=20), st.text(max_size=20).map(str.encode))
numbers = st.one_of(
    st.floats(allow_nan=True), st.integers(-(2**63), 2**63 - 1), st.sampled_from(["NaN", "Infinity"])
)
# Now and then a value or key the contract refuses or converts: beyond 64 bits, a bool, a string,
# a list, an empty or over-long name (the limit is 256).
odd_values = st.one_of(
    st.integers(2**63, 2**64 - 1),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(st.integers(-5, 5), max_size=2),
)
keys = st.one_of(st.text(min_size=1, max_size=10), st.just(""), st.text(min_size=250, max_size=260))
metric_data = st.dictionaries(keys, st.one_of(numbers, numbers, numbers, odd_values), min_size=1, max_size=4)


@st.composite
def entries(draw, seq: int):
    """A well-formed metric entry, sometimes with one field broken or removed."""
    data = draw(metric_data)
    fields = {
        b"v": b"1",
        b"kind": b"metric",
        b"run": RUN.encode(),
        b"label": LABEL.encode(),
        b"epoch": b"1",
        b"seq": str(seq).encode(),
        b"ts": b"1700000000.5",
        b"data": orjson.dumps(
            {k: wire.finite_to_wire(v) if isinstance(v, float) else v for k, v in data.items()}
        ),
    }
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(fields)))
        if draw(st.booleans()):
            del fields[name]
        else:
            fields[name] = draw(junk)
    return fields


def reason(fields: dict[bytes, bytes]) -> str | None:
    """Why the reference decoder refuses `fields`, or None if it takes them."""
    try:
        wire.decode_entry(wire.stream_key(RUN, LABEL), fields)
    except wire.InvalidEntry as exc:
        return str(exc)
    return None


def as_read(fields: dict[str, bytes | str | int | float]) -> list[bytes]:
    """encode_fields' output as XREADGROUP returns it: flat, every value as bytes."""
    return [
        part
        for k, v in fields.items()
        for part in (k.encode(), v if isinstance(v, bytes) else str(v).encode())
    ]


def outcomes(decoded: list[wire.Event | wire.InvalidEntry]) -> list[wire.Event | str]:
    """Decoded entries as comparable values: an InvalidEntry by its message."""
    return [str(d) if isinstance(d, wire.InvalidEntry) else d for d in decoded]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.integers(0, 1), min_size=1, max_size=30).flatmap(
        lambda xs: st.tuples(*[entries(seq) for seq in range(1, len(xs) + 1)])
    )
)
def test_every_entry_is_stored_or_dead_lettered(redis_server_url, decoder, generated):
    client = redis.Redis.from_url(redis_server_url)
    client.flushdb()
    key = wire.stream_key(RUN, LABEL)
    for fields in generated:
        client.xadd(key, fields)
    valid = [f for f in generated if reason(f) is None]
    with tempfile.TemporaryDirectory() as tmp:
        store_url = f"sqlite:///{tmp}/fuzz.db"
        stats = ingest(redis_server_url, store_url)
        assert stats.entries == len(generated)
        assert stats.dead_lettered == len(generated) - len(valid)
        assert stats.stored + stats.duplicates == len(valid)
        dead = client.xrange(wire.DEAD_LETTER_KEY)
        # Each dead letter says what the reference decoder says, in the stream's order.
        assert [f[b"reason"].decode() for _, f in dead] == [r for r in map(reason, generated) if r]
        assert pending_count(client, key) == 0
        if valid:
            run = read_store(store_url, "run", RUN)
            assert run.counts["metric"] == len({f[b"seq"] for f in valid})
    client.close()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50).flatmap(entries))
def test_the_dict_fast_path_agrees_with_the_reference(fields):
    """An entry in another field order is decoded from a dict: when the fast path takes it, the
    reference gives the same Event; when the reference refuses it, so does the fast path."""
    key = wire.stream_key(RUN, LABEL)
    fast = decoding._decode_plain(key, fields)
    try:
        expected = wire.decode_entry(key, fields)
    except wire.InvalidEntry:
        assert fast is None
    else:
        assert fast is None or fast == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 50).flatmap(entries), st.randoms(use_true_random=False))
def test_decoding_a_flat_reply_agrees_with_decoding_the_dict(decoder, fields, rnd):
    key = wire.stream_key(RUN, LABEL)
    pairs = list(fields.items())
    if rnd.random() < 0.5:  # producers' order is decoded by position; any other order via a dict
        rnd.shuffle(pairs)
    flat = [part for pair in pairs for part in pair]
    try:
        expected: wire.Event | str = wire.decode_entry(key, fields)
    except wire.InvalidEntry as exc:
        expected = str(exc)
    assert outcomes(decoder(key, [flat])) == [expected]


# --- whole streams, as producers and hostile writers leave them -----------------------------------

plain_numbers = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**63), 2**63 - 1))
LOG_STREAMS = ["stdout", "stderr", "logging"]
KINDS_WRITTEN = [kind.encode() for kind in sorted(wire.KINDS)]
# What a hostile or careless writer puts where the contract wants an epoch, seq or step, or a ts;
# some of them valid (Python's int() and float() read them), the fast path must agree either way.
BAD_INTEGERS = [b"9223372036854775808", b"9223372036854775807", b"-1", b"0", b"1" * 30, b"1e3", b"0x10"]
BAD_INTEGERS += [b" 7 ", b"1_000", b"+5", b"07", b"1.0", b"", b"\xff", "\u0661".encode()]
BAD_STAMPS = [b"inf", b"nan", b"1e400", b"-Infinity", b"Infinity", b"NaN", b"1e308", b"-0.0", b"5", b"1_0.5"]
BAD_STAMPS += [b" 1.5", b"", b"\xff", b"0x1p3", b"1e300", b"-1e300", b"1700000000000", b"1_700_000_000"]
# The ends of the accepted range (2000 to 2200), either side: all numbers, only some plausible.
BAD_STAMPS += [b"946684800", b"946684799.999", b"7258118400", b"7258118399.5", b" 1700000000.5 "]
# A metric name or value the contract refuses or converts.
BAD_NAMES = ["", "k" * 257, "k" * 256, "\x00", "é" * 200]
BAD_VALUES = [2**63, -(2**63) - 1, 2**63 - 1, -(2**63), 2**64, True, False, "NaN", "Infinity", "-Infinity"]
BAD_VALUES += ["nan", "inf", None, [1], {}, "", "1.5", 1e308, -0.0]
# A wrong value for a field of a log, start or finish event's data.
WRONG = [None, 0, 1.5, "", "0", [], {}, True, 2**63, 2**63 - 1, -(2**63), -(2**63) - 1, 2**64]
HUGE_DATA = b'{"x": 1.0, "pad": "' + b"a" * wire.MAX_DATA_BYTES + b'"}'


# Run metadata as producers send it: some of config, summary, name, tags.
meta_values = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(
        plain_numbers, st.text(max_size=5), st.booleans(), st.none(), st.lists(st.integers(-5, 5), max_size=2)
    ),
    max_size=3,
)
meta_data = st.fixed_dictionaries(
    {},
    optional={
        "config": meta_values,
        "summary": meta_values,
        "name": st.sampled_from(["run", "lr=3e-4 baseline", "ünï ✓"]),
        "tags": st.lists(st.sampled_from(["a", "b-1", "lr=3e-4", "κ"]), max_size=3),
    },
).filter(bool)
# What a hostile or careless writer puts in a meta event's field: a wrong type, an empty or
# over-long key, a name with a control character or white space around it, a bad tag, too many.
BAD_META = [
    {"config": []},
    {"config": "lr=1"},
    {"summary": None},
    {"config": {"": 1}},
    {"summary": {"k" * 257: 1}},
    {"name": ""},
    {"name": " padded"},
    {"name": "bell\x07"},
    {"name": "bidi\u202e"},
    {"name": "n" * 129},
    {"name": 5},
    {"tags": "single"},
    {"tags": ["has space"]},
    {"tags": ["comma,"]},
    {"tags": [""]},
    {"tags": [7]},
    {"tags": [f"t{n}" for n in range(33)]},
    {"tags": ["t" * 65]},
    {"other": 1},
    {},
]


@st.composite
def data_of(draw, kind: str) -> dict[str, Any]:
    """The data of a `kind` event as producers write it."""
    if kind in ("metric", "system"):
        return draw(st.dictionaries(st.text(min_size=1, max_size=5), plain_numbers, min_size=1, max_size=3))
    if kind == "log":
        data = {"stream": draw(st.sampled_from(LOG_STREAMS)), "text": draw(st.text(max_size=5))}
        if draw(st.booleans()):
            data["level"] = draw(st.sampled_from(["INFO", "ERROR", "chatty"]))
        return data
    if kind == "start":
        return {"primary": draw(st.booleans()), "config": {"lr": 0.1}, "world_size": 2}
    if kind == "finish":
        return {"exit_code": draw(st.none() | st.integers(-5, 300))}  # null: a keeper's notice
    if kind == "meta":
        return draw(meta_data)
    return draw(st.sampled_from([{}, {"dropped": 3, "buffered": 0}]))  # heartbeat


@st.composite
def bad_data(draw, kind: str) -> bytes:
    """The data of a `kind` event with one value the contract refuses or converts."""
    data = draw(data_of(kind))
    if kind in ("metric", "system"):
        if draw(st.integers(0, 9)) == 0:
            return b"{}"
        name = draw(st.sampled_from(BAD_NAMES)) if draw(st.booleans()) else "odd"
        data[name] = draw(st.sampled_from(BAD_VALUES)) if name == "odd" or draw(st.booleans()) else 1.0
    elif kind == "meta":
        data = (
            {**data, **draw(st.sampled_from(BAD_META))}
            if draw(st.booleans())
            else draw(st.sampled_from(BAD_META))
        )
    elif data:
        data[draw(st.sampled_from(sorted(data)))] = draw(st.sampled_from(WRONG))
    return json.dumps(data).encode()  # orjson refuses integers beyond 64 bits; JSON allows them


HAZARDS = ["integer", "stamp", "data", "data", "junk", "missing", "shuffled", "huge", "not an object"]
HAZARDS += ["kind", "version", "other run", "step", "deleted"]


@st.composite
def broken(draw, flat: list[bytes]) -> list[bytes] | None:
    """`flat` (a producer's entry) with one thing a hostile or careless writer does to it."""
    hazard = draw(st.sampled_from(HAZARDS))
    fields = dict(zip(flat[0::2], flat[1::2], strict=True))
    kind = fields[b"kind"].decode()
    if hazard == "integer":
        name = draw(st.sampled_from([n for n in (b"epoch", b"seq", b"step") if n in fields]))
        fields[name] = draw(st.sampled_from(BAD_INTEGERS))
    elif hazard == "stamp":
        fields[b"ts"] = draw(st.sampled_from(BAD_STAMPS))
    elif hazard == "data":
        fields[b"data"] = draw(bad_data(kind))
    elif hazard == "junk":  # non-UTF-8 bytes, text, anything, in any field
        fields[draw(st.sampled_from(sorted(fields)))] = draw(st.one_of(junk, st.just(b"\xff\xfe")))
    elif hazard == "missing":
        del fields[draw(st.sampled_from(sorted(fields)))]
    elif hazard == "shuffled":  # another client's field order, decoded through a dict: still valid
        return [part for pair in draw(st.permutations(list(fields.items()))) for part in pair]
    elif hazard == "huge":
        fields[b"data"] = HUGE_DATA
    elif hazard == "not an object":
        fields[b"data"] = draw(st.sampled_from([b"[1, 2]", b"{nope", b"", b"null", b'"text"', b"1", b"{}"]))
    elif hazard == "kind":
        fields[b"kind"] = draw(st.sampled_from([*KINDS_WRITTEN, b"x", b"METRIC"]))
    elif hazard == "version":
        fields[b"v"] = draw(st.sampled_from([b"2", b"", b"1.0"]))
    elif hazard == "other run":
        fields[draw(st.sampled_from([b"run", b"label"]))] = b"other"
    elif hazard == "step":  # a step on another kind, or taken off a metric
        if b"step" in fields:
            del fields[b"step"]
        else:
            fields = {**dict(list(fields.items())[:-1]), b"step": b"3", b"data": fields[b"data"]}
    else:
        return None  # deleted while pending: XREADGROUP gives None for its fields
    return [part for pair in fields.items() for part in pair]


STREAMS = {
    "metrics at steps": ["metric"],
    "stepless": ["metric", "metric", "system"],
    "mixed": ["metric", "metric", "metric", "system", "log", "start", "heartbeat", "finish", "meta"],
}


@st.composite
def streams(draw) -> tuple[str, list[list[bytes] | None]]:
    """A stream's key and its entries as XREADGROUP returns them, flat. A stream holds metrics at
    every step, metrics and system figures without steps, or every kind (metrics with and
    without steps); every entry is as a producer writes it, or one is broken, or a few are."""
    flavour = draw(st.sampled_from(sorted(STREAMS)))
    count = draw(st.integers(1, 40))
    bad = {
        "none": set(),
        "one": {draw(st.integers(0, count - 1))},
        "some": set(draw(st.lists(st.integers(0, count - 1), max_size=5))),
    }[draw(st.sampled_from(["none", "one", "one", "some"]))]
    epoch = draw(st.sampled_from([1, 2, 2**63 - 1]))
    # As a sealing producer writes them (a trailing seal), as an older one or redis-cli does
    # (none), or with an empty or junk seal: the decoders ignore it alike.
    sealing = draw(st.sampled_from(["seal", "none", "empty", "junk"]))
    secret = b"k" * 32
    flats: list[list[bytes] | None] = []
    for seq in range(1, count + 1):
        kind = draw(st.sampled_from(STREAMS[flavour]))
        step = None
        if kind == "metric" and (
            flavour == "metrics at steps" or (flavour == "mixed" and draw(st.booleans()))
        ):
            step = draw(st.one_of(st.integers(0, 100), st.integers(0, 2**63 - 1)))
        # Mostly within the accepted range (2000 to 2200), now and then beyond it either side.
        ts = draw(st.floats(min_value=9e8, max_value=7.3e9))
        data = orjson.dumps(draw(data_of(kind)))
        fields = wire.encode_fields(kind, RUN, LABEL, epoch, seq, ts, data, step)
        flat = draw(broken(as_read(fields))) if seq - 1 in bad else as_read(fields)
        if flat is not None and sealing != "none":
            stamp = {
                "seal": wire.seal_event(secret, kind, epoch, seq, ts, step, data),
                "empty": b"",
                "junk": b"x;",
            }
            flat += [wire.SEAL_FIELD, stamp[sealing]]
        flats.append(flat)
    keys = [wire.stream_key(RUN, LABEL), wire.stream_key("other", LABEL), "runbus:{bad run}:rank0"]
    return draw(st.sampled_from(keys)) if draw(st.integers(0, 19)) == 0 else keys[0], flats


@settings(max_examples=300, deadline=None)
@given(streams())
def test_the_fast_path_agrees_with_the_reference_on_whole_streams(stream):
    """Every stream the fast path decodes (by columns, by position, from a dict) gives the
    reference's Events and, for every bad entry, the reference's message."""
    key, flats = stream
    names = decoding._key_names(key)
    by_columns = names is not None and decoding._decoded_by_columns(key, names, flats) is not None
    event(f"decoded by columns: {by_columns}")
    reference = outcomes(wire.decode_stream(key, flats))
    assert outcomes(decoding.decode_stream_fast(key, flats)) == reference
    # The reference is entry by entry: one entry alone decodes as it does among others.
    assert [outcomes(wire.decode_stream(key, [flat]))[0] for flat in flats] == reference


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
@pytest.mark.parametrize("flavour", sorted(STREAMS))
def test_clean_streams_are_decoded_by_columns(flavour, sealed):
    """The property above is not vacuous: a clean stream of tallies does take the columns path
    (and a mixed one takes it for its metrics and system figures), sealed or not."""
    key, flats = wire.stream_key(RUN, LABEL), []
    for seq, kind in enumerate(STREAMS[flavour] * 3, start=1):
        step = seq if kind == "metric" and flavour != "stepless" else None
        data = {"stream": "stdout", "text": "hi"} if kind == "log" else {"loss": 0.5, "n": 7}
        data = {"primary": True} if kind == "start" else {"exit_code": 0} if kind == "finish" else data
        data = {"summary": {"loss": 0.5}, "tags": ["x"]} if kind == "meta" else data
        fields = wire.encode_fields(kind, RUN, LABEL, 1, seq, 1e9 + seq, orjson.dumps(data), step)
        flats.append(as_read(fields) + ([wire.SEAL_FIELD, b"0" * 32] if sealed else []))
    names = decoding._key_names(key)
    assert names is not None
    decoded = decoding._decoded_by_columns(key, names, flats)
    assert decoded is not None
    by_columns = decoded[0]
    assert all(isinstance(e, wire.Event) for e in by_columns)
    assert by_columns == wire.decode_stream(key, flats)


def test_sealed_streams_are_decoded_by_columns():
    """A sealing producer's entries (a trailing seal) take the columns path too, as the same
    Events as without seals."""
    key, flats, sealed = wire.stream_key(RUN, LABEL), [], []
    for seq in range(1, 20):
        data = orjson.dumps({"loss": 0.5, "n": seq})
        flat = as_read(wire.encode_fields("metric", RUN, LABEL, 1, seq, 1e9 + seq, data, seq))
        flats.append(flat)
        sealed.append([*flat, wire.SEAL_FIELD, wire.seal_event(b"k", "metric", 1, seq, 1e9 + seq, seq, data)])
    names = decoding._key_names(key)
    assert names is not None
    assert decoding._decoded_by_columns(key, names, sealed) is not None
    assert (
        decoding.decode_stream_fast(key, sealed)
        == wire.decode_stream(key, sealed)
        == wire.decode_stream(key, flats)
    )


def test_each_decoder_name_is_one_config_documents():
    assert sorted(decoding.DECODERS) == sorted(config.DECODERS)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.sampled_from(["stdout", "NaN", "-Infinity", "INFO"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=2), st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=4,
)
data_names = st.sampled_from(
    [
        "stream",
        "text",
        "level",
        "primary",
        "config",
        "exit_code",
        "loss",
        "",
        "x" * 257,
        "summary",
        "name",
        "tags",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(wire.KINDS)),
    st.dictionaries(data_names, json_values, max_size=4),
    st.integers(1, 12),
)
def test_any_json_data_of_any_kind_is_decoded_or_refused_alike(kind, data, count):
    """Whatever JSON object an entry's data holds, each path stores it or says why not, the same
    way, and neither raises anything but InvalidEntry (a TypeError once stopped the worker)."""
    key = wire.stream_key(RUN, LABEL)
    step = 3 if kind == "metric" else None
    flat = as_read(wire.encode_fields(kind, RUN, LABEL, 1, 1, 1.7e9, json.dumps(data).encode(), step))
    reference = outcomes(wire.decode_stream(key, [flat] * count))
    assert outcomes(decoding.decode_stream_fast(key, [flat] * count)) == reference
