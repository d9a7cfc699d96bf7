"""The ordering, finish and primary rules: pure functions over plain records, shared by every
backend.

A label's state follows its events in (epoch, seq) order, whatever order they arrive in. Its
finish ends its life: later events of that epoch do not revive it, only the start of a newer
epoch (a restarted process) begins a new one. The run's primary is decided once, by the first
primary claim the ingester can check, and the run's state is that label's state; with no primary
known, the run follows its labels (run_state).

Run metadata (a label's config, summary, name and tags) follows the same order: per label, the
latest value of each key by (epoch, seq) is the label's, and a restarted process begins its config
afresh (standing_settings). Merged into the run's view, the primary's value of a key wins; a key
the primary never set shows the latest (by ts) any other label set (merge_settings).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any

from runbus.redact import redact
from runbus.wire import Event

RUNNING, FINISHED, FAILED, CRASHED = "running", "finished", "failed", "crashed"
STATES = (RUNNING, FINISHED, FAILED, CRASHED)
# Set by a finish event with an exit code. Crashed is set by silence, or by a finish whose exit
# code is null (a keeper saw the process end, not how): any finish with a code overrides that.
ENDED = frozenset({FINISHED, FAILED})
ORIGIN = (0, 0)
_DIGITS = re.compile(r"([0-9]+)")


def natural_key(label: str) -> tuple[list[str | int], str]:
    """How labels sort wherever a person reads them: runs of digits as numbers (rank2 before
    rank10), then the text itself to order names those read alike (rank1, rank01)."""
    # re.split puts text at even places and digits at odd ones, so two keys compare like with like.
    parts: list[str | int] = [int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(label))]
    return parts, label


@dataclass(frozen=True, slots=True)
class LabelState:
    """What storage keeps per (run, label) to apply the rules."""

    run: str
    label: str
    state: str = RUNNING
    exit_code: int | None = None
    # Finished or failed: (epoch, seq) and ts of the finish that ended the label. Crashed: its
    # highest position and last ts when it was marked (a later event revives it). Running: none.
    state_pos: tuple[int, int] = ORIGIN
    state_ts: float | None = None
    primary: bool = False  # whether its latest start claims the primary role (granted or not)
    start_pos: tuple[int, int] = ORIGIN  # (epoch, seq) of its latest start
    start_data: dict[str, Any] | None = None
    epoch: int = 0  # highest epoch seen
    last_seq: int = 0  # highest seq seen in that epoch
    first_ts: float | None = None
    last_ts: float | None = None
    # seq ranges the producer reports it dropped (buffer full), per epoch: {epoch: ((a, b), ...)}
    dropped: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # When it last claimed the primary role and was refused (another label holds it): the ts
    # of that start event; None if it never was.
    primary_refused_ts: float | None = None


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
    """The run's state as derived from its labels and its primary."""

    state: str
    primary: str | None
    exit_code: int | None
    ended_ts: float | None = None


# Event fields read by the batch paths below, with C getters rather than Python lambdas.
_KIND, _SEQ, _TS = attrgetter("kind"), attrgetter("seq"), attrgetter("ts")
_EPOCH = attrgetter("epoch")
# Kinds that never change a label's state, primary or start record.
_NO_STATE_KINDS = frozenset({"metric", "log", "system", "meta"})


def apply_events(label: LabelState, events: Iterable[Event]) -> LabelState:
    """Fold many events of one label (any order, duplicates allowed).

    The state lives in local variables and the record is rebuilt once: an ingester folds
    every event it stores through here.
    """
    events = list(events)
    if not events:
        return label
    if _NO_STATE_KINDS.issuperset(map(_KIND, events)) and label.state != CRASHED:
        # Metrics, logs and system figures (nearly every event) move only the highest position
        # and the time span: folded with C loops (map, max, min) rather than event by event.
        # The highest (epoch, seq) without a tuple per event: one epoch is the usual case.
        epoch = max(map(_EPOCH, events))
        if min(map(_EPOCH, events)) == epoch:
            seq = max(map(_SEQ, events))
        else:
            seq = max(e.seq for e in events if e.epoch == epoch)
        top = max((label.epoch, label.last_seq), (epoch, seq))
        stamps = list(map(_TS, events))
        first, last = min(stamps), max(stamps)
        return replace(
            label,
            epoch=top[0],
            last_seq=top[1],
            first_ts=first if label.first_ts is None else min(label.first_ts, first),
            last_ts=last if label.last_ts is None else max(label.last_ts, last),
        )
    return _fold_each(label, events)


def _fold_each(label: LabelState, events: Iterable[Event]) -> LabelState:
    """apply_events for any kinds, one event at a time.

    Whatever the order, the result is that of folding in (epoch, seq) order: the latest finish
    ends the label unless a start of a newer epoch follows it (a new life); a finish of an older
    epoch than the latest start does not end the new life. A finish whose exit code is null
    (the process ended, its status unknown) marks the label crashed unless a finish with a code
    ended it, whatever their order. A label marked crashed is revived by any event beyond the
    position it had reached when it was marked.
    """
    top = (label.epoch, label.last_seq)
    first_ts, last_ts = label.first_ts, label.last_ts
    state, exit_code, state_pos, state_ts = label.state, label.exit_code, label.state_pos, label.state_ts
    primary, start_pos, start_data = label.primary, label.start_pos, label.start_data
    dropped = label.dropped
    for event in events:
        pos = (event.epoch, event.seq)
        ts = event.ts
        if pos > top:
            top = pos
        if first_ts is None or ts < first_ts:
            first_ts = ts
        if last_ts is None or ts > last_ts:
            last_ts = ts
        kind = event.kind
        if kind == "start" and pos > start_pos:
            # Redacted here, once per start, so that not even an entry written by hand puts a
            # secret in the store (the producer has redacted its own already).
            primary, start_pos, start_data = event.data["primary"], pos, redact(event.data)
        elif kind in ("heartbeat", "finish") and event.data.get("dropped_ranges"):
            dropped = merge_dropped(dropped, event.epoch, event.data["dropped_ranges"])
        if kind == "finish" or state != RUNNING:
            state, exit_code, state_pos, state_ts = _state_after(
                (state, exit_code, state_pos, state_ts), event, start_pos[0]
            )
    return replace(
        label,
        epoch=top[0],
        last_seq=top[1],
        first_ts=first_ts,
        last_ts=last_ts,
        state=state,
        exit_code=exit_code,
        state_pos=state_pos,
        state_ts=state_ts,
        primary=primary,
        start_pos=start_pos,
        start_data=start_data,
        dropped=dropped,
    )


# A label's state, exit code, and the (epoch, seq) and ts of the event that set them.
_State = tuple[str, int | None, tuple[int, int], float | None]
_ALIVE: _State = (RUNNING, None, ORIGIN, None)


def _state_after(current: _State, event: Event, start_epoch: int) -> _State:
    """_fold_each's state once `event` is folded (`start_epoch`: the epoch of the label's latest
    start so far)."""
    state, _, state_pos, _ = current
    pos = (event.epoch, event.seq)
    if event.kind == "finish":
        code = event.data["exit_code"]
        if code is None:  # ended with no known status: crashed, unless a finish said how
            if state not in ENDED and event.epoch >= start_epoch:
                return CRASHED, None, pos, event.ts
        elif (pos > state_pos) if state in ENDED else (event.epoch >= start_epoch):
            return (FINISHED if code == 0 else FAILED), code, pos, event.ts
    elif state in ENDED:
        if event.kind == "start" and event.epoch > state_pos[0]:  # a restarted process: a new life
            return _ALIVE
    elif state == CRASHED and pos > state_pos:
        return _ALIVE
    return current


# How far beyond a label's highest stored seq (in its latest epoch, or from 0 in a newer one) an
# event may lie, past what its producer reports dropping. A producer numbers its events 1, 2, 3 ...
# and reports every seq it dropped, so a seq further ahead is no event of it: stored, it would
# leave a gap of that many "missing" events forever.
SEQ_REACH = 10_000_000


def out_of_reach(label: LabelState, events: Sequence[Event]) -> str | None:
    """Why one of `events` (one label's, in (epoch, seq) order) lies too far beyond what the label
    has stored to be stored, or None: a seq more than SEQ_REACH past the label's highest stored
    seq of its epoch, and past every seq the producer reports dropping (reports in `events`
    count). Events of epochs older than the label's latest are not judged: their stored top is
    not in `label`."""
    if not events:
        return None
    if events[0].epoch == events[-1].epoch == label.epoch and events[-1].seq <= label.last_seq + SEQ_REACH:
        return None  # the common case: the label's own epoch, within reach
    for epoch, group in by_epoch(events).items():
        if epoch < label.epoch:
            continue
        top = max(label.last_seq if epoch == label.epoch else 0, _reported_top(label, epoch, group))
        for event in group:
            if event.seq > top + SEQ_REACH:
                return (
                    f"seq {event.seq} of epoch {epoch} lies {event.seq - top:,} beyond the label's "
                    f"highest stored or reported seq {top} (at most {SEQ_REACH:,}): no producer "
                    "numbered it, and stored it would leave a gap forever"
                )
            top = max(top, event.seq)
    return None


def _reported_top(label: LabelState, epoch: int, events: Iterable[Event]) -> int:
    """The highest seq of `epoch` its producer reports dropping, stored or in `events`."""
    dropped = label.dropped
    for event in events:
        if event.kind in ("heartbeat", "finish") and event.data.get("dropped_ranges"):
            dropped = merge_dropped(dropped, epoch, event.data["dropped_ranges"])
    return max((last for _, last in dropped.get(epoch, ())), default=0)


def crash(label: LabelState) -> LabelState:
    """A running label whose heartbeats stopped: crashed at the position and time it reached,
    until an event beyond them says otherwise."""
    if label.state != RUNNING:
        return label
    return replace(label, state=CRASHED, state_pos=(label.epoch, label.last_seq), state_ts=label.last_ts)


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, non-overlapping, non-adjacent ranges covering the same seqs."""
    merged: list[list[int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return tuple((a, b) for a, b in merged)


@dataclass(frozen=True, slots=True)
class Seen:
    """What one batch adds to one label and epoch's received seqs (`take_new`).

    `fresh` are the batch's events never stored before (each seq once, in seq order); the
    stored ranges `replaced` give way to `ranges`, which cover them and the fresh seqs.
    """

    fresh: list[Event]
    replaced: tuple[tuple[int, int], ...]
    ranges: tuple[tuple[int, int], ...]


def take_new(events: Sequence[Event], stored: Iterable[tuple[int, int]]) -> Seen:
    """Which of one epoch's events (sorted by seq) the stored seq ranges do not cover yet.

    `stored` need only hold the ranges that touch the events' span (from the first seq less one
    to the last plus one): the others neither cover an event nor merge with one.
    """
    replaced = tuple(sorted(stored))
    seqs = list(map(_SEQ, events))
    if seqs and seqs[-1] - seqs[0] == len(seqs) - 1 and len(set(seqs)) == len(seqs):
        # One unbroken run of seqs (the common case): new unless a stored range overlaps it.
        first, last = seqs[0], seqs[-1]
        if not any(a <= last and b >= first for a, b in replaced):
            return Seen(list(events), replaced, merge_ranges([*replaced, (first, last)]))
    fresh: list[Event] = []
    runs: list[tuple[int, int]] = []
    at, previous = 0, None
    for event in events:
        seq = event.seq
        if seq == previous:
            continue  # the same event twice in one batch
        previous = seq
        while at < len(replaced) and replaced[at][1] < seq:
            at += 1
        if at < len(replaced) and replaced[at][0] <= seq:
            continue
        fresh.append(event)
        if runs and runs[-1][1] == seq - 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    return Seen(fresh, replaced, merge_ranges([*replaced, *runs]) if runs else replaced)


def by_epoch(events: Sequence[Event]) -> dict[int, list[Event]]:
    """One label's events (sorted by position) split by epoch, each list in seq order."""
    if events and events[0].epoch == events[-1].epoch:
        return {events[0].epoch: list(events)}
    epochs: dict[int, list[Event]] = {}
    for event in events:
        epochs.setdefault(event.epoch, []).append(event)
    return epochs


def merge_dropped(
    dropped: dict[int, tuple[tuple[int, int], ...]], epoch: int, ranges: object
) -> dict[int, tuple[tuple[int, int], ...]]:
    """Add a report of dropped seq ranges; reports are cumulative, so merging is order-free.
    Anything but [first, last] pairs of seqs is ignored (the report is the producer's, unchecked
    by the wire)."""
    if not isinstance(ranges, list | tuple):
        return dropped
    valid = [
        (r[0], r[1])
        for r in ranges
        if isinstance(r, list | tuple)
        and len(r) == 2
        and all(type(x) is int and 0 < x < 2**63 for x in r)
        and r[0] <= r[1]
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


def primary_claims(events: Iterable[Event]) -> list[Event]:
    """The start events among `events` that claim the primary role."""
    return [e for e in events if e.kind == "start" and e.data.get("primary") is True]


def decide_primary(decided: str | None, claims: Iterable[Event], holder: str | None = None) -> str | None:
    """The run's primary once `claims` (primary starts of the run) are seen.

    Decided once: a primary decided before stays. Otherwise, once a claim is seen, the label
    holding the producers' live claim (`holder`, read from Redis when the run's first claim was
    seen) is the primary, whether or not its own start has arrived; with no live claim (a run
    written by hand, or one whose claim lapsed before it was read) the earliest claim (by ts,
    then label) wins.
    """
    if decided is not None:
        return decided
    claims = list(claims)
    if not claims:
        return None
    if holder is not None:
        return holder
    return min(claims, key=lambda e: (e.ts, e.label)).label


def refused_claims(primary: str | None, claims: Iterable[Event]) -> dict[str, float]:
    """Per label, the latest ts of its claims to a primary role that `primary` holds."""
    refused: dict[str, float] = {}
    for claim in claims:
        if claim.label != primary:
            refused[claim.label] = max(refused.get(claim.label, claim.ts), claim.ts)
    return refused


def refuse(label: LabelState, ts: float) -> LabelState:
    """`label` with a refused primary claim at `ts` on record (the latest one is kept)."""
    if label.primary_refused_ts is not None and label.primary_refused_ts >= ts:
        return label
    return replace(label, primary_refused_ts=ts)


def run_state(labels: Iterable[LabelState], primary: str | None) -> RunState:
    """The run's state: its primary label's, once the primary is known and has been heard from.

    Without one (no primary claim seen, or none of the primary's events yet), the run follows
    its labels, leaving out any whose primary claim was refused: running while any of them runs
    (or none is known); once every one has ended, failed if any failed (with the exit code of
    the earliest failure), else crashed if any crashed, else finished.
    """
    labels = list(labels)
    lead = next((lab for lab in labels if lab.label == primary), None)
    if lead is not None:
        ended = None if lead.state == RUNNING else lead.state_ts
        return RunState(lead.state, primary, lead.exit_code, ended)
    labels = [lab for lab in labels if lab.primary_refused_ts is None]
    if not labels or any(lab.state == RUNNING for lab in labels):
        return RunState(RUNNING, primary, None)
    ended = max((lab.state_ts for lab in labels if lab.state_ts is not None), default=None)
    failures = [lab for lab in labels if lab.state == FAILED]
    if failures:
        first = min(failures, key=lambda lab: (lab.state_ts is None, lab.state_ts or 0.0, lab.label))
        return RunState(FAILED, primary, first.exit_code, ended)
    if any(lab.state == CRASHED for lab in labels):
        return RunState(CRASHED, primary, None, ended)
    return RunState(FINISHED, primary, 0, ended)


def lives_of(epochs: Iterable[int]) -> dict[int, int]:
    """Each of a label's lease epochs (see docs/wire.md) by its life: 1 for the first process
    that held the label, 2 after its first restart, and so on, in ascending order of the epoch.
    The raw epoch is a millisecond clock, which people would read as the training epoch."""
    return {epoch: life for life, epoch in enumerate(sorted(set(epochs)), start=1)}


def missing_count(max_seq_by_epoch: dict[int, int], seen_by_epoch: dict[int, int]) -> int:
    """Seq numbers never received: in each epoch, the highest seq less the distinct seqs seen."""
    return sum(top - seen_by_epoch.get(epoch, 0) for epoch, top in max_seq_by_epoch.items())


# -- run metadata ----------------------------------------------------------------------------------

# The fields a label sets one value each of, under the key "" (config and summary set many keys).
WHOLE_FIELDS = ("name", "tags")


@dataclass(frozen=True, slots=True)
class Setting:
    """One value a label set: a config or summary key, or (key "") the run's name or tags."""

    label: str
    field: str  # config, summary, name or tags
    key: str
    value: Any
    epoch: int
    seq: int
    ts: float

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.seq)


def settings_of(events: Iterable[Event]) -> list[Setting]:
    """The values that start events (their config) and meta events set, redacted: not even an
    entry written by hand puts a secret in the store. Other kinds set none."""
    found: list[Setting] = []
    for event in events:
        if event.kind == "start":
            config = event.data.get("config")
            sections = {"config": config} if isinstance(config, dict) else {}
        elif event.kind == "meta":
            sections = event.data
        else:
            continue
        for name, given in redact(sections).items():
            if name in WHOLE_FIELDS:
                found.append(Setting(event.label, name, "", given, event.epoch, event.seq, event.ts))
            elif isinstance(given, dict):
                found += [
                    Setting(event.label, name, key, value, event.epoch, event.seq, event.ts)
                    for key, value in given.items()
                ]
    return found


def latest_settings(settings: Iterable[Setting]) -> dict[tuple[str, str, str], Setting]:
    """Per (label, field, key), the setting latest in the label's (epoch, seq) order."""
    latest: dict[tuple[str, str, str], Setting] = {}
    for setting in settings:
        where = (setting.label, setting.field, setting.key)
        held = latest.get(where)
        if held is None or setting.position > held.position:
            latest[where] = setting
    return latest


def standing_settings(settings: Iterable[Setting], starts: dict[str, tuple[int, int]]) -> list[Setting]:
    """The settings that stand, given each label's latest start position: a label's config is
    its latest start's and what it set since, so a restarted process (a newer epoch's start)
    begins its config afresh; its summary, name and tags stand until it sets them again."""
    return [s for s in settings if s.field != "config" or s.position >= starts.get(s.label, ORIGIN)]


def merge_settings(settings: Iterable[Setting], primary: str | None) -> dict[tuple[str, str], Setting]:
    """The run's view of its labels' latest settings: per (field, key), the primary's setting
    if it has one, else the latest by ts of any other label's (then by label, for equal ts)."""
    merged: dict[tuple[str, str], Setting] = {}
    for setting in settings:
        where = (setting.field, setting.key)
        held = merged.get(where)
        if held is None or _outranks(setting, held, primary):
            merged[where] = setting
    return merged


def _outranks(setting: Setting, held: Setting, primary: str | None) -> bool:
    if (setting.label == primary) != (held.label == primary):
        return setting.label == primary
    if setting.label == held.label:
        return setting.position > held.position
    return (setting.ts, setting.label) > (held.ts, held.label)
