"""runbus.integrations.lightning: every rank of a Lightning Trainer logs into one run.

The multi-process tests run a script (Lightning's ddp launcher re-runs the script it was started
from, so pytest cannot be it) with no RUNBUS_* variable set, then ingest and read the store.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import textwrap
from argparse import Namespace
from pathlib import Path
from unittest import mock

import pytest
import redis

from tests.conftest import missing_package
from tests.helpers import QUIET
from tests.integration_runs import run_job, series, the_only_run

try:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
except ImportError:
    missing_package("lightning")

from runbus import config as settings
from runbus.integrations.lightning import PendingRun, RunbusLogger, RunbusStepTimer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_ddp.py"
TIMINGS = ("perf/step_s", "perf/data_wait_s", "perf/compute_s", "perf/comm_wait_s", "perf/samples_per_s")

# Lightning's own warnings about this deliberately tiny setup (no dataloader workers, a small
# dataset) and one it raises from its own code under torch 2.13; none is runbus's.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*"),
    pytest.mark.filterwarnings("ignore:.*log_every_n_steps.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*GPU available but not used.*:UserWarning"),
]


def assert_two_ranks_finished_by_the_primary(run) -> None:
    assert {label.label for label in run.labels} == {"rank0", "rank1"}
    assert run.primary == "rank0" and run.state == "finished" and run.exit_code == 0
    assert all(label.state == "finished" and label.exit_code == 0 for label in run.labels)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork"])
def test_every_rank_logs_into_one_run_with_no_runbus_variable(strategy, redis_url, store_url):
    result = run_job([str(EXAMPLE), "--strategy", strategy, "--max-steps", "6", "--redis-url", redis_url])
    run = the_only_run(redis_url, store_url)
    assert f"logging into run {run.run_id}" in result.stdout
    assert_two_ranks_finished_by_the_primary(run)
    # The model's save_hyperparameters() and the logger's own config, from the primary.
    assert run.config == {"strategy": strategy, "devices": 2, "hidden": 32, "lr": 0.05, "slow_ms": 10.0}
    points = series(store_url, run.run_id)
    for label in ("rank0", "rank1"):
        steps = [step for step, _ in points[label, "train_loss"]]
        assert steps == [1, 3, 5]
        for key in (
            "perf/step_s",
            "perf/data_wait_s",
            "perf/compute_s",
            "perf/comm_wait_s",
            "perf/samples_per_s",
        ):
            assert [step for step, _ in points[label, key]] == [1, 3, 5], key
            assert all(value >= 0 for _, value in points[label, key])
    # Each rank's own loss (different data shards), not one average.
    assert points["rank0", "train_loss"] != points["rank1", "train_loss"]
    # Rank 1 sleeps 10 ms a step in its training_step: its compute shows it, not rank 0's.
    compute = {label: sum(v for _, v in points[label, "perf/compute_s"]) / 3 for label in ("rank0", "rank1")}
    assert compute["rank1"] >= 0.010 and compute["rank1"] > compute["rank0"], compute


PRE_FIT_LOGGING = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {examples!r})
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader
    from lightning_ddp import Regressor, dataset
    from runbus.integrations.lightning import RunbusLogger

    if __name__ == "__main__":
        logger = RunbusLogger(redis_url=sys.argv[2], system_interval=None)
        print(logger.experiment.run_id, repr(logger.experiment), flush=True)
        logger.experiment.config.update({{"before_fit": True}})
        logger.experiment.log({{"logged_before_fit": 1.0}}, step=0)  # this process, on a guess: rank0
        trainer = pl.Trainer(strategy=sys.argv[1], devices=2, accelerator="cpu", logger=logger,
                             max_steps=4, log_every_n_steps=2, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(Regressor(slow_ms=0), DataLoader(dataset(64), batch_size=16))
    """
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork", "ddp"])
def test_a_launcher_that_logged_before_fit_leaves_rank0_to_the_rank(strategy, redis_url, store_url, tmp_path):
    # Under ddp_spawn and ddp_fork the process that calls fit() is not a rank: having logged
    # as rank0 on a guess, it finishes that label as it starts the ranks, and rank 0 continues
    # it. Under ddp it is rank 0 and goes on as rank0. (ddp's rank 1 knows its rank from
    # LOCAL_RANK only before fit: that needs runbus.init's zero-config Lightning launcher.)
    script = tmp_path / "job.py"
    script.write_text(PRE_FIT_LOGGING.format(examples=str(EXAMPLE.parent)))
    result = run_job([str(script), strategy, redis_url])
    run = the_only_run(redis_url, store_url)
    assert result.stdout.startswith(run.run_id)
    assert_two_ranks_finished_by_the_primary(run)
    assert run.config is not None and run.config["before_fit"] is True
    points = series(store_url, run.run_id)
    assert points["rank0", "logged_before_fit"] == [(0, 1.0)]
    assert points["rank0", "train_loss"] and points["rank1", "train_loss"]


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.1, fail_at: int | None = None, late_config: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == self.hparams["fail_at"]:
            raise RuntimeError(f"injected failure at batch {batch_idx}")
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.layer(x), y))

    def on_train_start(self) -> None:
        if not self.hparams["late_config"]:
            return
        # Known only once training starts: added to the run's config after its start event.
        self.logger.log_hyperparams({"parameters": sum(p.numel() for p in self.parameters())})
        self.logger.experiment.config.update({"device": str(self.device)})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)), 8
    )


def trainer(logger, **kw) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=logger,
        max_steps=4,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return pl.Trainer(**{**options, **kw})


@pytest.fixture
def no_run_id(monkeypatch):
    """RUNBUS_RUN_ID and RUNBUS_RUN_ID_FROM unset, and set back as they were after the test
    (loggers export theirs)."""
    for name in (settings.RUN_ID_ENV, settings.RUN_ID_FROM_ENV):
        monkeypatch.setenv(name, "placeholder")  # registers the variable for undo
        monkeypatch.delenv(name)


def test_version_and_experiment_before_fit_claim_no_label(redis_url, store_url, no_run_id):
    logger = RunbusLogger(redis_url=redis_url, name="first try", tags=["tiny"], **QUIET)
    assert logger.name == "first try"
    run_id = logger.version
    assert os.environ[settings.RUN_ID_ENV] == run_id  # exported for the ranks this process starts
    experiment = logger.experiment
    assert isinstance(experiment, PendingRun) and experiment.run_id == run_id and run_id in repr(experiment)
    experiment.config.update({"from_experiment": 1})
    logger.log_hyperparams(Namespace(from_namespace="a"))
    assert redis.Redis.from_url(redis_url).keys("*") == []  # nothing claimed, nothing written

    # A second logger in this process (a sweep) starts a run of its own.
    assert RunbusLogger(redis_url=redis_url, **QUIET).version != run_id

    trainer(logger).fit(Tiny(), loader())
    run = the_only_run(redis_url, store_url)
    assert run.run_id == run_id and [label.label for label in run.labels] == ["rank0"]
    assert run.state == "finished" and run.exit_code == 0
    assert run.name == "first try" and run.tags == ["tiny"]
    assert {"from_experiment": 1, "from_namespace": "a", "lr": 0.1}.items() <= run.config.items()
    points = series(store_url, run_id)
    assert [step for step, _ in points["rank0", "train_loss"]] == [0, 1, 2, 3]
    assert [step for step, _ in points["rank0", "perf/step_s"]] == [0, 1, 2, 3]


def test_hyperparameters_added_after_the_run_started(redis_url, store_url, no_run_id):
    # Needs Run.config.update (run metadata).
    logger = RunbusLogger(redis_url=redis_url, **QUIET)
    trainer(logger).fit(Tiny(late_config=True), loader())
    run = the_only_run(redis_url, store_url)
    assert run.config["parameters"] == 5 and run.config["device"] == "cpu" and run.config["lr"] == 0.1


def test_a_failed_fit_finishes_the_label_with_a_nonzero_exit_code(redis_url, store_url, no_run_id):
    logger = RunbusLogger(redis_url=redis_url, **QUIET)
    with pytest.raises(RuntimeError, match="injected failure at batch 2"):
        trainer(logger).fit(Tiny(fail_at=2), loader())
    run = the_only_run(redis_url, store_url)
    assert run.state == "failed" and run.exit_code == 1
    assert [(label.label, label.state, label.exit_code) for label in run.labels] == [("rank0", "failed", 1)]
    assert [step for step, _ in series(store_url, run.run_id)["rank0", "train_loss"]] == [0, 1]


def test_testing_after_fit_continues_the_label(redis_url, store_url, no_run_id):
    logger = RunbusLogger(redis_url=redis_url, **QUIET)
    fit = trainer(logger)
    fit.fit(Tiny(), loader())
    fit.test(Tiny(), loader(), verbose=False)
    run = the_only_run(redis_url, store_url)
    assert run.state == "finished" and [label.label for label in run.labels] == ["rank0"]
    points = series(store_url, run.run_id)
    assert points["rank0", "train_loss"] and points["rank0", "test_loss"]


def test_the_logger_pickles_its_run_id_never_its_run(redis_url, store_url, no_run_id):
    logger = RunbusLogger(redis_url=redis_url, config={"a": 1}, **QUIET)
    copied = copy.deepcopy(logger)
    assert copied.version == logger.version and isinstance(copied.experiment, PendingRun)

    logger.log_metrics({"x": 1.0}, step=0)  # no Trainer, no process group: rank0 on a guess
    live = logger.experiment
    assert not isinstance(live, PendingRun) and live.label == "rank0"
    assert isinstance(copy.deepcopy(logger).experiment, PendingRun) and not live.finished
    # Pickled for other processes (ddp_spawn), it hands its guessed label over to the ranks.
    with pytest.warns(UserWarning, match="before starting the Trainer's ranks"):
        blob = pickle.dumps(logger)
    assert live.finished
    clone = pickle.loads(blob)
    assert clone.version == logger.version and isinstance(clone.experiment, PendingRun)
    assert b"runbus.producer" not in blob
    clone.log_metrics({"x": 2.0}, step=1)  # continues the label (resume allowed)
    clone.finalize("success")
    run = the_only_run(redis_url, store_url)
    assert series(store_url, run.run_id)["rank0", "x"] == [(0, 1.0), (1, 2.0)]
    assert run.state == "finished" and run.config == {"a": 1}


def test_bad_input_is_refused_with_the_reason(redis_url, no_run_id):
    with pytest.raises(ValueError, match="step_timing"):
        RunbusLogger(step_timing=0)
    with pytest.raises(ValueError, match="run id"):
        RunbusLogger(run_id="no spaces/or slashes")
    with pytest.raises(ValueError, match="resume"):
        RunbusLogger(resume="sometimes")
    with pytest.raises(ValueError, match="every_n_steps"):
        RunbusStepTimer(every_n_steps=0)
    with pytest.raises(TypeError, match="dict or an argparse"):
        RunbusLogger(redis_url=redis_url).log_hyperparams(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="RunbusStepTimer logs through a RunbusLogger"):
        trainer(False, callbacks=[RunbusStepTimer()]).fit(Tiny(), loader())
    assert redis.Redis.from_url(redis_url).keys("*") == []


def test_log_metrics_is_called_only_by_lightning_with_its_keywords(redis_url, store_url, no_run_id):
    # Lightning's own tests wrap or mock log_metrics and read call.kwargs["metrics"]: runbus's
    # step timings go straight to the Run, not through it.
    logger = RunbusLogger(redis_url=redis_url, **QUIET)
    with mock.patch.object(logger, "log_metrics", wraps=logger.log_metrics) as log_metrics:
        trainer(logger).fit(Tiny(), loader())
    calls = log_metrics.call_args_list
    assert len(calls) == 4 and all(
        call.args == () and set(call.kwargs) == {"metrics", "step"} for call in calls
    )
    assert [call.kwargs["step"] for call in calls] == [0, 1, 2, 3]
    assert all(sorted(call.kwargs["metrics"]) == ["epoch", "train_loss"] for call in calls)
    points = series(store_url, the_only_run(redis_url, store_url).run_id)
    assert [step for step, _ in points["rank0", "perf/step_s"]] == [0, 1, 2, 3]


def test_a_prefix_goes_before_each_key_lightning_logs(redis_url, store_url, no_run_id):
    logger = RunbusLogger(redis_url=redis_url, prefix="tmp", **QUIET)
    logger.log_metrics({"test": 1.0}, step=0)
    trainer(logger, max_steps=1).fit(Tiny(), loader())
    points = series(store_url, the_only_run(redis_url, store_url).run_id)
    assert points["rank0", "tmp-test"] == [(0, 1.0)]
    assert [step for step, _ in points["rank0", "tmp-train_loss"]] == [0]
    assert ("rank0", "train_loss") not in points and ("rank0", "perf/step_s") in points  # runbus's own: as is


class CliTiny(Tiny):
    """Tiny with its own data, for LightningCLI (which builds the model from its arguments)."""

    def train_dataloader(self) -> DataLoader:
        return loader()


def test_lightning_cli_saves_its_config_with_the_logger(
    redis_url, store_url, no_run_id, tmp_path, monkeypatch
):
    # Lightning's SaveConfigCallback writes config.yaml into trainer.log_dir, the logger's
    # save_dir for loggers other than TensorBoard's and CSV's: with none, it asserted.
    try:
        from lightning.pytorch.cli import LightningCLI
    except ImportError:  # jsonargparse's absence
        missing_package("jsonargparse")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(settings.REDIS_URL_ENV, redis_url)
    monkeypatch.setenv(settings.CONSOLE_ENV, "off")
    # Lightning 2.6 calls jsonargparse APIs that jsonargparse 4.49 deprecated: not runbus's.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    args = [
        "train.py",
        "fit",
        "--trainer.logger=runbus.integrations.lightning.RunbusLogger",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_steps=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--seed_everything=0",
        "--model.lr=0.05",
    ]
    monkeypatch.setattr(sys, "argv", args)  # as `python train.py fit --trainer.logger=...` runs it
    cli = LightningCLI(CliTiny)
    logger = cli.trainer.logger
    assert isinstance(logger, RunbusLogger) and cli.trainer.log_dir == logger.save_dir == "."
    saved = (tmp_path / "config.yaml").read_text()
    assert "runbus.integrations.lightning.RunbusLogger" in saved and "lr: 0.05" in saved
    run = the_only_run(redis_url, store_url)
    assert run.run_id == logger.version and run.state == "finished" and run.config["lr"] == 0.05
    # As with WandbLogger, a second run saving into the same folder needs overwrite=True.
    with pytest.raises(RuntimeError, match=r"config\.yaml to NOT exist"):
        LightningCLI(CliTiny)
    LightningCLI(CliTiny, save_config_kwargs={"overwrite": True})


@pytest.mark.parametrize("save_dir", [None, "elsewhere"])
def test_checkpoints_go_under_runbus_logs_never_a_folder_named_runbus(
    save_dir, redis_url, store_url, no_run_id, tmp_path, monkeypatch
):
    # A ./runbus folder would shadow the package for `python -m runbus` run from that directory.
    monkeypatch.chdir(tmp_path)
    options = {} if save_dir is None else {"save_dir": tmp_path / save_dir}
    logger = RunbusLogger(redis_url=redis_url, **options, **QUIET)
    trainer(logger, enable_checkpointing=True).fit(Tiny(), loader())
    assert logger.name == "runbus_logs" and logger.save_dir == os.fspath(options.get("save_dir", "."))
    assert logger.root_dir == os.path.join(logger.save_dir, "runbus_logs")
    assert logger.log_dir == os.path.join(logger.root_dir, logger.version)
    folder = tmp_path / (save_dir or "") / "runbus_logs" / logger.version
    assert [path.name for path in (folder / "checkpoints").iterdir()] == ["epoch=0-step=4.ckpt"]
    assert not (tmp_path / "runbus").exists()
    # The logger travels to other processes (ddp_spawn) with its folder.
    assert pickle.loads(pickle.dumps(logger)).save_dir == logger.save_dir
