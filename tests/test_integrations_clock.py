"""runbus.producer.clock: a step split into data wait, compute and collective wait.

One process, no process group: the waits are made by hand where DDP would make them (data
wait before the step, the collective wait between the last gradient and backward returning).
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import missing_package

try:
    import numpy as np
    import torch
    from torch import nn
except ImportError:
    missing_package("torch")

from runbus.producer.clock import StepClock, leading_size

DATA, COMPUTE, COLLECTIVE = 0.03, 0.04, 0.05


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE)
        return self.layer(x)


def test_each_part_of_a_step_is_where_the_time_went():
    model, clock = Slow(), StepClock()
    clock.watch(model)
    clock.idle()
    for _ in range(3):
        time.sleep(DATA)  # fetching the batch
        clock.begin_step(samples=8)
        model(torch.ones(8, 4)).sum().backward()
        time.sleep(COLLECTIVE)  # DDP's wait for the all-reduce, inside backward
        clock.backward_returned()
        clock.end_step()
    figures = clock.take()
    # A sleep lasts at least its time, and on a loaded machine longer: each part holds its own
    # sleep (a part counted in the wrong place leaves another short of its sleep), and the step
    # is its compute and collective wait.
    assert figures["perf/data_wait_s"] >= DATA
    assert figures["perf/compute_s"] >= COMPUTE
    assert figures["perf/comm_wait_s"] >= COLLECTIVE
    assert figures["perf/step_s"] == pytest.approx(
        figures["perf/compute_s"] + figures["perf/comm_wait_s"], abs=0.005
    )
    assert 0 < figures["perf/samples_per_s"] <= 24 / (3 * (DATA + COMPUTE + COLLECTIVE))
    assert figures["perf/rss_mb"] > 10
    assert clock.take() == {}  # a new window, empty

    # Work outside steps (evaluation) since the last step is not data wait.
    time.sleep(0.1)
    clock.idle()
    clock.begin_step()
    clock.end_step()
    assert clock.take()["perf/data_wait_s"] < 0.05

    # Without gradients (nothing trainable, or FSDP's flat parameters) nothing is guessed.
    clock.unwatch()
    clock.begin_step()
    model(torch.ones(1, 4)).sum().backward()
    clock.backward_returned()
    clock.end_step()
    figures = clock.take()
    assert "perf/comm_wait_s" not in figures and "perf/compute_s" not in figures and "perf/step_s" in figures


def test_gradients_outside_steps_are_not_counted():
    model, clock = Slow(), StepClock()
    clock.watch(model)
    model(torch.ones(1, 4)).sum().backward()  # before any step: no gradient time kept
    clock.begin_step()
    clock.backward_returned()  # no gradient in this step
    clock.end_step()
    assert "perf/comm_wait_s" not in clock.take()
    clock.unwatch()


def test_leading_size_finds_the_batch_size():
    assert leading_size(torch.zeros(5, 3)) == 5
    assert leading_size((torch.zeros(7, 2), torch.zeros(7))) == 7
    assert leading_size({"input_ids": np.zeros((3, 9)), "labels": [1, 2, 3]}) == 3
    assert leading_size([{"x": None}, [torch.zeros(4)]]) == 4
    assert leading_size(torch.tensor(1.0)) is None  # a scalar has no batch dimension
    assert leading_size("text") is None and leading_size(None) is None and leading_size([]) is None
