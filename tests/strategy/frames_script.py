"""Fit a wide straight pipeline and write each rank's memory report row, as a user's script would.

Run as ``python tests/strategy/frames_script.py --devices 3 --syncs async flush --out DIR``;
each sync mode is fitted in turn in the same processes with a plan profiled on this model
(``plan=``), so the report has an estimate. Rank 0 writes ``DIR/<sync>.json`` with every rank's
row (``strategy.memory_report``): the frames its channel held beside the estimate. The tests
call ``main(argv)`` on ranks forked from their own process (``launched``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from pl_pipedream.planner.optimize import plan as make_plan  # noqa: E402
from pl_pipedream.planner.plan import Plan  # noqa: E402
from pl_pipedream.planner.topology import Topology  # noqa: E402
from pl_pipedream.profile.measure import profile_layers  # noqa: E402

WIDTH, ROWS = 1024, 8  # one activation per microbatch: 8 x 1024 floats, 32 KiB


def make_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, 4),
    )


class Wide(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_layers()

    def configure_pipeline(self) -> nn.Sequential:
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


def profiled_plan(devices: int) -> Plan:
    """A straight plan of the planner's cuts with the profiled sizes, over layer indices."""
    profile = profile_layers(make_layers(), torch.randn(ROWS, 16))
    planned = make_plan(profile, Topology.flat(devices, 1e9), straight=True)
    stages = tuple(
        dataclasses.replace(s, nodes=tuple(n.removeprefix("layer") for n in s.nodes))
        for s in planned.stages
    )
    return dataclasses.replace(planned, stages=stages)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--syncs", nargs="+", default=["async"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    m = args.microbatches
    generator = torch.Generator().manual_seed(1)
    count = args.batches * m * ROWS
    data = TensorDataset(
        torch.randn(count, 16, generator=generator), torch.randn(count, 4, generator=generator)
    )
    plan = profiled_plan(args.devices)
    for sync in args.syncs:
        strategy = PipeDreamStrategy(sync=sync, microbatches=m, timeout=60, plan=plan)
        trainer = Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=args.devices,
            max_epochs=1,
            use_distributed_sampler=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
        )
        trainer.fit(Wide(), DataLoader(data, batch_size=m * ROWS, shuffle=False))
        if trainer.is_global_zero:
            rows = [dataclasses.asdict(row) for row in strategy.memory_report]
            (Path(args.out) / f"{sync}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
