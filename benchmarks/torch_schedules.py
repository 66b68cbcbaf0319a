"""Our flushed modes and async against every torch.distributed.pipelining schedule, 2 CPU ranks.

Run: OMP_NUM_THREADS=1 python benchmarks/torch_schedules.py --workload gpt --repeats 2

Like for like with benchmarks/pipeline_throughput.py (whose workloads, launcher and clocks this
reuses): every matrix product runs on ``--microbatch`` rows, a configuration with m microbatches
trains batches of m x ``--microbatch`` rows, the same samples, plain SGD, one thread per process,
each rank bound to a core of its own. Configurations, interleaved, in fresh processes:

* ``ours-<sync>-<m>``: ``PipeDreamStrategy(sync=flush|gpipe|zero_bubble, microbatches=m)`` under
  a Lightning ``Trainer`` with 2 CPU devices, one stage per rank; ``ours-interleaved-<m>`` and
  ``ours-zbv-<m>``: the same with ``sync=interleaved|zbv`` and a balance of the 4 stages torch's
  loop and V schedules cut (below), which the strategy places as torch does (interleaved: rank r
  holds stages r and r + 2; zbv: rank 0 holds stages 0 and 3); ``ours-async-1``: async, one
  microbatch per batch.
* ``torch-<schedule>-<m>``: ``PipelineStage`` over gloo, one optimizer step per batch, for every
  schedule torch ships: ``1F1B`` and ``GPipe`` with one stage per rank (the same 2 stages as
  ours); ``Interleaved1F1B``, ``LoopedBFS`` and ``InterleavedZeroBubble`` with 2 stages per rank
  placed in a loop (rank r holds stages r and r + 2), ``ZBVZeroBubble`` and ``DualPipeV`` with 2
  stages per rank placed in a V (rank 0 holds stages 0 and 3): the same layers cut into 4
  stages (the blocks in quarters; gpt: the embedding on the first, the head on the last).

A schedule that fails on this machine is reported with its error, and the run goes on. Time is
rank 0's wall clock over the steady batches (``throughput_model.measure``). Targets, as ratios
within each repeat, median over repeats: ``zero_bubble``-8 at least 1.05x torch's ``1F1B``-8
(gpt), and at every m our best flushed mode at least torch's best schedule (all of torch's
schedules are flushed: one update per batch).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import harness
import pipeline_throughput as bench
import throughput_workloads as work
import torch
import torch.distributed as dist
from throughput_configs import NUM_STAGES, Config, Result
from throughput_model import measure
from throughput_report import print_check
from throughput_workers import BatchClock, bind_rank, make_optimizer
from torch import nn

from pl_pipedream.runtime.memory import retain_freed_memory

SCRIPT = Path(__file__).resolve()
RANKS = NUM_STAGES
# torch's schedules by short name, and where their stages sit: "single" (one stage per rank),
# "loop" (rank r holds stages r and r + RANKS) or "v" (rank r holds r and 2 RANKS - 1 - r)
SCHEDULES = {
    "1F1B": "single",
    "GPipe": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
OURS_FLUSHED = ("flush", "gpipe", "zero_bubble", "interleaved", "zbv")
MICROBATCHES = (4, 8, 16)
FAST = {  # fewer batches than pipeline_throughput's defaults: 37 configurations per repeat
    "mlp": {"steps": 10, "warmup": 3},
    "gpt": {"steps": 6, "warmup": 2},
    "overhead": {"steps": 60, "warmup": 10},
}


def default_configs(microbatches: tuple[int, ...]) -> list[str]:
    names = ["ours-async-1"]
    for m in microbatches:
        names += [f"ours-{sync}-{m}" for sync in OURS_FLUSHED]
        names += [f"torch-{schedule}-{m}" for schedule in SCHEDULES]
    return names


# ----- the torch worker ------------------------------------------------------------------------


def stages_of(schedule: str, rank: int) -> list[int]:
    """The stage indices ``rank`` holds under ``schedule`` (of ``RANKS`` or 2 ``RANKS``)."""
    style = SCHEDULES[schedule]
    if style == "single":
        return [rank]
    if style == "loop":
        return [rank, rank + RANKS]
    return [rank, 2 * RANKS - 1 - rank]


def stage_count(schedule: str) -> int:
    return RANKS if SCHEDULES[schedule] == "single" else 2 * RANKS


def cut(layers: nn.Sequential, args: argparse.Namespace, stages: int) -> list[nn.Sequential]:
    """The layers in ``stages`` stages as ``throughput_workloads.balance`` cuts them (the blocks
    in equal parts; gpt: the embedding with the first, the head with the last): the same stages
    our chunked modes train."""
    sizes = work.balance(args, stages)
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [layers[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def make_schedule(args: argparse.Namespace, rank: int) -> tuple[Any, list[nn.Module]]:
    """``--schedule`` with ``--m`` microbatches over this rank's stages, and their modules."""
    from torch.distributed.pipelining import PipelineStage, schedules

    count = stage_count(args.schedule)
    modules = cut(work.make_layers(args), args, count)
    indices = stages_of(args.schedule, rank)
    device = torch.device("cpu")
    stages = [PipelineStage(modules[i], i, count, device) for i in indices]
    kind = getattr(schedules, f"Schedule{args.schedule}")
    given: Any = stages[0] if SCHEDULES[args.schedule] == "single" else stages
    schedule = kind(given, n_microbatches=args.m, loss_fn=work.loss)
    return schedule, [modules[i] for i in indices]


def run_torch(args: argparse.Namespace) -> Result:
    """One rank of ``torch.distributed.pipelining`` with ``--schedule`` and ``--m``."""
    rank = harness.launched_rank()
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    schedule, modules = make_schedule(args, rank)
    indices = stages_of(args.schedule, rank)
    first, last = 0 in indices, stage_count(args.schedule) - 1 in indices
    optimizer = make_optimizer([p for m in modules for p in m.parameters()])
    clock = BatchClock()
    for x, y in work.make_batches(args, args.batch):
        schedule.step(*([x] if first else []), **({"target": y} if last else {}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.on_train_batch_end()
    dist.destroy_process_group()
    return clock.result()


# ----- the driver ------------------------------------------------------------------------------


def run(args: argparse.Namespace, config: Config) -> list[Result]:
    if config.owner == "ours":
        return bench.run_config(args, config)
    extra = [f"--batch={config.rows(args)}", f"--m={config.microbatches}"]
    extra.append(f"--schedule={config.schedule}")
    return bench.launch(args, "torch", extra, RANKS, script=SCRIPT)


def failure(error: SystemExit) -> str:
    """The last error line of a failed worker's log."""
    lines = [line.strip() for line in str(error.code).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:200]


def drive(args: argparse.Namespace) -> None:
    print(f"$ {shlex.join(['OMP_NUM_THREADS=1', 'python', *sys.argv])}")
    print(
        f"{os.cpu_count()} cores, torch {torch.__version__}; {work.describe(args)}, "
        f"{args.microbatch} rows per microbatch, {args.steps} batches of which the first "
        f"{args.warmup} are not timed, SGD, 1 thread per process"
    )
    configs = [Config.parse(name) for name in args.configs]
    runs: dict[str, list[float]] = {c.name: [] for c in configs}
    cores: dict[str, list[float]] = {c.name: [] for c in configs}
    failed: dict[str, str] = {}
    for repeat in range(args.repeats):
        for config in configs:
            if config.name in failed:
                continue
            try:
                results = run(args, config)
            except SystemExit as error:
                failed[config.name] = failure(error)
                print(f"  repeat {repeat}: {config.name:<30} FAILED: {failed[config.name]}")
                continue
            measured = measure(args, config, results)
            rate = measured["samples"]
            runs[config.name].append(rate)
            cores[config.name].append(measured["cores"])
            print(
                f"  repeat {repeat}: {config.name:<30} {rate:8.1f} samples/s, "
                f"{measured['cores']:.2f} cores busy, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    print_table(args, configs, runs, cores, failed)
    print_targets(args, runs)


def print_table(
    args: argparse.Namespace,
    configs: list[Config],
    runs: dict[str, list[float]],
    cores: dict[str, list[float]],
    failed: dict[str, str],
) -> None:
    print(
        f"\nsamples/s (median over repeats; every matrix product on {args.microbatch} rows), "
        "the ratio to torch-1F1B at the same m within each repeat (median), and the CPU "
        "seconds of both ranks per wall second (2.0: both cores theirs):"
    )
    print(f"{'config':<30} {'samples/s':>9} {'/1F1B':>6} {'cores':>5}  every repeat")
    for config in configs:
        if config.name in failed:
            print(f"{config.name:<30} {'failed':>9}         {failed[config.name]}")
            continue
        rates = runs[config.name]
        base = runs.get(f"torch-1F1B-{config.microbatches}")
        against = ratios(rates, base) if config.owner != "ours" or config.microbatches > 1 else None
        cell = f"{statistics.median(against):6.3f}" if against else " " * 6
        busy = statistics.median(cores[config.name])
        each = ", ".join(f"{r:.1f}" for r in rates)
        print(f"{config.name:<30} {statistics.median(rates):9.1f} {cell} {busy:5.2f}  {each}")


def ratios(top: list[float] | None, bottom: list[float] | None) -> list[float] | None:
    if not top or not bottom or len(top) != len(bottom):
        return None
    return [a / b for a, b in zip(top, bottom, strict=True)]


def best(runs: dict[str, list[float]], names: list[str]) -> list[float] | None:
    """Per repeat, the best rate among ``names`` that ran every repeat."""
    ran = [runs[n] for n in names if n in runs and runs[n]]
    if not ran or len({len(r) for r in ran}) > 1:
        return None
    return [max(group) for group in zip(*ran, strict=True)]


def print_targets(args: argparse.Namespace, runs: dict[str, list[float]]) -> None:
    gpt = args.workload == "gpt"
    checks = [
        (
            "zero_bubble-8 / torch-1F1B-8 >= 1.05" + ("" if gpt else " (a gpt target)"),
            ratios(runs.get("ours-zero_bubble-8"), runs.get("torch-1F1B-8")),
            1.05 if gpt else None,
        )
    ]
    for m in sorted({Config.parse(n).microbatches for n in runs} - {1}):
        ours = best(runs, [f"ours-{sync}-{m}" for sync in OURS_FLUSHED])
        theirs = best(runs, [f"torch-{schedule}-{m}" for schedule in SCHEDULES])
        checks.append((f"best ours-{m} / best torch-{m} >= 1.0", ratios(ours, theirs), 1.0))
    async1 = runs.get("ours-async-1")
    for m in MICROBATCHES:
        theirs = best(runs, [f"torch-{schedule}-{m}" for schedule in SCHEDULES])
        checks.append((f"async-1 / best torch-{m}", ratios(async1, theirs), None))
    ran = [(label, values, goal) for label, values, goal in checks if values]
    print("\ntargets (met/MISSED; a row without a goal is for information), median of per-repeat:")
    for label, values, goal in ran:
        print_check(label, values, goal, higher=True)


# ----- entry point -----------------------------------------------------------------------------


def config_name(name: str) -> str:
    """``name`` if it names one of this benchmark's configurations, else argparse's error."""
    try:
        config = Config.parse(name)
    except ValueError:
        config = None
    known = (
        config is not None
        and config.microbatches >= 1
        and not config.unbound
        and not config.equal_minibatch
        and (
            (config.owner == "ours" and config.schedule in (*OURS_FLUSHED, "async"))
            or (config.owner == "torch" and config.schedule in SCHEDULES)
        )
    )
    if not known:
        raise argparse.ArgumentTypeError(
            f"a configuration is ours-<{'|'.join((*OURS_FLUSHED, 'async'))}>-<m> or "
            f"torch-<{'|'.join(SCHEDULES)}>-<m> (config: {name}); e.g. torch-ZBVZeroBubble-8"
        )
    return name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--configs",
        nargs="+",
        type=config_name,
        help="default: ours-async-1, and at every --microbatches our flushed modes and every "
        "torch schedule",
    )
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES))
    parser.add_argument("--microbatch", type=int, help="rows per microbatch")
    parser.add_argument("--steps", type=int, help="batches per run (default: few, see FAST)")
    parser.add_argument("--warmup", type=int, help="batches not timed")
    for name in ("width", "depth", "sequence", "heads", "vocab"):
        parser.add_argument(f"--{name}", type=int, help="the workload's size (its default)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (the tests)")
    parser.add_argument("--worker", choices=["torch"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cost-rows", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--default-allocator", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--unbound", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in FAST[args.workload].items():
        if getattr(args, name) is None and not args.quick:
            setattr(args, name, value)
    work.fill_defaults(args)
    if args.configs is None:
        args.configs = default_configs(tuple(args.microbatches))
    if args.quick:
        args.repeats = 1
    args.cost_rows, args.sync, args.simulate = [], None, False
    return args


def main() -> None:
    args = parse_args()
    if args.worker is None:
        drive(args)
        return
    torch.set_num_threads(1)
    retain_freed_memory()
    bind_rank(harness.launched_rank())
    result = run_torch(args)
    harness.write_result(args.out, result)


if __name__ == "__main__":
    main()
