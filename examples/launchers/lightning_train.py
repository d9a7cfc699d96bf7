r"""Lightning, launched by itself: every rank logs into one runbus run with nothing configured.

    python examples/launchers/lightning_train.py                          # ddp, 2 CPU processes
    python examples/launchers/lightning_train.py --strategy ddp_spawn     # or ddp_fork
    python examples/launchers/lightning_train.py --init top               # ddp only: see below

`--init setup` (the default) calls runbus.init() in the LightningModule's `setup()`, in every
rank once Lightning has made the process group: rank 0 makes the run id and the others read it
from the group's store. That works under every strategy, and under torchrun or srun too.

`--init top` calls it at the top of the script, before the Trainer exists. Under `ddp` the main
process is rank 0: its init() makes a run id and exports it to RUNBUS_RUN_ID, and the ranks
Lightning starts re-run the script with that variable and LOCAL_RANK, so they join as rank1, ...
Under `ddp_spawn` and `ddp_fork` the main process is no rank (it waits for its children), so
there the ranks call init() themselves (`--init setup`).
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from torch import nn

import runbus

run: runbus.Run | None = None


class Regression(L.LightningModule):
    """A linear model that fits a noisy linear map; each rank logs its loss to runbus."""

    def __init__(self, init_in_setup: bool, print_json: bool) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.init_in_setup = init_in_setup
        self.print_json = print_json

    def setup(self, stage: str) -> None:
        global run
        if self.init_in_setup:
            run = runbus.init(config={"strategy": str(self.trainer.strategy.__class__.__name__)})
        if self.print_json and run is not None:
            ident = run.identity
            fields = ("run_id", "label", "rank", "world_size", "launcher", "run_id_from", "primary")
            print(json.dumps({name: getattr(ident, name) for name in fields}), flush=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        if run is not None:
            run.log({"loss": loss.detach()}, step=self.global_step)
        return loss

    def teardown(self, stage: str) -> None:
        if run is not None and self.init_in_setup:
            run.finish()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    global run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "ddp_spawn", "ddp_fork"))
    parser.add_argument("--init", default="setup", choices=("setup", "top"))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--print-json", action="store_true")
    args = parser.parse_args()
    if args.init == "top":
        run = runbus.init(config=vars(args))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = L.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression(init_in_setup=args.init == "setup", print_json=args.print_json)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    if run is not None and args.init == "top":
        run.finish()


if __name__ == "__main__":
    main()
