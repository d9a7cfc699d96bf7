"""runbus.integrations.transformers: every rank of a Hugging Face Trainer logs into one run.

Two CPU processes under torchrun (gloo) train a GPT-2 built from a 1-layer config; nothing is
downloaded. One test slows one rank's forward and reads who computes and who waits.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import missing_package
from tests.helpers import QUIET, ingest
from tests.integration_runs import run_job, series, the_only_run

try:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError:
    missing_package("transformers")

import runbus
from runbus.integrations.transformers import RunbusCallback

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers_trainer.py"


def torchrun(redis_url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return run_job(
        [*launcher, str(EXAMPLE), "--redis-url", redis_url, "--output-dir", str(tmp_path / "out"), *args]
    )


@pytest.mark.timeout(150)
def test_every_rank_logs_what_the_averaged_loss_hides(redis_url, store_url, tmp_path):
    result = torchrun(redis_url, tmp_path, "--max-steps", "6")
    run = the_only_run(redis_url, store_url)
    assert f"logged into run {run.run_id}" in result.stdout
    assert {label.label for label in run.labels} == {"rank0", "rank1"}
    assert run.primary == "rank0" and run.state == "finished" and run.exit_code == 0
    assert run.config["max_steps"] == 6 and run.config["model"]["n_embd"] == 32
    assert run.name == "tiny-gpt2"
    points = series(store_url, run.run_id)
    steps = [1, 2, 3, 4, 5, 6]
    for label in ("rank0", "rank1"):
        for key in ("rank_loss", "perf/step_s", "perf/data_wait_s", "perf/compute_s", "perf/comm_wait_s"):
            assert [step for step, _ in points[label, key]] == steps, (label, key)
        for key in ("perf/samples_per_s", "perf/tokens_per_s", "perf/rss_mb"):
            assert all(value > 0 for _, value in points[label, key]), (label, key)
    # The Trainer's logs, once (the primary's copy): the loss averaged over the ranks...
    assert [step for step, _ in points["rank0", "loss"]] == steps and ("rank1", "loss") not in points
    # ... is the mean of the ranks' own losses, which differ.
    for (step, loss), (_, loss0), (_, loss1) in zip(
        points["rank0", "loss"], points["rank0", "rank_loss"], points["rank1", "rank_loss"], strict=True
    ):
        assert loss == pytest.approx((loss0 + loss1) / 2, rel=1e-4), step
    assert points["rank0", "rank_loss"] != points["rank1", "rank_loss"]
    # Samples per second counts this rank's batches (8 sequences of 16 tokens).
    for (_, samples), (_, tokens) in zip(
        points["rank0", "perf/samples_per_s"], points["rank0", "perf/tokens_per_s"], strict=True
    ):
        assert tokens == pytest.approx(16 * samples)


@pytest.mark.timeout(150)
def test_a_slow_rank_shows_in_its_compute_and_in_the_others_wait(redis_url, store_url, tmp_path):
    torchrun(redis_url, tmp_path, "--max-steps", "14", "--slow-rank", "1", "--slow-ms", "20")
    run = the_only_run(redis_url, store_url)
    points = series(store_url, run.run_id)

    def median(label: str, key: str) -> float:
        return statistics.median(value for step, value in points[label, key] if step > 2)  # warmed up

    # DDP makes rank 0 wait for rank 1 at the all-reduce: their step times look alike...
    assert abs(median("rank0", "perf/step_s") - median("rank1", "perf/step_s")) < 0.01
    # ... the split shows rank 1 computing ~20 ms longer, and rank 0 waiting for it.
    assert median("rank1", "perf/compute_s") - median("rank0", "perf/compute_s") > 0.012
    assert median("rank0", "perf/comm_wait_s") - median("rank1", "perf/comm_wait_s") > 0.012


class Sequences(torch.utils.data.Dataset):
    def __init__(self, size: int, delay: float = 0.0) -> None:
        self.size, self.delay = size, delay

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.delay)
        ids = (torch.arange(8) + index) % 50
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8))


def arguments(tmp_path: Path, **kw) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**options, **kw})


def test_a_run_of_yours_with_accumulation_and_evaluation_in_one_process(redis_url, store_url, tmp_path):
    run = runbus.init(run_id=f"hf-own-{os.getpid()}", redis_url=redis_url, **QUIET)
    callback = RunbusCallback(run=run)
    args = arguments(tmp_path, gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2)
    trainer = Trainer(
        model=tiny_model(),
        args=args,
        train_dataset=Sequences(64),
        eval_dataset=Sequences(8, delay=0.03),  # each evaluation takes over 0.2 s
        callbacks=[callback],
    )
    trainer.train()
    assert not run.finished  # yours to finish
    run.log({"after_training": 1.0})
    run.finish()
    ingest(redis_url, store_url)
    points = series(store_url, run.run_id)
    # One process: rank_loss is the Trainer's loss, accumulation steps and all.
    for (step, loss), (_, own) in zip(points["rank0", "loss"], points["rank0", "rank_loss"], strict=True):
        assert own == pytest.approx(loss, rel=1e-4), step
    assert [step for step, _ in points["rank0", "eval_loss"]] == [2, 4, 6]
    # Evaluation runs between steps, and is not counted as waiting for data.
    assert max(value for _, value in points["rank0", "perf/data_wait_s"]) < 0.15
    # Each optimizer step takes 2 batches of 4 sequences.
    assert [step for step, _ in points["rank0", "perf/samples_per_s"]] == [1, 2, 3, 4, 5, 6]


def test_bad_input_is_refused_with_the_reason(redis_url):
    with pytest.raises(ValueError, match="every_n_steps"):
        RunbusCallback(every_n_steps=0)
    run = runbus.init(run_id=f"hf-bad-{os.getpid()}", redis_url=redis_url, **QUIET)
    try:
        with pytest.raises(TypeError, match="either a Run or"):
            RunbusCallback(run=run, redis_url=redis_url)
    finally:
        run.finish()


class TupleModel(torch.nn.Module):
    """A model that returns (loss, logits), as plain PyTorch models often do."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_model()

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        out = self.inner(input_ids=input_ids, labels=labels)
        return out.loss, out.logits


def test_a_model_returning_a_tuple_logs_its_rank_loss(redis_url, store_url, tmp_path):
    # The Trainer reads the loss as outputs[0] from a tuple: so does the callback.
    callback = RunbusCallback(redis_url=redis_url, **QUIET)
    args = arguments(tmp_path, max_steps=3)
    Trainer(model=TupleModel(), args=args, train_dataset=Sequences(32), callbacks=[callback]).train()
    run = the_only_run(redis_url, store_url)
    points = series(store_url, run.run_id)
    assert [step for step, _ in points["rank0", "rank_loss"]] == [1, 2, 3]
    for (step, loss), (_, own) in zip(points["rank0", "loss"], points["rank0", "rank_loss"], strict=True):
        assert own == pytest.approx(loss, rel=1e-4), step


def test_training_twice_with_one_callback_continues_its_label(redis_url, store_url, tmp_path):
    # One Trainer, train() twice (more steps, a second phase): one run, the same label, resumed.
    callback = RunbusCallback(redis_url=redis_url, **QUIET)
    args = arguments(tmp_path, max_steps=2)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=Sequences(32), callbacks=[callback])
    trainer.train()
    first = callback.run
    trainer.train()
    assert first is not None and callback.run is not None and callback.run is not first
    assert callback.run.run_id == first.run_id and callback.run.finished
    run = the_only_run(redis_url, store_url)
    assert [label.label for label in run.labels] == ["rank0"] and run.state == "finished"
    assert sorted(step for step, _ in series(store_url, run.run_id)["rank0", "rank_loss"]) == [1, 1, 2, 2]
