"""A DDP job for tests/test_watch.py: a tiny MLP whose forward sleeps; one rank's sleeps longer.

    torchrun --standalone --nproc-per-node 3 tests/ddp_watch_job.py --redis-url URL --run-id ID \
        --slow-rank 1 --forward-s 0.02 --slowdown 3

Every rank calls run.watch(ddp) and nothing else about timing: runbus logs perf/*. Rank 0 prints
the trained weights (--no-watch: trained without the watch, to compare). The evaluation forward
between steps takes no time, so the fast ranks wait only for the slow rank's training forward.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import runbus


class SleepyMLP(nn.Module):
    def __init__(self, forward_s: float, pause_step: int = -1, pause_s: float = 0.0) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.pause_step, self.pause_s, self.step = pause_step, pause_s, 0
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.forward_s + (self.pause_s if self.step == self.pause_step else 0.0))
            self.step += 1
        return self.layers(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--forward-s", type=float, default=0.02)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--pause-rank", type=int, default=-1, help="this rank's forward pauses once")
    parser.add_argument("--pause-step", type=int, default=-1)
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--system-interval", type=float, default=None, help="sample system figures")
    parser.add_argument("--no-watch", action="store_true", help="train without run.watch()")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    forward_s = args.forward_s * (args.slowdown if rank == args.slow_rank else 1.0)
    run = runbus.init(
        run_id=args.run_id,
        redis_url=args.redis_url,
        system_interval=args.system_interval,
        hardware=False,
        quiet=True,
    )
    torch.manual_seed(0)
    pause = (args.pause_step, args.pause_s) if rank == args.pause_rank else (-1, 0.0)
    model = DistributedDataParallel(SleepyMLP(forward_s, *pause))
    if not args.no_watch:
        run.watch(model, every_n_steps=args.every)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.log({"loss": loss.detach()}, step=step)
        with torch.no_grad():
            model.eval()
            model(x)  # an evaluation forward between steps: not a step
            model.train()
    run.finish()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gc.collect()
    dist.destroy_process_group()
    if rank == 0:
        print(f"ddp_watch_job: {os.environ['WORLD_SIZE']} ranks, weights {weights.tolist()}", flush=True)


if __name__ == "__main__":
    main()
