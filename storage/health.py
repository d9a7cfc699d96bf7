"""A run's health from its labels' latest heartbeats: pure functions, tested without servers.

Each heartbeat (runbus.producer.vitals) says where its rank is: its last step, how long ago that
step advanced, its typical step time, whether it has stopped advancing (a stall beat, sent a few
step times after the last advance and again as soon as the step moves on), and its main thread's
stack. `judge` turns the latest beat of every label into a verdict:

- **stalled**: no label has advanced its step for longer than the threshold (a floor, or a
  multiple of the run's median step time); the culprits are the labels that stand apart (silent,
  not inside a collective while others wait in one, in another collective than the others, a
  step behind); labels merely waiting in a collective (by their beat's `collective`, timed by
  the producer, else by their stack, else in GPU work where their beat says their logged values
  have waited `gpu_wait_s` for their GPU) are named as waiting, with how long they have been in it;
- **dead**: a label stopped heartbeating while the others go on;
- **anomaly**: a label logged NaN or inf, or left the cross-rank band of a key (the first ones,
  by step: storage/anomalies.py, storage/outliers.py);
- **straggling**: a label is a chronic straggler (storage/stragglers.py);
- **crashed**: the run ended crashed, or a run of several labels ended failed or with a label
  that died, its first label to go named (storage/postmortem.py; judged until the labels' ends
  are known, recorded once, then no longer);
- **ok**: otherwise, and for a start-up (no step yet), a pause every label takes in the same
  non-collective frame (a checkpoint save, an evaluation) and a run that has ended.

The verdict depends on nothing but its arguments, so every ingester that judges the same stored
state reaches the same verdict (the store then lets one of them record a change: ingester/health.py).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from runbus.redact import redact

OK, STALLED, DEAD, SILENT = "ok", "stalled", "dead", "silent"
ANOMALY, STRAGGLING, CRASHED = "anomaly", "straggling", "crashed"
# The key of an ended run's verdict (storage/beats.py judges such a run no more).
ENDED_KEY = "ok:ended"
# States that call for attention (an alert when a run enters one).
ALERTING = frozenset({STALLED, DEAD, SILENT, ANOMALY, STRAGGLING, CRASHED})

# Frames that wait for the other ranks: torch.distributed's collectives and point-to-point calls,
# a Work's wait, and autograd's backward (DDP's gradient all-reduce runs inside it).
COLLECTIVE_FILES = ("torch/distributed/", "torch\\distributed\\")
COLLECTIVE_FUNCTIONS = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
        "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
        "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv",
        "isend", "irecv", "wait", "synchronize", "_engine_run_backward", "run_backward",
    }
)  # fmt: skip
# Where a label waits whose beat says its logged values wait for its GPU (`gpu_wait_s`): under
# NCCL a collective runs on the GPU, and the process only waits once it reads a value (.item()).
GPU_WORK = "GPU work"
# What a frame's function or file says a non-collective rank is doing, most telling first.
_DOINGS = (
    (
        "in a data loader",
        ("dataloader", "data_loader", "_next_data", "fetch", "collate", "load_batch", "loader"),
    ),
    ("in I/O", ("read", "write", "open", "recv_into", "save", "load", "flush", "fsync", "socket")),
)


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """The detector's thresholds: `floor` the least time without a step that is a stall (the
    threshold is the larger of it and `step_factor` times the run's median step time);
    a label is silent once its last beat is older than `silent_factor` of its heartbeat interval,
    and at least `silent_min` seconds."""

    floor: float = 10.0
    step_factor: float = 5.0
    silent_factor: float = 2.5
    silent_min: float = 3.0


@dataclass(frozen=True, slots=True)
class LabelVitals:
    """What the detector knows of one running label: its latest heartbeat (`beat`, its data as
    the producer sent it; None before the first) and when it was stored (`beat_seen_at`), when
    anything of the label was last stored (`heard_at`; both by the ingesters' clock), and what a
    look at its process on this host found (`process`: "running", "stopped", "gone", or None
    where it could not be looked at). For an ended run's post-mortem (storage/postmortem.py):
    the label's stored `state` and `exit_code`, the time its state was set (`state_ts`: its
    finish's, or its last event's where it was marked crashed) and its last event's (`last_ts`),
    by its producer's clock."""

    label: str
    beat: Mapping[str, Any] | None
    beat_seen_at: float | None
    heard_at: float | None = None
    process: str | None = None
    state: str = "running"
    exit_code: int | None = None
    state_ts: float | None = None
    last_ts: float | None = None

    @property
    def step(self) -> int | None:
        step = (self.beat or {}).get("step")
        return step if type(step) is int else None

    @property
    def every(self) -> float:
        return _number((self.beat or {}).get("every"), 10.0)

    @property
    def stack(self) -> list[list[Any]]:
        stack = (self.beat or {}).get("stack")
        return [f for f in stack if isinstance(f, list) and len(f) >= 3] if isinstance(stack, list) else []

    def silent_for(self, now: float) -> float:
        """Seconds since anything of it (a beat, any event) was last stored."""
        since = max((t for t in (self.heard_at, self.beat_seen_at) if t is not None), default=None)
        return 0.0 if since is None else max(0.0, now - since)

    def step_age(self, now: float) -> float | None:
        """Seconds since its step last advanced, as far as its beats tell: a stall beat's age
        grows until a newer beat says otherwise; a beat that was no stall beat vouches for
        progress (the producer would have sent one), so its age is the one it gave."""
        beat = self.beat or {}
        if self.step is None:
            return None
        age = _number(beat.get("step_age"), 0.0)
        if beat.get("stalled") is True and self.beat_seen_at is not None:
            age += max(0.0, now - self.beat_seen_at)
        return age


@dataclass(frozen=True, slots=True)
class Verdict:
    """A run's health: its state, the labels at fault (most telling first), the labels waiting
    for them, a note, and the stall threshold used; for an ended run, the labels that ended after
    its first to go (`followers`), or `settling` while the labels' ends are not all known yet
    (nothing is recorded then: the run is judged again)."""

    state: str
    culprits: list[dict[str, Any]] = field(default_factory=list)
    waiting: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None
    threshold: float | None = None
    ended: bool = False  # the run has ended: no detector judges it again
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    followers: list[dict[str, Any]] = field(default_factory=list)
    settling: bool = False
    # Band leavers are known up to this step: a first anomaly past it may yet be preceded by one.
    band_to: int | None = None

    @property
    def key(self) -> str:
        """What a change of health is: the state, who is at fault, the chronic stragglers and
        the first anomaly's label (an alert per change; one-off stragglers change nothing)."""
        if self.ended:
            return ENDED_KEY
        parts = [self.state, *sorted(c["label"] for c in self.culprits)]
        slow = sorted(s["label"] for s in self.stragglers if s.get("kind") == "chronic")
        if slow:
            parts.append("slow:" + ",".join(slow))
        if self.anomalies:
            first = self.anomalies[0]
            parts.append(f"{'out' if first.get('kind') == 'outlier' else 'nan'}:{first['label']}")
        return "|".join(parts)

    def document(self, since: float | None) -> dict[str, Any]:
        """The health object `runbus show --json` and the API give."""
        return {
            "state": self.state,
            "since": since,
            "culprits": self.culprits,
            "waiting": self.waiting,
            "note": self.note,
            "threshold": self.threshold,
            "stragglers": self.stragglers,
            "anomalies": self.anomalies,
            "band_to": self.band_to,
            "followers": self.followers,
            "ended": self.ended,
        }


def _number(value: object, default: float) -> float:
    return float(value) if type(value) in (int, float) and value == value else default  # type: ignore[arg-type]


def silent_after(vitals: LabelVitals, settings: HealthSettings) -> float:
    """How long a label may go without a beat before it counts as silent."""
    return max(settings.silent_min, settings.silent_factor * vitals.every)


def threshold(labels: Sequence[LabelVitals], settings: HealthSettings) -> float:
    """The run's stall threshold: the floor, or step_factor times its labels' median step time."""
    times = [_number((v.beat or {}).get("step_s"), 0.0) for v in labels]
    times = [t for t in times if t > 0]
    learnt = settings.step_factor * statistics.median(times) if times else 0.0
    return max(settings.floor, learnt)


def in_collective(stack: Sequence[Sequence[Any]]) -> str | None:
    """The collective a stack (outermost frame first) waits in, innermost first, or None."""
    for frame in reversed(stack):
        path, function = str(frame[0]), str(frame[2])
        if function in COLLECTIVE_FUNCTIONS and (
            any(part in path for part in COLLECTIVE_FILES) or "torch" in path
        ):
            return function
    return None


def waits_in(vitals: LabelVitals) -> str | None:
    """The collective a label waits in: the one its beat says the process is inside (the
    producer times torch.distributed's calls: runbus.producer.collectives), else its stack's,
    else GPU_WORK where its beat says the values it logged wait for its GPU (an NCCL collective
    runs on the GPU: the process goes on until it reads a value, runbus.producer.devicevalues)."""
    beat = vitals.beat or {}
    named = beat.get("collective")
    if isinstance(named, str) and named:
        return named
    return in_collective(vitals.stack) or (GPU_WORK if _number(beat.get("gpu_wait_s"), 0.0) > 0 else None)


def inside_for(vitals: LabelVitals, now: float) -> float | None:
    """How long a label has been inside its beat's collective (or waited for its GPU), as of
    `now`: None where its beat names neither."""
    beat = vitals.beat or {}
    if vitals.beat_seen_at is None:
        return None
    if isinstance(beat.get("collective"), str):
        inside = _number(beat.get("collective_s"), 0.0)
    elif "gpu_wait_s" in beat and in_collective(vitals.stack) is None:
        inside = _number(beat.get("gpu_wait_s"), 0.0)
    else:
        return None
    return round(inside + max(0.0, now - vitals.beat_seen_at), 3)


def doing(stack: Sequence[Sequence[Any]]) -> str:
    """What a stack outside any collective says its rank is doing, in a few words."""
    for frame in reversed(stack):
        where = f"{frame[2]} {frame[0]}".lower()
        for what, marks in _DOINGS:
            if any(mark in where for mark in marks):
                return f"{what} ({frame[2]})"
    innermost = stack[-1][2] if stack else "?"
    return f"in Python ({innermost})"


# Where a frame's file says it is a library's (installed packages, the standard library, frozen
# modules), not the job's own code.
_LIBRARY_MARKS = ("site-packages", "dist-packages", "/lib/python3", "\\lib\\python3", "<frozen ")


def _own_frame(stack: Sequence[Sequence[Any]]) -> Sequence[Any]:
    """A stack's innermost frame in the job's own code (its innermost of all where every frame is
    a library's)."""
    own = [index for index, frame in enumerate(stack) if not any(m in str(frame[0]) for m in _LIBRARY_MARKS)]
    return stack[own[-1] if own else -1]


def signature(stack: Sequence[Sequence[Any]]) -> str:
    """A stack's innermost function and file of the job's own code, to group ranks that stand at
    the same place: ranks evaluating in one function stand there together whether a beat caught
    them in a sleep or inside the model's forward (torch's frames)."""
    if not stack:
        return ""
    path, _, function = _own_frame(stack)[:3]
    return f"{function}@{path}"


def judge(
    run_state: str,
    labels: Sequence[LabelVitals],
    now: float,
    settings: HealthSettings,
    stragglers: Sequence[dict[str, Any]] = (),
    anomalies: Sequence[dict[str, Any]] = (),
) -> Verdict:
    """The health of a run (`run_state` as stored) whose running labels are `labels`, its
    stragglers (storage/stragglers.find) and first anomalies (in order) beside: a stall, a dead
    rank or silence first, then an anomaly, then a chronic straggler."""
    if run_state != "running":
        state = CRASHED if run_state == CRASHED else OK
        return Verdict(
            state,
            note=f"the run has {run_state}",
            ended=True,
            stragglers=list(stragglers),
            anomalies=list(anomalies),
        )
    verdict = _judge_beats(labels, now, settings)
    state = verdict.state
    if state == OK and anomalies:
        state = ANOMALY
    elif state == OK and any(s.get("kind") == "chronic" for s in stragglers):
        state = STRAGGLING
    return replace(verdict, state=state, stragglers=list(stragglers), anomalies=list(anomalies))


def _judge_beats(labels: Sequence[LabelVitals], now: float, settings: HealthSettings) -> Verdict:
    """The verdict of the labels' heartbeats alone: stalled, dead, silent or ok."""
    if not labels:
        return Verdict(OK)
    limit = threshold(labels, settings)
    silent = [v for v in labels if v.silent_for(now) > silent_after(v, settings)]
    stepping = [v for v in labels if v.step is not None]
    if stepping and all(v in silent or (v.step_age(now) or 0.0) > limit for v in stepping):
        if len(silent) == len(labels):
            return Verdict(
                SILENT, [_silent(v, now) for v in labels], note="no label sends heartbeats", threshold=limit
            )
        return _stalled(stepping, _silent_in_stall(silent, stepping), now, limit)
    if silent and len(silent) < len(labels):
        return Verdict(DEAD, [_silent(v, now) for v in silent], threshold=limit)
    if not stepping:
        return Verdict(OK, note="starting: no step yet", threshold=limit)
    return Verdict(OK, threshold=limit)


def _silent_in_stall(silent: Sequence[LabelVitals], stepping: Sequence[LabelVitals]) -> list[LabelVitals]:
    """The silent labels a stall names: labels that never stepped (a child process's, a loader's)
    are neither culprits nor waiting, but a silent one that never sent a beat is a culprit (it hung
    or died before its first beat)."""
    return [v for v in silent if v in stepping or v.beat is None]


def _stalled(
    labels: Sequence[LabelVitals], silent: Sequence[LabelVitals], now: float, limit: float
) -> Verdict:
    """The stall's culprits and waiting labels; OK for a pause every label takes at one place."""
    heard = [v for v in labels if v not in silent]
    waits = {v.label: waits_in(v) for v in heard}
    if not silent and _paused(heard, waits):
        where = _own_frame(heard[0].stack)[2] if heard[0].stack else "the same place"
        pause = f"paused: every label in {where} (a checkpoint or evaluation?)"
        return Verdict(OK, note=pause, threshold=limit)
    if not silent and (joining := _joining(heard, waits, now, limit)):
        return Verdict(OK, note=joining, threshold=limit)
    culprits = [_silent(v, now) for v in silent] + _apart(heard, waits, now)
    culprits += _behind(labels, heard, {c["label"] for c in culprits}, now)
    named = {c["label"] for c in culprits}
    waiting = [
        {"label": v.label, "in": waits[v.label], "step": v.step, "for_s": inside_for(v, now)}
        for v in heard
        if v.label not in named and waits[v.label] is not None
    ]
    note = None if culprits else "no label stands apart: every label waits at the same place"
    return Verdict(STALLED, culprits, waiting, note, limit)


def _paused(heard: Sequence[LabelVitals], waits: Mapping[str, str | None]) -> bool:
    """Whether every heard label stands at one place outside any collective (a pause they all
    take: a checkpoint save, an evaluation)."""
    if any(waits[v.label] is not None for v in heard):
        return False
    return len({signature(v.stack) for v in heard}) == 1


def _joining(heard: Sequence[LabelVitals], waits: Mapping[str, str | None], now: float, limit: float) -> str:
    """A pause ending: the labels that wait in a collective entered it less than `limit` ago (by
    their beats' timing) while the others are still outside it. Ranks leave an evaluation or a
    checkpoint save one by one, so the stall began as a pause every label took, and the last ones
    are not culprits until the first have waited as long as a stall takes. "" otherwise (a label
    without timing, none waiting, or none outside)."""
    waiting = [v for v in heard if waits[v.label] is not None]
    outside = [v.label for v in heard if waits[v.label] is None]
    times = [inside_for(v, now) for v in waiting]
    if not waiting or not outside or any(t is None for t in times):
        return ""
    longest = max(t for t in times if t is not None)
    if longest >= limit:
        return ""
    ahead = waits[waiting[0].label]
    return (
        f"paused: {len(outside)} label(s) still outside any collective ({', '.join(outside[:8])}), "
        f"the others in {ahead} for {longest:.0f}s at most (a checkpoint or evaluation ending?)"
    )


def _apart(heard: Sequence[LabelVitals], waits: Mapping[str, str | None], now: float) -> list[dict[str, Any]]:
    """The heard labels whose stacks stand apart from the group's."""
    outside = [v for v in heard if waits[v.label] is None]
    if outside and len(outside) < len(heard):
        return [culprit_of(v, doing(v.stack), now) for v in outside]
    if not outside:
        return _odd_collectives(heard, waits, now) or _odd_groups(heard, now)
    return _odd_places(heard, now)


def _behind(
    labels: Sequence[LabelVitals], heard: Sequence[LabelVitals], named: set[str], now: float
) -> list[dict[str, Any]]:
    """The heard labels not named yet whose last step is behind the run's furthest."""
    top = max((v.step for v in labels if v.step is not None), default=None)
    if top is None:
        return []
    return [
        culprit_of(v, f"behind: at step {v.step}, others at {top}", now)
        for v in heard
        if v.label not in named and v.step is not None and v.step < top
    ]


def _odd_collectives(
    heard: Sequence[LabelVitals], waits: Mapping[str, str | None], now: float
) -> list[dict[str, Any]]:
    """Every heard label waits in a collective: those in another one than most are culprits."""
    counts = Counter(waits[v.label] for v in heard)
    if len(counts) < 2:
        return []
    usual, _ = counts.most_common(1)[0]
    return [
        culprit_of(v, f"in {waits[v.label]} while the others are in {usual}", now)
        for v in heard
        if waits[v.label] != usual
    ]


def _groups(vitals: LabelVitals) -> Mapping[str, Sequence[int]]:
    """A label's process groups' progress by its beat: {group: [queued, started, completed]}."""
    groups = (vitals.beat or {}).get("groups")
    return groups if isinstance(groups, Mapping) else {}


def _odd_groups(heard: Sequence[LabelVitals], now: float) -> list[dict[str, Any]]:
    """Every heard label waits in the same collective (or GPU work): those whose process group's
    collectives stand apart by the flight recorder's counts (producer/collectives.py), in the
    first group where some do. Under NCCL a rank whose GPU runs a kernel that never ends waits
    like the others do, by its stack and its values, but its GPU never started the collective
    theirs did."""
    counts = [_groups(v) for v in heard]
    shared = set.intersection(*(set(c) for c in counts)) if counts else set()
    for group in sorted(shared):
        pairs = [_queued_started(c[group]) for c in counts]
        if any(pair is None for pair in pairs):  # a beat not as the producer writes it
            continue
        progress = [(v, pair) for v, pair in zip(heard, pairs, strict=True) if pair is not None]
        if found := _lagging(progress, group, now):
            return found
    return []


def _queued_started(counts: Any) -> tuple[int, int] | None:
    """A group's [queued, started, completed] from a beat, as (queued, started), or None."""
    if isinstance(counts, list | tuple) and len(counts) >= 2 and all(type(n) is int for n in counts[:2]):
        return counts[0], counts[1]
    return None


def _lagging(
    progress: Sequence[tuple[LabelVitals, tuple[int, int]]], group: str, now: float
) -> list[dict[str, Any]]:
    """Of (label, (queued, started)) in one group: the labels that queued fewer collectives than
    the others, else (all queued as many) those whose GPU started fewer: under NCCL each rank
    queues ahead of its GPU, and the collective the others' GPUs started waits for the rank whose
    GPU is still in a kernel before it. [] when none, or all, stand apart."""
    reasons = (
        "queued collective {} of group {}, the others {}",
        "its GPU started collective {} of group {}, the others' {} "
        "(a kernel before the next that does not end?)",
    )
    for index, reason in enumerate(reasons):
        top = max(counts[index] for _, counts in progress)
        behind = [(v, counts[index]) for v, counts in progress if counts[index] < top]
        if top >= 0 and 0 < len(behind) < len(progress):
            return [culprit_of(v, reason.format(count, group, top), now) for v, count in behind]
        if behind:
            return []
    return []


def _odd_places(heard: Sequence[LabelVitals], now: float) -> list[dict[str, Any]]:
    """No label waits in a collective: those at another place than most are culprits."""
    counts = Counter(signature(v.stack) for v in heard)
    usual, most = counts.most_common(1)[0]
    if most * 2 <= len(heard):
        return []
    return [culprit_of(v, doing(v.stack), now) for v in heard if signature(v.stack) != usual]


def _silent(vitals: LabelVitals, now: float) -> dict[str, Any]:
    quiet = vitals.silent_for(now)
    why = {
        "stopped": f"stopped: no heartbeat for {quiet:.0f}s, its process is stopped (SIGSTOP?)",
        "gone": f"dead: no heartbeat for {quiet:.0f}s, its process is gone",
        "running": f"frozen: no heartbeat for {quiet:.0f}s, its process is running",
    }.get(vitals.process or "", f"no heartbeat for {quiet:.0f}s")
    return culprit_of(vitals, why, now)


def culprit_of(vitals: LabelVitals, reason: str, now: float) -> dict[str, Any]:
    beat = vitals.beat or {}
    return {
        "label": vitals.label,
        "reason": reason,
        "step": vitals.step,
        "step_age": vitals.step_age(now),
        "silent_s": round(vitals.silent_for(now), 3),
        "host": beat.get("host"),
        "pid": beat.get("pid"),
        "stack": [
            {"file": f[0], "line": f[1], "function": f[2], "code": f[3] if len(f) > 3 else None}
            for f in vitals.stack
        ],
        "last_lines": [],
    }


def redacted(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A health object with its secrets redacted, as every reader shows it (a heartbeat written
    by hand may hold anything); the anomalies' metric keys are names every reader shows anyway
    (`key` is no secret there), the rest of each anomaly is redacted."""
    shown: dict[str, Any] = redact({k: v for k, v in doc.items() if k != "anomalies"})
    shown["anomalies"] = [
        {**redact({k: v for k, v in a.items() if k != "key"}), "key": a.get("key")}
        for a in doc.get("anomalies") or []
        if isinstance(a, Mapping)
    ]
    return shown
