r"""A tiny GPT-2 trained by the Hugging Face Trainer on 2 CPU processes, every rank logging to runbus.

    torchrun --standalone --nproc-per-node 2 examples/transformers_trainer.py
    torchrun --standalone --nproc-per-node 2 examples/transformers_trainer.py --slow-rank 1 --slow-ms 20

The model is built from a config (1 layer, width 32, vocabulary 100: nothing is downloaded) and
learns synthetic token sequences. RunbusCallback runs on every rank: each logs its own loss and
its step time split into data wait, compute and collective wait, while the Trainer's loss is
the average over ranks. With --slow-rank, that rank's forward takes --slow-ms longer: both ranks'
step times stay equal (DDP makes the fast rank wait at the all-reduce), and the split shows which
one computes and which one waits.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from runbus.integrations.transformers import RunbusCallback

SEQUENCE = 16
VOCABULARY = 100


class Sequences(torch.utils.data.Dataset):
    """Repeating token patterns: each sequence counts up from a random start, modulo the vocabulary."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(torch.randint(0, VOCABULARY, (1,), generator=torch.Generator().manual_seed(index)))
        ids = (torch.arange(SEQUENCE) + start) % VOCABULARY
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--logging-steps", type=int, default=1, help="also the window of the per-rank figures"
    )
    parser.add_argument("--slow-rank", type=int, help="this rank's forward takes --slow-ms longer")
    parser.add_argument("--slow-ms", type=float, default=20.0)
    parser.add_argument(
        "--output-dir", default=os.path.join(tempfile.gettempdir(), "runbus-transformers-example")
    )
    parser.add_argument("--redis-url", help="RUNBUS_REDIS_URL, else redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=SEQUENCE)
    )
    if args.slow_rank is not None and int(os.environ.get("RANK", "0")) == args.slow_rank:
        model.transformer.h[0].register_forward_hook(lambda *_: time.sleep(args.slow_ms / 1000))
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        logging_steps=args.logging_steps,
        save_strategy="no",
        report_to=[],  # the Trainer's own integrations log from rank 0 only
        run_name="tiny-gpt2",  # the runbus run's name
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    options: dict[str, Any] = {"redis_url": args.redis_url} if args.redis_url else {}
    callback = RunbusCallback(**options)
    Trainer(model=model, args=training, train_dataset=Sequences(), callbacks=[callback]).train()
    if training.process_index == 0 and callback.run is not None:
        print(f"transformers_trainer: logged into run {callback.run.run_id}", flush=True)


if __name__ == "__main__":
    main()
