"""What activation recomputation saves and costs: time per step and memory per stage.

Fits the same pipelined MLP (``--stages`` stages of ``--layers`` x (Linear(width) + GELU),
their bytes profiled for the estimate) with ``PipeDreamStrategy(recompute=False)`` and
``recompute=True`` in turn, in the same processes, ``--repeats`` times each, alternating, and
prints the median time per Lightning step of each (timed on rank 0 after ``--warmup`` steps) and
each stage's memory report: the activations its minibatches in flight kept at their peak, and
the measured total.

    python benchmarks/recompute_cost.py --sync async --out outputs/recompute
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.planner.plan import Plan
from pl_pipedream.profile.measure import profile_layers


class Mlp(LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*blocks)

    def configure_pipeline(self) -> nn.Sequential:
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


class StepTimes(Callback):
    """The time of every training step's end, on this rank."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.ends.append(time.perf_counter())


def sized_plan(layers: nn.Sequential, sample: torch.Tensor, balance: list[int]) -> Plan:
    """``Plan.from_balance`` with the profile's bytes per stage filled in (weights, activations,
    what crosses each cut; bytes only, so every rank computes the same plan), so that the memory
    report can print the plan's estimate beside what it measures."""
    nodes = profile_layers(layers, sample, warmup=0, repeats=1).nodes
    plan = Plan.from_balance(balance)
    stages, first = [], 0
    for stage in plan.stages:
        own = nodes[first : first + len(stage.nodes)]
        before = nodes[first - 1].output_bytes if first else 0.0
        sizes = {
            "parameter_bytes": sum(n.parameter_bytes for n in own),
            "activation_bytes": sum(n.output_bytes for n in own),
            "input_bytes": before,
            "output_bytes": own[-1].output_bytes if stage.index < plan.num_stages - 1 else 0.0,
        }
        stages.append(replace(stage, **sizes))
        first += len(stage.nodes)
    return replace(plan, stages=tuple(stages))


def fit(args: argparse.Namespace, recompute: bool) -> tuple[float, list[dict], int]:
    rows = args.microbatches * args.rows
    generator = torch.Generator().manual_seed(1)
    count = rows * (args.steps + args.warmup)
    x = torch.randn(count, args.width, generator=generator)
    data = TensorDataset(x, torch.randn(count, args.width, generator=generator))
    module = Mlp(args.width, args.stages * args.layers)
    strategy = PipeDreamStrategy(
        sync=args.sync,
        microbatches=args.microbatches,
        plan=sized_plan(module.net, x[: args.rows], [2 * args.layers] * args.stages),
        recompute=recompute,
        timeout=120,
    )
    times = StepTimes()
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.stages,
        max_epochs=1,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[times],
    )
    trainer.fit(module, DataLoader(data, batch_size=rows, shuffle=False))
    timed = times.ends[args.warmup :]
    per_step = (timed[-1] - timed[0]) / (len(timed) - 1)
    report = [asdict(row) for row in strategy.memory_report]
    return per_step, report, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sync", default="async")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4, help="blocks per stage")
    parser.add_argument("--rows", type=int, default=64, help="rows per microbatch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="outputs/recompute")
    args = parser.parse_args()
    results: dict[bool, list[float]] = {False: [], True: []}
    reports: dict[bool, list[dict]] = {}
    rank = 0
    for _ in range(args.repeats):
        for recompute in (False, True):
            per_step, reports[recompute], rank = fit(args, recompute)
            results[recompute].append(per_step)
    if rank != 0:
        return
    mib = 2**20
    lines = [
        f"recompute_cost: {args.sync}, {args.stages} stages x {args.layers} x "
        f"(Linear({args.width}) + GELU), "
        f"{args.microbatches} microbatches of {args.rows} rows, {args.steps} timed steps, "
        f"{args.repeats} repeats (median)",
        f"{'recompute':>9} {'ms/step':>9}  activations per stage (MiB)  total per stage (MiB)",
    ]
    summary = {}
    for recompute in (False, True):
        ms = statistics.median(results[recompute]) * 1e3
        rows = sorted(reports[recompute], key=lambda r: r["rank"])
        act = [r["activations"] / mib for r in rows]
        total = [
            (r["weights"] + r["stashed"] + r["activations"] + r["optimizer"]) / mib for r in rows
        ]
        acts = " ".join(f"{a:.2f}" for a in act)
        totals = " ".join(f"{t:.2f}" for t in total)
        lines.append(f"{recompute!s:>9} {ms:>9.2f}  {acts:<28} {totals}")
        summary[str(recompute)] = {"ms_per_step": ms, "per_step": results[recompute], "rows": rows}
    ratio = statistics.median(results[True]) / statistics.median(results[False])
    lines.append(f"time with recompute / without: {ratio:.3f}")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recompute_cost.json").write_text(json.dumps({"args": vars(args), **summary}))


if __name__ == "__main__":
    main()
