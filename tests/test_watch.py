"""run.watch(model): plain DDP's per-rank compute and all-reduce wait, from one line.

Three CPU processes under torchrun (gloo) train a tiny MLP (tests/ddp_watch_job.py) whose
forward sleeps; one rank's sleeps three times as long. The figures are read back from the store.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

import runbus
from tests.conftest import missing_package
from tests.helpers import ingest
from tests.integration_runs import run_job, series, the_only_run
from tests.rank_processes import watch_job

try:
    import torch
    from torch import nn
except ImportError:
    missing_package("torch")

FORWARD_S = 0.02


def torchrun(redis_url: str, run_id: str, *args: str) -> str:
    result = run_job(watch_job(redis_url, run_id, *args), timeout=120)
    return result.stdout


@pytest.mark.timeout(240)
def test_a_slow_forward_shows_in_its_compute_and_in_the_others_wait(redis_url, store_url):
    watched = torchrun(redis_url, f"watch-{os.getpid()}", "--slow-rank", "1", "--forward-s", str(FORWARD_S))
    run = the_only_run(redis_url, store_url)
    assert {label.label for label in run.labels} == {"rank0", "rank1", "rank2"}
    assert run.state == "finished"
    points = series(store_url, run.run_id)
    for label in ("rank0", "rank1", "rank2"):
        for key in ("perf/step_s", "perf/compute_s", "perf/comm_wait_s", "perf/data_wait_s", "perf/rss_mb"):
            # every 2 steps of 12: at the window's last step, the user's step numbers
            assert [step for step, _ in points[label, key]] == [1, 3, 5, 7, 9, 11], (label, key)

    def median(label: str, key: str) -> float:
        return statistics.median(value for step, value in points[label, key] if step > 1)  # warmed up

    fast = [median(label, "perf/compute_s") for label in ("rank0", "rank2")]
    slow = median("rank1", "perf/compute_s")
    # Rank 1's forward sleeps 3x as long: its compute is ~3x the others' (each holds its sleep
    # plus a little real work, more of it on a loaded machine).
    for compute in fast:
        assert 2.2 < slow / compute < 3.5, (slow, fast)
    # The fast ranks wait in the all-reduce for what rank 1 computes beyond them; rank 1 barely waits.
    for label, compute in zip(("rank0", "rank2"), fast, strict=True):
        waited = median(label, "perf/comm_wait_s")
        assert waited == pytest.approx(slow - compute, abs=0.012), (label, waited, slow - compute)
        assert median("rank1", "perf/comm_wait_s") < waited / 4
    # Under DDP every rank's step takes the slow rank's time: step time alone names nobody.
    steps = [median(label, "perf/step_s") for label in ("rank0", "rank1", "rank2")]
    assert max(steps) - min(steps) < 0.012, steps
    assert all(value < 0.005 for _, value in points["rank0", "perf/data_wait_s"])  # eval forwards aren't

    # The hook reduces as DDP does without it: the same trained weights (to float rounding: DDP's
    # own reduction divides in another order).
    unwatched = torchrun(redis_url, f"nowatch-{os.getpid()}", "--no-watch", "--forward-s", "0")
    with_hook, without = (json.loads(out.split("weights ")[1]) for out in (watched, unwatched))
    assert len(with_hook) == 16 * 32 + 32 + 32 + 1 and with_hook == pytest.approx(without, rel=1e-5, abs=1e-7)


class Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.layer(x)


def test_one_process_without_ddp_logs_step_and_data_wait(redis_url, store_url):
    run = runbus.init(
        run_id=f"watch-one-{os.getpid()}", redis_url=redis_url, system_interval=None, quiet=True
    )
    model = Slow(0.01)
    watch = run.watch(model, every_n_steps=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # not the model's
    for _ in range(7):
        time.sleep(0.02)  # fetching the batch
        for _ in range(2):  # two micro-batches per step
            model(torch.ones(5, 4)).sum().backward()
        other.step()  # another optimizer's step ends no step of this model
        optimizer.step()
        model.seconds = 0.06
        with torch.no_grad():
            model(torch.ones(1, 4))  # evaluation: no step
        model.seconds = 0.01
    run.finish()  # logs the last window (1 step)
    assert watch._clock.steps == 0
    ingest(redis_url, store_url)
    points = series(store_url, run.run_id)
    assert [step for step, _ in points["rank0", "perf/step_s"]] == [2, 5, 6]
    assert all(value >= 0.02 for _, value in points["rank0", "perf/step_s"])  # two forwards
    # Data wait holds the batch's 20 ms, not the evaluation forward's 60 ms after the step (and
    # nothing before the first step: watch() is no step's end).
    assert all(0.02 <= value < 0.05 for _, value in points["rank0", "perf/data_wait_s"]), points[
        "rank0", "perf/data_wait_s"
    ]
    # 10 samples a step (two micro-batches of 5), a step taking 20 ms or more.
    assert all(20 < value <= 10 / 0.02 for _, value in points["rank0", "perf/samples_per_s"])
    # No all-reduce: no split is guessed.
    assert ("rank0", "perf/compute_s") not in points and ("rank0", "perf/comm_wait_s") not in points


def test_bad_arguments_are_refused(redis_url):
    run = runbus.init(
        run_id=f"watch-bad-{os.getpid()}", redis_url=redis_url, system_interval=None, quiet=True
    )
    try:
        with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
            run.watch(object())
        with pytest.raises(ValueError, match="every_n_steps"):
            run.watch(nn.Linear(1, 1), every_n_steps=0)
        model = nn.Linear(1, 1)
        assert run.watch(model) is run.watch(model)  # timed once, not logged twice
    finally:
        run.finish()
    with pytest.raises(runbus.RunFinished):
        run.watch(nn.Linear(1, 1))


def test_watch_loads_torch_only_when_called():
    code = "import runbus, sys; runbus.Run.watch; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
