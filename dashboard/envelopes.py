"""The JSON documents of the chart reads (storage/charts.py): a key's band and lines, the step
times heat map and stragglers, each label's hardware, command line and git state.

Rows are arrays under named columns, numbers cut to 7 significant digits (a chart draws no
finer, and a 1,024-label chart stays within a few hundred kB); non-finite numbers are written
as the wire writes them: "NaN", "Infinity", "-Infinity". Start data is shown redacted
(runbus.redact), as a run's config is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from runbus.query.documents import anomaly_document, git_document
from runbus.redact import redact
from runbus.storage import base
from runbus.storage.anomalies import Anomaly
from runbus.storage.rules import natural_key
from runbus.wire import finite_to_wire

BAND_COLUMNS = ("x0", "x1", "n", "nan", "inf", "min", "p10", "p50", "p90", "max", "mean")
LINE_COLUMNS = ("x", "value", "mean", "min", "max", "n")
SIGNIFICANT = 7
# The start data fields shown per label, and the hardware fields that group labels alike.
LABEL_FIELDS = ("host", "pid", "rank", "local_rank", "world_size", "restart_count", "primary")
ALIKE_FIELDS = ("gpus", "driver_version", "cuda_version", "torch_version", "python_version", "cpu_count")


def number(value: float | int | None) -> float | int | str | None:
    """A value for a chart document: 7 significant digits, non-finite as the wire's strings."""
    if value is None or isinstance(value, int):
        return value
    if not math.isfinite(value):
        return finite_to_wire(value)
    return float(f"{value:.{SIGNIFICANT}g}")


def x_number(value: float | int) -> float | int:
    """An x: a step as it is, a ts to the millisecond."""
    return value if isinstance(value, int) else round(value, 3)


def envelope_document(found: base.Envelope, non_finite: Sequence[Anomaly] = ()) -> dict[str, Any]:
    """GET /api/runs/RUN/metrics/envelope: the band, and the lines (every label's, else the
    outliers' furthest first, `outlier` true, then those of the labels asked for by `label=`);
    `non_finite`: each label's first NaN or inf in view (storage.anomalies), so that the chart
    marks them where the label is no line."""
    return {
        "run_id": found.run_id,
        "key": found.key,
        "x": found.x,
        "width": found.width,
        "exact": found.exact,
        "labels": found.labels,
        "start": found.start,
        "end": found.end,
        "all_lines": found.all_lines,
        "other_axis": found.other_axis,
        "band_columns": BAND_COLUMNS,
        "band": [
            {
                "generation": segment.generation,
                "rows": [
                    [
                        x_number(b.x_lo),
                        x_number(b.x_hi),
                        b.n,
                        b.nan,
                        b.inf,
                        number(b.lo),
                        number(b.p10),
                        number(b.p50),
                        number(b.p90),
                        number(b.hi),
                        number(b.mean),
                    ]
                    for b in segment.buckets
                ],
                "gaps": [[x_number(a), x_number(b)] for a, b in segment.gaps],
            }
            for segment in found.band
        ],
        "line_columns": LINE_COLUMNS,
        "lines": [
            {
                "label": line.label,
                "distance": number(line.distance),
                "outlier": line.outlier,
                "segments": [
                    {
                        "epoch": segment.epoch,
                        "generation": segment.generation,
                        "rows": [
                            [x_number(p.x), number(p.value), number(p.mean), number(p.lo), number(p.hi), p.n]
                            for p in segment.points
                        ],
                    }
                    for segment in line.segments
                ],
            }
            for line in found.lines
        ],
        "non_finite": [anomaly_document(a) for a in non_finite],
    }


def stragglers_document(found: base.Stragglers, offset: int, limit: int) -> dict[str, Any]:
    """GET /api/runs/RUN/stragglers: labels slowest first, a page of them."""
    page = found.labels[offset : offset + limit]
    return {
        "run_id": found.run_id,
        "source": {"key": found.source, "derived": found.derived},
        "x": "step",
        "width": found.width,
        "buckets": [list(pair) for pair in found.buckets],
        "median": [number(m) for m in found.median],
        "total": len(found.labels),
        "offset": offset,
        "limit": limit,
        "labels": [
            {
                "label": s.label,
                "kind": s.kind,
                "mean_ratio": number(s.mean_ratio),
                "worst_ratio": number(s.worst_ratio),
                "worst_step": s.worst_step,
                "slow_buckets": s.slow_buckets,
                "seconds_behind": number(s.seconds_behind),
                "step_time": [number(t) for t in s.step_time],
            }
            for s in page
        ],
    }


def labels_document(
    run_id: str, starts: Mapping[str, Mapping[str, Any]], offset: int, limit: int
) -> dict[str, Any]:
    """GET /api/runs/RUN/labels: each label's identity, hardware and command line (from its
    latest start), a page of labels; and the distinct hardware among all, with their counts."""
    names = sorted(starts, key=natural_key)
    alike: dict[str, dict[str, Any]] = {}
    for name in names:
        hardware = starts[name].get("hardware")
        hardware = hardware if isinstance(hardware, dict) else {}
        shown = redact({field: hardware.get(field) for field in ALIKE_FIELDS})
        group = alike.setdefault(repr(shown), {"count": 0, "first_label": name, **shown})
        group["count"] += 1
    return {
        "run_id": run_id,
        "total": len(names),
        "offset": offset,
        "limit": limit,
        "labels": [_label(name, starts[name]) for name in names[offset : offset + limit]],
        "hardware": sorted(alike.values(), key=lambda group: (-group["count"], group["first_label"])),
    }


def _label(name: str, start: Mapping[str, Any]) -> dict[str, Any]:
    hardware = start.get("hardware")
    return {
        "label": name,
        **{field: redact(start.get(field)) for field in LABEL_FIELDS},
        "hardware": redact(hardware) if isinstance(hardware, dict) else None,
        "git": git_document(start),
    }
