"""Per-rank step timing: where each training step's time went (perf/* figures).

One clock for every way runbus times steps: the framework integrations (runbus.integrations.*)
and run.watch(model) under plain DistributedDataParallel (runbus.producer.watch). Their hooks tell
a StepClock where a step begins and ends and when backward returned; hooks on the model's
parameters (or DDP's gradient buckets) tell it when this rank's last gradient was ready. From
those it splits each step of this rank (host-side wall time, time.perf_counter):

- data wait (perf/data_wait_s): from the end of the previous step, or of the last work outside
  steps the framework reported (evaluation, logging, checkpointing), to the start of this one:
  fetching the batch, and whatever else runs between steps.
- collective wait (perf/comm_wait_s): from this rank's last gradient being ready to backward
  returning. Under DistributedDataParallel that is the wait for the gradient all-reduce, so for
  the slowest rank: a fast rank waits there, a slow rank barely does.
- compute (perf/compute_s): the rest of the step: forward, loss, this rank's backward, the
  optimizer step.

On CUDA these are host times: kernels and NCCL collectives run asynchronously, so the split shows
where the host waited, not where the device did. Under FSDP or DeepSpeed, whose flat parameters
take the gradients, no gradient hook fires: compute and collective wait are then left out.

Figures are means over a window of steps (every_n_steps), plus throughput over the window's wall
time and this process's memory at its end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

import psutil

MIB = 1024 * 1024


def leading_size(batch: Any) -> int | None:
    """The length of the first tensor (or array) found in `batch`: its batch size, or None."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif not isinstance(batch, list | tuple):
        return None
    for item in batch:
        size = leading_size(item)
        if size is not None:
            return size
    return None


class StepClock:
    """Times one rank's training steps; `take()` gives the window's figures as metrics."""

    def __init__(self) -> None:
        self._hooks: list[Any] = []
        self._in_step = False
        self._step_start = 0.0
        self._idle_since: float | None = None
        self._last_grad: float | None = None
        self._step_comm: float | None = None
        self._process = psutil.Process()
        self._reset_window()

    def _reset_window(self) -> None:
        self.steps = 0
        self._window_start: float | None = None
        self._window_end = 0.0
        self._step_total = 0.0
        self._step_max = 0.0
        self._data_total = 0.0
        self._data_steps = 0
        self._comm_total = 0.0
        self._comm_steps = 0
        self._samples = 0
        self._tokens = 0

    @property
    def in_step(self) -> bool:
        return self._in_step

    # -- what the framework's hooks call --------------------------------------------------------

    def watch(self, module: Any) -> None:
        """Note when each trainable parameter of `module` gets its gradient (torch >= 2.1)."""
        for param in module.parameters():
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_ready))

    def unwatch(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def idle(self) -> None:
        """Work outside steps ended now (evaluation, logging, saving): data wait counts from here."""
        if not self._in_step:
            self._idle_since = time.perf_counter()

    def begin_step(self, samples: int | None = None, tokens: int | None = None) -> None:
        now = time.perf_counter()
        if self._idle_since is not None:
            self._data_total += now - self._idle_since
            self._data_steps += 1
        if self._window_start is None:
            self._window_start = self._idle_since if self._idle_since is not None else now
        self._in_step = True
        self._step_start = now
        self._last_grad = None
        self._step_comm = None
        self.add_inputs(samples, tokens)

    def add_inputs(self, samples: int | None, tokens: int | None = None) -> None:
        """Count a (micro-)batch's samples and tokens into the window's throughput."""
        if samples:
            self._samples += samples
        if tokens:
            self._tokens += tokens

    def _grad_ready(self, param: Any) -> None:
        self.grad_ready()

    def grad_ready(self) -> None:
        """This rank's gradients are ready now (the last one so far in this step)."""
        if self._in_step:
            self._last_grad = time.perf_counter()

    def backward_returned(self, at: float | None = None) -> None:
        """Backward has returned (under DDP, after waiting for the gradient all-reduce), now or
        at the perf_counter time `at`."""
        if self._in_step and self._last_grad is not None:
            returned = time.perf_counter() if at is None else at
            self._step_comm = (self._step_comm or 0.0) + max(0.0, returned - self._last_grad)
            self._last_grad = None

    def end_step(self) -> None:
        if not self._in_step:
            return
        now = time.perf_counter()
        duration = now - self._step_start
        self.steps += 1
        self._step_total += duration
        self._step_max = max(self._step_max, duration)
        if self._step_comm is not None:
            self._comm_total += min(self._step_comm, duration)
            self._comm_steps += 1
        self._in_step = False
        self._idle_since = self._window_end = now

    # -- the window's figures --------------------------------------------------------------------

    def take(self) -> dict[str, float]:
        """The figures of the steps since the last take() (empty if none), and a new window."""
        if not self.steps:
            return {}
        figures = {
            "perf/step_s": self._step_total / self.steps,
            "perf/step_max_s": self._step_max,
        }
        if self._data_steps:
            figures["perf/data_wait_s"] = self._data_total / self._data_steps
        if self._comm_steps == self.steps:
            figures["perf/comm_wait_s"] = self._comm_total / self.steps
            figures["perf/compute_s"] = (self._step_total - self._comm_total) / self.steps
        wall = self._window_end - (self._window_start or self._window_end)
        if wall > 0 and self._samples:
            figures["perf/samples_per_s"] = self._samples / wall
        if wall > 0 and self._tokens:
            figures["perf/tokens_per_s"] = self._tokens / wall
        figures.update(self.memory())
        self._reset_window()
        return figures

    def memory(self) -> dict[str, float]:
        """This process's resident memory, and CUDA's peak allocation where CUDA is in use."""
        figures = {"perf/rss_mb": self._process.memory_info().rss / MIB}
        cuda = getattr(sys.modules.get("torch"), "cuda", None)
        if cuda is not None and cuda.is_initialized():
            figures["perf/cuda_max_allocated_mb"] = cuda.max_memory_allocated() / MIB
        return figures
