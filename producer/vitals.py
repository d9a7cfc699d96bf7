"""What a rank's heartbeats tell the detector: its step progress, its training thread's stack and
the torch.distributed collective it is inside (runbus.producer.collectives).

Everything here runs on the shipper thread. The step is read from the metric events as they are
encoded (log() does nothing more for it), and the stack is taken with sys._current_frames(): no
signal is sent into the training code, which goes on while its frames are read.
"""

from __future__ import annotations

import linecache
import os
import socket
import statistics
import sys
import time
from collections import deque
from typing import Any

from runbus.producer import collectives
from runbus.redact import redact_line

# The frames a beat carries at most (the innermost), and the longest source line it keeps.
MAX_FRAMES = 30
MAX_LINE = 160
# A stall beat goes once the step has not advanced for STALL_STEPS typical step times, and at
# least STALL_MIN seconds (the detector's floor is 10 s by default: the beat is there before it).
STALL_STEPS = 3.0
STALL_MIN = 1.0
STEP_TIMES = 32  # recent step times kept for the typical one
# Stall beats begin once this many step times are known: a loop that has not yet stepped a few
# times is starting, and the detector does not judge a start-up.
STALL_AFTER_STEPS = 3


class Progress:
    """A label's step as its encoded metric events show it: the last step, when it advanced
    (wall clock, the events' own `ts`), the recent step times, and whether a stall beat went out
    since (so that the step moving on sends a beat at once)."""

    __slots__ = ("advanced_at", "announced", "moved", "step", "times")

    def __init__(self) -> None:
        self.step: int | None = None
        self.advanced_at: float | None = None
        self.times: deque[float] = deque(maxlen=STEP_TIMES)
        self.announced = False  # a stall beat went out, and the step has not moved since
        self.moved = False  # the step moved after a stall beat: a beat is due now

    def saw(self, step: int, ts: float) -> None:
        """A metric event at `step`, logged at `ts` (the shipper tells the last of each batch
        it encodes: a step time is the time between two of them over the steps between)."""
        previous = self.step
        if previous == step:
            return
        if previous is not None and step > previous and self.advanced_at is not None:
            self.times.append(max(0.0, ts - self.advanced_at) / (step - previous))
        self.step, self.advanced_at = step, ts
        if self.announced:
            self.announced, self.moved = False, True

    def step_time(self) -> float | None:
        """The median of the recent step times (None before two steps)."""
        return statistics.median(self.times) if self.times else None

    def stall_after(self) -> float:
        typical = self.step_time()
        return max(STALL_MIN, STALL_STEPS * typical) if typical is not None else STALL_MIN

    def beat_due(self, now: float) -> bool:
        """Whether a beat is due outside the schedule: the step stopped advancing (once per
        stall), or moved on after a stall beat."""
        if self.moved:
            self.moved = False
            return True
        if self.announced or self.advanced_at is None or len(self.times) < STALL_AFTER_STEPS:
            return False
        if now - self.advanced_at >= self.stall_after():
            self.announced = True
            return True
        return False

    def report(self, now: float) -> dict[str, Any]:
        """The beat's step fields: step, step_age, step_s, stalled."""
        if self.step is None or self.advanced_at is None:
            return {}
        typical = self.step_time()
        age = max(0.0, now - self.advanced_at)
        return {
            "step": self.step,
            "step_age": round(age, 3),
            "step_s": None if typical is None else round(typical, 6),
            # What the stall beat said, until the step moves on: then a beat goes at once, so
            # the detector may count a stalled label's age on from it.
            "stalled": self.announced,
        }


def thread_stack(thread_id: int | None, limit: int = MAX_FRAMES) -> list[list[Any]]:
    """The stack of thread `thread_id`, outermost frame first, its innermost `limit` frames:
    [file, line, function, source line] each, the source cut to MAX_LINE characters and its
    secrets redacted. [] when the thread is gone."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    frames: list[list[Any]] = []
    while frame is not None and len(frames) < limit:
        code = frame.f_code
        text = linecache.getline(code.co_filename, frame.f_lineno).strip()
        if len(text) > MAX_LINE:
            text = text[: MAX_LINE - 1] + "…"
        frames.append([code.co_filename, frame.f_lineno, code.co_name, redact_line(text)])
        frame = frame.f_back
    frames.reverse()
    return frames


def beat_fields(progress: Progress, thread_id: int | None, every: float) -> dict[str, Any]:
    """What a heartbeat adds for the detector: step progress, the watched thread's stack, the
    collective the process is inside and for how long (runbus.producer.collectives), the
    heartbeat interval (`every`), host and pid (so an ingester on this host can look at it)."""
    return {
        **progress.report(time.time()),
        **collectives.beat_fields(),
        "every": every,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "stack": thread_stack(thread_id),
    }
