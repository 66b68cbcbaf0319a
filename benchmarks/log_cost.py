"""What logging the training loss costs per step: ``LightningModule.log`` against the strategy's
``lightning_patches.log_step_value`` (which updates the metric Lightning registered at the
epoch's first step in place).

``python benchmarks/log_cost.py`` runs one-process Lightning for ``--steps`` steps; each
``training_step`` logs one value through each path, in alternating order, under its own name
(the options the strategy uses for ``train_loss``), and times each call. Prints the median and
mean microseconds per call of each, and the CPU time, so the two share the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream.strategy import lightning_patches

OPTIONS = {"prog_bar": True, "on_step": True, "on_epoch": False, "sync_dist": False}


class Logs(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.costs: dict[str, list[float]] = {"LightningModule.log": [], "log_step_value": []}

    def _public(self, value: torch.Tensor) -> None:
        self.log("loss_public", value, **OPTIONS)

    def _patched(self, value: torch.Tensor) -> None:
        lightning_patches.log_step_value(self, "loss_patched", value)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        value = torch.tensor(float(batch_idx))
        calls = [("LightningModule.log", self._public), ("log_step_value", self._patched)]
        for name, call in calls if batch_idx % 2 else calls[::-1]:
            started = time.process_time()
            call(value)
            self.costs[name].append(time.process_time() - started)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = Logs()
    data = DataLoader(TensorDataset(torch.ones(args.steps, 4)), batch_size=1)
    Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model, data)
    for name, costs in model.costs.items():
        steady = costs[100:]
        print(
            f"{name}: median {statistics.median(steady) * 1e6:.0f} us, "
            f"mean {statistics.fmean(steady) * 1e6:.0f} us CPU per call ({len(steady)} calls)"
        )


if __name__ == "__main__":
    main()
