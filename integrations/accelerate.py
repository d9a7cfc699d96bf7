"""Hugging Face Accelerate: RunbusTracker logs every process of an Accelerator into one run.

    from runbus.integrations.accelerate import RunbusTracker, finish_every_process, log_every_process

    accelerator = Accelerator(log_with=RunbusTracker())        # built on every process
    accelerator.init_trackers("my-project", config=vars(args)) # the config, from the main process
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker_of(accelerator).watch(model)                       # every process: perf/* step timing
    for step, batch in enumerate(loader):
        ...
        accelerator.log({"loss": avg_loss}, step=step)        # the main process only (accelerate's rule)
        log_every_process(accelerator, {"rank_loss": loss}, step=step)   # every process, its own label
    finish_every_process(accelerator)
    accelerator.end_training()

Accelerator.init_trackers(), log() and end_training() reach trackers on the main process only,
whatever a tracker's main_process_only says. A RunbusTracker is built on every process (it is
just an object until it logs) and starts its label (rank0, rank1, ... from the launcher's
environment) the first time it logs: through accelerator.log() on the main process, through
log_every_process() or tracker.log() on every process. finish_every_process() (or
tracker.finish()) finishes each process's label; end_training() finishes the main process's
only, and runbus finishes what is left at exit.

tracker.watch(model), on the model accelerator.prepare() returned, times every process's
training steps as the Lightning and Transformers integrations do (perf/step_s, perf/compute_s,
perf/comm_wait_s, perf/data_wait_s, ...: run.watch(), runbus.producer.watch): under DDP the
all-reduce wait is told apart from compute. Call it before the first step.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from runbus.producer import check_arguments, init
from runbus.producer.run import Run

__all__ = ["RunbusTracker", "finish_every_process", "log_every_process", "tracker_of"]


class RunbusTracker(GeneralTracker):  # type: ignore[misc]  # accelerate has no types: its base is Any
    """An accelerate tracker whose every process logs under its own label of one run.

    The Run starts on first use with runbus.init(**init_options): run id, label and primary
    from the launcher's environment (accelerate launch, torchrun) once the Accelerator exists.
    Numbers are logged as metrics; strings as log lines (`key: value`).
    """

    name = "runbus"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, **init_options: Any) -> None:
        super().__init__()
        check_arguments(**init_options)
        self._init_options = init_options
        self._config: dict[str, Any] = dict(init_options.pop("config", None) or {})
        self._run: Run | None = None
        self._lock = threading.Lock()

    @property
    def tracker(self) -> Run:
        """This process's Run (started now if need be)."""
        with self._lock:
            if self._run is None:
                self._run = init(config=self._config, **self._init_options)
            return self._run

    def start(self) -> None:
        """Nothing yet: the label starts on first use, with the configuration stored by then."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        with self._lock:
            run = self._run
            if run is None:
                self._config.update(values)
                return
        run.config.update(dict(values))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        run = self.tracker
        metrics = {k: v for k, v in values.items() if not isinstance(v, str)}
        if metrics:
            run.log(metrics, step=step)
        for key, text in values.items():
            if isinstance(text, str):
                run.log_text(f"{key}: {text}")

    def watch(self, model: Any, every_n_steps: int = 10) -> None:
        """Time this process's training steps of `model` (as accelerator.prepare() returned it)
        and log the perf/* figures every `every_n_steps` steps (Run.watch; starts the label)."""
        self.tracker.watch(model, every_n_steps)

    def finish(self) -> None:
        with self._lock:
            run = self._run
        if run is not None:
            run.finish()


def tracker_of(accelerator: Accelerator) -> RunbusTracker:
    """The RunbusTracker passed as Accelerator(log_with=...), on any process."""
    for tracker in accelerator.log_with:
        if isinstance(tracker, RunbusTracker):
            return tracker
    raise ValueError("this Accelerator has no RunbusTracker: pass Accelerator(log_with=RunbusTracker())")


def log_every_process(accelerator: Accelerator, values: Mapping[str, Any], step: int | None = None) -> None:
    """accelerator.log() for every process: each logs `values` under its own label."""
    tracker_of(accelerator).log(values, step=step)


def finish_every_process(accelerator: Accelerator) -> None:
    """Finish this process's label (accelerator.end_training() finishes the main process's only)."""
    tracker_of(accelerator).finish()
