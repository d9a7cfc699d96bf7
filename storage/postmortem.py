"""Which label went first in a run that ended badly: a pure function over its labels' ends,
tested without servers.

When one rank of a job dies (SIGKILL, the OOM killer, an exception), the others fail at once
(their collectives error: gloo sees the connection close) and the run ends failed or crashed
before the live detector could see the dead rank fall silent. `judge_ended` then names the label
that went first, from what the store holds of each label's end:

- a label with a finish (finished or failed) ended at its finish's `ts`: exact;
- a label without one (still running, or marked crashed: SIGKILL, a segfault, a lost host) ended
  after its last event and before its next heartbeat was due: its last event's `ts` is the
  earliest it can have died.

The culprit is the label that ended badly (failed, crashed, or silent with no finish) first; the
other labels that ended are its followers, in the order they ended. Labels without a finish whose
last events lie within a heartbeat interval of each other cannot be told apart (a job killed from
outside): no culprit then. A run that finished names only a label that stepped and then died
without a finish (a rank killed while the others went on), never one that failed with a code (a
pool worker terminated by its parent is no fault of the job's). A run of one label names nobody.

The ends are judged once they are known: every label has ended or fallen silent (past the live
detector's silence), or the latest end was heard longer ago than that silence (a label still
beating then is a survivor, left out). Until then the verdict is `settling`: nothing is recorded,
and the run is judged again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from runbus.storage.health import (
    CRASHED,
    HealthSettings,
    LabelVitals,
    Verdict,
    culprit_of,
    judge,
    silent_after,
)
from runbus.storage.rules import FAILED, FINISHED, RUNNING

SIGNALLED = 128  # an exit code past this is 128 + the signal that ended the process


@dataclass(frozen=True, slots=True)
class End:
    """When one label ended (`at`, by its producer's clock): its finish's time where it sent one
    (`exact`), else the earliest it can have died (its last event's)."""

    vitals: LabelVitals
    at: float
    exact: bool

    def entry(self, first: float) -> dict[str, Any]:
        """The label as a follower of a culprit that ended at `first`."""
        v = self.vitals
        return {"label": v.label, "state": v.state, "exit_code": v.exit_code, "ended_at": self.at,
                "after_s": round(self.at - first, 3)}  # fmt: skip


def end_of(vitals: LabelVitals, now: float, settings: HealthSettings) -> End | None:
    """A label's end, or None while it may still run (heard within its silence)."""
    if vitals.state in (FINISHED, FAILED):
        at, exact = vitals.state_ts, True
    elif vitals.state == CRASHED or vitals.silent_for(now) > silent_after(vitals, settings):
        at, exact = vitals.state_ts if vitals.state == CRASHED else vitals.last_ts, False
    else:
        return None
    at = vitals.last_ts if at is None else at
    return None if at is None else End(vitals, at, exact)


def settled(labels: Sequence[LabelVitals], ends: Sequence[End], now: float, settings: HealthSettings) -> bool:
    """Whether the labels' ends are known: each label ended (or fell silent), or the latest end was
    heard longer ago than the longest silence a label may keep."""
    if len(ends) == len(labels):
        return True
    heard = [e.vitals.heard_at for e in ends if e.vitals.heard_at is not None]
    grace = max(silent_after(v, settings) for v in labels)
    return bool(heard) and now - max(heard) > grace


def suspect(end: End, run_state: str) -> bool:
    """Whether a label's end may be the run's fault (the module docstring)."""
    if run_state == FINISHED:
        return end.vitals.state in (RUNNING, CRASHED) and end.vitals.step is not None
    return end.vitals.state != FINISHED


def judge_ended(
    run_state: str,
    labels: Sequence[LabelVitals],
    now: float,
    settings: HealthSettings,
    stragglers: Sequence[dict[str, Any]] = (),
    anomalies: Sequence[dict[str, Any]] = (),
) -> Verdict:
    """The last verdict of a run that ended (`run_state`), its `labels` all it had: crashed with
    the label that went first and its followers, where one went first; else the ended verdict of
    storage/health.py (crashed for a crashed run, ok otherwise)."""
    verdict = judge(run_state, [], now, settings, stragglers, anomalies)
    if len(labels) < 2:
        return verdict
    ends = [e for v in labels if (e := end_of(v, now, settings)) is not None]
    if not settled(labels, ends, now, settings):
        return replace(verdict, settling=True)
    ends.sort(key=lambda e: (e.at, e.vitals.label))
    suspects = [e for e in ends if suspect(e, run_state)]
    if not suspects:
        return verdict
    first = suspects[0]
    together = [
        e for e in suspects if not e.exact and e.at - first.at < max(first.vitals.every, e.vitals.every)
    ]
    if not first.exact and len(together) > 1:
        names = ", ".join(e.vitals.label for e in together)
        note = f"{verdict.note}; {names} ended with no finish within a heartbeat of each other"
        note += " (killed together?)"
        return replace(verdict, note=note)
    others = [e for e in ends if e is not first]
    culprit = culprit_of(first.vitals, reason(first, others), now)
    culprit.update(state=first.vitals.state, exit_code=first.vitals.exit_code, ended_at=first.at)
    followers = [e.entry(first.at) for e in others]
    return replace(verdict, state=CRASHED, culprits=[culprit], followers=followers)


def reason(first: End, others: Sequence[End]) -> str:
    """Why `first` is named: how it ended, when, and how long before the next label ended."""
    vitals, at = first.vitals, clock(first.at)
    code = vitals.exit_code
    if vitals.state == FAILED and code is not None and code > SIGNALLED:
        how = f"killed by signal {code - SIGNALLED} (exit code {code}) at {at}"
    elif vitals.state == FAILED:
        how = f"exited with code {code} at {at}"
    elif vitals.state == CRASHED:
        how = f"crashed: no exit status, last heard at {at}"
    else:
        how = f"killed: no finish, last heard at {at}"
    after = next((e for e in others if e.at >= first.at), None)
    if after is None:
        return f"{how}, the last to end" if others else f"{how}, while the others went on"
    verb = "finished" if after.vitals.state == FINISHED else "failed"
    return f"{how}, {after.at - first.at:.1f} s before any other rank {verb}"


def clock(ts: float) -> str:
    """A time of day to the tenth of a second, as the ingester's clock reads it."""
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 10) % 10}"
