"""Metric values logged as CUDA tensors, read without ever waiting for the GPU.

log() must not wait for the device, so a CUDA tensor's value is read later, off the training
thread. Reading it with `.item()` there would still wait: for every kernel queued before it. A
rank whose GPU hangs (a kernel that never ends, an NCCL collective waiting for a peer that never
comes) would then hang its shipper thread too, and with it the heartbeats that say what the rank
is doing: the detector would see the hung rank as silent, or as not started, instead of naming it.

So log() queues the value's copy to host memory on the tensor's stream (`non_blocking`: into
pinned memory, no wait) and records a CUDA event after it. The outbox does not take an event
whose values are not ready (`DeviceMetrics.ready`: the events asked, never waited on): it and
what was logged after it wait, in order, while heartbeats go ahead of them
(runbus.producer.outbox). Other accelerators (MPS, XPU) keep a device copy, read by the shipper
with `.item()`, which waits for their device.

torch is never imported here: a tensor's own module is found through `sys.modules`.
"""

from __future__ import annotations

import sys
from typing import Any


class DeviceNotReady(RuntimeError):
    """A CUDA value read before its device computed it (a run giving up at finish)."""


def recorded_event(device: Any) -> Any:
    """A CUDA event recorded now on `device`'s current stream (where the copy was queued): its
    `query()` says whether the GPU got past it, without waiting."""
    cuda = sys.modules["torch"].cuda
    event = cuda.Event()
    event.record(cuda.current_stream(device))
    return event


class PendingValue:
    """One CUDA tensor's value on its way to the host: read it once `ready()`."""

    __slots__ = ("_done", "_host")

    def __init__(self, value: Any) -> None:
        self._host = value.detach().to("cpu", non_blocking=True)
        self._done = recorded_event(value.device)

    def ready(self) -> bool:
        return bool(self._done.query())

    def item(self) -> Any:
        """The value, once its device computed it; DeviceNotReady before (never a wait)."""
        if not self._done.query():
            raise DeviceNotReady("its GPU had not computed it (a kernel or collective still running)")
        return self._host.item()


class DeviceMetrics(dict):  # type: ignore[type-arg]
    """A metric event's values, some of them PendingValues: the outbox takes it once every one is
    ready."""

    __slots__ = ()

    def ready(self) -> bool:
        return all(value.ready() for value in self.values() if type(value) is PendingValue)
