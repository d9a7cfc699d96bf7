"""Column chunks a column at a time with numpy: the bytes and values of runbus.storage.columns' reference.

`encode_arrays` and `decode_arrays` work on numpy arrays (what the store's reads build tables
from); `encode_chunk` and `decode_chunk` take and give the reference's lists, for the switch in
runbus.storage.columns and the tests that compare the two paths bit for bit. `decode_many`
decodes many chunks into one set of arrays: format 2's pcodec columns straight into their place,
format 1's byte planes gathered over the chunks and undone together. `encode_arrays_v1` writes
format 1, for the tests and bench/columns.py's comparison.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import groupby, pairwise
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from runbus.storage.columns import (
    FLAG_INTS,
    FLAG_STEP_NULLS,
    FLAG_STEPS,
    FLOAT_CHOICES,
    FLOAT_INTEGRAL,
    FLOAT_PLAIN,
    FLOAT_XOR,
    INT_DOD,
    INT_DOD_FROM_SEQS,
    NOISE_DISTINCT,
    NULL_MASK,
    PCO,
    SAMPLE,
    STEP_CHOICES,
    V1,
    ZLIB_LEVEL,
    Bounds,
    Chunk,
    FormatError,
    bounds,
    checked_count,
    column,
    column_views,
    columns,
    deflate,
    header,
    inflate,
    is_v1,
    mask_column,
    pack_planes,
    pco_into,
    pco_payload,
    pco_values,
    smallest,
)

Ints = npt.NDArray[np.int64]
Words = npt.NDArray[np.uint64]
Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]

_WORD = np.dtype("<u8")
# For a mask byte: which planes it names (as row indexes), and how many.
_PLANES_OF = [np.flatnonzero([mask >> index & 1 for index in range(8)]) for mask in range(256)]
_PLANES_IN = [bin(mask).count("1") for mask in range(256)]
_LIMIT = 2.0**63


class Arrays(NamedTuple):
    """A chunk's points as arrays. `step_nulls` is None where every point has a step, and all
    True where none has (`steps` then holds zeros); `values` are int64 where logged as ints."""

    seqs: Ints
    steps: Ints
    step_nulls: Mask | None
    ts: Ints
    values: Floats | Ints


def _shuffle(words: Words) -> bytes:
    # The planes made contiguous at once: each is then copied out, and sampled, in one stride.
    planes = np.ascontiguousarray(words.astype(_WORD, copy=False).view(np.uint8).reshape(-1, 8).T)
    return pack_planes([plane.tobytes() for plane in planes], len(words), _noise(planes))


# Where each plane's byte values count in _noise's table: plane k's from 256 k.
_PLANE_OFFSETS = (np.arange(8, dtype=np.uint16) * 256)[:, None]


def _noise(planes: npt.NDArray[np.uint8]) -> list[bool]:
    """columns.incompressible of each of 8 planes, counted in one pass: the distinct bytes of
    each plane's first SAMPLE."""
    sample = planes[:, :SAMPLE]
    seen = np.zeros(8 * 256, np.bool_)
    seen[(sample + _PLANE_OFFSETS).ravel()] = True
    noisy: list[bool] = (
        np.count_nonzero(seen.reshape(8, 256), axis=1) >= NOISE_DISTINCT[sample.shape[1]]
    ).tolist()
    return noisy


def _unshuffle(payload: bytes, count: int) -> Words:
    return _words([payload], [count])


# A zlib part that inflates to nothing, as pack_planes writes it: known, so never inflated.
_NOTHING_DEFLATED = deflate(b"", ZLIB_LEVEL)


def _dod_words(values: Ints) -> Words:
    """As the reference's: x0, x1 - x0, then each delta minus the one before, zigzagged."""
    words = values.view(np.uint64)
    deltas = words.copy()
    deltas[1:] -= words[:-1]
    steps = deltas.copy()
    steps[2:] -= deltas[1:-1]
    signed = steps.view(np.int64)
    return ((signed << 1) ^ (signed >> 63)).view(np.uint64)


def _undod_words(words: Words) -> Ints:
    steps = (words >> np.uint64(1)) ^ (np.uint64(0) - (words & np.uint64(1)))
    deltas = steps
    deltas[1:] = np.cumsum(steps[1:], dtype=np.uint64)
    return np.cumsum(deltas, dtype=np.uint64).view(np.int64)


def pack_ints(values: Ints) -> bytes:
    return _shuffle(_dod_words(np.ascontiguousarray(values, np.int64)))


def unpack_ints(payload: bytes, count: int) -> Ints:
    return _undod_words(_unshuffle(payload, count))


def _integral(values: Floats) -> Ints | None:
    finite = np.isfinite(values)
    if not finite.all() or not (np.abs(values) < _LIMIT).all():
        return None
    ints = values.astype(np.int64)
    # Bits compared, not values: -0.0 and fractions come back different.
    return ints if np.array_equal(ints.astype(np.float64).view(np.uint64), values.view(np.uint64)) else None


def float_payload(values: Floats, encoding: int) -> bytes | None:
    """The float column's payload in `encoding`; None where it cannot hold these values."""
    if encoding == FLOAT_INTEGRAL:
        ints = _integral(values)
        return None if ints is None else pack_ints(ints)
    bits = values.view(np.uint64)
    if encoding == FLOAT_XOR:
        bits = bits.copy()
        bits[1:] ^= values.view(np.uint64)[:-1]
    return _shuffle(bits)


def unpack_floats(encoding: int, payload: bytes, count: int) -> Floats:
    if encoding == PCO:
        floats: Floats = pco_values(payload, count, np.float64)
        return floats
    if encoding == FLOAT_INTEGRAL:
        return unpack_ints(payload, count).astype(np.float64)
    if encoding not in (FLOAT_PLAIN, FLOAT_XOR):
        raise FormatError(f"unknown float column encoding {encoding}")
    bits = _unshuffle(payload, count)
    if encoding == FLOAT_XOR:
        bits = np.bitwise_xor.accumulate(bits)
    return bits.view(np.float64)


def _values_column(values: Floats | Ints) -> tuple[int, bytes, bool]:
    if values.dtype == np.int64 and len(values):
        return INT_DOD, pack_ints(values.view(np.int64)), True
    floats = np.ascontiguousarray(values, np.float64)
    tried = [(code, float_payload(floats, code)) for code in FLOAT_CHOICES]
    return (*smallest([(code, payload) for code, payload in tried if payload is not None]), False)


def _steps_columns(seqs: Ints, steps: Ints, nulls: Mask | None) -> tuple[int, list[bytes], Ints]:
    filled = steps if nulls is None else np.where(nulls, 0, steps)
    given = filled if nulls is None else steps[~nulls]
    if not len(given):
        return 0, [], given
    relative = (filled.view(np.uint64) - seqs.view(np.uint64)).view(np.int64)
    encoding, payload = smallest([(INT_DOD, pack_ints(filled)), (INT_DOD_FROM_SEQS, pack_ints(relative))])
    parts = [column(encoding, payload)]
    if nulls is None or not nulls.any():
        return FLAG_STEPS, parts, given
    return FLAG_STEPS | FLAG_STEP_NULLS, [*parts, _mask_column(nulls)], given


def _mask_column(nulls: Mask) -> bytes:
    return mask_column(np.packbits(nulls, bitorder="little").tobytes())


def encode_arrays(arrays: Arrays) -> bytes:
    """A chunk's bytes (format 2) from its arrays: the same bytes as the reference's for the
    same points."""
    seqs = np.ascontiguousarray(arrays.seqs, np.int64)
    steps = np.ascontiguousarray(arrays.steps, np.int64)
    ts = np.ascontiguousarray(arrays.ts, np.int64)
    nulls = arrays.step_nulls
    lengths = (len(seqs), len(steps), len(ts), len(arrays.values))
    count = checked_count(*lengths, *(() if nulls is None else (len(nulls),)))
    ints = arrays.values.dtype == np.int64 and count > 0
    values = np.ascontiguousarray(arrays.values, np.int64 if ints else np.float64)
    given = steps if nulls is None else steps[~nulls]
    flags = (FLAG_STEPS if len(given) else 0) | (FLAG_INTS if ints else 0)
    step_parts = []
    if len(given):
        filled = steps if nulls is None else np.where(nulls, 0, steps)
        step_parts.append(column(PCO, pco_payload(filled)))
        if nulls is not None and nulls.any():
            flags |= FLAG_STEP_NULLS
            step_parts.append(_mask_column(nulls))
    # The header's bounds as Python ints: numpy scalars would pack the same, at more cost.
    ends = (seqs[[0, -1]].tolist(), ts[[0, -1]].tolist()) if count else ([], [])
    bounds = [int(given.min()), int(given.max())] if len(given) else []
    return b"".join(
        [
            header(count, ends[0], bounds, ends[1], flags),
            column(PCO, pco_payload(seqs)),
            *step_parts,
            column(PCO, pco_payload(ts)),
            column(PCO, pco_payload(values)),
        ]
    )


def encode_arrays_v1(arrays: Arrays) -> bytes:
    """A chunk's bytes in format 1 from its arrays: the same bytes as encode_v1_reference's."""
    seqs = np.ascontiguousarray(arrays.seqs, np.int64)
    steps = np.ascontiguousarray(arrays.steps, np.int64)
    ts = np.ascontiguousarray(arrays.ts, np.int64)
    nulls = () if arrays.step_nulls is None else (len(arrays.step_nulls),)
    count = checked_count(len(seqs), len(steps), len(ts), len(arrays.values), *nulls)
    step_flags, step_parts, given = _steps_columns(seqs, steps, arrays.step_nulls)
    encoding, payload, ints = _values_column(arrays.values)
    flags = step_flags | (FLAG_INTS if ints else 0)
    # The header's bounds as Python ints: numpy scalars would pack the same, at more cost.
    ends = (seqs[[0, -1]].tolist(), ts[[0, -1]].tolist()) if count else ([], [])
    bounds = [int(given.min()), int(given.max())] if len(given) else []
    return b"".join(
        [
            header(count, ends[0], bounds, ends[1], flags, V1),
            column(INT_DOD, pack_ints(seqs)),
            *step_parts,
            column(INT_DOD, pack_ints(ts)),
            column(encoding, payload),
        ]
    )


def _int_words(part: tuple[int, bytes], count: int) -> Words:
    encoding, payload = part
    if encoding != INT_DOD:
        raise FormatError(f"unknown integer column encoding {encoding}")
    return _unshuffle(payload, count)


def _int_column(part: tuple[int, bytes], count: int) -> Ints:
    if part[0] == PCO:
        ints: Ints = pco_values(part[1], count, np.int64)
        return ints
    return _undod_words(_int_words(part, count))


def _nulls(parts: Sequence[tuple[int, bytes | memoryview]], count: int) -> Mask:
    if parts[2][0] != NULL_MASK:
        raise FormatError(f"a null mask column with encoding {parts[2][0]}")
    packed = np.frombuffer(inflate(parts[2][1], (count + 7) // 8), np.uint8)
    return np.unpackbits(packed, count=count, bitorder="little").view(np.bool_)


def _decode_steps(
    parts: list[tuple[int, bytes]], seqs: Ints, count: int, flags: int
) -> tuple[Ints, Mask | None]:
    if not flags & FLAG_STEPS:
        return np.zeros(count, np.int64), np.ones(count, np.bool_)
    encoding, payload = parts[1]
    if encoding not in (*STEP_CHOICES, PCO):
        raise FormatError(f"unknown steps column encoding {encoding}")
    steps = _int_column(parts[1], count) if encoding == PCO else unpack_ints(payload, count)
    if encoding == INT_DOD_FROM_SEQS:
        steps = (steps.view(np.uint64) + seqs.view(np.uint64)).view(np.int64)
    if not flags & FLAG_STEP_NULLS:
        return steps, None
    return steps, _nulls(parts, count)


def decode_arrays(blob: bytes) -> Arrays:
    """A chunk's arrays from its bytes."""
    found, parts = columns(blob)
    count, flags = found.points, blob[1]
    seqs = _int_column(parts[0], count)
    steps, nulls = _decode_steps(parts, seqs, count, flags)
    ts = _int_column(parts[-2], count)
    values = _int_column(parts[-1], count) if flags & FLAG_INTS else unpack_floats(*parts[-1], count)
    return Arrays(seqs, steps, nulls, ts, values)


def _undod_segments(words: Words, starts: Ints, counts: Ints) -> Ints:
    """_undod_words over chunks laid end to end (`starts` and `counts` of each, none empty):
    two running sums over all of them at once, each chunk's start set so that the sums start
    again there (from the segment sums of the chunk before, np.add.reduceat). The values are
    made in `words`' memory, with no column-sized workings: a fresh page costs more on many
    machines than the arithmetic on it."""
    if np.count_nonzero(words) <= 2 * len(starts):
        # A first value and a delta a chunk at most set (steps, constants, counters): the
        # zigzag undone on those alone. (np.flatnonzero is several times faster on a mask.)
        at = np.flatnonzero(words != 0)
        word = words[at]
        words[at] = (word >> np.uint64(1)) ^ (np.uint64(0) - (word & np.uint64(1)))
        if _lines(words, starts, counts, at):
            return words.view(np.int64)
    else:
        _unzigzag(words)
    # Each chunk's first word is its first value: kept aside, the chunk's deltas start at 0.
    firsts = words[starts]
    words[starts] = 0
    # deltas: a chunk's start cancels what the chunk before added up.
    _restart_at(words, starts, np.zeros(len(starts), np.uint64))
    np.cumsum(words, out=words)
    # values: each chunk's start is its first value, less where the chunk before ended.
    _restart_at(words, starts, firsts)
    np.cumsum(words, out=words)
    return words.view(np.int64)


# Points a chunk holds on average, at least, for _lines to make each chunk's points apart.
LINE_POINTS = 64


def _lines(words: Words, starts: Ints, counts: Ints, at: Ints) -> bool:
    """Where each chunk's delta never changes (a step, a constant, a counter: no word is set
    past a chunk's second), each chunk's points made at once from its first value and delta
    (`words` hold them, the zigzag undone, at `at`: the words not zero), rather than two running
    sums over them all; False, with `words` as they were given, elsewhere."""
    if len(words) < LINE_POINTS * len(starts):
        return False
    chunk = np.searchsorted(starts, at, side="right") - 1
    offset = at - starts[chunk]
    if len(offset) and int(offset.max()) > 1:
        return False
    firsts = np.zeros(len(starts), np.uint64)
    deltas = np.zeros(len(starts), np.uint64)
    firsts[chunk[offset == 0]] = words[at[offset == 0]]
    deltas[chunk[offset == 1]] = words[at[offset == 1]]
    for start, count, first, delta in zip(starts.tolist(), counts.tolist(), firsts, deltas, strict=True):
        points = words[start : start + count]
        np.multiply(np.arange(count, dtype=np.uint64), delta, out=points)
        points += first
    return True


# A plane of a column is written at its set bytes alone where fewer than one in SPARSE_SHARE is set.
SPARSE_SHARE = 8
# Points whose workings are made at a time: few enough that they are taken from memory freed
# before (under glibc's 128 kB mmap threshold), not from fresh pages.
BLOCK_POINTS = 1 << 13


def _unzigzag(words: Words) -> None:
    """The zigzag undone in place, a block at a time."""
    low = np.empty(min(len(words), BLOCK_POINTS), np.uint64)
    for at in range(0, len(words), BLOCK_POINTS):
        block = words[at : at + BLOCK_POINTS]
        mine = low[: len(block)]
        np.bitwise_and(block, np.uint64(1), out=mine)
        np.negative(mine, out=mine)
        block >>= np.uint64(1)
        block ^= mine


def _restart_at(words: Words, starts: Ints, values: Words) -> None:
    """Set each chunk's first word so that a running sum over all the chunks reaches `values`
    there (its other words unchanged, all modulo 2**64): chunk i's first word becomes
    values[i] minus (values[i-1] plus the chunk i-1's words after its first)."""
    sums = np.add.reduceat(words, starts, dtype=np.uint64)  # each chunk's words, its first at 0
    words[starts[0]] = values[0]
    if len(starts) > 1:
        words[starts[1:]] = values[1:] - (values[:-1] + sums[:-1])


# How a chunk's values column decodes in decode_many: its encoding, with ints apart.
_LOGGED_INTS = -1


def _words(
    payloads: Sequence[bytes | memoryview | None],
    counts: Sequence[int],
    out: npt.NDArray[np.generic] | None = None,
) -> Words:
    """One column of many chunks (a payload of `counts` points each; None: a chunk without the
    column, zeros) as words, gathered plane by plane: each payload is taken as it comes (its
    stored planes viewed, the others inflated), then each plane that any chunk keeps is laid end
    to end over the chunks (zeros for a chunk that does not keep it), joined once and written
    into the words in one strided copy, not a chunk at a time. Every word is written (plane 0
    widened into whole words, zeros where no chunk keeps it): `out` (8 bytes a point, the
    caller's memory where the words and then the values go) need not start zeroed."""
    chunks = [
        _Payload(b"", b"", 0, 0, count) if payload is None else _payload(payload, count)
        for payload, count in zip(payloads, counts, strict=True)
    ]
    total, kept = sum(counts), 0
    for chunk in chunks:
        kept |= chunk.kept
    words: Words = np.empty(total, _WORD) if out is None else out.view(_WORD)
    if kept & 1:
        np.copyto(words, _plane(chunks, 0))  # widened: the words' other bytes 0
    else:
        words.fill(0)
    rows = words.view(np.uint8).reshape(total, 8)
    for index in _PLANES_OF[kept & ~1].tolist():
        for start, plane in _plane_runs(chunks, index):
            column = rows[start : start + len(plane), index]
            if np.count_nonzero(plane) * SPARSE_SHARE < len(plane):
                # Mostly zeros (a clock's high bytes: set at each chunk's first point alone):
                # the others only, the words' other bytes being zeros already.
                at = np.flatnonzero(plane != 0)  # several times faster on a mask
                column[at] = plane[at]
            else:
                column[:] = plane
    return words


def _plane_runs(chunks: list[_Payload], index: int) -> list[tuple[int, npt.NDArray[np.uint8]]]:
    """Plane `index` of each run of chunks that keep it, end to end, with the point where the
    run starts: the chunks between (zeros there already) are not written again."""
    bit = 1 << index
    if all(chunk.kept & bit for chunk in chunks):  # the usual: one run of every chunk
        return [(0, _plane(chunks, index))]
    runs: list[tuple[int, npt.NDArray[np.uint8]]] = []
    pieces: list[bytes | memoryview] = []
    start = at = 0
    for chunk in chunks:
        if chunk.kept & bit:
            start = start if pieces else at
            pieces.append(_piece(chunk, index))
        elif pieces:
            runs.append((start, np.frombuffer(b"".join(pieces), np.uint8)))
            pieces = []
        at += chunk.points
    if pieces:
        runs.append((start, np.frombuffer(b"".join(pieces), np.uint8)))
    return runs


def _plane(chunks: list[_Payload], index: int) -> npt.NDArray[np.uint8]:
    """Plane `index` of every chunk, end to end (zeros for a chunk that does not keep it)."""
    bit, below = 1 << index, (1 << index) - 1
    # _piece's, inline: a call per chunk and plane would cost more than the bytes it copies.
    pieces = [
        chunk.view[2 + _PLANES_IN[chunk.stored & below] * chunk.points :][: chunk.points]
        if chunk.stored & bit
        else chunk.inflated[_PLANES_IN[chunk.kept & ~chunk.stored & below] * chunk.points :][: chunk.points]
        if chunk.kept & bit
        else _zeros(chunk.points)
        for chunk in chunks
    ]
    return np.frombuffer(b"".join(pieces), np.uint8)


def _piece(chunk: _Payload, index: int) -> bytes | memoryview:
    """Plane `index` of a chunk that keeps it: in its stored planes or in those it inflated."""
    below, count = (1 << index) - 1, chunk.points
    if chunk.stored >> index & 1:
        return chunk.view[2 + _PLANES_IN[chunk.stored & below] * count :][:count]
    return chunk.inflated[_PLANES_IN[chunk.kept & ~chunk.stored & below] * count :][:count]


class _Payload(NamedTuple):
    """A chunk's shuffled column, its planes where they lie: stored ones in `view` (after the
    two mask bytes), the other kept ones in `inflated`, in plane order."""

    view: bytes | memoryview
    inflated: bytes | memoryview
    kept: int
    stored: int
    points: int


def _payload(payload: bytes | memoryview, count: int) -> _Payload:
    """A payload's planes (as unpack_planes reads them), checked, the packed ones inflated."""
    if len(payload) < 2:
        raise FormatError("a shuffled column without its plane masks")
    kept, stored = payload[0], payload[1]
    if stored & ~kept:
        raise FormatError("a shuffled column stores a plane it does not keep")
    stored_size = _PLANES_IN[stored] * count
    if len(payload) < 2 + stored_size:
        raise FormatError("a shuffled column ends inside its stored planes")
    packed = kept & ~stored
    rest = payload[2 + stored_size :]
    inflated: bytes | memoryview = b""
    if packed or rest != _NOTHING_DEFLATED:
        inflated = memoryview(inflate(rest, _PLANES_IN[packed] * count))
    return _Payload(memoryview(payload) if stored else b"", inflated, kept, stored, count)


_ZEROS: dict[int, bytes] = {}


def _zeros(count: int) -> bytes:
    """`count` zero bytes: a plane a chunk does not keep (one object for every such plane)."""
    zero = _ZEROS.get(count)
    if zero is None:
        if len(_ZEROS) >= 64:  # chunks of many sizes: the table kept small
            _ZEROS.clear()
        zero = _ZEROS[count] = bytes(count)
    return zero


class _Gathered(NamedTuple):
    counts: Ints
    seqs: Words
    steps: Words
    steps_from_seqs: Mask  # a chunk at a time
    nulls: Mask
    ts: Words
    values: Words
    value_encodings: Ints  # a chunk at a time, _LOGGED_INTS for ints


def _parsed(blobs: Sequence[bytes]) -> list[tuple[int, int, list[tuple[int, memoryview]]]]:
    """(count, flags, columns) of each chunk that holds points, its encodings checked."""
    found = []
    for blob in blobs:
        bounds, encoded = column_views(blob)
        flags = blob[1]
        if not bounds.points:
            continue
        values = encoded[-1][0]
        if (encoded[0][0], encoded[-2][0]) != (INT_DOD, INT_DOD) or values not in (INT_DOD, *FLOAT_CHOICES):
            raise FormatError("a column chunk with an unknown column encoding")
        if flags & FLAG_STEPS and encoded[1][0] not in STEP_CHOICES:
            raise FormatError(f"unknown steps column encoding {encoded[1][0]}")
        found.append((bounds.points, flags, encoded))
    return found


def _gather(blobs: Sequence[bytes], times: bool = True, into: Arrays | None = None) -> _Gathered:
    """Every column of `blobs` as words, a column at a time (a column's inflated planes are held
    only while its words are made)."""
    found = _parsed(blobs)
    sizes = [count for count, _, _ in found]
    counts = np.array(sizes, np.int64)
    # Where each column goes: the caller's arrays, or new ones.
    outs: tuple[Any, ...] = (None,) * 5 if into is None else tuple(into)
    seqs, steps, nulls, ts, values = outs
    return _Gathered(
        counts,
        _words([encoded[0][1] for _, _, encoded in found], sizes, seqs),
        _words([encoded[1][1] if flags & FLAG_STEPS else None for _, flags, encoded in found], sizes, steps),
        np.array([_steps_from_seqs(flags, encoded) for _, flags, encoded in found], np.bool_),
        _step_nulls(found, counts, nulls),
        _words([encoded[-2][1] for _, _, encoded in found], sizes, ts) if times else np.zeros(0, _WORD),
        _words([encoded[-1][1] for _, _, encoded in found], sizes, values),
        np.array([_value_encoding(flags, encoded) for _, flags, encoded in found], np.int64),
    )


def _steps_from_seqs(flags: int, encoded: list[tuple[int, memoryview]]) -> bool:
    return bool(flags & FLAG_STEPS) and encoded[1][0] == INT_DOD_FROM_SEQS


def _value_encoding(flags: int, encoded: list[tuple[int, memoryview]]) -> int:
    return _LOGGED_INTS if flags & FLAG_INTS else encoded[-1][0]


def _step_nulls(
    found: list[tuple[int, int, list[tuple[int, memoryview]]]], counts: Ints, into: Mask | None
) -> Mask:
    """Which points have no step (in `into` where given): a chunk's null mask, or all of a
    chunk without steps."""
    nulls = np.zeros(int(counts.sum()), np.bool_) if into is None else into
    nulls.fill(False)
    for at, (count, flags, encoded) in zip((np.cumsum(counts) - counts).tolist(), found, strict=True):
        if flags & FLAG_STEP_NULLS:
            nulls[at : at + count] = _nulls(encoded, count)
        elif not flags & FLAG_STEPS:
            nulls[at : at + count] = True
    return nulls


def _values_of(gathered: _Gathered, starts: Ints) -> Floats | Ints:
    """The values of chunks decoded together, whatever each chunk's encoding, in place: each
    run of chunks of one kind (XOR, integers, plain bits) decoded together (a chunk's points lie
    together), with no column-sized workings."""
    counts, encodings, words = gathered.counts, gathered.value_encodings, gathered.values
    if (encodings == _LOGGED_INTS).all():
        return _undod_segments(words, starts, counts)
    # 1: XOR, 2: integers (logged so, or floats kept as integers), 0: the bits as they are.
    kinds = (encodings == FLOAT_XOR) + 2 * ((encodings == _LOGGED_INTS) | (encodings == FLOAT_INTEGRAL))
    edges = [0, *(np.flatnonzero(kinds[1:] != kinds[:-1]) + 1).tolist(), len(counts)]
    for first, end in pairwise(edges):
        kind = int(kinds[first])
        if not kind:
            continue
        run = words[int(starts[first]) : int(starts[end - 1] + counts[end - 1])]
        run_starts = starts[first:end] - starts[first]
        if kind == 1:
            _unxor(run, run_starts)
        else:
            _undod_segments(run, run_starts, counts[first:end])
            _floats_in_place(run)
    return words.view(np.float64)


def _unxor(words: Words, starts: Ints) -> None:
    """XOR chunks laid end to end decoded in place: one running XOR, each chunk's first word
    XORing out where the chunk before ended (that chunk's words XORed together)."""
    ended = np.bitwise_xor.reduceat(words, starts)
    words[starts[1:]] ^= ended[:-1]
    np.bitwise_xor.accumulate(words, out=words)


def _floats_in_place(words: Words) -> None:
    """int64 values in `words` made float64 in the same memory, a block at a time (numpy copies
    an overlapping source first: the block bounds what that costs)."""
    ints, floats = words.view(np.int64), words.view(np.float64)
    for at in range(0, len(words), BLOCK_POINTS):
        floats[at : at + BLOCK_POINTS] = ints[at : at + BLOCK_POINTS]


def decode_many(blobs: Sequence[bytes], times: bool = True, into: Arrays | None = None) -> Arrays:
    """The points of many chunks, one chunk after another, as one set of arrays: what a read of
    a key across its chunks wants, at a fraction of decode_arrays' cost per chunk. Values are
    int64 where every chunk's were logged as ints, else float64 (ints converted, as a store of
    float64 values keeps them). Without `times`, the ts column is left undecoded (and empty):
    a store's series chunks hold zeros there, their times are their clock's (decode_times).

    `into`: arrays of as many points as the chunks hold (a step_nulls array, float64 values)
    where the columns are decoded in place, with no copy: the arrays returned are those."""
    if all(map(is_v1, blobs)):  # a store written before format 2
        return _many_v1(blobs, times, into)
    chunks = _with_points(blobs)
    total = sum(head.points for _, head in chunks)
    into = into or _columns_for(total, times, bool(chunks) and all(head.ints for _, head in chunks))
    nulls = np.empty(total, np.bool_) if into.step_nulls is None else into.step_nulls
    for version, found, at, end in _runs(chunks):
        part = _part(into, nulls, at, end)
        if version == V1:
            _many_v1([blob for blob, _ in found], times, part)
        else:
            _many_v2(found, times, part, nulls[at:end])
    return into._replace(
        step_nulls=nulls if nulls.any() else None,
        ts=into.ts if times else np.zeros(0, np.int64),
    )


def _part(into: Arrays, nulls: Mask, at: int, end: int) -> Arrays:
    """Points at:end of `into` (its step nulls in `nulls`), as views."""
    return Arrays(into.seqs[at:end], into.steps[at:end], nulls[at:end], into.ts[at:end], into.values[at:end])


def _columns_for(total: int, times: bool, ints: bool) -> Arrays:
    """decode_many's arrays for `total` points (ts only with `times`; int64 values if `ints`)."""
    values: Floats | Ints = np.empty(total, np.int64) if ints else np.empty(total, np.float64)
    ts = np.empty(total if times else 0, np.int64)
    return Arrays(np.empty(total, np.int64), np.empty(total, np.int64), np.empty(total, np.bool_), ts, values)


def _runs(chunks: list[tuple[bytes, Bounds]]) -> Iterator[tuple[int, list[tuple[bytes, Bounds]], int, int]]:
    """Each run of chunks of one format: (version, its chunks, where its points start and end)."""
    at = 0
    for version, run in groupby(chunks, key=lambda chunk: chunk[0][0]):
        found = list(run)
        end = at + sum(head.points for _, head in found)
        yield version, found, at, end
        at = end


def _with_points(blobs: Sequence[bytes]) -> list[tuple[bytes, Bounds]]:
    """Each chunk that holds points, with its bounds (decode_many leaves empty chunks out)."""
    found = [(blob, bounds(blob)) for blob in blobs]
    return [(blob, head) for blob, head in found if head.points]


def _many_v2(chunks: list[tuple[bytes, Bounds]], times: bool, into: Arrays, nulls: Mask) -> None:
    """Format 2 chunks decoded into `into` (`nulls`: its step_nulls), each column of each chunk
    straight into its place."""
    at = 0
    for blob, head in chunks:
        _, encoded = columns(blob)
        end, flags = at + head.points, blob[1]
        pco_into(encoded[0][1], into.seqs[at:end])
        steps, no_step = into.steps[at:end], nulls[at:end]
        if not flags & FLAG_STEPS:
            steps.fill(0)
            no_step.fill(True)
        else:
            pco_into(encoded[1][1], steps)  # a null's step is written as 0
            no_step[:] = _nulls(encoded, head.points) if flags & FLAG_STEP_NULLS else False
        if times:
            pco_into(encoded[-2][1], into.ts[at:end])
        values = into.values[at:end]
        if flags & FLAG_INTS and values.dtype != np.int64:  # logged as ints, kept as float64
            values[:] = pco_values(encoded[-1][1], head.points, np.int64)
        else:
            pco_into(encoded[-1][1], values)
        at = end


def _many_v1(blobs: Sequence[bytes], times: bool, into: Arrays | None) -> Arrays:
    """Format 1 chunks decoded together: their byte planes gathered over the chunks, then each
    column's running sums or XORs undone over all of them at once."""
    gathered = _gather(blobs, times, into)
    counts = gathered.counts
    if not len(counts):
        if into is not None:
            return into._replace(step_nulls=None, ts=into.ts if times else np.zeros(0, np.int64))
        return Arrays(np.zeros(0, np.int64), np.zeros(0, np.int64), None, np.zeros(0, np.int64), np.zeros(0))
    starts = np.cumsum(counts) - counts
    seqs = _undod_segments(gathered.seqs, starts, counts)
    ts = _undod_segments(gathered.ts, starts, counts) if gathered.ts.any() else gathered.ts.view(np.int64)
    steps = _undod_segments(gathered.steps, starts, counts)
    if gathered.steps_from_seqs.all():
        steps.view(np.uint64)[:] += seqs.view(np.uint64)
    elif gathered.steps_from_seqs.any():
        relative = np.repeat(gathered.steps_from_seqs, counts)
        steps[relative] = (steps[relative].view(np.uint64) + seqs[relative].view(np.uint64)).view(np.int64)
    values = _values_of(gathered, starts)
    if into is not None and values.dtype != into.values.dtype:  # logged as ints, kept as float64
        _floats_in_place(gathered.values)  # into.values' memory
        values = into.values
    nulls = gathered.nulls
    if nulls.any():
        steps[nulls] = 0
        return Arrays(seqs, steps, nulls, ts, values)
    return Arrays(seqs, steps, None, ts, values)


def decode_times(blobs: Sequence[bytes], into: Ints | None = None) -> Ints:
    """The ts column alone of many chunks, one chunk after another (decode_many's `ts`): a
    clock's timestamps, where a read has its seqs already; decoded in `into` where given."""
    if all(map(is_v1, blobs)):
        return _times_v1(blobs, into)
    chunks = _with_points(blobs)
    total = sum(head.points for _, head in chunks)
    out: Ints = np.empty(total, np.int64) if into is None else into
    for version, found, at, end in _runs(chunks):
        if version == V1:
            _times_v1([blob for blob, _ in found], out[at:end])
            continue
        for blob, head in found:
            pco_into(columns(blob)[1][-2][1], out[at : at + head.points])
            at += head.points
    return out


def _times_v1(blobs: Sequence[bytes], into: Ints | None) -> Ints:
    found = _parsed(blobs)
    sizes = [count for count, _, _ in found]
    counts = np.array(sizes, np.int64)
    words = _words([encoded[-2][1] for _, _, encoded in found], sizes, into)
    if not words.any():
        return words.view(np.int64)
    return _undod_segments(words, np.cumsum(counts) - counts, counts)


def arrays_of(chunk: Chunk) -> Arrays:
    """The reference's lists as arrays (ints where every value is an int, as the reference keeps)."""
    seqs, steps, ts, values = chunk
    nulls = np.array([step is None for step in steps], np.bool_)
    filled = np.array([0 if step is None else step for step in steps], np.int64)
    ints = bool(values) and all(type(value) is int for value in values)
    column_values = np.array(values, np.int64) if ints else np.array([float(v) for v in values], np.float64)
    return Arrays(
        np.array(seqs, np.int64),
        filled,
        nulls if nulls.any() else None,
        np.array(ts, np.int64),
        column_values,
    )


def chunk_of(arrays: Arrays) -> Chunk:
    """Arrays as the reference's lists."""
    steps: list[int | None] = list(arrays.steps.tolist())
    if arrays.step_nulls is not None:
        steps = [None if null else step for step, null in zip(steps, arrays.step_nulls.tolist(), strict=True)]
    return Chunk(arrays.seqs.tolist(), steps, arrays.ts.tolist(), arrays.values.tolist())


def encode_chunk(chunk: Chunk) -> bytes:
    return encode_arrays(arrays_of(chunk))


def decode_chunk(blob: bytes) -> Chunk:
    return chunk_of(decode_arrays(blob))
