"""Property-based fuzzing of stream entries: the worker never crashes, every bad entry is
dead-lettered with a reason, every good one is stored."""

from __future__ import annotations

import tempfile

import orjson
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runbus import wire
from tests.helpers import ingest, read_store

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


def is_valid(fields: dict[bytes, bytes]) -> bool:
    try:
        wire.decode_entry(wire.stream_key(RUN, LABEL), fields)
    except wire.InvalidEntry:
        return False
    return True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.integers(0, 1), min_size=1, max_size=30).flatmap(
        lambda xs: st.tuples(*[entries(seq) for seq in range(1, len(xs) + 1)])
    )
)
def test_every_entry_is_stored_or_dead_lettered(redis_server_url, generated):
    client = redis.Redis.from_url(redis_server_url)
    client.flushdb()
    key = wire.stream_key(RUN, LABEL)
    for fields in generated:
        client.xadd(key, fields)
    valid = [f for f in generated if is_valid(f)]
    with tempfile.TemporaryDirectory() as tmp:
        store_url = f"sqlite:///{tmp}/fuzz.db"
        stats = ingest(redis_server_url, store_url)
        assert stats.entries == len(generated)
        assert stats.dead_lettered == len(generated) - len(valid)
        assert stats.stored + stats.duplicates == len(valid)
        dead = client.xrange(wire.DEAD_LETTER_KEY)
        assert len(dead) == stats.dead_lettered and all(fields[b"reason"] for _, fields in dead)
        assert client.xpending(key, wire.DEFAULT_GROUP)["pending"] == 0
        if valid:
            run = read_store(store_url, "run", RUN)
            assert run.counts["metric"] == len({f[b"seq"] for f in valid})
    client.close()


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50).flatmap(entries))
def test_the_fast_decoder_agrees_with_the_checked_one(fields):
    key = wire.stream_key(RUN, LABEL)
    fast = wire._decode_plain(key, fields)
    try:
        checked = wire.decode_checked(key, fields)
    except wire.InvalidEntry:
        checked = None
        assert fast is None
    if fast is not None:
        assert fast == checked


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50).flatmap(entries), st.randoms(use_true_random=False))
def test_decoding_a_flat_reply_agrees_with_decoding_the_dict(fields, rnd):
    key = wire.stream_key(RUN, LABEL)
    pairs = list(fields.items())
    if rnd.random() < 0.5:  # producers' order is decoded by position; any other order via a dict
        rnd.shuffle(pairs)
    flat = [part for pair in pairs for part in pair]
    try:
        expected = wire.decode_checked(key, fields)
    except wire.InvalidEntry as exc:
        try:
            wire.decode_flat(key, flat)
        except wire.InvalidEntry as again:
            assert str(again) == str(exc)
        else:
            raise AssertionError("the flat decoder accepted an invalid entry") from None
    else:
        assert wire.decode_flat(key, flat) == expected


@st.composite
def producer_entries(draw, seq: int) -> list[bytes]:
    """An entry as a producer writes it (flat, in its field order): a metric at a step, a metric,
    system figures or a log line; now and then with one value broken."""
    kind = draw(st.sampled_from(["metric", "metric", "metric", "system", "log"]))
    if kind == "log":
        data = {"stream": "stdout", "text": draw(st.text(max_size=5))}
    else:
        plain = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**63), 2**63 - 1))
        rare = st.integers(0, 19).flatmap(lambda n: st.one_of(numbers, odd_values) if n == 0 else plain)
        data = draw(st.dictionaries(st.text(min_size=1, max_size=5), rare, min_size=1, max_size=3))
        data = {k: wire.finite_to_wire(v) if isinstance(v, float) else v for k, v in data.items()}
    step = draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))) if kind == "metric" else None
    ts = draw(st.floats(min_value=0, max_value=4e9))
    fields = wire.encode_fields(kind, RUN, LABEL, 1, seq, ts, orjson.dumps(data), step)
    flat = []
    for name, value in fields.items():
        flat += [name.encode(), value if isinstance(value, bytes) else str(value).encode()]
    if draw(st.integers(0, 29)) == 0:
        flat[draw(st.integers(0, len(flat) // 2 - 1)) * 2 + 1] = draw(junk)
    return flat


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(*[producer_entries(seq) for seq in range(1, n + 1)])))
def test_decoding_a_stream_by_columns_agrees_with_entry_by_entry(flats):
    key = wire.stream_key(RUN, LABEL)
    one_by_one = []
    for flat in flats:
        try:
            one_by_one.append(wire.decode_flat(key, flat))
        except wire.InvalidEntry as exc:
            one_by_one.append(str(exc))
    together = wire.decode_stream(key, list(flats))
    assert [str(d) if isinstance(d, wire.InvalidEntry) else d for d in together] == one_by_one
