r"""A plain training loop under Hugging Face Accelerate, every process logging into one runbus run.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py          # 2 CPU processes
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # 2 GPUs

accelerator.init_trackers() and accelerator.log() reach trackers on the main process only. The
RunbusTracker is built on every process; log_every_process() logs each process's own figures
under its label (rank0, rank1, ...), next to what the main process logs through accelerate, and
tracker.watch(model) times each process's steps (perf/compute_s, perf/comm_wait_s, ...).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from runbus.integrations.accelerate import RunbusTracker, finish_every_process, log_every_process, tracker_of

FEATURES = 16


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--redis-url", help="RUNBUS_REDIS_URL, else redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)

    options: dict[str, Any] = {"redis_url": args.redis_url} if args.redis_url else {}
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with=RunbusTracker(**options))
    accelerator.init_trackers("accelerate-loop", config=vars(args))  # the config: main process

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    tracker_of(accelerator).watch(model, every_n_steps=1)  # perf/*: compute and all-reduce wait
    weights = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0)).to(accelerator.device)
    data = torch.Generator().manual_seed(accelerator.process_index)  # each process its own shard

    for step in range(args.steps):
        started = time.perf_counter()
        x = torch.randn(args.batch_size, FEATURES, generator=data).to(accelerator.device)
        y = x @ weights + 0.1 * torch.randn(args.batch_size, 1, generator=data).to(accelerator.device)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = accelerator.gather(loss.detach()).mean()
        accelerator.log({"loss": mean_loss, "phase": "warmup" if step < 5 else "main"}, step=step)
        log_every_process(
            accelerator,
            {"rank_loss": loss.detach(), "step_s": time.perf_counter() - started},
            step=step,
        )

    finish_every_process(accelerator)  # end_training() finishes the main process's label only
    accelerator.end_training()
    if accelerator.is_main_process:
        print(
            f"accelerate_loop: logged into run {accelerator.get_tracker('runbus').tracker.run_id}", flush=True
        )


if __name__ == "__main__":
    main()
