"""Column chunks (runbus.storage.columns): every point comes back bit for bit, and the numpy path
writes the reference's bytes and reads back its points, on arbitrary arrays as on training-like ones,
in format 2 (pcodec columns, what the stores write) and format 1 (byte planes, what stores written
before it hold), and in reads that meet both."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runbus.storage import columns, columns_numpy
from runbus.storage.columns import Chunk, FormatError

# These tests do no I/O. Hypothesis collects garbage as it starts (the first module to use it in the
# suite's order), which surfaces a socket left unclosed by an earlier test as an unraisable warning
# here. That leak is not this module's: tests/test_cluster.py's in-process ingest, producer-outage
# and CLI tests leave it when they run together (none alone); which socket is still open.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

INT64 = st.integers(-(2**63), 2**63 - 1)
# Every float64 bit pattern: NaNs with any payload and sign, -0.0, ±inf, subnormals.
FLOAT_BITS = st.integers(0, 2**64 - 1).map(lambda word: struct.unpack("<d", struct.pack("<Q", word))[0])
FLOATS = st.one_of(FLOAT_BITS, st.floats(allow_nan=True), st.integers(-(2**53), 2**53).map(float))
# Floats that are integers, but for a -0.0 or a 2**63 now and then: where FLOAT_INTEGRAL applies or
# must not.
INTEGRAL = st.one_of(
    st.integers(-1000, 1000).map(float), st.sampled_from([-0.0, 2.0**63, -(2.0**63), 2.0**62, 0.5])
)
# Mostly-regular sequences (the common case the encodings favour), or anything at all.
SMOOTH = st.builds(
    lambda start, stride, jitter: [start + stride * index + noise for index, noise in enumerate(jitter)],
    st.integers(-(2**40), 2**40),
    st.integers(-1000, 1000),
    st.lists(st.integers(-3, 3), max_size=80),
)


# Each format's writers: the reference's, and the numpy path's (from the reference's lists).
FORMATS = {
    1: (columns.encode_v1_reference, lambda c: columns_numpy.encode_arrays_v1(columns_numpy.arrays_of(c))),
    2: (columns.encode_reference, columns_numpy.encode_chunk),
}


def encoded(chunk: Chunk, version: int) -> bytes:
    return FORMATS[version][0](chunk)


def bits(values: list[float] | list[int]) -> list[tuple[type, int]]:
    """Values as (type, bits): floats compared by their bytes, NaN payloads and -0.0 included."""
    return [
        (float, struct.unpack("<Q", struct.pack("<d", value))[0]) if type(value) is float else (int, value)
        for value in values
    ]


def same(left: Chunk, right: Chunk) -> bool:
    return (left.seqs, left.steps, left.ts, bits(left.values)) == (
        right.seqs,
        right.steps,
        right.ts,
        bits(right.values),
    )


@st.composite
def chunks(draw: st.DrawFn) -> Chunk:
    ints = st.one_of(st.lists(INT64, max_size=40), SMOOTH)
    seqs = draw(ints)
    count = len(seqs)
    ts = draw(st.one_of(st.lists(INT64, min_size=count, max_size=count), SMOOTH)) + [0] * count
    steps_kind = draw(st.sampled_from(["none", "all", "some", "aligned"]))
    steps: list[int | None]
    if steps_kind == "none":
        steps = [None] * count
    elif steps_kind == "aligned":
        offset = draw(st.integers(-(2**62), 2**62))
        steps = [seq + offset if abs(seq + offset) < 2**63 else None for seq in seqs]
    else:
        options = INT64 if steps_kind == "all" else st.one_of(st.none(), INT64)
        steps = draw(st.lists(options, min_size=count, max_size=count))
    values: list[float] | list[int]
    kind = draw(st.sampled_from(["ints", "floats", "integral"]))
    if kind == "ints":
        values = draw(st.lists(INT64, min_size=count, max_size=count))
    else:
        values = draw(st.lists(FLOATS if kind == "floats" else INTEGRAL, min_size=count, max_size=count))
    return Chunk(seqs, steps, ts[:count], values)


@settings(max_examples=400, deadline=None)
@given(chunks())
@pytest.mark.parametrize("version", FORMATS)
def test_both_paths_write_the_same_bytes_and_read_back_every_bit(version: int, chunk: Chunk) -> None:
    reference, fast = FORMATS[version]
    blob = reference(chunk)
    assert blob[0] == version and fast(chunk) == blob
    assert same(columns.decode_reference(blob), chunk)
    assert same(columns_numpy.decode_chunk(blob), chunk)
    found = columns.bounds(blob)
    given_steps = [step for step in chunk.steps if step is not None]
    assert found.points == len(chunk.seqs)
    if chunk.seqs:
        assert (found.first_seq, found.last_seq) == (chunk.seqs[0], chunk.seqs[-1])
        assert (found.first_ts, found.last_ts) == (chunk.ts[0], chunk.ts[-1])
    assert found.has_steps == bool(given_steps)
    if given_steps:
        assert (found.min_step, found.max_step) == (min(given_steps), max(given_steps))
    assert found.ints == (bool(chunk.values) and all(type(value) is int for value in chunk.values))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(FLOAT_BITS, INTEGRAL), max_size=60), st.sampled_from(columns.FLOAT_CHOICES))
def test_every_float_encoding_agrees_and_round_trips(values: list[float], encoding: int) -> None:
    reference = columns.float_payload_reference(values, encoding)
    array = np.array(values, np.float64)
    fast = columns_numpy.float_payload(array, encoding)
    assert fast == reference
    if reference is not None:
        back = columns_numpy.unpack_floats(encoding, reference, len(values))
        assert back.view(np.uint64).tolist() == array.view(np.uint64).tolist()


def test_special_values_and_null_steps_round_trip_on_both_paths() -> None:
    payload_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF4_0000_DEAD_BEEF))[0]
    chunk = Chunk(
        seqs=[5, 3, 9, 9, -1],  # not monotonic: the codec keeps whatever it is given
        steps=[None, 2**63 - 1, None, -(2**63), 0],
        ts=[1_700_000_000_000_000, 0, -5, 2**63 - 1, -(2**63)],
        values=[payload_nan, -0.0, math.inf, -math.inf, 5e-324],
    )
    for path in columns.PATHS:
        columns.use(path)
        try:
            assert same(columns.decode_chunk(columns.encode_chunk(chunk)), chunk)
        finally:
            columns.use("numpy")
    for version in FORMATS:
        blob = encoded(chunk, version)
        assert blob[1] & columns.FLAG_STEP_NULLS
        arrays = columns_numpy.decode_arrays(blob)
        assert arrays.step_nulls is not None
        assert arrays.step_nulls.tolist() == [True, False, True, False, False]
        assert arrays.values.view(np.uint64).tolist()[0] == 0xFFF4_0000_DEAD_BEEF


@pytest.mark.parametrize("version", FORMATS)
def test_ints_as_logged_come_back_as_ints_and_integral_floats_as_floats(version: int) -> None:
    counter = list(range(2**53, 2**53 + 100))  # past float64's exact integers
    as_ints = columns_numpy.decode_arrays(encoded(Chunk(counter, counter, counter, counter), version))
    assert as_ints.values.dtype == np.int64 and as_ints.values.tolist() == counter
    floats = [float(step) for step in range(100)]
    blob = encoded(Chunk(list(range(100)), [None] * 100, list(range(100)), floats), version)
    assert not columns.bounds(blob).ints
    back = columns.decode_reference(blob).values
    assert all(type(value) is float for value in back) and back == floats


@pytest.mark.parametrize("version", FORMATS)
def test_integers_as_floats_keep_their_bits_and_minus_zero_stays_a_float(version: int) -> None:
    reference, fast = FORMATS[version]
    for values in ([0.0, -0.0, 1.0], [-0.0], [3.0, 2.0**63], [-(2.0**63), 1.0], [2.0**62, 7.0]):
        chunk = Chunk(list(range(len(values))), [None] * len(values), [0] * len(values), values)
        blob = reference(chunk)
        assert fast(chunk) == blob
        assert same(columns.decode_reference(blob), chunk) and same(columns_numpy.decode_chunk(blob), chunk)
        assert same(
            columns_numpy.chunk_of(columns_numpy.decode_many([blob, blob])),
            chunk._replace(seqs=chunk.seqs * 2, steps=chunk.steps * 2, ts=chunk.ts * 2, values=values * 2),
        )


def test_a_chunk_over_the_limit_is_not_encoded() -> None:
    count = columns.MAX_COUNT + 1
    arrays = columns_numpy.Arrays(
        np.arange(count), np.arange(count), None, np.arange(count), np.zeros(count, np.float64)
    )
    with pytest.raises(ValueError, match="at most"):
        columns_numpy.encode_arrays(arrays)


def test_regular_columns_compress_to_almost_nothing() -> None:
    count = 4096
    seqs = list(range(1, count + 1))
    chunk = Chunk(
        seqs, [seq + 100 for seq in seqs], [1_700_000_000_000 + 50 * seq for seq in seqs], [0.1] * count
    )
    assert len(columns.encode_reference(chunk)) < count / 10  # well under a byte a point


def test_the_path_in_use_is_numpy_and_use_switches_it() -> None:
    assert columns.path_in_use == "numpy"
    columns.use("reference")
    try:
        assert columns.encode_chunk is columns.encode_reference
    finally:
        columns.use("numpy")
    chunk = Chunk([1, 2, 3], [1, None, 3], [7, 8, 9], [0.5, -0.0, math.inf])
    assert columns.encode_chunk(chunk) == columns_numpy.encode_chunk(chunk)
    assert columns.decode_chunk(columns_numpy.encode_chunk(chunk)) == columns_numpy.decode_chunk(
        columns_numpy.encode_chunk(chunk)
    )
    with pytest.raises(ValueError, match="unknown column path"):
        columns.use("c")


def with_last_column(blob: bytes, encoding: int, payload: bytes) -> bytes:
    """`blob` with its values column replaced."""
    at = len(blob) - len(columns.columns(blob)[1][-1][1]) - columns.COLUMN.size
    return blob[:at] + columns.column(encoding, payload)


@pytest.mark.parametrize("version", FORMATS)
def test_damaged_or_foreign_bytes_are_refused_with_a_format_error(version: int) -> None:
    chunk = Chunk([1, 2, 3], [1, 2, 3], [1, 2, 3], [0.5, 0.25, 0.125])
    blob = encoded(chunk, version)
    other = 2 if version == 1 else 1
    values = columns.columns(blob)[1][-1][1]
    damaged = [
        b"",
        b"\x01",  # a version byte alone
        b"\x03" + blob[1:],  # a version this code does not know
        bytes([other]) + blob[1:],  # the other version's header over this one's columns
        blob[:-3],  # cut inside the last column
        blob[: columns.HEADER.size + 2],  # cut inside a column's header
        blob + columns.column(columns.INT_DOD, zlib.compress(b"")),  # a column too many
        with_last_column(blob, 99, values),  # an unknown encoding
        with_last_column(blob, columns.PCO, b"pco!" + bytes(40)),  # a pcodec column of garbage
        # pcodec columns of the wrong length or type: 2 values, ints where floats are flagged.
        with_last_column(blob, columns.PCO, columns.pco_payload(np.array([0.5, 0.25]))),
        with_last_column(blob, columns.PCO, columns.pco_payload(np.array([1, 2, 3], np.int64))),
    ]
    # A count past the limit: refused from the header, before 8 bytes a point are allocated.
    damaged.append(blob[:2] + (columns.MAX_COUNT + 1).to_bytes(4, "little") + blob[6:])
    good = encoded(chunk, 2)
    for bad in damaged:
        for decode in (
            columns.decode_reference,
            columns_numpy.decode_arrays,
            lambda bad: columns_numpy.decode_many([bad]),
            lambda bad: columns_numpy.decode_many([good, bad]),
        ):
            with pytest.raises(FormatError):
                decode(bad)


# Chunks each in a format: a store written before format 2 and read after holds both, in runs.
MIXED = st.lists(st.tuples(chunks(), st.sampled_from(sorted(FORMATS))), max_size=6)


@settings(max_examples=150, deadline=None)
@given(MIXED)
def test_many_chunks_decode_at_once_as_one_by_one(mixed: list[tuple[Chunk, int]]) -> None:
    chunks_ = [chunk for chunk, _ in mixed]
    blobs = [encoded(chunk, version) for chunk, version in mixed]
    together = columns_numpy.decode_many(blobs)
    points = [point for chunk in chunks_ for point in zip(*chunk, strict=True)]
    assert together.seqs.tolist() == [point[0] for point in points]
    assert together.ts.tolist() == [point[2] for point in points]
    nulls = [False] * len(points) if together.step_nulls is None else together.step_nulls.tolist()
    steps = [None if null else step for step, null in zip(together.steps.tolist(), nulls, strict=True)]
    assert steps == [point[1] for point in points]
    logged = [point[3] for point in points]
    if together.values.dtype == np.int64:
        assert together.values.tolist() == logged
    else:
        assert (
            together.values.view(np.uint64).tolist() == np.array(logged, np.float64).view(np.uint64).tolist()
        )


def garbage_arrays(count: int) -> columns_numpy.Arrays:
    """Arrays of `count` points filled with bytes a decoder must overwrite, every one of them."""
    noise = np.frombuffer(bytes(range(256)) * (count * 8 // 256 + 1), np.uint8)[: count * 8]
    return columns_numpy.Arrays(
        noise.view(np.int64).copy(),
        noise.view(np.int64).copy(),
        np.ones(count, np.bool_),
        noise.view(np.int64).copy(),
        noise.view(np.float64).copy(),
    )


@settings(max_examples=150, deadline=None)
@given(MIXED)
def test_decoding_in_place_and_the_times_alone_give_the_same_columns(mixed: list[tuple[Chunk, int]]) -> None:
    blobs = [encoded(chunk, version) for chunk, version in mixed]
    together = columns_numpy.decode_many(blobs)
    into = garbage_arrays(len(together.seqs))
    found = columns_numpy.decode_many(blobs, times=False, into=into)
    assert found.seqs.tolist() == together.seqs.tolist()
    if len(found.seqs):  # decoded in the memory given
        assert np.shares_memory(found.seqs, into.seqs) and np.shares_memory(found.values, into.values)
    assert found.steps.tolist() == together.steps.tolist()
    nulls = np.zeros(len(together.seqs), np.bool_) if together.step_nulls is None else together.step_nulls
    assert into.step_nulls is not None and into.step_nulls.tolist() == nulls.tolist()
    assert (found.step_nulls is None) == (together.step_nulls is None)
    # In place, values are float64 whatever was logged: a store keeps them so.
    assert (
        found.values.view(np.uint64).tolist() == together.values.astype(np.float64).view(np.uint64).tolist()
    )
    assert len(found.ts) == 0
    times = into.ts.copy()
    assert columns_numpy.decode_times(blobs).tolist() == together.ts.tolist()
    assert columns_numpy.decode_times(blobs, times).tolist() == together.ts.tolist()


# Columns whose delta changes now and then (seqs with gaps, steps, counters): decoded as runs.
RUNS = st.lists(st.tuples(st.integers(1, 60), st.integers(-(2**63), 2**63 - 1)), min_size=1, max_size=6).map(
    lambda runs: [delta for length, delta in runs for _ in range(length)]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(INT64, RUNS), min_size=1, max_size=5))
def test_columns_of_runs_decode_as_the_reference_does(columns_: list[tuple[int, list[int]]]) -> None:
    chunks_ = []
    for first, deltas in columns_:
        seqs = [first]
        for delta in deltas:
            seqs.append((seqs[-1] + delta + 2**63) % 2**64 - 2**63)  # int64 wraps
        chunks_.append(Chunk(seqs, [None] * len(seqs), [0] * len(seqs), list(seqs)))
    blobs = [columns.encode_v1_reference(chunk) for chunk in chunks_]  # format 1's running sums
    found = columns_numpy.decode_many(blobs)
    expected = [seq for chunk in chunks_ for seq in chunk.seqs]
    assert found.seqs.tolist() == expected and found.values.tolist() == expected


# Chunks of one delta each (steps, constants, counters), most long enough to be made a chunk at a
# time from their first value and delta; `bent` adds one whose delta changes (running sums then).
LINES = st.lists(st.tuples(INT64, INT64, st.integers(1, 300)), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(LINES, st.booleans())
def test_chunks_of_one_delta_each_decode_as_the_reference_does(
    lines: list[tuple[int, int, int]], bent: bool
) -> None:
    chunks_ = []
    for first, delta, count in lines:
        seqs = [(first + delta * index + 2**63) % 2**64 - 2**63 for index in range(count)]
        chunks_.append(Chunk(seqs, [None] * count, [0] * count, list(seqs)))
    if bent:
        seqs = [0, 1, 2, 10, 11] + [12] * 200
        chunks_.append(Chunk(seqs, [None] * len(seqs), [0] * len(seqs), list(seqs)))
    blobs = [columns.encode_v1_reference(chunk) for chunk in chunks_]  # format 1's lines
    found = columns_numpy.decode_many(blobs)
    expected = [seq for chunk in chunks_ for seq in chunk.seqs]
    assert found.seqs.tolist() == expected and found.values.tolist() == expected
