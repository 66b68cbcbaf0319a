"""Throughput of PipeDreamStrategy on 2 CPU ranks, against torch's pipelining and one process.

Run: python benchmarks/pipeline_throughput.py --workload mlp|gpt|overhead --repeats 3

This file is the driver; the configurations, workers, figures and tables are in
benchmarks/throughput_configs.py, _workers.py, _model.py and _report.py, the launch in
benchmarks/harness.py.

Workloads (benchmarks/throughput_workloads.py): ``mlp`` (8 x Linear(1024), 128 rows per
microbatch), ``gpt`` (a GPT-style decoder: embedding, 4 pre-LayerNorm blocks of width 256 over
windows of 128 tokens, head; 8 windows per microbatch) and ``overhead`` (Linear(16)-ReLU-Linear(16),
8 rows, 600 steps: the fixed cost of a step and of a microbatch). Half the blocks per stage, plain
SGD, every process on one thread. Configurations, interleaved, each run ``--repeats`` times in
fresh processes:

* ``single``: a plain PyTorch loop in one process, the reference for efficiency;
  ``lightning-1``: the same model and samples through a one-process Lightning ``Trainer``;
  ``single-x2``: two independent copies of ``single`` at once (what sharing the 2 cores costs).
* ``ours-<sync>-<m>``: ``Trainer(strategy=PipeDreamStrategy(sync=..., balance=[...],
  microbatches=m), accelerator="cpu", devices=2)``; Lightning's script launcher re-runs this file
  for rank 1. The modes of two stages per rank (``interleaved``, ``zbv``) get the blocks in
  quarters (``stage_count``), placed by the strategy; they are not simulated (``--simulate``
  measures one stage per rank).
* ``torch-<schedule>-<m>``: ``torch.distributed.pipelining`` (``PipelineStage`` over gloo,
  ``Schedule1F1B`` or ``ScheduleGPipe`` with m microbatches), one optimizer step per batch.

Two views. The headline is at EQUAL MICROBATCH: every configuration's matrix products run on
``--microbatch`` rows, so a configuration with m microbatches trains batches of m x
``--microbatch`` rows (``single``, ``lightning-1`` and ``ours-async-1`` batches of
``--microbatch``). The second view, EQUAL MINIBATCH (configurations ending in ``-minibatch``),
gives every configuration batches of ``--microbatch`` rows, which those with m microbatches split
into m microbatches of ``--microbatch / m`` rows (smaller, less efficient matrix products).
Throughput is compared per sample.

Time is rank 0's wall clock from the end of batch ``--warmup - 1`` to the end of the
second-to-last batch (the last one also drains an async pipeline). Efficiency is the one-process
time per sample over twice the pipeline's. The simulator predicts each pipeline's time per batch
from per-stage forward, backward, step, stash-copy and gradient-sum times, each stage measured
alone in its own process while the other stage is measured in another (both cores busy, as in
the pipeline), and from the bandwidth of gloo on loopback measured at each message size. For our
configurations the executor's timeline splits each rank's time per batch by action kind. All of
this runs for every workload (``--no-simulate`` leaves out the stage costs and the simulator).
"""

# The figures below were taken before issue 15, at EQUAL MINIBATCH with the MLP at width 2048
# (the equivalent command now: --workload mlp --width 2048 --configs single single-x2 lightning-1
# ours-async-1 ours-async-1-unbound ours-async-4-minibatch ours-flush-8-minibatch
# ours-gpipe-8-minibatch torch-1F1B-8-minibatch torch-GPipe-8-minibatch; the table's names are
# the old ones, "torch best" is torch's best schedule at equal minibatch).
#
# Measured on the project machine, an AMD EPYC VM (2 shared cores; torch 2.13 CPU, lightning
# 2.6), at commit 87f95b5 (ranks bound to cores of their own):
#
# $ OMP_NUM_THREADS=1 python benchmarks/pipeline_throughput.py --repeats 3 --steps 32
# config               samples/s ms/batch cores  kflt  work effic. sim ms ratio sim(run) ratio
# single                   155.9    820.9  1.00   0.2  1.00         (153.3, 155.9, 159.8)
# single-x2                293.9    435.5  1.99   0.7  0.95  0.943  (271.5, 303.2, 293.9)
# lightning-1              154.2    829.9  1.00   0.2  0.99
# ours-async-1             280.0    457.2  1.92   1.0  0.94  0.898  441.2  1.04  444.2  1.03
# ours-async-1-unbound     284.0    450.7  1.91   1.0  0.95  0.911  441.2  1.02  432.5  1.04
# ours-async-4             184.5    693.6  1.91   0.7  0.62  0.592  622.5  1.11  681.2  1.02
# ours-flush-8             150.7    849.3  1.72   0.5  0.56  0.483  885.2  0.96  811.1  1.05
# ours-gpipe-8             153.7    832.9  1.74   0.3  0.57  0.493  884.4  0.94  816.2  1.02
# torch-1F1B-8             123.1   1039.7  1.72   0.8  0.46  0.395  977.2  1.06
# torch-GPipe-8            115.0   1113.5  1.72   0.6  0.43  0.369  981.5  1.13
# targets, median of per-repeat ratios: async-1 efficiency 0.898 (0.890, 0.898, 0.918: MISSED
#   by 0.002); async-1 / torch best 2.229 (met); flush-8 / torch-1F1B-8 1.224 (1.282, 1.130,
#   1.224: met). Bound over unbound async-1: 0.982 (0.982, 0.973, 1.033).
#
# Before and after the restructure of issues 10 and 11 (175e7ba against 0646e4a), interleaved,
# three rounds of `--configs single ours-async-1 ours-flush-8 torch-1F1B-8 --repeats 1 --steps 24`
# on another 2-core VM (one process: 501-522 samples/s): async-1 efficiency 0.924, 0.916, 0.896
# before and 0.928, 0.876, 0.956 after; flush-8 / torch-1F1B-8 1.19, 1.20, 1.10 before and 1.18,
# 1.17, 1.18 after.
#
# Earlier runs of the same command: 6dd8aff (before binding): async-1 efficiency 0.809 (0.809,
# 0.922, 0.767), flush-8 / torch-1F1B-8 1.170; db06dee: 0.906 (0.914, 0.831, 0.932) and 1.128.
#
# Where the time goes:
# * async-1 runs at the pace of the last stage, which does 12 of a step's 23 matrix products
#   (the first stage computes no gradient for its input): at best 23 / 24 = 0.958 of twice one
#   process. Two busy cores of this VM also compute less than twice one: two independent copies
#   of the one-process loop (single-x2) reach 0.943 here (0.89-0.99 per repeat). Together these
#   put the ceiling near 0.90-0.92; the last stage's forward and backward (151 / 277 ms per
#   batch) match its cost measured alone (148 / 279 ms), and its gaps between actions are about
#   3 ms per batch ("outside" also counts the actions that straddle the window's edges).
# * Some runs are slower still: one process computes 12-25% slower for the whole run. Two
#   independent copies of the one-process loop show it too when the kernel places them (4 of 6
#   runs), and not when each is bound to a core (0 of 6; the bound single-x2 of repeat 0 above
#   was slowish), hence the binding. Bound async-1 pipelines still had 3 slow runs in 18 (and
#   one where both ranks ran 1.8x slower), against 11 in 30 unbound; the slow rank's core was
#   100% busy: the VM's core itself ran slower. No async-1 run of the table above was slow.
# * Weight stashing costs no copy with SGD: a stashed version shares the live storage and the
#   update writes the new weights out of place (before: 10-12 ms of copy per minibatch on
#   stage 0, the "stash copy" column of the stage costs).
# * flush-8/gpipe-8: the Linear layers add each microbatch's weight gradients into the batch's
#   sum inside the GEMM (addmm, beta=1) instead of writing a fresh gradient and adding it (torch
#   pays one gradient sum, 12-14 ms per stage, for every microbatch but the first).
# * Earlier changes this figure reflects: one transfer per message with receives posted ahead,
#   no per-step flush, freed memory kept, the loss seed carrying 1/m.

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import harness
import throughput_workloads as work
import torch
from throughput_configs import (
    CONFIGS,
    DEFAULT_CONFIGS,
    NUM_STAGES,
    QUICK_CONFIGS,
    Config,
    Result,
    config_name,
)
from throughput_model import measure, median_costs, stage_costs_of
from throughput_report import print_costs, print_profile, print_tables, print_targets
from throughput_workers import WORKERS, bind_rank

from pl_pipedream.runtime.memory import retain_freed_memory

SCRIPT = Path(__file__).resolve()


SIZE_ARGUMENTS = ("width", "depth", "microbatch", "steps", "warmup", "sequence", "heads", "vocab")


def launch(
    args: argparse.Namespace,
    worker: str,
    extra: list[str],
    ranks: int,
    expected: int = 0,
    script: Path = SCRIPT,
) -> list[Result]:
    """Run ``worker`` of ``script`` (this one by default) in ``ranks`` processes that this
    script starts; return the results of ``expected`` ranks (default ``ranks``; Lightning starts
    our pipeline's rank 1 itself). A worker that fails ends the others and exits with its log
    (``harness.start_ranks``)."""
    command = [sys.executable, str(script), "--worker", worker, *workload_args(args), *extra]
    return harness.start_ranks(command, ranks, args.timeout, expected)


def workload_args(args: argparse.Namespace) -> list[str]:
    given = [f"--workload={args.workload}"]
    given += [f"--{name}={getattr(args, name)}" for name in SIZE_ARGUMENTS]
    given.append("--cost-rows=" + ",".join(map(str, args.cost_rows)))
    flags = {"--default-allocator": args.default_allocator, "--unbound": args.unbound}
    return given + [flag for flag, on in flags.items() if on]


def run_config(args: argparse.Namespace, config: Config) -> list[Result]:
    rows = [f"--batch={config.rows(args)}"]
    if config.owner == "single":
        return launch(args, "single", rows, 1)
    if config.owner == "single-x2":  # two independent copies at once: what sharing costs
        return launch(args, "single", rows, 2)
    if config.owner == "lightning-1":
        return launch(args, "lightning", rows, 1)
    extra = [*rows, f"--m={config.microbatches}"]
    if config.owner == "ours":
        extra += [f"--sync={config.schedule}"] + (["--unbound"] if config.unbound else [])
        return launch(args, "lightning", extra, 1, NUM_STAGES)
    return launch(args, "torch", [*extra, f"--schedule={config.schedule}"], NUM_STAGES)


def drive(args: argparse.Namespace) -> None:
    print(f"$ {shlex.join(['OMP_NUM_THREADS=1', 'python', *sys.argv])}")
    print(
        f"{os.cpu_count()} cores, torch {torch.__version__}; {work.describe(args)}, "
        f"{args.microbatch} rows per microbatch, {args.steps} batches of which the first "
        f"{args.warmup} are not timed, SGD, 1 thread per process; allocator: "
        + ("glibc's defaults" if args.default_allocator else "freed memory kept, every process")
    )
    configs = [Config.parse(name) for name in args.configs]
    runs: dict[str, list[Result]] = {c.name: [] for c in configs}
    cost_runs, bandwidth_runs = [], []
    for repeat in range(args.repeats):
        if args.simulate:
            cost_runs.append(stage_costs_of(launch(args, "stage-costs", [], NUM_STAGES)))
            bandwidth_runs.append(launch(args, "bandwidth", [], NUM_STAGES)[0])
        for config in configs:
            results = run_config(args, config)
            runs[config.name].append(measure(args, config, results))
            print(
                f"  repeat {repeat}: {config.name:<24} {runs[config.name][-1]['samples']:8.1f} "
                f"samples/s, {runs[config.name][-1]['cores']:.2f} cores busy, "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    costs, bandwidth = None, None
    if args.simulate:
        costs, bandwidth = median_costs(cost_runs), median_costs(bandwidth_runs)
        print_costs(args, costs, bandwidth)
    print_tables(args, configs, runs, costs, bandwidth)
    print_targets(args, runs)
    print_profile(configs, runs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=work.WORKLOADS, default="mlp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--configs",
        nargs="+",
        type=config_name,
        help="default: the workload's; any of single, single-x2, lightning-1, "
        "ours-<sync>-<m>[-unbound][-minibatch], torch-<1F1B|GPipe>-<m>[-minibatch], e.g. "
        + " ".join(CONFIGS),
    )
    parser.add_argument("--width", type=int, help="default: the workload's")
    parser.add_argument("--depth", type=int, help="blocks (default: the workload's)")
    parser.add_argument("--microbatch", type=int, help="rows per microbatch (see the views)")
    parser.add_argument("--steps", type=int, help="batches per run")
    parser.add_argument("--warmup", type=int, help="batches not timed")
    parser.add_argument("--sequence", type=int, help="gpt: tokens per row")
    parser.add_argument("--heads", type=int, help="gpt: attention heads")
    parser.add_argument("--vocab", type=int, help="gpt: vocabulary size")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument(
        "--simulate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the stage costs and gloo's bandwidth every repeat and print the simulator's "
        "predictions (default: yes)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, a few configurations, 1 repeat: checks that everything runs (the tests)",
    )
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's allocator as it is in every process, ours included (by default every "
        "process keeps freed memory, as PipeDreamStrategy's ranks do)",
    )
    parser.add_argument(
        "--unbound",
        action="store_true",
        help="leave every process where the kernel places it, ours included (by default each "
        "rank of a configuration with 2 processes is bound to a core of its own, as "
        "PipeDreamStrategy binds its ranks)",
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cost-rows", help=argparse.SUPPRESS)
    parser.add_argument("--sync", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work.fill_defaults(args)
    if args.configs is None:
        args.configs = (QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)[args.workload]
    if args.quick:
        args.repeats = 1
    configs = [Config.parse(name) for name in args.configs]
    for config in configs:
        if config.rows(args) % config.microbatches:
            raise SystemExit(
                f"an equal-minibatch configuration splits --microbatch rows m ways "
                f"(microbatch: {args.microbatch}, {config.name}); give a --microbatch that "
                f"{config.microbatches} divides"
            )
    if args.cost_rows is None:
        args.cost_rows = sorted({c.microbatch_rows(args) for c in configs if c.piped})
    else:
        args.cost_rows = [int(rows) for rows in args.cost_rows.split(",") if rows]
    return args


def main() -> None:
    args = parse_args()
    if args.worker is None:
        drive(args)
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if not args.default_allocator:
        retain_freed_memory()
    if "RANK" in os.environ and not args.unbound:  # this script's ranks; Lightning's bind later
        bind_rank(harness.launched_rank())
    result = WORKERS[args.worker](args)
    harness.write_result(args.out, result)


if __name__ == "__main__":
    main()
