"""How the CLI prints runs as text: aligned tables, times, states and numbers.

Every string from the bus goes through `printable` (terminal controls shown, not obeyed) and a
run's metadata (config, summary, name, tags) through `redact` (secrets as '***') before it is
printed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from runbus.query.documents import git_document
from runbus.redact import redact, redact_text
from runbus.storage.anomalies import Anomaly
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


def show_text(run: RunSummary, anomalies: Sequence[Anomaly] = ()) -> str:
    """The `runbus show` page: the run, a table of its labels, its gaps, then its config; with
    `anomalies` (storage.anomalies, in order), a line naming the first NaN or inf."""
    counts = ", ".join(f"{kind} {n}" for kind, n in run.counts.items())
    head = [f"run      {run.run_id}"]
    if run.name is not None:
        head.append(printable(f"name     {redact_text(run.name)}  (set by {run.set_by.name})"))
    if run.tags:
        head.append(printable(f"tags     {tags_text(run.tags)}  (set by {run.set_by.tags})"))
    head += [
        f"state    {state_text(run)}",
        f"primary  {run.primary or '-'}",
        f"started  {when(run.started_ts)}",
        f"ended    {when(run.ended_ts)}",
        f"events   {counts}",
    ]
    head += git_lines(run)
    head += anomaly_lines(anomalies)
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
            lab.life,
            lab.last_seq,
            lab.events,
            lab.missing,
        )
        for lab in run.labels
    ]
    text = (
        "\n".join(head)
        + "\n\n"
        + table(("LABEL", "PRIMARY", "STATE", "LIFE", "LAST_SEQ", "EVENTS", "MISSING"), rows)
    )
    gaps = [(lab.label, lab.lives.get(g.epoch), g) for lab in run.labels for g in lab.gaps]
    if gaps:
        text += "\n\ngaps (seq numbers that never arrived):\n" + "\n".join(
            f"  {label} life {life}: seq {g.first}..{g.last} ({g.last - g.first + 1})"
            + (f", {g.dropped} dropped by the producer (buffers full)" if g.dropped else ", unexplained")
            for label, life, g in gaps
        )
    for field, merged in (("config", run.config), ("summary", run.summary)):
        if merged:
            set_by = getattr(run.set_by, field)
            per_label = {lab.label: getattr(lab, field) for lab in run.labels}
            text += f"\n\n{field} (the label that set each value):\n" + values_text(merged, set_by, per_label)
    return text


def anomaly_lines(anomalies: Sequence[Anomaly]) -> list[str]:
    """`nan/inf  rank3 loss went NaN first, at step 30 (12 label keys in all)`, or `outlier  rank3
    loss left the cross-rank band first, at step 700 (5.2; band 0.61 to 1.4)`, if any went bad."""
    if not anomalies:
        return []
    first = anomalies[0]
    where = f"at step {first.step}" if first.step is not None else f"at {when(first.ts)} (no step)"
    more = f" ({len(anomalies)} label keys in all: runbus show --json)" if len(anomalies) > 1 else ""
    if first.kind == "outlier":
        band = f" ({first.value:.4g}; band {first.lo:.4g} to {first.hi:.4g})"
        left = f"{first.label} {first.key} left the cross-rank band first"
        return [printable(f"outlier  {left}, {where}{band}{more}")]
    kind = "NaN" if first.kind == "nan" else "inf"
    return [printable(f"nan/inf  {first.label} {first.key} went {kind} first, {where}{more}")]


# Labels named beside a git state that not every label shares, at most.
GIT_LABELS_SHOWN = 3


def git_lines(run: RunSummary) -> list[str]:
    """`git  5413b39 on main, dirty, origin URL`: one line per distinct git state the labels
    recorded at their start, with the labels that did where not all share it."""
    states: dict[str, list[str]] = {}
    for lab in run.labels:
        git = git_document(lab.start)
        if git is not None:
            states.setdefault(git_text(git), []).append(lab.label)
    lines = []
    for text, labels in states.items():
        if len(labels) < len(run.labels):
            named = labels[:GIT_LABELS_SHOWN] + [f"{len(labels) - GIT_LABELS_SHOWN} more"] * (
                len(labels) > GIT_LABELS_SHOWN
            )
            text += f"  ({', '.join(named)})"
        lines.append(printable(f"git      {text}"))
    return lines


def git_text(git: dict[str, Any]) -> str:
    """A git state (documents.git_document) in words: short commit, branch, dirty, origin."""
    commit = (git["commit"] or "?")[:7]
    branch = "detached" if git["branch"] is None else f"on {git['branch']}"
    dirty = {True: "dirty", False: "clean", None: "dirty unknown"}[git["dirty"]]
    origin = "" if git["remote"] is None else f", origin {git['remote']}"
    return f"{commit} {branch}, {dirty}{origin}"


def clipped(text: str, width: int) -> str:
    """`text` cut to `width` characters, an ellipsis marking the cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def tags_text(tags: Sequence[str]) -> str:
    """Tags as one line, secrets redacted: `a, b, c`."""
    return ", ".join(redact_text(tag) for tag in tags)


# Other labels' values of a key listed beside the one shown, at most.
OTHER_VALUES_SHOWN = 3


def values_text(merged: dict[str, Any], set_by: dict[str, str], per_label: dict[str, dict[str, Any]]) -> str:
    """A run's merged config or summary, secrets redacted: one `  key: value  (label)` line per
    key, the value as JSON, with the other labels that set the key to something else."""
    lines = []
    for key, value in merged.items():
        label = set_by.get(key, "?")
        others = [
            f"{other} {_shown(key, values[key])[1]}"
            for other, values in per_label.items()
            if other != label and key in values and values[key] != value
        ]
        if len(others) > OTHER_VALUES_SHOWN:
            others[OTHER_VALUES_SHOWN:] = [f"{len(others) - OTHER_VALUES_SHOWN} more labels"]
        note = label + (f"; also {', '.join(others)}" if others else "")
        shown_key, shown_value = _shown(key, value)
        lines.append(printable(f"  {shown_key}: {shown_value}  ({note})"))
    return "\n".join(lines)


def _shown(key: str, value: Any) -> tuple[str, str]:
    """A key and its value as JSON, redacted as the pair (by the key's name, and each by shape)."""
    [(shown_key, shown_value)] = redact({key: value}).items()
    return shown_key, orjson.dumps(shown_value, default=str).decode()


def number_text(value: float) -> str:
    """A value to six significant digits; non-finite ones as the wire writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(finite_to_wire(value))
    return f"{value:.6g}"
