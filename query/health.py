"""A run's health as people read it: the object `runbus show --json` and the API give, and the
lines `runbus show` opens with (the verdict itself is the detector's: storage/health.py)."""

from __future__ import annotations

import time
from typing import Any

from runbus.storage.base import RunSummary, Store
from runbus.storage.health import redacted
from runbus.terminal import printable

# Frames and log lines of each culprit that `runbus show` prints (--json has them all).
SHOWN_FRAMES = 3
SHOWN_LINES = 3
SHOWN_STRAGGLERS = 5  # stragglers the health line names (--json has them all)
SHOWN_FOLLOWERS = 5  # labels the health line names as ending after an ended run's culprit


def health_document(run: RunSummary, stored: dict[str, Any] | None) -> dict[str, Any]:
    """The run's health object: as the detector last recorded it, secrets redacted again (a
    heartbeat written by hand may hold anything); `unknown` for a live run no detector has
    judged yet (no `runbus ingest` of this release running), `ok` for an ended one."""
    if stored is None:
        state = "unknown" if run.state == "running" else "ok"
        stored = {"state": state, "since": None, "culprits": [], "waiting": [], "note": None}
        stored["threshold"] = None
    ended = run.state != "running"
    return redacted({"stragglers": [], "anomalies": [], "followers": [], "ended": ended, **stored})


async def read_health(store: Store, run: RunSummary) -> dict[str, Any]:
    """health_document of `run` as the store holds it."""
    return health_document(run, await store.health(run.run_id))


def health_lines(health: dict[str, Any]) -> list[str]:
    """`runbus show`'s first lines: the state, since when, who is at fault and who waits, how far
    the cross-rank band is checked; then each culprit's innermost frames and last lines."""
    head = f"health   {health['state']}"
    if health.get("since") and health["state"] != "ok":
        head += f" since {time.strftime('%H:%M:%S', time.localtime(health['since']))}"
    culprits, waiting = health.get("culprits") or [], health.get("waiting") or []
    parts = [f"{c['label']} {c['reason']}" for c in culprits]
    if waiting:
        places = sorted({str(w.get("in")) for w in waiting})
        parts.append(f"{len(waiting)} waiting in {', '.join(places)}")
    parts += _followers_text(health.get("followers") or [])
    parts += _stragglers_text(health.get("stragglers") or []) + _anomalies_text(health.get("anomalies") or [])
    parts += _band_text(health)
    if parts:
        head += ": " + "; ".join(parts)
    if health.get("note"):
        head += f" ({health['note']})"
    lines = [printable(head)]
    for culprit in culprits:
        for frame in (culprit.get("stack") or [])[-SHOWN_FRAMES:]:
            where = f"{frame['file']}:{frame['line']} in {frame['function']}"
            lines.append(printable(f"         {culprit['label']}  {where}"))
        for text in (culprit.get("last_lines") or [])[-SHOWN_LINES:]:
            lines.append(printable(f"         {culprit['label']}  | {text}"))
    return lines


def _followers_text(followers: list[dict[str, Any]]) -> list[str]:
    """The health line's labels that ended after an ended run's culprit: each, how, how much later."""
    if not followers:
        return []
    shown = [
        f"{f['label']} {f.get('state')} {f.get('after_s', 0.0):+.1f}s"
        + (f" (exit {f['exit_code']})" if f.get("exit_code") else "")
        for f in followers[:SHOWN_FOLLOWERS]
    ]
    more = f" (+{len(followers) - SHOWN_FOLLOWERS} more)" if len(followers) > SHOWN_FOLLOWERS else ""
    return ["after it: " + ", ".join(shown) + more]


def _stragglers_text(stragglers: list[dict[str, Any]]) -> list[str]:
    """The health line's stragglers: each label, its kind, how far behind, the time lost to it."""
    if not stragglers:
        return []
    return [
        "stragglers: "
        + ", ".join(
            f"{s['label']} {s['kind']} {s.get('behind')}x ({s.get('lost_s')}s lost"
            + (f", on {s['host']})" if s.get("host") else ")")
            for s in stragglers[:SHOWN_STRAGGLERS]
        )
    ]


def _anomalies_text(anomalies: list[dict[str, Any]]) -> list[str]:
    """The health line's first anomaly (the first label that went NaN or inf, or left the
    cross-rank band, and where)."""
    if not anomalies:
        return []
    first = anomalies[0]
    at = f" at step {first['step']}" if first.get("step") is not None else ""
    more = f" (+{len(anomalies) - 1} more)" if len(anomalies) > 1 else ""
    went = "left the cross-rank band" if first.get("kind") == "outlier" else f"went {first['kind']}"
    return [f"{first['label']} {went} in {first['key']}{at} first{more}"]


def _band_text(health: dict[str, Any]) -> list[str]:
    """How far the cross-rank band is checked (the health object's `band_to`): every label that
    left it up to that step is named. Nothing where the run has no band (`null`: fewer than four
    labels), nor while no step is checked (negative: the slowest label's second 128-step bucket
    is open) unless an anomaly was found, which a band leaver may then yet precede."""
    band_to = health.get("band_to")
    if type(band_to) is not int or (band_to < 0 and not health.get("anomalies")):
        return []
    checked = f"checked to step {band_to}" if band_to >= 0 else "not checked yet"
    return [f"cross-rank band {checked}"]


def change_key(health: dict[str, Any]) -> tuple[Any, ...]:
    """What a change of a health object is, for a reader that follows it (`runbus watch`): its
    state, the culprits, the stragglers and their kinds, the first anomaly."""
    anomalies = health.get("anomalies") or []
    return (
        health.get("state"),
        tuple(sorted(str(c.get("label")) for c in health.get("culprits") or [])),
        tuple(sorted((str(s.get("label")), str(s.get("kind"))) for s in health.get("stragglers") or [])),
        (anomalies[0].get("label"), anomalies[0].get("key")) if anomalies else None,
        health.get("note"),
    )
