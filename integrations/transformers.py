"""Hugging Face Transformers: RunbusCallback logs every rank of a Trainer into one run.

    from runbus.integrations.transformers import RunbusCallback

    trainer = Trainer(model, args, train_dataset=train, callbacks=[RunbusCallback()])
    trainer.train()                      # torchrun --nproc-per-node 8 train.py

The Trainer averages the loss over ranks before on_log, and its own integrations report from the
main process only. RunbusCallback acts on every rank, each logging under its label (rank0,
rank1, ...) of one run, every logging_steps optimizer steps (or every_n_steps), what that average
hides: this rank's own loss (rank_loss: per optimizer step, the model's loss, read as the Trainer
reads it (output["loss"], or output[0] of a tuple) and scaled as the Trainer scales it before
averaging over ranks, so the mean of rank_loss over the ranks is the logged loss), its step
time split into data wait, compute and collective wait (perf/data_wait_s,
perf/compute_s, perf/comm_wait_s, perf/step_s, perf/step_max_s: see runbus.producer.clock),
its throughput (perf/samples_per_s, and perf/tokens_per_s counting input_ids, padding included)
and its memory (perf/rss_mb, perf/cuda_max_allocated_mb). The primary also logs the Trainer's
logs (loss, learning_rate, grad_norm, eval metrics) as on_log receives them. The run's config is
the TrainingArguments, with the model's config under "model"; its name is their run_name.

Data wait runs from the Trainer's last event before a step (step end, log, evaluate, save) to
the step's begin: fetching the step's batches, and (when the model takes num_items_in_batch)
the Trainer's gather of their token count. Collective wait runs from this rank's last gradient
to on_pre_optimizer_step, so it includes gradient clipping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from runbus.producer import check_arguments, init
from runbus.producer.clock import StepClock, leading_size
from runbus.producer.run import Run

__all__ = ["RunbusCallback"]


class RunbusCallback(TrainerCallback):
    """A TrainerCallback that logs from every rank, each under its own label of one run.

    run: log into this Run (yours to finish) instead of starting one at train begin with
    runbus.init(**init_options) (run id, label and primary from torchrun's or accelerate's
    environment; finished at train end, and continued, same run id and label, resumed, by the
    next train() of the callback). every_n_steps: the window, in optimizer steps, of the
    per-rank figures (default: the Trainer's logging_steps).
    """

    def __init__(self, run: Run | None = None, every_n_steps: int | None = None, **init_options: Any) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, not {every_n_steps}")
        if run is not None and init_options:
            raise TypeError("pass either a Run or runbus.init() options, not both")
        check_arguments(**init_options)
        self.run = run
        self.every_n_steps = every_n_steps
        self._own_run = run is None
        self._init_options = init_options
        self._clock: StepClock | None = None
        self._hooks: list[Any] = []
        self._loss_sum: Any = None
        self._loss_scale = (1.0, 1.0)  # (with num_items_in_batch, without): see on_train_begin
        self._items_passed = False

    # -- start and end -----------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if self._own_run and (self.run is None or self.run.finished):
            options = dict(self._init_options)
            if args.run_name and "name" not in options:
                options["name"] = args.run_name  # the run's name, as other trackers take it
            if self.run is not None:  # train() again: the same run and label, resumed
                options.setdefault("run_id", self.run.run_id)
                options.setdefault("resume", "allow")
            self.run = init(config=_config(args, model), **options)
        # The Trainer's training_step returns the model's loss times the world size when the model
        # divides by the items of every rank (num_items_in_batch, average_tokens_across_devices),
        # else divided by the accumulation steps; its logged loss averages those over ranks.
        world = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        self._loss_scale = (float(world), 1.0 / max(1, args.gradient_accumulation_steps))
        self._clock = StepClock()
        if model is not None:
            self._clock.watch(model)
            self._hooks.append(
                model.register_forward_pre_hook(self._count_inputs, with_kwargs=True, prepend=True)
            )
            self._hooks.append(model.register_forward_hook(self._add_loss))
        self._clock.idle()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._clock is not None:
            self._log_window(state)
            self._clock.unwatch()
            self._clock = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._own_run and self.run is not None:
            self.run.finish()

    # -- a step --------------------------------------------------------------------------------------

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._clock is not None:
            self._clock.begin_step()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._clock is not None:
            self._clock.backward_returned()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._clock is None:
            return
        self._clock.end_step()
        if self._clock.steps >= (self.every_n_steps or max(1, int(state.logging_steps or 1))):
            self._log_window(state)

    def _count_inputs(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._clock is None or not self._clock.in_step:
            return
        self._items_passed = kwargs.get("num_items_in_batch") is not None
        ids = kwargs.get("input_ids")
        if ids is not None and hasattr(ids, "numel"):
            self._clock.add_inputs(leading_size(ids), int(ids.numel()))
        else:
            self._clock.add_inputs(leading_size(kwargs) or leading_size(args))

    def _add_loss(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if self._clock is None or not self._clock.in_step:
            return
        loss = _loss(output)
        if loss is not None and getattr(loss, "numel", lambda: 0)() == 1:
            # Summed on its device: reading it here would wait for the device every micro-batch.
            loss = loss.detach().float() * self._loss_scale[0 if self._items_passed else 1]
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    def _log_window(self, state: TrainerState) -> None:
        assert self._clock is not None
        steps = self._clock.steps
        figures: dict[str, Any] = self._clock.take()
        if self._loss_sum is not None and steps:
            figures["rank_loss"] = (self._loss_sum / steps).reshape(())
            self._loss_sum = None
        if figures and self.run is not None and not self.run.finished:
            self.run.log(figures, step=state.global_step)

    # -- work between steps: not data wait -----------------------------------------------------------

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._clock is not None:
            self._clock.idle()
        if not logs or not state.is_world_process_zero or self.run is None or self.run.finished:
            return
        # The Trainer's logs are the same on every rank (the loss averaged over them): one copy.
        numbers = {k: v for k, v in logs.items() if isinstance(v, int | float)}
        if numbers:
            self.run.log(numbers, step=state.global_step)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._clock is not None:
            self._clock.idle()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._clock is not None:
            self._clock.idle()


def _loss(output: Any) -> Any:
    """The loss in a model's output, read as the Trainer reads it: output["loss"] from a dict
    (ModelOutput is one), else output[0] (a model may return a tuple (loss, logits, ...))."""
    if isinstance(output, Mapping):
        return output.get("loss")
    if isinstance(output, tuple | list):
        return output[0] if output else None
    return getattr(output, "loss", None)


def _config(args: TrainingArguments, model: Any) -> dict[str, Any]:
    # Tokens are masked by to_dict(), secrets by runbus.redact (transformers leaves it unannotated).
    config: dict[str, Any] = args.to_dict()  # type: ignore[no-untyped-call]
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "to_dict"):
        config["model"] = model_config.to_dict()
    return config
