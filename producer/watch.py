"""run.watch(model): each rank's step time split into compute and all-reduce wait, in plain PyTorch.

Under DistributedDataParallel every rank's step takes as long as the slowest one's: the fast ranks
wait in the gradient all-reduce. ModelWatch times where each step of this rank went with the
integrations' StepClock (runbus.producer.clock) and logs the same perf/* figures they do, from
hooks on the model alone, with no change to the training loop:

- a step begins at the first training forward (grad enabled, module.training) after the last one
  ended; evaluation forwards between steps are not data wait;
- DDP's communication hook (register_comm_hook) wraps the default all-reduce hook, so gradients
  are reduced exactly as without it: the last bucket's call is this rank's last gradient ready,
  and the reduced future's completion is when backward stops waiting for the other ranks;
- a step ends when an optimizer holding the model's parameters has stepped (torch's global
  optimizer step hook), else at the next training forward (no optimizer: compute then holds what
  ran between steps).

A model that is not DDP-wrapped gets step and data-wait figures only, as a framework without
gradient hooks does. torch is imported here, never by `import runbus`: this module loads on the
first run.watch().
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from runbus.producer.clock import StepClock, leading_size

if TYPE_CHECKING:
    from runbus.producer.run import Run

log = logging.getLogger("runbus.producer")


class ModelWatch:
    """Times one model's training steps and logs perf/* into `run` every `every_n_steps` steps,
    at the step counted from `first_step` (the index of the window's last step)."""

    def __init__(self, run: Run, model: Any, every_n_steps: int = 10, first_step: int = 0) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch() takes a torch.nn.Module, not {type(model).__name__}")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, not {every_n_steps!r}")
        self._run = run
        self.model = model
        self._every = every_n_steps
        self._step = first_step
        self._clock = StepClock()
        self._reduced_at: float | None = None
        self._params = {id(p) for p in model.parameters()}
        self._optimizers: dict[int, bool] = {}
        if isinstance(model, DistributedDataParallel):
            # Wrapping the default hook keeps DDP's reduction (a sum divided by the group's size).
            # No annotations: DDP checks them as objects, and this module's are strings.
            def all_reduce(state, bucket):  # type: (Any, Any) -> torch.futures.Future[torch.Tensor]
                return self._all_reduce(state, bucket)

            try:
                model.register_comm_hook(model.process_group, all_reduce)
            except RuntimeError as exc:  # a model takes one hook: another (fp16 compression) is in place
                log.warning("runbus: watch() leaves out compute and all-reduce wait: %s", exc)
        self._handles = [
            model.register_forward_pre_hook(self._forward, with_kwargs=True),
            model.register_forward_hook(self._forwarded),
            register_optimizer_step_post_hook(self._optimizer_stepped),
        ]
        # No idle() here: what runs between watch() and the first step (building the optimizer)
        # is no data wait; data wait counts from the first step's end.

    def close(self) -> None:
        """Stop timing (DDP keeps the communication hook, which then only reduces); log the
        window's figures, if any."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._end_step()
        self._log()

    # -- hooks -------------------------------------------------------------------------------------

    def _forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        clock = self._clock
        if clock.in_step and self._reduced_at is not None:
            self._step_done()  # the last step's gradients were reduced, and no optimizer stepped
        samples = leading_size(args) or leading_size(kwargs)
        if clock.in_step:
            clock.add_inputs(samples)  # accumulating gradients over several forwards
        else:
            clock.begin_step(samples=samples)

    def _forwarded(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            self._clock.idle()  # an evaluation forward: what follows is not waiting for data

    def _all_reduce(self, group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        if bucket.is_last():
            self._clock.grad_ready()
        return default_hooks.allreduce_hook(group, bucket).then(self._reduced)

    def _reduced(self, future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        # On the thread that completed the all-reduce: one float, read on the training thread.
        self._reduced_at = time.perf_counter()
        return future.value()

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        mine = self._optimizers.get(id(optimizer))
        if mine is None:
            mine = self._optimizers[id(optimizer)] = any(
                id(p) in self._params for group in optimizer.param_groups for p in group["params"]
            )
        if mine and self._clock.in_step:
            self._step_done()

    # -- steps -------------------------------------------------------------------------------------

    def _step_done(self) -> None:
        self._end_step()
        if self._clock.steps >= self._every:
            self._log()

    def _end_step(self) -> None:
        clock = self._clock
        if not clock.in_step:
            return
        if self._reduced_at is not None:
            clock.backward_returned(at=self._reduced_at)
            self._reduced_at = None
        clock.end_step()
        self._step += 1

    def _log(self) -> None:
        figures = self._clock.take()
        if figures and not self._run.finished:
            self._run.log(figures, step=self._step - 1)
