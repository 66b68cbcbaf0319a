"""pipeline_throughput's printed tables: the stage costs, both views' rows, the targets with
their verdicts, the overhead workload's fixed costs, and our pipeline's time by action kind.
"""

from __future__ import annotations

import argparse
import statistics

import throughput_workloads as work
from throughput_configs import (
    KINDS,
    NUM_STAGES,
    OVERHEAD_TARGET_MS,
    Config,
    Result,
)
from throughput_model import simulated


def print_costs(args: argparse.Namespace, costs: Result, bandwidth: Result) -> None:
    print(
        "\neach stage alone in its process, both at once; ms per microbatch (forward / backward / "
        "step / stash copy / gradient sum / backward summing Linear gradients in the GEMM):"
    )
    for rows in args.cost_rows:
        parts = [
            f"stage {s}: "
            + " / ".join(
                f"{c[k]:.1f}"
                for k in ("forward", "backward", "step", "copy", "accumulate", "summed backward")
            )
            for s, c in enumerate(costs[str(rows)])
        ]
        megabytes = work.message_bytes(args, rows) / 1e6
        print(
            f"  {rows} rows (a {megabytes:.2f} MB message over gloo loopback at "
            f"{bandwidth[str(rows)] / 1e9:.2f} GB/s): " + "; ".join(parts)
        )


def print_tables(
    args: argparse.Namespace,
    configs: list[Config],
    runs: dict[str, list[Result]],
    costs: Result | None,
    bandwidth: Result | None,
) -> None:
    median = {c: statistics.median(r["samples"] for r in rs) for c, rs in runs.items()}
    views = (
        (
            f"EQUAL MICROBATCH (headline): every matrix product on {args.microbatch} rows, a "
            f"configuration with m microbatches trains batches of m x {args.microbatch} rows",
            [c for c in configs if not c.equal_minibatch],
        ),
        (
            f"EQUAL MINIBATCH (second view): batches of {args.microbatch} rows, split into m "
            f"microbatches of {args.microbatch} / m rows",
            [c for c in configs if c.equal_minibatch],
        ),
    )
    for title, chosen in views:
        if not chosen:
            continue
        print(f"\n{title}; medians over repeats, per sample:")
        sim = f" {'sim ms':>6} {'ratio':>5} {'sim(run)':>8} {'ratio':>5}" if costs else ""
        print(
            f"{'config':<24} {'samples/s':>9} {'ms/batch':>8} {'ms/mb':>6} {'cores':>5} "
            f"{'kflt':>5} {'work':>5} {'effic.':>6} {'/x2':>5}{sim}  every repeat"
        )
        for config in chosen:
            print_row(args, config, runs, median, costs, bandwidth)
    print(
        "ms/mb: ms per microbatch; cores: CPU seconds of all ranks per wall second; kflt:\n"
        "thousands of page faults per batch (all ranks); work: one process's CPU time per sample\n"
        "over this one's; effic.: samples/s over twice single's; /x2: efficiency over\n"
        "single-x2's; sim: predicted ms per batch from stage costs measured alone; sim(run):\n"
        "from the action times of this run; ratio: measured / predicted"
    )


def print_row(
    args: argparse.Namespace,
    config: Config,
    runs: dict[str, list[Result]],
    median: dict[str, float],
    costs: Result | None,
    bandwidth: Result | None,
) -> None:
    results, rate = runs[config.name], median[config.name]
    single, pair = median.get("single"), median.get("single-x2")
    cores = {c: statistics.median(r["cores"] for r in rs) for c, rs in runs.items()}
    ms = 1e3 * config.rows(args) / rate
    faults = statistics.median(sum(r["faults"]) for r in results) / 1e3
    cells = [
        f"{config.name:<24} {rate:9.1f} {ms:8.1f} {ms / config.microbatches:6.2f} "
        f"{cores[config.name]:5.2f} {faults:5.1f}"
    ]
    if single:  # CPU time per sample of one process over this configuration's
        cells.append(f"{cores['single'] / single / (cores[config.name] / rate):5.2f}")
    else:
        cells.append(" " * 5)
    both = config.piped or config.owner == "single-x2"
    cells.append(f"{rate / (2 * single):6.3f}" if single and both else " " * 6)
    cells.append(f"{rate / pair:5.3f}" if pair and both else " " * 5)
    if costs is not None and bandwidth is not None:
        for predicted in simulated(args, config, results, costs, bandwidth):
            cells.append(f"{predicted:6.1f} {ms / predicted:5.2f}" if predicted else " " * 12)
    values = ", ".join(f"{r['samples']:.1f}" for r in results)
    print(" ".join(cells) + f"  {values}")


def print_targets(args: argparse.Namespace, runs: dict[str, list[Result]]) -> None:
    """Each target's ratio within every repeat (configurations of one repeat ran back to back),
    and the median of those; a check whose configurations were not run is left out. The
    overhead workload has targets of its own (ms per step and microbatch): the throughput
    targets are for workloads whose compute dominates."""
    if args.workload == "overhead":
        print_overhead(args, runs)
        return

    def rate(*names: str) -> list[float] | None:
        if not all(name in runs for name in names):
            return None
        return [
            max(r["samples"] for r in group)
            for group in zip(*(runs[n] for n in names), strict=True)
        ]

    def ratio(
        top: list[float] | None, bottom: list[float] | None, factor: float = 1.0
    ) -> list[float] | None:
        if top is None or bottom is None:
            return None
        return [a / (factor * b) for a, b in zip(top, bottom, strict=True)]

    torch_schedules = [
        n for n in ("torch-1F1B-8-minibatch", "torch-GPipe-8-minibatch") if n in runs
    ]
    torch_best = rate(*torch_schedules) if torch_schedules else None  # best of the two per repeat
    async1 = rate("ours-async-1")
    checks = [
        ("async-1 / torch-1F1B-8 >= 1.10 (ideal 1.125)", ratio(async1, rate("torch-1F1B-8")), 1.10),
        ("flush-8 / torch-1F1B-8 >= 1.0", ratio(rate("ours-flush-8"), rate("torch-1F1B-8")), 1.0),
        ("async-1 efficiency / single-x2's >= 0.92", ratio(async1, rate("single-x2")), 0.92),
        ("async-1 efficiency", ratio(async1, rate("single"), 2.0), None),
        ("async-4 / torch-1F1B-8", ratio(rate("ours-async-4"), rate("torch-1F1B-8")), None),
        ("gpipe-8 / torch-GPipe-8", ratio(rate("ours-gpipe-8"), rate("torch-GPipe-8")), None),
        ("single-x2 efficiency", ratio(rate("single-x2"), rate("single"), 2.0), None),
        ("lightning-1 / single", ratio(rate("lightning-1"), rate("single")), None),
        ("async-1 bound / unbound", ratio(async1, rate("ours-async-1-unbound")), None),
        ("async-1 / torch best (equal minibatch)", ratio(async1, torch_best), None),
        (
            "flush-8 / torch-1F1B-8 (equal minibatch)",
            ratio(rate("ours-flush-8-minibatch"), rate("torch-1F1B-8-minibatch")),
            None,
        ),
    ]
    ran = [(label, values, goal) for label, values, goal in checks if values is not None]
    if not ran:  # a bare heading would look like a list that lost its rows
        print(
            "\ntargets: none printed, no pair of configurations they compare ran (e.g. "
            "ours-async-1 with torch-1F1B-8, single or single-x2; the default --configs run them)"
        )
        return
    print(
        "\ntargets (met/MISSED against the goal; a row without a goal is for information), "
        "median of per-repeat ratios, at equal microbatch unless labelled:"
    )
    for label, values, goal in ran:
        print_check(label, values, goal, higher=True)


def print_check(label: str, values: list[float], goal: float | None, higher: bool) -> None:
    value = statistics.median(values)
    met = goal is not None and (value >= goal if higher else value <= goal)
    verdict = "" if goal is None else "met" if met else "MISSED"
    each = ", ".join(f"{v:.3f}" for v in values)
    print(f"  {label:<44} {value:7.3f}  {verdict:<6}  ({each})")


def print_overhead(args: argparse.Namespace, runs: dict[str, list[Result]]) -> None:
    """ms per step (one microbatch) or per microbatch, per configuration; targets for ours."""
    print("\nfixed cost, ms per microbatch (per step where m = 1), median over repeats:")
    goals = {"ours-async-1": OVERHEAD_TARGET_MS, "ours-flush-1": OVERHEAD_TARGET_MS}
    goals["ours-flush-8"] = OVERHEAD_TARGET_MS
    for name, results in runs.items():
        config = Config.parse(name)
        ms = [1e3 * config.microbatch_rows(args) / r["samples"] for r in results]
        goal = goals.get(name)
        label = f"{name} <= {goal}" if goal else name
        print_check(label, ms, goal, higher=False)


def print_profile(configs: list[Config], runs: dict[str, list[Result]]) -> None:
    print("\nour pipeline, ms per batch and rank in the steady window (median over repeats):")
    short = (
        "fwd",
        "bwd",
        "bwd-in",
        "bwd-wt",
        "step",
        "recv-act",
        "recv-grad",
        "send-act",
        "send-grad",
        "outside",
    )
    print(f"  {'config':<24} rank " + " ".join(f"{s:>9}" for s in short))
    for config in configs:
        if config.owner != "ours":
            continue
        for rank in range(NUM_STAGES):
            values = [
                statistics.median(r["kinds"][rank][kind] for r in runs[config.name])
                for kind in (*KINDS, "outside")
            ]
            print(f"  {config.name:<24} {rank:>4} " + " ".join(f"{v:9.1f}" for v in values))
