"""The ordering and finish rules: pure functions over plain records, shared by every backend.

A label's state follows its events in (epoch, seq) order, whatever order they arrive in; the run's
state is its primary label's state, so only the primary's finish ends the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from producer.wire import Event

RUNNING, FINISHED, FAILED, CRASHED = "running", "finished", "failed", "crashed"
STATES = (RUNNING, FINISHED, FAILED, CRASHED)
ORIGIN = (0, 0)


@dataclass(frozen=True, slots=True)
class LabelState:
    """What storage keeps per (run, label) to apply the rules."""

    run: str
    label: str
    state: str = RUNNING
    exit_code: int | None = None
    state_pos: tuple[int, int] = ORIGIN  # (epoch, seq) of the event that set `state`
    state_ts: float | None = None  # when that event was produced
    primary: bool = False
    start_pos: tuple[int, int] = ORIGIN  # (epoch, seq) of the start that set `primary`
    start_data: dict | None = None
    epoch: int = 0  # highest epoch seen
    last_seq: int = 0  # highest seq seen in that epoch
    first_ts: float | None = None
    last_ts: float | None = None
    # seq ranges the producer reports it dropped (buffer full), per epoch: {epoch: ((a, b), ...)}
    dropped: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Gap:
    """Seq numbers first..last of one epoch that never arrived; `dropped` of them the producer
    reported dropping (so the gap is explained)."""

    epoch: int
    first: int
    last: int
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class RunState:
    """The run's state as derived from its labels."""

    state: str
    primary: str | None
    exit_code: int | None
    ended_ts: float | None = None


def apply_event(label: LabelState, event: Event) -> LabelState:
    """Fold one event into its label's state; the result does not depend on arrival order."""
    pos = event.position
    changes: dict = {}
    if pos > (label.epoch, label.last_seq):
        changes["epoch"], changes["last_seq"] = pos
    if label.first_ts is None or event.ts < label.first_ts:
        changes["first_ts"] = event.ts
    if label.last_ts is None or event.ts > label.last_ts:
        changes["last_ts"] = event.ts
    if event.kind == "start" and pos > label.start_pos:
        changes.update(primary=event.data["primary"], start_pos=pos, start_data=event.data)
    if event.kind in ("heartbeat", "finish") and event.data.get("dropped_ranges"):
        changes["dropped"] = merge_dropped(label.dropped, event.epoch, event.data["dropped_ranges"])
    if pos > label.state_pos:
        if event.kind == "finish":
            code = event.data["exit_code"]
            state = FINISHED if code == 0 else FAILED
            changes.update(state=state, exit_code=code, state_pos=pos, state_ts=event.ts)
        elif event.kind in ("start", "heartbeat") or label.state == CRASHED:
            # Any later sign of life revives a label that was marked crashed.
            changes.update(state=RUNNING, exit_code=None, state_pos=pos, state_ts=event.ts)
    return replace(label, **changes) if changes else label


def apply_events(label: LabelState, events: Iterable[Event]) -> LabelState:
    """Fold many events of one label (any order, duplicates allowed)."""
    for event in events:
        label = apply_event(label, event)
    return label


def crash(label: LabelState) -> LabelState:
    """A running label whose heartbeats stopped: crashed, until a later event says otherwise."""
    return replace(label, state=CRASHED) if label.state == RUNNING else label


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, non-overlapping, non-adjacent ranges covering the same seqs."""
    merged: list[list[int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return tuple((a, b) for a, b in merged)


def merge_dropped(
    dropped: dict[int, tuple[tuple[int, int], ...]], epoch: int, ranges: Iterable
) -> dict[int, tuple[tuple[int, int], ...]]:
    """Add a report of dropped seq ranges; reports are cumulative, so merging is order-free."""
    valid = [
        (int(r[0]), int(r[1]))
        for r in ranges
        if isinstance(r, list | tuple) and len(r) == 2 and all(type(x) is int for x in r) and r[0] <= r[1]
    ]
    return {**dropped, epoch: merge_ranges([*dropped.get(epoch, ()), *valid])}


def explain_gaps(
    missing: Iterable[tuple[int, int, int]], dropped: dict[int, tuple[tuple[int, int], ...]]
) -> list[Gap]:
    """Gaps (epoch, first, last) with how many of their seqs the producer reported dropped."""
    gaps = []
    for epoch, first, last in missing:
        covered = sum(max(0, min(last, b) - max(first, a) + 1) for a, b in dropped.get(epoch, ()))
        gaps.append(Gap(epoch, first, last, covered))
    return gaps


def primary_label(labels: Iterable[LabelState]) -> LabelState | None:
    """The run's primary: the label whose latest start says so (the smallest name if several)."""
    primaries = sorted((lab for lab in labels if lab.primary), key=lambda lab: lab.label)
    return primaries[0] if primaries else None


def run_state(labels: Iterable[LabelState]) -> RunState:
    """The run follows its primary label; with no primary known yet it is running."""
    primary = primary_label(labels)
    if primary is None:
        return RunState(RUNNING, None, None)
    ended = None if primary.state == RUNNING else primary.state_ts
    return RunState(primary.state, primary.label, primary.exit_code, ended)


def missing_count(max_seq_by_epoch: dict[int, int], seen_by_epoch: dict[int, int]) -> int:
    """Seq numbers never received: in each epoch, the highest seq less the distinct seqs seen."""
    return sum(top - seen_by_epoch.get(epoch, 0) for epoch, top in max_seq_by_epoch.items())
