"""Column chunks: one stretch of a key's points (seqs, steps, timestamps, values) as compressed bytes.

The format (docs/columns.md, byte by byte) and its readable reference encoder and decoder, in pure
Python. runbus.storage.columns_numpy gives the same bytes and values a column at a time with numpy;
`encode_chunk` and `decode_chunk` are the path in use: numpy's where it imports, else this one
(`use()` switches; the tests run both and compare them bit for bit).

A chunk holds the consecutive points of one (run, label, key, epoch). Format 2, which the stores
write, keeps each column (seqs, steps, timestamps, values) as one pcodec chunk (`PCO`): pcodec
finds each column's delta order and bins, and decodes at hundreds of millions of values a second
in C. Format 1, which stores written before it hold, kept integers as delta-of-delta, zigzagged and
byte-shuffled, and floats as the smallest of three encodings (XOR with the previous value, plain,
or integral values as integers), byte-shuffled, the planes of zeros left out, noise stored as it
is and the rest compressed with zlib; both paths still decode it, and `encode_v1_reference`
writes it for the tests. Every float64 comes back bit for bit (NaN payloads, -0.0, ±inf); steps
never given stay None.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np
from pcodec import ChunkConfig, DeltaSpec, standalone

# The format written (2: pcodec columns), and those read (1: byte planes, as stores written before
# format 2 hold them).
VERSION = 2
V1 = 1
VERSIONS = (V1, VERSION)
_V1_BYTE = bytes([V1])


def is_v1(blob: bytes) -> bool:
    """Whether a chunk's header says format 1 (a damaged or empty blob says no: its read raises)."""
    return blob[:1] == _V1_BYTE

# The header: version, flags, count, then the chunk's bounds (first/last seq, min/max step,
# first/last ts) as little-endian int64s.
HEADER = struct.Struct("<BBI6q")
# Before each column's payload: its encoding and the payload's length in bytes.
COLUMN = struct.Struct("<BI")

FLAG_STEPS = 1  # some point has a step: a steps column follows the seqs
FLAG_STEP_NULLS = 2  # some point has none: a null mask follows the steps
FLAG_INTS = 4  # the values were logged as ints: they come back as ints

# Encodings, one code space for every column (the byte before each payload).
INT_DOD = 0  # int64: delta-of-delta, zigzag, byte planes (pack_planes)
INT_DOD_FROM_SEQS = 1  # steps only: steps minus seqs, then as INT_DOD
FLOAT_PLAIN = 2  # float64 bits as byte planes
FLOAT_XOR = 3  # float64 bits XOR the previous value's (the first XOR 0), as byte planes
FLOAT_INTEGRAL = 4  # float64 that are all integers (no -0.0): as int64, then as INT_DOD
NULL_MASK = 5  # one bit a point, least significant bit first, 1 where the step is null; zlib
PCO = 6  # format 2: the column as one pcodec standalone chunk of int64 (float64 for float values)

# Tried in this order; the smallest payload wins, the earlier on a tie.
FLOAT_CHOICES = (FLOAT_XOR, FLOAT_PLAIN, FLOAT_INTEGRAL)
STEP_CHOICES = (INT_DOD, INT_DOD_FROM_SEQS)

ZLIB_LEVEL = 6
MASK = (1 << 64) - 1
SIGN = 1 << 63
# Points in a chunk at most: a header that says more is damaged, and is refused before anything
# is allocated for it (a column of zeros holds any count in a few bytes).
MAX_COUNT = 1 << 20


class FormatError(ValueError):
    """The bytes are no column chunk this version of runbus reads: the caller cannot retry."""


class Bounds(NamedTuple):
    """What a chunk spans, read from its header alone: for the row that indexes it.
    Bounds of an empty chunk, and steps of a chunk without any, are 0."""

    points: int
    first_seq: int
    last_seq: int
    min_step: int
    max_step: int
    first_ts: int
    last_ts: int
    has_steps: bool
    ints: bool


class Chunk(NamedTuple):
    """A chunk's points as Python lists: what the reference encodes and decodes."""

    seqs: list[int]
    steps: list[int | None]
    ts: list[int]
    values: list[float] | list[int]


def bounds(blob: bytes) -> Bounds:
    """The bounds of an encoded chunk, from its header."""
    if len(blob) < HEADER.size or blob[0] not in VERSIONS:
        raise FormatError(f"not a column chunk of version {' or '.join(map(str, VERSIONS))}")
    _, flags, count, first_seq, last_seq, min_step, max_step, first_ts, last_ts = HEADER.unpack_from(blob)
    if count > MAX_COUNT:
        raise FormatError(f"a column chunk of {count} points, over the limit of {MAX_COUNT}")
    return Bounds(
        count,
        first_seq,
        last_seq,
        min_step,
        max_step,
        first_ts,
        last_ts,
        bool(flags & FLAG_STEPS),
        bool(flags & FLAG_INTS),
    )


def checked_count(*lengths: int) -> int:
    """The points of a chunk to encode from its columns' lengths; raises ValueError unless they
    are one length within MAX_COUNT."""
    if len(set(lengths)) != 1:
        raise ValueError("a chunk's columns must be of one length")
    if lengths[0] > MAX_COUNT:
        raise ValueError(f"a chunk holds at most {MAX_COUNT} points, not {lengths[0]}")
    return lengths[0]


def header(
    count: int,
    seqs: Sequence[int],
    steps: Sequence[int],
    ts: Sequence[int],
    flags: int,
    version: int = VERSION,
) -> bytes:
    """The header of a chunk of `count` points; `steps` are the non-null steps only."""
    if not count:
        return HEADER.pack(version, flags, 0, 0, 0, 0, 0, 0, 0)
    low, high = (min(steps), max(steps)) if len(steps) else (0, 0)
    return HEADER.pack(version, flags, count, seqs[0], seqs[-1], low, high, ts[0], ts[-1])


def column(encoding: int, payload: bytes) -> bytes:
    return COLUMN.pack(encoding, len(payload)) + payload


def mask_column(packed: bytes) -> bytes:
    """The null mask column of a chunk, from its bits packed least significant first."""
    return column(NULL_MASK, deflate(packed, ZLIB_LEVEL))


# A chunk's bytes, or a view of them.
B = TypeVar("B", bytes, memoryview)


def columns(blob: bytes) -> tuple[Bounds, list[tuple[int, bytes]]]:
    """A chunk's bounds and its columns' (encoding, payload), in order."""
    return _columns(blob, blob)


def column_views(blob: bytes) -> tuple[Bounds, list[tuple[int, memoryview]]]:
    """columns(), the payloads as views of `blob` rather than copies of its bytes (a read
    decodes them at once: a chunk's values need not be copied to be read)."""
    return _columns(blob, memoryview(blob))


def _columns(blob: bytes, data: B) -> tuple[Bounds, list[tuple[int, B]]]:
    found, parts, at = bounds(blob), [], HEADER.size
    while at < len(blob):
        if at + COLUMN.size > len(blob):
            raise FormatError("a column chunk ends inside a column's header")
        encoding, size = COLUMN.unpack_from(blob, at)
        at += COLUMN.size
        if at + size > len(blob):
            raise FormatError("a column chunk ends inside a column")
        parts.append((encoding, data[at : at + size]))
        at += size
    expected = 3 + bool(found.has_steps) + bool(blob[1] & FLAG_STEP_NULLS)
    if len(parts) != expected:
        raise FormatError(f"a column chunk with {len(parts)} columns where its flags say {expected}")
    allowed = _ENCODINGS[blob[0]]
    for encoding, _ in parts:
        if encoding not in allowed:
            raise FormatError(f"a version {blob[0]} column chunk with a column of encoding {encoding}")
    return found, parts


# The encodings each version's columns may have.
_ENCODINGS = {V1: frozenset(range(NULL_MASK + 1)), VERSION: frozenset({PCO, NULL_MASK})}


def seqs_column(blob: bytes) -> bytes:
    """A chunk's seqs column as its bytes stand (encoding, length, payload): two chunks of as
    many points whose seqs columns are the same bytes hold the same seqs, so a read can tell a
    key's chunk that holds its clock chunk's seqs without decoding either."""
    if len(blob) < HEADER.size + COLUMN.size:
        raise FormatError("a column chunk ends inside its seqs column's header")
    _, size = COLUMN.unpack_from(blob, HEADER.size)
    return blob[HEADER.size : HEADER.size + COLUMN.size + size]


def smallest(candidates: Sequence[tuple[int, bytes]]) -> tuple[int, bytes]:
    """The (encoding, payload) with the fewest bytes, the earliest of equals."""
    return min(candidates, key=lambda candidate: len(candidate[1]))


# pcodec's compression level for format 2's columns: 6 finds a schedule's second-order deltas (a
# warmup + cosine learning rate: 1.6 bytes a value, 5.9 at level 4) at twice level 8's encoding
# speed, within 1% of its bytes on bench/columns.py's mix.
PCO_LEVEL = 6
_PCO_CONFIG = ChunkConfig(compression_level=PCO_LEVEL)
# Integers also tried as first differences: pcodec's own guess keeps a counter that steps now and
# then (an epoch number: 0, 0, ..., 1, 1, ...) undifferenced, at 2 bits a value instead of ~0.
_PCO_DELTAS = ChunkConfig(compression_level=PCO_LEVEL, delta_spec=DeltaSpec.try_consecutive(1))


def pco_payload(values: Any) -> bytes:
    """A format 2 column's payload: `values` (an int64 or float64 array) as one pcodec chunk;
    integers as the smaller of pcodec's own choice and their first differences."""
    payload = bytes(standalone.simple_compress(values, _PCO_CONFIG))
    if values.dtype != np.int64:
        return payload
    differenced = bytes(standalone.simple_compress(values, _PCO_DELTAS))
    return differenced if len(differenced) < len(payload) else payload


def pco_into(payload: bytes | memoryview, out: Any) -> None:
    """A format 2 column's payload decoded into `out` (int64 or float64, as the column was
    written), which it must fill exactly."""
    try:
        # pcodec takes bytes alone: a view is copied (a chunk's columns are a few kB).
        progress = standalone.simple_decompress_into(bytes(payload), out)
    except (RuntimeError, ValueError, TypeError) as error:
        raise FormatError(f"a pcodec column does not decode: {error}") from None
    if progress.n_processed != len(out) or not progress.finished:
        raise FormatError(f"a pcodec column does not hold the {len(out)} values its chunk says")


def pco_values(payload: bytes | memoryview, count: int, dtype: type[np.generic]) -> Any:
    """A format 2 column's `count` values as a new array of `dtype` (int64 or float64)."""
    out = np.empty(count, dtype)
    if count:
        pco_into(payload, out)
    return out


def inflate(payload: bytes | memoryview, size: int) -> bytes:
    """A zlib payload that must hold exactly `size` bytes."""
    try:
        raw = zlib.decompress(payload)
    except zlib.error as error:
        raise FormatError(f"a column does not decompress: {error}") from None
    if len(raw) != size:
        raise FormatError(f"a column holds {len(raw)} bytes where its chunk needs {size}")
    return raw


# zlib's window (2**WBITS bytes) and hash memory for a chunk's compressed parts, which are a few kB
# (32 kB at the most): zlib's defaults (a 32 kB window, memLevel 8) cost ~95 µs a call to set up on
# this project's VM, these ~25 µs, for the same bytes on bench/history.py's mix. Any zlib stream
# inflates the same way whatever its window: chunks written with other settings still decode.
WBITS, MEM_LEVEL = 12, 4


def deflate(data: bytes, level: int) -> bytes:
    """zlib of `data`, with the window and memory a chunk's parts need."""
    packer = zlib.compressobj(level, zlib.DEFLATED, WBITS, MEM_LEVEL)
    return packer.compress(data) + packer.flush()


# zlib of nothing (a column whose kept planes are all stored, or none kept: a column of zeros),
# made once rather than for every such column.
_NOTHING_DEFLATED = deflate(b"", ZLIB_LEVEL)


# The bytes of a plane that incompressible() looks at: its first, as many as a typical chunk's.
SAMPLE = 512
# Distinct byte values that make a sample of n bytes noise (columns_numpy counts them too): 80% of
# what n random bytes hold on average, 256 (1 - (255/256)**n).
NOISE_DISTINCT = [math.ceil(0.8 * 256 * (1 - (255 / 256) ** n)) for n in range(SAMPLE + 1)]


def incompressible(plane: bytes) -> bool:
    """Whether a plane is left as it is: its first SAMPLE bytes take nearly as many distinct
    values as random bytes would. Noise (a float's low mantissa bytes, a clock's jitter) costs
    more to inflate than to copy. Counting is ~15 times cheaper than trying zlib on the plane,
    which was a third of the ingester's store time, and decides alike for 99% of the planes of
    bench/history.py's mix (the chunks came out 0.1% smaller)."""
    sample = plane[:SAMPLE]
    return len(set(sample)) >= NOISE_DISTINCT[len(sample)]


def pack_planes(planes: Sequence[bytes], count: int, noise: Sequence[bool] | None = None) -> bytes:
    """A shuffled column's payload from its 8 planes of `count` bytes: a byte whose bit k says
    plane k is kept (planes of zeros are not), a byte whose bit k says plane k is stored as it is,
    those planes in order, then zlib of the other kept planes in order. `noise` says of each
    plane what incompressible() would (a caller that knows it already), else it is asked."""
    empty = bytes(count)
    kept = [index for index, plane in enumerate(planes) if plane != empty]
    if noise is None:
        stored = [index for index in kept if incompressible(planes[index])]
    else:
        stored = [index for index in kept if noise[index]]
    packed = [index for index in kept if index not in stored]
    return b"".join(
        [
            bytes([sum(1 << index for index in kept), sum(1 << index for index in stored)]),
            *(planes[index] for index in stored),
            deflate(b"".join(planes[index] for index in packed), ZLIB_LEVEL) if packed else _NOTHING_DEFLATED,
        ]
    )


def unpack_planes(payload: bytes, count: int) -> list[memoryview | None]:
    """The 8 planes of a shuffled column's payload; None for a plane of zeros."""
    if len(payload) < 2:
        raise FormatError("a shuffled column without its plane masks")
    kept, stored = payload[0], payload[1]
    if stored & ~kept:
        raise FormatError("a shuffled column stores a plane it does not keep")
    stored_size = count * bin(stored).count("1")
    if len(payload) < 2 + stored_size:
        raise FormatError("a shuffled column ends inside its stored planes")
    raw = memoryview(payload)[2 : 2 + stored_size]
    packed = memoryview(inflate(payload[2 + stored_size :], count * bin(kept & ~stored).count("1")))
    planes: list[memoryview | None] = []
    for index in range(8):
        source = raw if stored >> index & 1 else packed
        if not kept >> index & 1:
            planes.append(None)
        elif source is raw:
            planes.append(raw[:count])
            raw = raw[count:]
        else:
            planes.append(packed[:count])
            packed = packed[count:]
    return planes


# The reference: one point at a time, in Python.


def _signed(word: int) -> int:
    return word - (1 << 64) if word & SIGN else word


def _shuffle(words: Sequence[int]) -> bytes:
    """uint64 words as byte planes (every word's first byte, then every word's second, and so
    on), packed by pack_planes."""
    raw = struct.pack(f"<{len(words)}Q", *words)
    return pack_planes([raw[plane::8] for plane in range(8)], len(words))


def _unshuffle(payload: bytes, count: int) -> list[int]:
    words = bytearray(8 * count)
    for index, plane in enumerate(unpack_planes(payload, count)):
        if plane is not None:
            words[index::8] = plane
    return list(struct.unpack(f"<{count}Q", words))


def _dod_words(values: Sequence[int]) -> list[int]:
    """int64s as zigzagged delta-of-delta words: x0, x1 - x0, then each delta minus the one before."""
    words, last, last_delta = [], 0, 0
    for index, value in enumerate(values):
        delta = (value - last) & MASK
        step = delta if index < 2 else (delta - last_delta) & MASK
        signed = _signed(step)
        words.append(((signed << 1) ^ (signed >> 63)) & MASK)
        last, last_delta = value, delta
    return words


def _undod_words(words: Sequence[int]) -> list[int]:
    values, last, delta = [], 0, 0
    for index, word in enumerate(words):
        step = (word >> 1) ^ (-(word & 1) & MASK)
        delta = step if index < 2 else (delta + step) & MASK
        last = (last + delta) & MASK
        values.append(_signed(last))
    return values


def _pack_ints(values: Sequence[int]) -> bytes:
    return _shuffle(_dod_words(values))


def _unpack_ints(payload: bytes, count: int) -> list[int]:
    return _undod_words(_unshuffle(payload, count))


def _float_bits(values: Sequence[float]) -> list[int]:
    return list(struct.unpack(f"<{len(values)}Q", struct.pack(f"<{len(values)}d", *values)))


def _bits_float(words: Sequence[int]) -> list[float]:
    return list(struct.unpack(f"<{len(words)}d", struct.pack(f"<{len(words)}Q", *words)))


def _integral(values: Sequence[float]) -> list[int] | None:
    """The values as ints if every one is an integer an int64 holds and -0.0 is not among them."""
    ints = []
    for value in values:
        if not (math.isfinite(value) and abs(value) < 2.0**63 and value == math.trunc(value)):
            return None
        if math.copysign(1.0, value) < 0 and value == 0:
            return None
        ints.append(int(value))
    return ints


def float_payload_reference(values: Sequence[float], encoding: int) -> bytes | None:
    """The float column's payload in `encoding`; None where it cannot hold these values."""
    if encoding == FLOAT_INTEGRAL:
        ints = _integral(values)
        return None if ints is None else _pack_ints(ints)
    bits = _float_bits(values)
    if encoding == FLOAT_XOR:
        bits = [word ^ before for word, before in zip(bits, [0, *bits], strict=False)]
    return _shuffle(bits)


def _unpack_floats(encoding: int, payload: bytes, count: int) -> list[float]:
    if encoding == PCO:
        return cast(list[float], pco_values(payload, count, np.float64).tolist())
    if encoding == FLOAT_INTEGRAL:
        return [float(value) for value in _unpack_ints(payload, count)]
    if encoding not in (FLOAT_PLAIN, FLOAT_XOR):
        raise FormatError(f"unknown float column encoding {encoding}")
    bits = _unshuffle(payload, count)
    if encoding == FLOAT_XOR:
        for index in range(1, count):
            bits[index] ^= bits[index - 1]
    return _bits_float(bits)


def _mask_bytes(nulls: Sequence[bool]) -> bytes:
    packed = bytearray((len(nulls) + 7) // 8)
    for index, null in enumerate(nulls):
        if null:
            packed[index >> 3] |= 1 << (index & 7)
    return bytes(packed)


def _values_column(values: list[float] | list[int]) -> tuple[int, bytes, bool]:
    """(encoding, payload, ints): ints when every value is an int (bools are not), else floats."""
    if _logged_ints(values):
        return INT_DOD, _pack_ints(cast(list[int], values)), True
    floats = [float(value) for value in values]
    tried = [(code, float_payload_reference(floats, code)) for code in FLOAT_CHOICES]
    return (*smallest([(code, payload) for code, payload in tried if payload is not None]), False)


def _steps_columns(seqs: list[int], steps: list[int | None]) -> tuple[int, list[bytes], list[int]]:
    """(flags, columns, the given steps) for a chunk's steps."""
    given = [step for step in steps if step is not None]
    if not given:
        return 0, [], given
    filled = [0 if step is None else step for step in steps]
    relative = [(step - seq + SIGN) % (1 << 64) - SIGN for step, seq in zip(filled, seqs, strict=True)]
    encoding, payload = smallest([(INT_DOD, _pack_ints(filled)), (INT_DOD_FROM_SEQS, _pack_ints(relative))])
    parts = [column(encoding, payload)]
    if len(given) == len(steps):
        return FLAG_STEPS, parts, given
    mask = mask_column(_mask_bytes([step is None for step in steps]))
    return FLAG_STEPS | FLAG_STEP_NULLS, [*parts, mask], given


def encode_v1_reference(chunk: Chunk) -> bytes:
    """A chunk's bytes in format 1, point by point in Python: what stores written before format 2
    hold, which the decoders still read (the tests write such chunks with it)."""
    seqs, steps, ts, values = chunk
    count = checked_count(len(seqs), len(steps), len(ts), len(values))
    step_flags, step_parts, given = _steps_columns(seqs, steps)
    encoding, payload, ints = _values_column(values)
    flags = step_flags | (FLAG_INTS if ints else 0)
    return b"".join(
        [
            header(count, seqs, given, ts, flags, V1),
            column(INT_DOD, _pack_ints(seqs)),
            *step_parts,
            column(INT_DOD, _pack_ints(ts)),
            column(encoding, payload),
        ]
    )


def _logged_ints(values: list[float] | list[int]) -> bool:
    """Whether a chunk's values are kept as ints: every one an int (bools are not)."""
    return bool(values) and all(type(value) is int for value in values)


def encode_reference(chunk: Chunk) -> bytes:
    """A chunk's bytes in format 2 from Python lists: each column one pcodec chunk."""
    seqs, steps, ts, values = chunk
    count = checked_count(len(seqs), len(steps), len(ts), len(values))
    given = [step for step in steps if step is not None]
    ints = _logged_ints(values)
    flags = (FLAG_STEPS if given else 0) | (FLAG_INTS if ints else 0)
    step_parts = []
    if given:
        step_parts.append(column(PCO, pco_payload(np.array([step or 0 for step in steps], np.int64))))
        if len(given) != count:
            flags |= FLAG_STEP_NULLS
            step_parts.append(mask_column(_mask_bytes([step is None for step in steps])))
    kept = np.array(values, np.int64) if ints else np.array([float(value) for value in values], np.float64)
    return b"".join(
        [
            header(count, seqs, given, ts, flags),
            column(PCO, pco_payload(np.array(seqs, np.int64))),
            *step_parts,
            column(PCO, pco_payload(np.array(ts, np.int64))),
            column(PCO, pco_payload(kept)),
        ]
    )


def _int_column(part: tuple[int, bytes], count: int) -> list[int]:
    encoding, payload = part
    if encoding == PCO:
        return cast(list[int], pco_values(payload, count, np.int64).tolist())
    if encoding != INT_DOD:
        raise FormatError(f"unknown integer column encoding {encoding}")
    return _unpack_ints(payload, count)


def _decode_steps(
    parts: list[tuple[int, bytes]], seqs: list[int], count: int, nulls: bool
) -> list[int | None]:
    encoding, payload = parts[0]
    if encoding not in (*STEP_CHOICES, PCO):
        raise FormatError(f"unknown steps column encoding {encoding}")
    steps = _int_column((PCO, payload), count) if encoding == PCO else _unpack_ints(payload, count)
    if encoding == INT_DOD_FROM_SEQS:
        steps = [_signed((step + seq) & MASK) for step, seq in zip(steps, seqs, strict=True)]
    if not nulls:
        return list(steps)
    if parts[1][0] != NULL_MASK:
        raise FormatError(f"a null mask column with encoding {parts[1][0]}")
    mask = inflate(parts[1][1], (count + 7) // 8)
    return [None if mask[index >> 3] >> (index & 7) & 1 else step for index, step in enumerate(steps)]


def decode_reference(blob: bytes) -> Chunk:
    """A chunk's points from its bytes, point by point in Python."""
    found, parts = columns(blob)
    count, flags = found.points, blob[1]
    seqs = _int_column(parts[0], count)
    steps: list[int | None] = [None] * count
    if flags & FLAG_STEPS:
        width = 2 if flags & FLAG_STEP_NULLS else 1
        steps = _decode_steps(parts[1 : 1 + width], seqs, count, bool(flags & FLAG_STEP_NULLS))
    ts = _int_column(parts[-2], count)
    values: list[float] | list[int] = (
        _int_column(parts[-1], count) if flags & FLAG_INTS else _unpack_floats(*parts[-1], count)
    )
    return Chunk(seqs, steps, ts, values)


# The path in use: numpy's where numpy imports (runbus.storage.columns_numpy), else the reference.
PATHS = ("numpy", "reference")
encode_chunk: Callable[[Chunk], bytes] = encode_reference
decode_chunk: Callable[[bytes], Chunk] = decode_reference
path_in_use = "reference"


def use(name: str) -> None:
    """Encode and decode with the path named `name`, 'numpy' or 'reference', from now on."""
    global encode_chunk, decode_chunk, path_in_use
    if name not in PATHS:
        raise ValueError(f"unknown column path {name!r}: use one of {', '.join(PATHS)}")
    if name == "numpy":
        import numpy  # noqa: F401  # ImportError here, where the switch is asked for

        encode_chunk, decode_chunk = _encode_with_numpy, _decode_with_numpy
    else:
        encode_chunk, decode_chunk = encode_reference, decode_reference
    path_in_use = name


# Looked up at each call: columns_numpy imports this module, and may be what is importing it.
def _encode_with_numpy(chunk: Chunk) -> bytes:
    from runbus.storage import columns_numpy

    return columns_numpy.encode_chunk(chunk)


def _decode_with_numpy(blob: bytes) -> Chunk:
    from runbus.storage import columns_numpy

    return columns_numpy.decode_chunk(blob)


def _use_the_fastest() -> None:
    try:
        use("numpy")
    except ImportError:
        # numpy is optional: without it the reference encodes the same bytes, slower.
        use("reference")


_use_the_fastest()
