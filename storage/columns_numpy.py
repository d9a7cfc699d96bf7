"""Column chunks a column at a time with numpy: the bytes and values of runbus.storage.columns' reference.

`encode_arrays` and `decode_arrays` work on numpy arrays (what the store's reads build tables
from); `encode_chunk` and `decode_chunk` take and give the reference's lists, for the switch in
runbus.storage.columns and the tests that compare the two paths bit for bit.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

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
    NULL_MASK,
    STEP_CHOICES,
    ZLIB_LEVEL,
    Chunk,
    FormatError,
    column,
    columns,
    header,
    inflate,
    smallest,
)

Ints = npt.NDArray[np.int64]
Words = npt.NDArray[np.uint64]
Floats = npt.NDArray[np.float64]
Mask = npt.NDArray[np.bool_]

_WORD = np.dtype("<u8")
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
    return words.astype(_WORD, copy=False).view(np.uint8).reshape(-1, 8).T.tobytes()


def _unshuffle(raw: bytes, count: int) -> Words:
    planes = np.frombuffer(raw, np.uint8).reshape(8, count)
    return np.ascontiguousarray(planes.T).view(_WORD).reshape(count)


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
    return zlib.compress(_shuffle(_dod_words(np.ascontiguousarray(values, np.int64))), ZLIB_LEVEL)


def unpack_ints(payload: bytes, count: int) -> Ints:
    return _undod_words(_unshuffle(inflate(payload, 8 * count), count))


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
    return zlib.compress(_shuffle(bits), ZLIB_LEVEL)


def unpack_floats(encoding: int, payload: bytes, count: int) -> Floats:
    if encoding == FLOAT_INTEGRAL:
        return unpack_ints(payload, count).astype(np.float64)
    if encoding not in (FLOAT_PLAIN, FLOAT_XOR):
        raise FormatError(f"unknown float column encoding {encoding}")
    bits = _unshuffle(inflate(payload, 8 * count), count)
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
    mask = zlib.compress(np.packbits(nulls, bitorder="little").tobytes(), ZLIB_LEVEL)
    return FLAG_STEPS | FLAG_STEP_NULLS, [*parts, column(NULL_MASK, mask)], given


def encode_arrays(arrays: Arrays) -> bytes:
    """A chunk's bytes from its arrays: the same bytes as the reference's for the same points."""
    seqs = np.ascontiguousarray(arrays.seqs, np.int64)
    steps = np.ascontiguousarray(arrays.steps, np.int64)
    ts = np.ascontiguousarray(arrays.ts, np.int64)
    count = len(seqs)
    if not len(steps) == len(ts) == len(arrays.values) == count:
        raise ValueError("a chunk's columns must be of one length")
    if arrays.step_nulls is not None and len(arrays.step_nulls) != count:
        raise ValueError("a chunk's columns must be of one length")
    step_flags, step_parts, given = _steps_columns(seqs, steps, arrays.step_nulls)
    encoding, payload, ints = _values_column(arrays.values)
    flags = step_flags | (FLAG_INTS if ints else 0)
    # The header's bounds as Python ints: numpy scalars would pack the same, at more cost.
    ends = (seqs[[0, -1]].tolist(), ts[[0, -1]].tolist()) if count else ([], [])
    bounds = [int(given.min()), int(given.max())] if len(given) else []
    return b"".join(
        [
            header(count, ends[0], bounds, ends[1], flags),
            column(INT_DOD, pack_ints(seqs)),
            *step_parts,
            column(INT_DOD, pack_ints(ts)),
            column(encoding, payload),
        ]
    )


def _int_column(part: tuple[int, bytes], count: int) -> Ints:
    encoding, payload = part
    if encoding != INT_DOD:
        raise FormatError(f"unknown integer column encoding {encoding}")
    return unpack_ints(payload, count)


def _decode_steps(
    parts: list[tuple[int, bytes]], seqs: Ints, count: int, flags: int
) -> tuple[Ints, Mask | None]:
    if not flags & FLAG_STEPS:
        return np.zeros(count, np.int64), np.ones(count, np.bool_)
    encoding, payload = parts[1]
    if encoding not in STEP_CHOICES:
        raise FormatError(f"unknown steps column encoding {encoding}")
    steps = unpack_ints(payload, count)
    if encoding == INT_DOD_FROM_SEQS:
        steps = (steps.view(np.uint64) + seqs.view(np.uint64)).view(np.int64)
    if not flags & FLAG_STEP_NULLS:
        return steps, None
    if parts[2][0] != NULL_MASK:
        raise FormatError(f"a null mask column with encoding {parts[2][0]}")
    packed = np.frombuffer(inflate(parts[2][1], (count + 7) // 8), np.uint8)
    nulls = np.unpackbits(packed, count=count, bitorder="little").view(np.bool_)
    return steps, nulls


def decode_arrays(blob: bytes) -> Arrays:
    """A chunk's arrays from its bytes."""
    found, parts = columns(blob)
    count, flags = found.count, blob[1]
    seqs = _int_column(parts[0], count)
    steps, nulls = _decode_steps(parts, seqs, count, flags)
    ts = _int_column(parts[-2], count)
    values = _int_column(parts[-1], count) if flags & FLAG_INTS else unpack_floats(*parts[-1], count)
    return Arrays(seqs, steps, nulls, ts, values)


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
