"""Column chunks (runbus.storage.columns) on a realistic run: bytes per point and encode/decode rates.

A run like issue #22's: 64 labels x 2,000 steps x 20 keys (2.56M points) of noisy losses with full
53-bit mantissas, smooth schedules (warmup then cosine), constants, integer counters (logged as
ints, and one as floats) and float32-origin metrics; one event per step holds all 20 keys, seqs
skip where a label logged something else between steps, steps are aligned with seqs, timestamps
come from a clock ticking each step with jitter (µs). Each (label, key) is encoded in chunks of
256, 1,024 and 4,096 points (a label's 2,000 points fit one 4,096 chunk).

Reported: bytes per point for each column and in all (headers included), the values column per
kind of key under each float scheme (format 2's pcodec column, format 1's choice and its XOR and
plain encodings, XOR + shuffle + zlib, shuffle + zlib, XOR + zlib without the shuffle, zlib alone,
Gorilla's bit packing, XOR + shuffle + lzma),
timestamps once per key against once per event, and points encoded and decoded per second by
the numpy path (chunk by chunk with decode_arrays, and a key's chunks across its labels at
once with decode_many) and by the reference (on 4 labels' share: it is the readable one).

    python bench/columns.py [--labels 64] [--steps 2000] [--sizes 256,1024,4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import lzma
import sys
import time
import zlib
from collections.abc import Callable, Iterator

import numpy as np
from common import emit

from runbus.storage import columns, columns_numpy
from runbus.storage.columns_numpy import Arrays

KINDS = {  # kind of key -> how many of the 20
    "noisy": 6,  # losses and grad norms: float64 arithmetic on noise, every mantissa bit used
    "grad_norm": 2,
    "schedule": 3,  # lr warmup + cosine, weight decay, momentum: smooth, full mantissas
    "constant": 3,  # batch size, dropout, max lr
    "int_counter": 3,  # tokens and samples seen, epoch: logged as Python ints
    "float_counter": 1,  # global step logged as a float
    "float32": 2,  # accuracy-like metrics computed in float32, then float()
}
TARGETS = {
    "bytes_per_point_overall": 6.0,
    "constant_and_counter_bytes_per_point": 1.0,
    "decode_values_per_s": 10e6,
}
TICK_US = 350_000  # a step every 0.35 s


def key_values(kind: int, name: str, steps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One label's values of one key, a value per step."""
    s = steps.astype(np.float64)
    if name == "noisy":
        return 2.5 * np.exp(-s / (700 + 300 * rng.random())) + 0.3 + rng.normal(0, 0.05, len(s))
    if name == "grad_norm":
        return np.abs(rng.normal(1.0, 0.3, len(s))) * (1 + 5 * np.exp(-s / 100))
    if name == "schedule":
        warm = 100 + 50 * kind
        peak = [3e-4, 0.1, 0.9][kind % 3]
        cosine = 0.5 * (1 + np.cos(np.pi * np.clip((s - warm) / (len(s) - warm), 0, 1)))
        return np.where(s < warm, peak * s / warm, peak * cosine)
    if name == "constant":
        return np.full(len(s), [256.0, 0.1, 3e-4][kind % 3])
    if name == "int_counter":
        return ((steps + 1) * [4096 * 512, 512, 0][kind % 3] + (steps // 500 if kind % 3 == 2 else 0)).astype(
            np.int64
        )
    if name == "float_counter":
        return s
    if name == "float32":
        return (
            (0.5 + 0.45 * (1 - np.exp(-s / 500)) + rng.normal(0, 0.01, len(s)))
            .astype(np.float32)
            .astype(np.float64)
        )
    raise ValueError(name)


def label_data(index: int, steps: int) -> tuple[np.ndarray, np.ndarray, dict[str, list[np.ndarray]]]:
    """One label's seqs, timestamps (µs) and values by kind of key."""
    rng = np.random.default_rng(index)
    step_numbers = np.arange(steps, dtype=np.int64)
    # A log line or a system sample now and then takes a seq between two steps' events.
    seqs = 1 + step_numbers + np.cumsum(rng.random(steps) < 0.05)
    ticks = TICK_US + rng.normal(0, 4_000, steps).astype(np.int64) + (rng.random(steps) < 0.01) * 2_000_000
    ts = 1_764_190_000_000_000 + index * 1_000 + np.cumsum(ticks)
    values = {
        name: [key_values(kind, name, step_numbers, rng) for kind in range(count)]
        for name, count in KINDS.items()
    }
    return seqs, ts.astype(np.int64), values


def chunked(length: int, size: int) -> Iterator[slice]:
    for start in range(0, length, size):
        yield slice(start, min(length, start + size))


def gorilla_bits(values: np.ndarray) -> int:
    """Bits of Gorilla's XOR float packing (Pelkonen et al. 2015): the first value whole, then per
    value '0' for a repeat, '10' + meaningful bits inside the previous window, or '11' + 5 bits of
    leading zeros + 6 of length + the meaningful bits."""
    words = values.view(np.uint64)
    xors = (words[1:] ^ words[:-1]).tolist()
    total, lead, trail = 64, -1, -1
    for word in xors:
        if not word:
            total += 1
            continue
        leading = 64 - word.bit_length()
        trailing = (word & -word).bit_length() - 1
        if lead >= 0 and leading >= lead and trailing >= trail:
            total += 2 + 64 - lead - trail
        else:
            lead, trail = min(leading, 31), trailing
            total += 2 + 5 + 6 + 64 - lead - trail
    return total


def _shuffled(words: np.ndarray) -> bytes:
    return words.view(np.uint8).reshape(-1, 8).T.tobytes()


def _xor(values: np.ndarray) -> np.ndarray:
    words = values.view(np.uint64).copy()
    words[1:] ^= values.view(np.uint64)[:-1]
    return words


SCHEMES: dict[str, Callable[[np.ndarray], int]] = {
    # Format 2's column (pcodec), as the stores write it: int64 where logged as ints.
    "chosen": lambda v: len(columns.pco_payload(np.ascontiguousarray(v))),
    # Format 1's choice, and its XOR and plain encodings each alone (byte planes: zeros left
    # out, noise stored as it is, the rest through zlib).
    "format1_chosen": lambda v: len(columns_numpy._values_column(v)[1]),
    "codec_xor": lambda v: len(columns_numpy.float_payload(v, columns.FLOAT_XOR) or b""),
    "codec_plain": lambda v: len(columns_numpy.float_payload(v, columns.FLOAT_PLAIN) or b""),
    "xor_shuffle_zlib": lambda v: len(zlib.compress(_shuffled(_xor(v)), 6)),
    "shuffle_zlib": lambda v: len(zlib.compress(_shuffled(v.view(np.uint64)), 6)),
    "xor_zlib": lambda v: len(zlib.compress(_xor(v).tobytes(), 6)),
    "zlib": lambda v: len(zlib.compress(v.tobytes(), 6)),
    "gorilla": lambda v: (gorilla_bits(v) + 7) // 8,
    "xor_shuffle_lzma": lambda v: len(lzma.compress(_shuffled(_xor(v)), preset=6)),
}


# The schemes that keep ints logged as ints (the others see every value as a float64).
AS_LOGGED = ("chosen", "format1_chosen")


def chunks_of(labels: list, size: int) -> list[tuple[str, Arrays]]:
    """(kind of key, arrays) for every chunk of every (label, key), key by key: a key's chunks
    of every label one after another."""
    out = []
    for name, count in KINDS.items():
        for key in range(count):
            for seqs, ts, values in labels:
                steps = seqs - seqs[0]  # aligned with seqs: the same gaps
                for part in chunked(len(seqs), size):
                    out.append(
                        (name, Arrays(seqs[part], steps[part], None, ts[part], values[name][key][part]))
                    )
    return out


def sizes_by_column(blobs: list[bytes], points: int) -> dict[str, float]:
    totals = {"header": 0, "seqs": 0, "steps": 0, "ts": 0, "values": 0}
    for blob in blobs:
        _, parts = columns.columns(blob)
        totals["header"] += columns.HEADER.size
        for name, (_, payload) in zip(("seqs", "steps", "ts", "values"), parts, strict=True):
            totals[name] += columns.COLUMN.size + len(payload)
    result = {name: round(size / points, 3) for name, size in totals.items()}
    result["total"] = round(sum(totals.values()) / points, 3)
    return result


def totals_by_kind(
    chunks: list[tuple[str, Arrays]], blobs: list[bytes], per_event: float
) -> dict[str, float]:
    """Bytes per point of each kind of key, every column and header counted, its timestamps
    kept once per event (their share of `per_event`) rather than in its chunks."""
    sizes: dict[str, int] = {}
    points: dict[str, int] = {}
    for (kind, arrays), blob in zip(chunks, blobs, strict=True):
        ts = columns.COLUMN.size + len(columns.columns(blob)[1][-2][1])
        sizes[kind] = sizes.get(kind, 0) + len(blob) - ts
        points[kind] = points.get(kind, 0) + len(arrays.seqs)
    return {kind: round(sizes[kind] / points[kind] + per_event, 3) for kind in sizes}


def best_seconds(work: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def schemes_by_kind(chunks: list[tuple[str, Arrays]]) -> dict[str, dict[str, float]]:
    """Bytes per point of the values column alone, per kind of key, under each scheme."""
    result: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        mine = [arrays.values for name, arrays in chunks if name == kind]
        points = sum(len(values) for values in mine)
        floats = [values.astype(np.float64) for values in mine]
        result[kind] = {
            scheme: round(sum(measure(v) for v in (mine if scheme in AS_LOGGED else floats)) / points, 3)
            for scheme, measure in SCHEMES.items()
        }
    every = [arrays.values for _, arrays in chunks]
    points = sum(len(values) for values in every)
    result["all"] = {
        scheme: round(
            sum(SCHEMES[scheme](v if scheme in AS_LOGGED else v.astype(np.float64)) for v in every) / points,
            3,
        )
        for scheme in SCHEMES
    }
    return result


def timestamps_per_event(labels: list, size: int) -> float:
    """Bytes per point of the timestamps kept once per event (shared by its 20 keys)."""
    total = sum(
        columns.COLUMN.size + len(columns.pco_payload(np.ascontiguousarray(ts[part])))
        for _, ts, _ in labels
        for part in chunked(len(ts), size)
    )
    points = sum(len(ts) for _, ts, _ in labels) * sum(KINDS.values())
    return round(total / points, 3)


def rates(chunks: list[tuple[str, Arrays]], labels_for_reference: int, repeat: int) -> dict[str, float]:
    arrays = [a for _, a in chunks]
    points = sum(len(a.seqs) for a in arrays)
    blobs = [columns_numpy.encode_arrays(a) for a in arrays]
    encode = best_seconds(lambda: [columns_numpy.encode_arrays(a) for a in arrays], repeat)
    decode = best_seconds(lambda: [columns_numpy.decode_arrays(b) for b in blobs], repeat)
    # A key across all its labels: its chunks decoded together, as a read of it would.
    per_key = len(blobs) // sum(KINDS.values())
    keys = [blobs[start : start + per_key] for start in range(0, len(blobs), per_key)]
    many = best_seconds(lambda: [columns_numpy.decode_many(key) for key in keys], repeat)
    # The same chunks in format 1, as stores written before format 2 hold them.
    old = [columns_numpy.encode_arrays_v1(a) for a in arrays]
    old_keys = [old[start : start + per_key] for start in range(0, len(old), per_key)]
    many_v1 = best_seconds(lambda: [columns_numpy.decode_many(key) for key in old_keys], repeat)
    # The reference on a slice of the chunks (a label's share of them): it is slow by design.
    share = max(1, len(arrays) * labels_for_reference // 64)
    lists = [columns_numpy.chunk_of(a) for a in arrays[:share]]
    ref_blobs = blobs[:share]
    ref_points = sum(len(chunk.seqs) for chunk in lists)
    ref_encode = best_seconds(lambda: [columns.encode_reference(c) for c in lists], 1)
    ref_decode = best_seconds(lambda: [columns.decode_reference(b) for b in ref_blobs], 1)
    return {
        "numpy_encode_points_per_s": round(points / encode),
        "numpy_decode_points_per_s": round(points / decode),
        "numpy_decode_many_by_key_points_per_s": round(points / many),
        "format1_decode_many_by_key_points_per_s": round(points / many_v1),
        "reference_encode_points_per_s": round(ref_points / ref_encode),
        "reference_decode_points_per_s": round(ref_points / ref_decode),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--sizes", default="256,1024,4096")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--reference-labels", type=int, default=4)
    args = parser.parse_args()
    labels = [label_data(index, args.steps) for index in range(args.labels)]
    points = args.labels * args.steps * sum(KINDS.values())
    results: dict[str, object] = {"points": points, "targets": TARGETS, "by_chunk_size": {}}
    for size in (int(text) for text in args.sizes.split(",")):
        chunks = chunks_of(labels, size)
        blobs = [columns_numpy.encode_arrays(arrays) for _, arrays in chunks]
        by_column = sizes_by_column(blobs, points)
        per_event = timestamps_per_event(labels, size)
        entry = {
            "bytes_per_point": by_column,
            "bytes_per_point_with_ts_per_event": round(by_column["total"] - by_column["ts"] + per_event, 3),
            "ts_per_event_bytes_per_point": per_event,
            "bytes_per_point_by_kind_with_ts_per_event": totals_by_kind(chunks, blobs, per_event),
            "values_bytes_per_point_by_kind_and_scheme": schemes_by_kind(chunks),
            **rates(chunks, args.reference_labels, args.repeat),
        }
        results["by_chunk_size"][str(size)] = entry  # type: ignore[index]
        print(f"chunk {size}: {entry}", file=sys.stderr, flush=True)
    emit("columns", results)


if __name__ == "__main__":
    main()
