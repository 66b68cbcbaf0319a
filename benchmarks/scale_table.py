"""Scale table: ``flush`` on straight pipelines of 4 to 16 processes against one device, with the
setup time and the memory per rank, then the weight stash of 64 and 128 stages by the memory model.

Part 1 (processes). For each count N, one command trains a straight N-stage pipeline (one layer
per stage: Linear ``--width`` x ``--width`` + Tanh, the last without Tanh) with ``flush``, SGD
(lr 0.1, momentum 0.9), ``--microbatches`` microbatches of 2 rows, 5 batches, through Lightning's
Trainer, the popen launcher and gloo on CPU, and consolidates the weights. The table gives:

* ``max |diff|``: the largest difference between those weights and one device's (``Trainer(
  devices=1, accumulate_grad_batches=microbatches)`` over the same rows in microbatches);
* ``setup s``: the wall time of ``PipeDreamStrategy.setup`` per rank (plan, stage cut, schedule
  built and validated, process groups), max and min over the ranks; ``validate s``: building and
  validating the same schedule once in this process (what every rank does at setup);
* ``report KiB``: the memory report's total per rank (weights, stashed versions, activations in
  flight, optimizer state), max over the ranks; ``RSS MiB``: the largest peak resident set;
* ``wall s``: the whole command, most of it the ranks importing torch and Lightning.

Part 2 (no processes). Weight versions a stage keeps (``schedule.memory.versions_kept``) on straight
pipelines of 16 to 128 stages in ``async``, ``vertical_sync``, ``2bw`` and ``flush``; the input
stage's weight versions and activations in flight (``schedule.memory``; message frames left
out) for ``--stage-mib`` MiB of weights and ``--activation-mib`` MiB of activations per
minibatch per stage, beside the planner's own constraint figure (``planner.costs.stashed_bytes``);
and the most stages with which the input stage still fits ``--device-gib`` GiB in each mode.

    python benchmarks/scale_table.py                                # 4, 8, 12, 16 processes
    python benchmarks/scale_table.py --processes 4 --width 8        # one quick row
    python benchmarks/scale_table.py --processes                    # part 2 only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import harness
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream.planner.costs import stashed_bytes
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule.memory import kept_bytes, versions_kept
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.stream import SegmentStream

BATCHES = 5
ROWS = 2  # per microbatch
MIB = 2**20


# ----- the model and the data, the same in every rank and in the one-device run -----------------


def deep_model(layers: int, width: int) -> nn.Sequential:
    """``layers`` pipeline layers of ``width`` features: Linear + Tanh, the last a bare Linear."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers - 1)
    ]
    return nn.Sequential(*blocks, nn.Linear(width, width))


def rows(microbatches: int, width: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    count = BATCHES * microbatches * ROWS
    inputs = torch.randn(count, width, generator=generator)
    return TensorDataset(inputs, torch.randn(count, width, generator=generator))


def lightning_module(layers: int, width: int):  # type: ignore[no-untyped-def]
    from lightning.pytorch import LightningModule

    class Deep(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = deep_model(layers, width)

        def configure_pipeline(self) -> nn.Sequential:
            return self.net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return ((self(x) - y) ** 2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Deep()


def trainer(**kwargs):  # type: ignore[no-untyped-def]
    from lightning.pytorch import Trainer

    settings = {"accelerator": "cpu", "max_epochs": 1, "enable_progress_bar": False}
    settings |= {"enable_model_summary": False, "logger": False, "enable_checkpointing": False}
    return Trainer(**settings, **kwargs)


# ----- one rank of the pipelined run (the launcher re-runs this file with LOCAL_RANK set) --------


def run_worker(args: argparse.Namespace) -> None:
    from pl_pipedream import PipeDreamStrategy, consolidate_checkpoint

    class TimedStrategy(PipeDreamStrategy):
        def setup(self, trainer) -> None:  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            super().setup(trainer)
            self.setup_wall = time.perf_counter() - start

    n, m, out = args.worker, args.microbatches, Path(args.out)
    strategy = TimedStrategy(sync="flush", balance=[1] * n, microbatches=m, timeout=300)
    fitter = trainer(devices=n, strategy=strategy, use_distributed_sampler=False)
    module = lightning_module(n, args.width)
    fitter.fit(module, DataLoader(rows(m, args.width), batch_size=m * ROWS, shuffle=False))
    fitter.save_checkpoint(out / "run.ckpt")
    rank = fitter.global_rank
    row = next(r for r in strategy.memory_report if r.rank == rank)
    record = {"setup": strategy.setup_wall, "report": row.total}
    record["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if fitter.is_global_zero:
        torch.save(consolidate_checkpoint(out / "run.ckpt"), out / "weights.pt")


# ----- the parent: one command per process count, then the table --------------------------------


def one_device(layers: int, width: int, microbatches: int) -> dict[str, torch.Tensor]:
    module = lightning_module(layers, width)  # imports Lightning, which sets its log level
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    run = trainer(devices=1, accumulate_grad_batches=microbatches)
    run.fit(module, DataLoader(rows(microbatches, width), batch_size=ROWS, shuffle=False))
    return module.state_dict()


def validate_seconds(n: int, microbatches: int) -> float:
    start = time.perf_counter()
    SegmentStream(Plan.from_balance([1] * n), SyncMode.parse("flush"), microbatches).validate()
    return time.perf_counter() - start


def measure(n: int, args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory(prefix=f"scale-{n}-") as directory:
        out = Path(directory)
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(n)]
        command += ["--microbatches", str(args.microbatches), "--width", str(args.width)]
        command += ["--out", directory]
        env = harness.child_env(OMP_NUM_THREADS="1")
        start = time.perf_counter()
        result = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            return f"{n:>5} | failed with exit status {result.returncode}: {result.stderr[-600:]}"
        got = torch.load(out / "weights.pt")
        expected = one_device(n, args.width, args.microbatches)
        diff = max((got[k] - t).abs().max().item() for k, t in expected.items())
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    setups = [r["setup"] for r in ranks]
    report = max(r["report"] for r in ranks) / 2**10
    rss = max(r["rss"] for r in ranks) / MIB
    check = validate_seconds(n, args.microbatches)
    plan = f"{n} x 1 layer"
    return (
        f"{n:>5} | {plan:<12} | {diff:>9.1e} | {max(setups):>7.2f} {min(setups):>5.2f} | "
        f"{check:>10.3f} | {report:>10.1f} | {rss:>7.0f} | {wall:>6.1f}"
    )


def processes_table(args: argparse.Namespace) -> None:
    cores, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
    print(
        f"flush, straight pipelines, width {args.width}, {args.microbatches} microbatches of "
        f"{ROWS} rows, {BATCHES} batches, gloo on CPU ({cores} cores, load {load:.1f} at start)"
    )
    print(
        f"{'ranks':>5} | {'plan':<12} | {'max |diff|':>9} | {'setup s max min':>13} | "
        f"{'validate s':>10} | {'report KiB':>10} | {'RSS MiB':>7} | {'wall s':>6}"
    )
    for n in args.processes:
        print(measure(n, args), flush=True)


# ----- part 2: the weight stash by the memory model ----------------------------------------------

MODES = ("async", "vertical_sync", "2bw", "flush")
FIT_MODES = ("async", "2bw")
CAP = 4096  # stages: the most the search below tries


def sized(stages: int, weights: float, activations: float) -> Plan:
    plan = Plan.from_balance([1] * stages)
    every = (replace(s, parameter_bytes=weights, activation_bytes=activations) for s in plan.stages)
    return replace(plan, stages=tuple(every))


def stash_and_activations(plan: Plan, sync: SyncMode, stage: int) -> float:
    """``schedule.memory.kept_bytes`` of ``stage`` (weight versions and activations in flight;
    message frames left out: they depend on the boundary sizes, not on the stash), with the
    fewest microbatches the mode takes (``2bw``: as many as stages)."""
    return kept_bytes(plan, sync, sync.min_microbatches(plan.num_stages), stage)


def most_stages(
    sync: SyncMode, weights: float, activations: float, memory: float, cap: int = CAP
) -> int:
    """The most stages (up to ``cap``) with which the input stage fits ``memory``."""
    low, high = 1, cap  # the input stage's bytes grow with the stage count: bisect
    if stash_and_activations(sized(high, weights, activations), sync, 0) <= memory:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        fits = stash_and_activations(sized(middle, weights, activations), sync, 0) <= memory
        low, high = (middle, high) if fits else (low, middle)
    return low


def stash_table(args: argparse.Namespace) -> None:
    weights, activations = args.stage_mib * MIB, args.activation_mib * MIB
    print(
        "\nweight versions kept per stage (straight pipelines, one microbatch per batch; 2bw: as "
        "many as stages), and the "
        f"input stage's bytes for {args.stage_mib:g} MiB of weights and {args.activation_mib:g} "
        "MiB of activations per minibatch per stage"
    )
    head = f"{'stages':>6} | {'mode':<13} | {'stage 0':>7} {'middle':>6} {'last':>4} | "
    print(head + f"{'all stages':>10} | {'stage 0 GiB':>11} | {'planner GiB':>11}")
    for stages in args.stash_stages:
        plan = sized(stages, weights, activations)
        planner = stashed_bytes(weights + activations, stages - 1, 1) / 2**30
        for name in MODES:
            sync = SyncMode.parse(name)
            m = sync.min_microbatches(stages)
            kept = [versions_kept(plan, sync, m, s) for s in range(stages)]
            stage0 = stash_and_activations(plan, sync, 0) / 2**30
            print(
                f"{stages:>6} | {name:<13} | {kept[0]:>7} {kept[stages // 2]:>6} {kept[-1]:>4} | "
                f"{sum(kept):>10} | {stage0:>11.2f} | {planner:>11.2f}"
            )
    memory = args.device_gib * 2**30
    # vertical_sync keeps as many versions at the input stage as async, flush one
    fits = {n: most_stages(SyncMode.parse(n), weights, activations, memory) for n in FIT_MODES}
    print(
        f"most stages whose input stage fits {args.device_gib:g} GiB: "
        + ", ".join(f"{name} {'>= ' if c == CAP else ''}{c}" for name, c in fits.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="*", default=[4, 8, 12, 16])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--stash-stages", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--stage-mib", type=float, default=64.0)
    parser.add_argument("--activation-mib", type=float, default=8.0)
    parser.add_argument("--device-gib", type=float, default=16.0)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.processes:
        processes_table(args)
    stash_table(args)


if __name__ == "__main__":
    main()
