"""What run.watch(model) adds to a training step on the CPU: the same tiny DDP loop, with and without.

    python bench/watch.py [--steps 3000] [--repeats 5]     # a RUNBUS_REDIS_URL (or local) Redis

One gloo process group of one rank (its all-reduce is real, and returns at once), a 2-layer MLP,
SGD: a step of a few hundred microseconds, so the hooks' cost is not hidden in the model's. The
median over repeats of each arm's median step time, and their difference: the per-step overhead
(a forward pre-hook and a forward hook, the comm hook and its future's callback, the optimizer
step hook, and every 10 steps the window's log()).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import runbus


def steps(model: nn.Module, count: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    run = runbus.init(run_id=f"bench-watch-{os.getpid()}", system_interval=None, console="off", quiet=True)
    plain, watched = [], []
    for _ in range(args.repeats):
        for arm, out in (("plain", plain), ("watched", watched)):
            model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
            watch = run.watch(model) if arm == "watched" else None
            out.append(statistics.median(steps(model, args.steps)))
            if watch is not None:
                watch.close()
    run.finish()
    dist.destroy_process_group()
    base, with_watch = statistics.median(plain), statistics.median(watched)
    figures = {
        "step_us_plain": round(base * 1e6, 1),
        "step_us_watched": round(with_watch * 1e6, 1),
        "overhead_us_per_step": round((with_watch - base) * 1e6, 1),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
