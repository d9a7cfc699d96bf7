r"""One training script, any launcher: every rank logs into one runbus run with nothing configured.

    python examples/launchers/train.py                                          # one process
    torchrun --nproc-per-node 2 examples/launchers/train.py                     # run id: the agent's
    torchrun --nnodes 2 --rdzv-id myjob ... examples/launchers/train.py         # run id: myjob
    accelerate launch --multi_gpu --num_processes 2 examples/launchers/train.py # (torchrun inside)
    deepspeed --num_gpus 2 examples/launchers/train.py                          # agreed through gloo
    srun -N 2 --ntasks-per-node 4 python examples/launchers/train.py            # run id: slurm-JOB.STEP
    mpirun -np 2 python examples/launchers/train.py                             # Open MPI: openmpi-JOB-…
    mpiexec.hydra -n 2 python examples/launchers/train.py                       # MPICH: agreed through gloo

Only the process group needs the launcher's variables, as any PyTorch script does (`rank_and_world`
reads them; MASTER_ADDR / MASTER_PORT default to this machine). runbus.init() comes after
init_process_group: where the launcher names no run (MPICH, DeepSpeed, a multi-node torchrun
without --rdzv-id), rank 0 makes the run id and the others read it from the group's store.
Where it names one, init() could as well come first.

A linear model fits a noisy linear map on synthetic data; each rank logs its loss per step.
`--steps`, `--print-json` (each rank prints its identity as one JSON line, for the tests).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import runbus

# (rank, world size) variables per launcher, innermost first: torchrun / accelerate / DeepSpeed,
# Open MPI, MPICH and Intel MPI, SLURM's srun.
LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),  # set by srun only: not in an sbatch script itself
)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes, as its launcher tells them (0, 1 alone)."""
    for rank, world in LAUNCHER_VARIABLES:
        if rank in os.environ and world in os.environ:
            return int(os.environ[rank]), int(os.environ[world])
    return 0, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # DeepSpeed's launcher adds it
    parser.add_argument("--print-json", action="store_true")
    args = parser.parse_args()

    rank, world = rank_and_world()
    if world > 1:
        address = (
            f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
        )
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    with runbus.init(config={"steps": args.steps, "world": world}, system_interval=None) as run:
        if args.print_json:
            ident = run.identity
            fields = ("run_id", "label", "rank", "world_size", "launcher", "run_id_from", "primary")
            print(json.dumps({name: getattr(ident, name) for name in fields}), flush=True)
        train(run, args.steps, rank, world)
    if world > 1:
        # The DDP model held the process group: freed now (its reducer's cycles collected), or
        # gloo's threads are torn down at interpreter exit, where they abort the rank.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def train(run: runbus.Run, steps: int, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model: nn.Module = nn.Linear(8, 1)
    if world > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(32, 8, generator=data)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.log({"loss": loss.detach()}, step=step)


if __name__ == "__main__":
    main()
