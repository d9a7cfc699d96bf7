r"""PyTorch Lightning on 2 CPU processes, every rank logging into one runbus run.

    python examples/lightning_ddp.py                          # strategy ddp, 2 CPU processes
    python examples/lightning_ddp.py --strategy ddp_spawn     # or ddp_fork
    runbus ingest & runbus show <run id>                      # rank0 and rank1, each its own loss

Nothing is set for runbus: RunbusLogger makes up the run id in the process you start and hands
it to the ranks Lightning launches (RUNBUS_RUN_ID, or the pickled logger under ddp_spawn). Each
rank logs its own loss (self.log without sync_dist), and its step time split into data wait,
compute and collective wait; rank 1 computes longer (--slow-ms) to show who makes whom wait.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runbus.integrations.lightning import RunbusLogger

FEATURES = 16


class Regressor(pl.LightningModule):
    """A 2-layer MLP learning a noisy linear map."""

    def __init__(self, hidden: int = 32, lr: float = 0.05, slow_ms: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()  # the run's config, from every rank
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 1 and self.hparams["slow_ms"]:
            time.sleep(self.hparams["slow_ms"] / 1000)  # a slower rank: the others wait at the all-reduce
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # this rank's own value: no sync_dist
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


def dataset(samples: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=generator)
    weights = torch.randn(FEATURES, 1, generator=generator)
    return TensorDataset(x, x @ weights + 0.1 * torch.randn(samples, 1, generator=generator))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "ddp_spawn", "ddp_fork"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--slow-ms", type=float, default=10.0, help="extra compute per step on rank 1")
    parser.add_argument("--redis-url", help="RUNBUS_REDIS_URL, else redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)

    options = {"redis_url": args.redis_url} if args.redis_url else {}
    logger = RunbusLogger(config={"strategy": args.strategy, "devices": args.devices}, **options)
    # Claims no label: this process may not be a rank (under ddp_spawn it is not).
    print(f"lightning_ddp: logging into run {logger.version}", flush=True)
    trainer = pl.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        accelerator="cpu",
        logger=logger,
        max_steps=args.max_steps,
        log_every_n_steps=2,  # also the window of the per-rank step timing
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        Regressor(slow_ms=args.slow_ms), DataLoader(dataset(), batch_size=args.batch_size, shuffle=True)
    )


if __name__ == "__main__":
    main()
