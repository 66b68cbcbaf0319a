"""bf16-mixed throughput on one GPU: two pipeline ranks sharing it, against one process.

Run: python benchmarks/gpu_precision_throughput.py [--steps 24] [--dry]

Model: 8 blocks of Linear(width)-ReLU and a Linear head (width 2048), MSE loss, plain SGD,
batches of ``microbatches`` x 128 rows. Configurations, each a fresh ``Trainer.fit``:

* ``single-fp32``, ``single-bf16``: one process, ``Trainer(accelerator="gpu", devices=1)``;
* ``pipe-bf16-<sync>``: ``PipeDreamStrategy(sync=..., balance=[8, 9], microbatches=4)`` with both
  ranks on ``cuda:0`` (``parallel_devices``; gloo, since NCCL refuses two ranks on one device:
  messages travel through host memory), ``precision="bf16-mixed"``.

Two ranks on one GPU share its compute: the pipeline cannot beat one process here; the figures
show what the precision costs or saves in each, and the pipeline's overhead on a GPU. Time is rank
0's wall clock, the device synchronised, from the end of batch ``--warmup - 1`` to the end of the
second-to-last batch (the last also drains an async pipeline). ``--dry`` runs the same code on the
CPU at width 64 (a check that the script works, not a measurement).

Figures from an H100: docs/performance.md, "One GPU shared by two ranks".
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy

ROWS = 128  # per microbatch
MICROBATCHES = 4


class Blocks(LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, width))  # 17 layers

    def configure_pipeline(self) -> nn.Sequential:
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Clock(Callback):
    """Rank 0 writes the seconds between two batch ends (device synchronised) to ``out``."""

    def __init__(self, out: Path, first: int, last: int) -> None:
        self.out, self.first, self.last = out, first, last
        self.start = 0.0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_rank != 0 or batch_idx not in (self.first, self.last):
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if batch_idx == self.first:
            self.start = time.perf_counter()
        else:
            self.out.write_text(json.dumps(time.perf_counter() - self.start))


def run(config: str, args: argparse.Namespace, out: Path) -> float:
    """Samples per second of one configuration."""
    torch.manual_seed(0)
    width = 64 if args.dry else 2048
    batch = MICROBATCHES * ROWS
    data = TensorDataset(
        torch.randn(args.steps * batch, width), torch.randn(args.steps * batch, width)
    )
    loader = DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)
    accelerator = "cpu" if args.dry else "gpu"
    precision = "32-true" if config.endswith("fp32") else "bf16-mixed"
    settings: dict = {"devices": 1}
    if config.startswith("pipe"):
        device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
        strategy = PipeDreamStrategy(
            sync=config.rsplit("-", 1)[1],
            balance=[8, 9],
            microbatches=MICROBATCHES,
            start_method="spawn",
            timeout=120,
            parallel_devices=[device, device],
            process_group_backend="gloo",
            divergence="off",
        )
        settings = {"strategy": strategy, "devices": 1}  # two ranks, on that one device
    clock = out / f"{config}.json"
    trainer = Trainer(
        accelerator=accelerator,
        precision=precision,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Clock(clock, args.warmup - 1, args.steps - 2)],
        **settings,
    )
    trainer.fit(Blocks(width), loader)
    seconds = json.loads(clock.read_text())
    return (args.steps - 1 - args.warmup) * batch / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--dry", action="store_true", help="on the CPU, tiny: a check, no figures")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["single-fp32", "single-bf16", "pipe-bf16-flush", "pipe-bf16-async"],
    )
    args = parser.parse_args()
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --dry for a CPU check)")
    where = "CPU (dry run, not a measurement)" if args.dry else torch.cuda.get_device_name(0)
    print(f"bf16-mixed throughput on {where}, torch {torch.__version__}")
    print(f"{'config':18} {'samples/s':>10} {'vs single-bf16':>15}")
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            figures[config] = run(config, args, Path(tmp))
            base = figures.get("single-bf16")
            ratio = f"{figures[config] / base:15.2f}" if base else f"{'':15}"
            print(f"{config:18} {figures[config]:10.1f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
