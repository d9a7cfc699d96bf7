"""How the CLI prints runs as text: aligned tables, times, states and numbers.

Every string from the bus goes through `printable` (terminal controls shown, not obeyed) and a
run's config through `redact` (secrets as '***') before it is printed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from runbus.redact import redact
from runbus.storage.base import RunSummary
from runbus.terminal import printable
from runbus.wire import finite_to_wire


def when(ts: float | None) -> str:
    """A timestamp as local time to the second; '-' for none; as the number where no date can
    show it (a ts stored before the wire refused such values)."""
    if ts is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return repr(ts)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; every cell printable."""
    cells = [list(map(str, headers))] + [
        ["-" if c is None else printable(str(c)) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def state_text(run: RunSummary) -> str:
    """`finished`, or `crashed (exit 1)` where the run has an exit code."""
    if run.exit_code is None:
        return run.state
    return f"{run.state} (exit {run.exit_code})"


def show_text(run: RunSummary) -> str:
    """The `runbus show` page: the run, a table of its labels, its gaps, then its config."""
    counts = ", ".join(f"{kind} {n}" for kind, n in run.counts.items())
    head = [
        f"run      {run.run_id}",
        f"state    {state_text(run)}",
        f"primary  {run.primary or '-'}",
        f"started  {when(run.started_ts)}",
        f"ended    {when(run.ended_ts)}",
        f"events   {counts}",
    ]
    head += [
        f"refused  {lab.label} claimed the primary role at {when(lab.primary_refused_ts)}; "
        f"{run.primary or '-'} holds it"
        for lab in run.labels
        if lab.primary_refused_ts is not None
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
    if run.config:
        text += "\n\nconfig:\n" + config_text(run.config)
    return text


def config_text(config: dict[str, Any]) -> str:
    """A run's config, secrets redacted: one `  key: value` line per key, the value as JSON."""
    return "\n".join(
        printable(f"  {key}: {orjson.dumps(value, default=str).decode()}")
        for key, value in redact(config).items()
    )


def number_text(value: float) -> str:
    """A value to six significant digits; non-finite ones as the wire writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(finite_to_wire(value))
    return f"{value:.6g}"
