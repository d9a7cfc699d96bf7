"""PyTorch Lightning: RunbusLogger logs every rank of a Trainer into one run.

    from runbus.integrations.lightning import RunbusLogger

    trainer = Trainer(strategy="ddp", devices=4, logger=RunbusLogger(tags=["baseline"]))
    trainer.fit(model)

Lightning's own loggers write from rank 0 only; RunbusLogger writes from every rank, each under
its label (rank0, rank1, ...) of one run: what each rank logs with `self.log()` (its own values
unless sync_dist=True), the hyperparameters (save_hyperparameters(), log_hyperparams() and
`experiment.config.update()`, before or after the run starts) and, through the RunbusStepTimer it
adds to the Trainer, each rank's step time split into data wait, compute and collective wait
(runbus.producer.clock). Nothing needs setting under the ddp, ddp_spawn and ddp_fork
strategies, torchrun or SLURM: the process that builds the logger makes up the run id and
exports it (RUNBUS_RUN_ID) for the ranks it launches, or pickles it into them.

A process logs as a label only once it knows its rank: when the Trainer shows it the model, or
when it first logs a metric. Until then `logger.version` (the run id) and `logger.experiment` (a
PendingRun: run_id, config.update()) claim nothing, so the process that launches ddp_spawn's ranks,
which is not a rank itself, never takes rank0 from the spawned rank 0. finalize() finishes the
label: exit code 0 for "success" or "finished", 1 otherwise; logging again afterwards (a
trainer.test() after fit) continues the label under a new epoch.
"""

from __future__ import annotations

import copy
import os
import threading
import warnings
import weakref
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger

from runbus import config as settings
from runbus.producer import check_arguments, environment, init
from runbus.producer.clock import StepClock, leading_size
from runbus.producer.run import Run
from runbus.wire import check_name

__all__ = ["PendingRun", "RunbusLogger", "RunbusStepTimer"]

_guessing: weakref.WeakSet[RunbusLogger] = weakref.WeakSet()


def launch_run_id(run_id: str | None) -> str | None:
    """The run id to hand to the ranks this process may launch, or None to settle it later.

    A process with no rank of its own in the environment (a script Lightning's launchers will
    start ranks from) makes up the id now and exports it as RUNBUS_RUN_ID (naming itself in
    RUNBUS_RUN_ID_FROM), before any rank starts. An id this process exported for an earlier run
    (a sweep's previous Trainer) is not reused. A process that is already one rank among several
    leaves the id to runbus.init, which reads the launcher's environment or agrees on one
    through the process group.
    """
    if run_id is not None:
        check_name("run id", run_id)
        return run_id
    env = dict(os.environ)
    if env.get(settings.RUN_ID_FROM_ENV) == str(os.getpid()):
        env.pop(settings.RUN_ID_ENV, None)
    try:
        identity = environment.resolve(env=env)
    except ValueError:  # IdentityUnknown among them: several ranks, no shared id yet
        return None
    if identity.rank is not None:
        return None
    environment.export_run_id(identity)  # a new id only: one from the environment is there already
    return identity.run_id


def _exit_code(status: str) -> int:
    return 0 if status in ("success", "finished") else 1


class PendingRun:
    """What RunbusLogger.experiment is until this process logs as a label.

    run_id, config.update() and repr() claim nothing; any other attribute (log, log_text,
    summary, ...) starts the label, as the rank the process is known to be, else rank0.
    """

    def __init__(self, logger: RunbusLogger) -> None:
        self._logger = logger
        self.config = _PendingConfig(logger)

    @property
    def run_id(self) -> str:
        return self._logger.version

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy and pickle probe for these: no label for them
            raise AttributeError(name)
        return getattr(self._logger.run(), name)

    def __repr__(self) -> str:
        return f"<PendingRun {self._logger.version} (label chosen when this process logs)>"


class _PendingConfig:
    def __init__(self, logger: RunbusLogger) -> None:
        self._logger = logger

    def update(self, values: Mapping[str, Any] | Namespace) -> None:
        self._logger.log_hyperparams(values)


class RunbusLogger(Logger):
    """A Lightning Logger that logs from every rank, each under its own label of one run.

    run_id: the same in every process, else made up (see launch_run_id). step_timing: add a
    RunbusStepTimer to the Trainer (True), with its window in steps (an int), or not (False).
    config: hyperparameters known up front; resume and every other keyword (redis_url, name,
    tags, system_interval, console, ...) go to runbus.init. save_dir (default: the current
    directory, as WandbLogger's): where Lightning writes for this logger, as for its own:
    ModelCheckpoint under save_dir/name/run id/checkpoints (name: the run's name, else
    "runbus_logs", as Lightning's "lightning_logs"), LightningCLI's config.yaml in
    trainer.log_dir, which Lightning takes from save_dir for this logger. prefix: put before
    each key Lightning logs (joined with "-"), as its loggers do; runbus's own perf/* figures
    keep their names.
    """

    LOGGER_JOIN_CHAR = "-"
    # Not "runbus": `python -m` searches the current directory first, and under an editable
    # install (its finder runs after that search) a ./runbus folder of checkpoints is taken for
    # the package.
    DEFAULT_NAME = "runbus_logs"

    def __init__(
        self,
        run_id: str | None = None,
        *,
        step_timing: bool | int = True,
        config: Mapping[str, Any] | Namespace | None = None,
        resume: str | None = None,
        save_dir: str | os.PathLike[str] = ".",
        prefix: str = "",
        **init_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(step_timing, int) and not isinstance(step_timing, bool) and step_timing < 1:
            raise ValueError(f"step_timing must be True, False or a window of >= 1 steps, not {step_timing}")
        check_arguments(run_id=run_id, resume=resume, **init_options)
        self._run_id = launch_run_id(run_id)
        self._save_dir = os.fspath(save_dir)
        self._prefix = prefix
        self._step_timing = step_timing
        self._hparams: dict[str, Any] = _params(config)
        self._resume = resume
        self._init_options = init_options
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self._run: Run | None = None
        self._run_pid: int | None = None
        self._rank: int | None = None
        self._rank_guessed = False
        self._ended = False  # a Run of this logger finished: the next one continues the label
        self._lock = threading.Lock()
        self._pending = PendingRun(self)

    # -- what Lightning reads --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return str(self._init_options.get("name") or self.DEFAULT_NAME)

    @property
    def save_dir(self) -> str:
        """The folder Lightning writes under for this logger (trainer.log_dir, checkpoints)."""
        return self._save_dir

    @property
    def root_dir(self) -> str:
        """save_dir/name: the folder of this name's runs."""
        return os.path.join(self.save_dir, self.name)

    @property
    def log_dir(self) -> str:
        """save_dir/name/run id: this run's folder (its checkpoints/, by default)."""
        return os.path.join(self.root_dir, self.version)

    @property
    def version(self) -> str:
        """The run id (settled without starting a label)."""
        if self._run_id is None:
            self._run_id = environment.resolve(redis_url=self._init_options.get("redis_url")).run_id
        return self._run_id

    @property
    def experiment(self) -> Run | PendingRun:
        """This process's Run once it logs as a label; a PendingRun until then."""
        return self._live_run() or self._pending

    def run(self) -> Run:
        """This process's Run, started now if need be (as the rank it is known to be, else rank0)."""
        with self._lock:
            run = self._live_run()
            if run is None:
                run = self._start()
            return run

    # -- the Logger interface --------------------------------------------------------------------

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        values = _params(params)
        with self._lock:
            self._hparams.update(values)
            run = self._live_run()
        if run is not None and values:
            run.config.update(values)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if metrics:
            self.run().log(dict(_add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR)), step=step)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        # Lightning calls this on every rank as fit/validate/test starts: the model knows its
        # Trainer, so this process now knows its rank.
        trainer = getattr(model, "_trainer", None) if isinstance(model, LightningModule) else None
        if isinstance(trainer, Trainer):
            self.attach(trainer)

    def attach(self, trainer: Trainer) -> None:
        """Learn this process's rank from `trainer`, add the step timer, start the label."""
        with self._lock:
            run = self._live_run()
            label = f"rank{trainer.global_rank}"
            if run is not None and self._rank_guessed and run.label != label:
                self._end(run, 0)
                warnings.warn(
                    f"runbus: this process logged as {run.label} before the Trainer said it is "
                    f"rank {trainer.global_rank}; it goes on as {label}",
                    stacklevel=2,
                )
            self._rank = trainer.global_rank
            self._rank_guessed = False
            _guessing.discard(self)
        # Trainer.callbacks and log_every_n_steps are set by Lightning's connectors, undeclared
        # on the class: hence the ignores.
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self._step_timing is not False and not any(isinstance(c, RunbusStepTimer) for c in callbacks):
            window = None if self._step_timing is True else int(self._step_timing)
            callbacks.append(RunbusStepTimer(every_n_steps=window))
        self.run()

    def save(self) -> None:
        """Nothing to do: events are shipped as they are logged."""

    def finalize(self, status: str) -> None:
        """Finish this process's label (exit code 0 for "success" and "finished", else 1)."""
        with self._lock:
            run = self._live_run()
            failed = status not in ("success", "finished")
            if run is None and failed and not self._ended and self._rank_known():
                run = self._start()  # a rank that fails before logging still reports its failure
            if run is not None:
                self._end(run, _exit_code(status))

    # -- starting and ending labels (under self._lock) ------------------------------------------

    def _live_run(self) -> Run | None:
        if self._run_pid != os.getpid():
            if self._run_pid is not None:  # a forked copy: the Run and the rank are the parent's
                self._run = self._run_pid = self._rank = None
                self._rank_guessed = False
            return None
        run = self._run
        return run if run is not None and not run.finished else None

    def _rank_known(self) -> bool:
        return self._rank is not None or (dist.is_available() and dist.is_initialized())

    def _start(self) -> Run:
        options = dict(self._init_options)
        if self._rank is not None:
            options.update(label=f"rank{self._rank}", primary=self._rank == 0)
        resume = "allow" if self._ended else self._resume
        run = init(run_id=self._run_id, config=self._hparams, resume=resume, **options)
        self._run, self._run_pid, self._run_id = run, os.getpid(), run.run_id
        self._rank_guessed = not self._rank_known() and run.identity.rank is None
        if self._rank_guessed:
            _guessing.add(self)
        return run

    def _end(self, run: Run, exit_code: int) -> None:
        run.finish(exit_code=exit_code)
        self._run = None
        self._ended = True
        _guessing.discard(self)

    def _hand_over(self) -> None:
        """This process is about to start the Trainer's ranks (ddp_spawn pickles the logger,
        ddp_fork forks): a label it took on a guess is finished, for the rank that is it."""
        with self._lock:
            run = self._live_run()
            if run is not None and self._rank_guessed:
                self._end(run, 0)  # first: a warning may be an error, and this runs at fork
                warnings.warn(
                    f"runbus: this process logged as {run.label} before starting the Trainer's "
                    "ranks, which it is not one of: its label is finished and the rank continues it",
                    stacklevel=3,
                )

    # -- pickling (ddp_spawn pickles the Trainer): the run id travels, never the Run --------------

    def __getstate__(self) -> dict[str, Any]:
        self._hand_over()
        return self._portable_state()

    def _portable_state(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_run", "_lock", "_pending")}
        state.update(_run_pid=None, _rank=None, _rank_guessed=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        ended = state.get("_ended", False)
        vars(self).update(state)
        self._reset_process_state()
        self._ended = ended

    def __deepcopy__(self, memo: dict[int, Any]) -> RunbusLogger:
        clone = RunbusLogger.__new__(RunbusLogger)
        clone.__setstate__(copy.deepcopy(self._portable_state(), memo))
        return clone


def _params(params: Mapping[str, Any] | Namespace | None) -> dict[str, Any]:
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return vars(params).copy()
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(f"hyperparameters must be a dict or an argparse.Namespace, not {type(params).__name__}")


def _before_fork() -> None:
    for logger in list(_guessing):
        logger._hand_over()


os.register_at_fork(before=_before_fork)


class RunbusStepTimer(Callback):
    """Logs each rank's step timing into the Run of the Trainer's RunbusLogger (added by it by
    default), not through its log_metrics: that one sees only what Lightning logs.

    Every every_n_steps training batches (default: the Trainer's log_every_n_steps) each rank
    logs the means of perf/step_s, perf/data_wait_s, perf/compute_s, perf/comm_wait_s, and
    perf/step_max_s, perf/samples_per_s, perf/rss_mb (perf/cuda_max_allocated_mb on CUDA): see
    runbus.producer.clock for what each measures. Validation runs are not data wait.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, not {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._clock: StepClock | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_clock": None}

    @staticmethod
    def _logger(trainer: Trainer) -> RunbusLogger:
        for logger in trainer.loggers:
            if isinstance(logger, RunbusLogger):
                return logger
        raise ValueError("RunbusStepTimer logs through a RunbusLogger: pass Trainer(logger=RunbusLogger())")

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._logger(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock = StepClock()
        self._clock.watch(pl_module)
        self._clock.idle()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is not None:
            self._clock.begin_step(samples=leading_size(batch))

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is not None:
            self._clock.backward_returned()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._clock is None:
            return
        self._clock.end_step()
        window = self.every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if self._clock.steps >= max(1, window):
            self._log(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is not None:
            self._clock.idle()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._clock is not None:
            self._log(trainer)
            self._clock.unwatch()
            self._clock = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._clock is not None:
            self._clock.unwatch()
            self._clock = None

    def _log(self, trainer: Trainer) -> None:
        assert self._clock is not None
        figures = self._clock.take()
        if figures:
            # The step Lightning logs self.log() values at, so the figures line up with them.
            step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
            self._logger(trainer).run().log(figures, step=step)
