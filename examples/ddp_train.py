r"""A small DDP job that logs every rank into one runbus run.

    torchrun --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --rdzv-id myjob \
        examples/ddp_train.py              # NCCL with a GPU per rank, else gloo on the CPU
    torchrun --standalone --nproc-per-node 4 examples/ddp_train.py     # a random run id
    RUNBUS_RUN_ID=myjob torchrun --nproc-per-node 4 examples/ddp_train.py

A 2-layer MLP learns a noisy linear map from synthetic data. Every rank logs its loss (a tensor:
on a GPU it is read off the training thread), throughput and learning rate, prints a line every
few steps and logs through `logging`: all of it lands in one run, while the terminal shows the
primary's console only (and any rank's errors). Nothing is passed to runbus.init(): the run
id, label and primary come from torchrun's environment: the run id from --rdzv-id, --standalone's
random one or RUNBUS_RUN_ID; plain `torchrun --nproc-per-node 4` names none, and then runbus names
the run after torchrun's agent (one node), or the ranks agree on one through the process group
this script makes before runbus.init() (several nodes). See examples/launchers/ for other launchers.

`--fail-rank R --fail-step S` makes rank R fail at step S on its first attempt only, to watch
`torchrun --max-restarts 1` restart the job into the same run (a new epoch of every label).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import runbus

FEATURES = 16

log = logging.getLogger("ddp_train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--print-every", type=int, default=5)
    parser.add_argument("--system-interval", type=float, default=15.0, help="seconds between system samples")
    parser.add_argument("--console", choices=("primary", "all", "off"), help="RUNBUS_CONSOLE, else primary")
    parser.add_argument("--fail-rank", type=int, help="this rank fails at --fail-step on the first attempt")
    parser.add_argument("--fail-step", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # NCCL takes a GPU per rank: more ranks on a machine than it has GPUs train on the CPU.
    if torch.cuda.is_available() and local_world <= torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=attempt_store(rank, world), rank=rank, world_size=world)
    try:
        train(args, device, backend)
    finally:
        # The DDP model held the process group: its reducer's cycles collected now, or gloo's
        # threads are torn down at interpreter exit, where they can abort the rank.
        gc.collect()
        dist.destroy_process_group()


def attempt_store(rank: int, world: int) -> dist.Store:
    """The rendezvous store of this attempt, at torchrun's MASTER_ADDR and MASTER_PORT.

    torchrun 2.13 hands a restarted group the agent's store with the failed attempt's keys still
    in it, and the new process group connects to the dead ranks' addresses (pytorch#167288). A
    prefix per attempt keeps the attempts apart.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=datetime.timedelta(minutes=5),
    )
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def train(args: argparse.Namespace, device: torch.device, backend: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    options = {"console": args.console} if args.console else {}
    config = {**vars(args), "backend": backend, "world_size": world}
    with runbus.init(config=config, system_interval=args.system_interval, **options) as run:
        if run.primary:
            print(f"ddp_train: {world} ranks ({backend}) logging into run {run.run_id}", flush=True)
        log.info("rank %d of %d on %s, attempt %d", rank, world, device, attempt)

        torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; this keeps runs repeatable
        model = nn.Sequential(nn.Linear(FEATURES, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model.to(device), device_ids=device_ids)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
        true_weights = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0)).to(device)
        data = torch.Generator().manual_seed(1000 * attempt + rank)  # each rank its own shard

        window_start, window_samples = time.perf_counter(), 0
        for step in range(args.steps):
            x = torch.randn(args.batch_size, FEATURES, generator=data).to(device)
            y = x @ true_weights + 0.1 * torch.randn(args.batch_size, 1, generator=data).to(device)
            loss = nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lr = schedule.get_last_lr()[0]
            schedule.step()
            window_samples += args.batch_size
            metrics = {"loss": loss.detach(), "lr": lr}
            if (step + 1) % args.print_every == 0 or step + 1 == args.steps:
                value = loss.item()  # waits for the device, once per window: throughput is honest
                elapsed = time.perf_counter() - window_start
                metrics["samples_per_s"] = window_samples / elapsed
                print(
                    f"rank {rank} step {step} loss {value:.4f} lr {lr:.4f} "
                    f"{metrics['samples_per_s']:.0f} samples/s",
                    flush=True,
                )
                window_start, window_samples = time.perf_counter(), 0
            run.log(metrics, step=step)
            if rank == args.fail_rank and step == args.fail_step and attempt == 0:
                raise RuntimeError(f"rank {rank} fails at step {step} (injected by --fail-rank)")
        log.info("rank %d done after %d steps", rank, args.steps)


if __name__ == "__main__":
    main()
