"""The thread that makes a shipper's Redis calls, one at a time, so that encoding never waits on Redis.

The shipper thread hands the courier a `Call` (a function that talks to Redis, and what to do
with its result) and goes on moving events from the queue that log() feeds into the byte buffer;
it collects the outcome, on its own thread, once the call is done. A Redis that is paused, slow,
failing over or out of memory holds up this thread only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _ignore(result: Any) -> None:
    return None


@dataclass(eq=False)
class Call:
    """One Redis call: `work` runs on the courier's thread; `then(result)` on the shipper's,
    once it has collected the call (an `error` is handled there instead)."""

    work: Callable[[], Any]
    then: Callable[[Any], None] = _ignore
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Courier(threading.Thread):
    """Runs one Call at a time; sets `wake` when one is done, so the shipper collects it at once."""

    def __init__(self, name: str, wake: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self._wake = wake
        self._queued: Call | None = None
        self._ready = threading.Event()
        self._closing = False

    def submit(self, call: Call) -> None:
        """Make `call` (the shipper has none other in flight)."""
        call.started = time.monotonic()
        self._queued = call
        self._ready.set()

    def close(self) -> None:
        """End once the call in flight, if any, returns (a daemon: a hung call never holds exit)."""
        self._closing = True
        self._ready.set()

    def run(self) -> None:
        while True:
            self._ready.wait()
            self._ready.clear()
            call, self._queued = self._queued, None
            if call is not None:
                try:
                    call.result = call.work()
                except BaseException as exc:  # the shipper's thread decides: retry, refuse or raise
                    call.error = exc
                call.done.set()
                self._wake.set()
            elif self._closing:
                return
