"""Which torch.distributed collective this rank is inside, and since when, for its heartbeats.

Once torch.distributed has a process group (the shipper thread looks at each heartbeat, through
`sys.modules` only: runbus never imports torch, the training code did), the blocking entry points
of the `torch.distributed` namespace are wrapped, once per process: entering one puts its name and
the monotonic time in a plain slot, leaving it empties the slot. A heartbeat reads the slot
(`beat_fields`): `collective` (None while outside every one) and `collective_s`, how long it has
been inside. The detector counts a rank inside one as waiting (storage/health.py).

What it does not see: calls through a name bound before the wrapping (`from torch.distributed
import all_reduce` at import time, `torch.distributed.distributed_c10d.all_reduce`), the wait of
an `async_op=True` call (its Work's wait() is C++), and DDP's gradient all-reduce (inside
backward, where the stack still shows it). Only the outermost collective is kept (an
`all_gather_object` calls `all_gather`), one per process whatever the thread. Under torch.compile
the wrapper only forwards the call (torch.compiler.is_compiling), so tracing sees torch's own
function. RUNBUS_COLLECTIVES=0 leaves torch.distributed alone.

A beat also carries each process group's progress as torch's flight recorder counts it
(`groups`: the last collective queued, started and completed), read in about 30 µs: under NCCL a
collective runs on the GPU and the Python call returns at once, so the slot above stays empty
while the rank's GPU waits for its peers; the counts say which rank never queued, or whose GPU
never started, the collective the others wait in.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from runbus import config

log = logging.getLogger("runbus.producer")

# The entry points wrapped, where this torch has them: collectives and blocking point-to-point.
NAMES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "batch_isend_irecv",
)  # fmt: skip
# torch's flight recorders, each asked for its groups' status: NCCL's groups are in its own (a
# CUDA build has both), gloo's in the other (recent torch); the first to name a group wins.
RECORDERS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
MAX_GROUPS = 16  # process groups a beat reports the progress of (FSDP and TP jobs make many)
WRAPPED = "__runbus_collective__"  # the attribute that marks a wrapper (holding what it wraps)

# The collective the process is inside and when it entered it (time.monotonic()), else None.
# Written by the training thread, read by the shipper thread: a tuple is swapped whole.
_entered: tuple[str, float] | None = None
# None until torch.distributed had a process group (or was found switched off); then whether wrapped.
_wrapped: bool | None = None


def _wrapper(name: str, call: Callable[..., Any], compiling: Callable[[], bool]) -> Callable[..., Any]:
    """`call` (torch.distributed's `name`), recording its time inside in the slot."""

    @functools.wraps(call)
    def collective(*args: Any, **kwargs: Any) -> Any:
        global _entered
        if _entered is not None or compiling():  # inside one already, or being traced
            return call(*args, **kwargs)
        _entered = (name, time.monotonic())
        try:
            return call(*args, **kwargs)
        finally:
            _entered = None

    setattr(collective, WRAPPED, call)
    return collective


def _not_compiling() -> bool:
    return False


def instrument() -> bool:
    """Wrap torch.distributed's entry points once it has a process group (never importing it);
    whether they are wrapped."""
    global _wrapped
    if _wrapped is not None:
        return _wrapped
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        enabled = config.time_collectives()
    except ValueError as exc:
        log.warning("runbus: %s: collectives not timed", exc)
        enabled = False
    if enabled:
        compiler = getattr(sys.modules.get("torch"), "compiler", None)
        compiling = getattr(compiler, "is_compiling", _not_compiling)
        for name in NAMES:
            call = getattr(dist, name, None)
            if callable(call) and not hasattr(call, WRAPPED):
                setattr(dist, name, _wrapper(name, call, compiling))
    _wrapped = enabled
    return enabled


def beat_fields() -> dict[str, Any]:
    """What a heartbeat says of the collectives: none of it before they are wrapped; then the one
    the process is inside (`collective`, None if none) and for how long (`collective_s`), and
    each process group's progress where torch's flight recorder keeps it (`groups`)."""
    if not instrument():
        return {}
    entered = _entered
    fields: dict[str, Any] = {"collective": None, "collective_s": None}
    if entered is not None:
        name, since = entered
        fields = {"collective": name, "collective_s": round(time.monotonic() - since, 3)}
    groups = group_progress()
    if groups:
        fields["groups"] = groups
    return fields


def group_progress() -> dict[str, list[int]] | None:
    """Each process group's collectives as torch's flight recorder counts them (NCCL's and, in
    recent torch, gloo's): {group id: [last queued, last started, last completed]}, sequence
    numbers, `started` -1 unless NCCL times its collectives (TORCH_NCCL_ENABLE_TIMING=1). Under
    NCCL a collective runs on the GPU and the call returns at once: these say which one a rank's
    GPU waits in, and which rank never queued, or never started, the one the others wait in.
    None where this torch has no recorder or it answers nothing; at most MAX_GROUPS groups."""
    c10d = getattr(getattr(sys.modules.get("torch"), "_C", None), "_distributed_c10d", None)
    status: dict[str, Any] = {}
    for name in RECORDERS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            found = orjson.loads(dump(includeCollectives=False, onlyActive=True)).get("pg_status") or {}
        except Exception as exc:  # another torch's format: the beat goes without it
            log.debug("runbus: %s could not be read: %s", name, exc)
            continue
        for group, counts in found.items():
            status.setdefault(str(group), counts)
    try:
        return {
            group: [
                int(counts["last_enqueued_collective"]),
                int(counts["last_started_collective"]),
                int(counts["last_completed_collective"]),
            ]
            for group, counts in sorted(status.items())[:MAX_GROUPS]
        } or None
    except (KeyError, TypeError, ValueError) as exc:
        log.debug("runbus: the flight recorder's group status is not as expected: %s", exc)
        return None
