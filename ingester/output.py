"""How the CLI prints: JSON documents and plain-text tables."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

import orjson

from runbus.storage.base import Point, RunSummary
from runbus.wire import finite_to_wire


def json_value(value: float) -> float | str:
    """A value as the wire writes it: non-finite floats become 'NaN', 'Infinity', '-Infinity'."""
    return finite_to_wire(value) if isinstance(value, float) else value


def dumps(document: Any) -> str:
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).decode()


def when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [list(map(str, headers))] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def run_head(run: RunSummary) -> dict[str, Any]:
    """A run's own fields, as the CLI's and the API's JSON documents start."""
    return {
        "run_id": run.run_id,
        "state": run.state,
        "primary": run.primary,
        "exit_code": run.exit_code,
        "started_ts": run.started_ts,
        "ended_ts": run.ended_ts,
        "last_ts": run.last_ts,
        "label_count": run.label_count,
        "counts": run.counts,
    }


def run_document(run: RunSummary) -> dict[str, Any]:
    """The `runbus show --json` object."""
    return {
        **run_head(run),
        "labels": [
            {
                "label": lab.label,
                "primary": lab.primary,
                "state": lab.state,
                "exit_code": lab.exit_code,
                "epoch": lab.epoch,
                "last_seq": lab.last_seq,
                "events": lab.events,
                "missing": lab.missing,
                "gaps": [
                    {"epoch": g.epoch, "first": g.first, "last": g.last, "dropped": g.dropped}
                    for g in lab.gaps
                ],
            }
            for lab in run.labels
        ],
        "config": run.config,
    }


def runs_document(runs: Sequence[RunSummary]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(run).items() if k not in ("labels", "counts", "config")} for run in runs]


def point_document(point: Point) -> dict[str, Any]:
    return {
        "label": point.label,
        "key": point.key,
        "step": point.step,
        "seq": point.seq,
        "epoch": point.epoch,
        "ts": point.ts,
        "value": json_value(point.value),
    }


def state_text(run: RunSummary) -> str:
    if run.exit_code is None:
        return run.state
    return f"{run.state} (exit {run.exit_code})"


def show_text(run: RunSummary) -> str:
    counts = ", ".join(f"{kind} {n}" for kind, n in run.counts.items())
    head = [
        f"run      {run.run_id}",
        f"state    {state_text(run)}",
        f"primary  {run.primary or '-'}",
        f"started  {when(run.started_ts)}",
        f"ended    {when(run.ended_ts)}",
        f"events   {counts}",
    ]
    rows = [
        (
            lab.label,
            "*" if lab.primary else "",
            lab.state if lab.exit_code is None else f"{lab.state} ({lab.exit_code})",
            lab.epoch,
            lab.last_seq,
            lab.events,
            lab.missing,
        )
        for lab in run.labels
    ]
    text = (
        "\n".join(head)
        + "\n\n"
        + table(("LABEL", "PRIMARY", "STATE", "EPOCH", "LAST_SEQ", "EVENTS", "MISSING"), rows)
    )
    gaps = [(lab.label, g) for lab in run.labels for g in lab.gaps]
    if gaps:
        text += "\n\ngaps (seq numbers that never arrived):\n" + "\n".join(
            f"  {label} epoch {g.epoch}: seq {g.first}..{g.last} ({g.last - g.first + 1})"
            + (f", {g.dropped} dropped by the producer (buffers full)" if g.dropped else ", unexplained")
            for label, g in gaps
        )
    return text


def number_text(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(finite_to_wire(value))
    return f"{value:.6g}"
