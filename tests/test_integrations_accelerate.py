"""runbus.integrations.accelerate: every process of an Accelerator logs into one run.

accelerate's init_trackers() and log() run on the main process only; the example logs each
process's own figures through log_every_process(), and rank 1's must reach the store.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import missing_package
from tests.helpers import QUIET, read_store
from tests.integration_runs import run_job, series, the_only_run

try:
    from accelerate import Accelerator
except ImportError:
    missing_package("accelerate")

from runbus.integrations.accelerate import RunbusTracker, finish_every_process, log_every_process, tracker_of

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "accelerate_loop.py"


@pytest.mark.timeout(150)
def test_every_process_logs_under_its_own_label(redis_url, store_url):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = run_job([*launcher, str(EXAMPLE), "--steps", "5", "--redis-url", redis_url])
    run = the_only_run(redis_url, store_url)
    assert f"logged into run {run.run_id}" in result.stdout
    assert {label.label for label in run.labels} == {"rank0", "rank1"}
    assert run.primary == "rank0" and run.state == "finished" and run.exit_code == 0
    assert all(label.state == "finished" and label.exit_code == 0 for label in run.labels)
    assert run.config == {"steps": 5, "batch_size": 32, "lr": 0.05, "redis_url": run.config["redis_url"]}
    points = series(store_url, run.run_id)
    steps = [0, 1, 2, 3, 4]
    for label in ("rank0", "rank1"):
        assert [step for step, _ in points[label, "rank_loss"]] == steps
        assert [step for step, _ in points[label, "step_s"]] == steps
    assert points["rank0", "rank_loss"] != points["rank1", "rank_loss"]
    # tracker.watch(model) on the prepared (DDP) model: each process's step split, every step.
    for label in ("rank0", "rank1"):
        for key in ("perf/step_s", "perf/compute_s", "perf/comm_wait_s"):
            assert [step for step, _ in points[label, key]] == steps, (label, key)
        # data wait counts from a step's end: none before the first
        assert [step for step, _ in points[label, "perf/data_wait_s"]] == steps[1:]
        for (_, total), (_, compute), (_, wait) in zip(
            points[label, "perf/step_s"],
            points[label, "perf/compute_s"],
            points[label, "perf/comm_wait_s"],
            strict=True,
        ):
            assert compute > 0 and wait >= 0 and total == pytest.approx(compute + wait, abs=1e-6)
    # What goes through accelerator.log() is the main process's alone; strings become log lines.
    assert [step for step, _ in points["rank0", "loss"]] == steps and ("rank1", "loss") not in points
    lines = [(line.label, line.text) for line in read_store(store_url, "logs", run.run_id)]
    assert lines.count(("rank0", "phase: warmup")) == 5 and not any(label == "rank1" for label, _ in lines)


def test_one_process_without_a_launcher(redis_url, store_url, monkeypatch):
    monkeypatch.setenv("RUNBUS_RUN_ID", f"accelerate-one-{os.getpid()}")
    tracker = RunbusTracker(redis_url=redis_url, config={"given": 1}, **QUIET)
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("one", config={"lr": 0.1})
    assert tracker_of(accelerator) is tracker and accelerator.get_tracker("runbus") is tracker
    accelerator.log({"loss": 1.5}, step=0)
    log_every_process(accelerator, {"own": 2}, step=0)
    finish_every_process(accelerator)
    accelerator.end_training()  # finishing again is harmless
    run = the_only_run(redis_url, store_url)
    assert run.state == "finished" and [label.label for label in run.labels] == ["rank0"]
    assert run.config == {"given": 1, "lr": 0.1}
    points = series(store_url, run.run_id)
    assert points["rank0", "loss"] == [(0, 1.5)] and points["rank0", "own"] == [(0, 2)]


def test_configuration_stored_after_the_start(redis_url, store_url):
    # Needs Run.config.update (run metadata).
    tracker = RunbusTracker(run_id=f"accelerate-late-{os.getpid()}", redis_url=redis_url, **QUIET)
    tracker.store_init_configuration({"lr": 0.1})
    tracker.log({"loss": 1.0}, step=0)
    tracker.store_init_configuration({"later": True})
    tracker.finish()
    assert the_only_run(redis_url, store_url).config == {"lr": 0.1, "later": True}


def test_bad_input_is_refused_with_the_reason(redis_url):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="no RunbusTracker"):
        log_every_process(accelerator, {"x": 1})
    tracker = RunbusTracker(run_id=f"accelerate-bad-{os.getpid()}", redis_url=redis_url, **QUIET)
    with pytest.raises(TypeError, match="not a number"):
        tracker.log({"x": [1, 2]})
    tracker.finish()
