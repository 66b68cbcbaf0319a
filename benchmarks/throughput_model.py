"""pipeline_throughput's figures from the ranks' results: samples/s in the steady window, cores
busy, page faults, time per action kind, and the simulator's prediction of each pipeline from
stage costs (measured alone, or taken from the run's own action times).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import harness
import throughput_workloads as work
from throughput_configs import (
    KINDS,
    NUM_STAGES,
    Config,
    Result,
    stage_count,
    sync_of,
)

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import build, simulate


def stage_costs_of(results: list[Result]) -> Result:
    """{rows: [stage 0's costs, stage 1's, ...]} from the ranks' results."""
    return {rows: [result[rows] for result in results] for rows in results[0]}


def measure(args: argparse.Namespace, config: Config, results: list[Result]) -> Result:
    """Samples/s in rank 0's steady window (summed over the ranks of single-x2's independent
    copies), CPU cores the ranks kept busy, page faults per batch and rank, time by action kind."""
    first, last = args.warmup - 1, args.steps - 2
    window = harness.steady_window(results[0]["times"], args.steps, args.warmup)
    cores, faults, rates = 0.0, [], []
    for result in results:
        wall = result["times"][last] - result["times"][first]
        cores += (result["cpu"][last] - result["cpu"][first]) / wall
        faults.append((result["faults"][last] - result["faults"][first]) / (last - first))
        rates.append((last - first) * config.rows(args) / wall)
    return {
        "samples": sum(rates) if config.owner == "single-x2" else rates[0],
        "cores": cores,
        "faults": faults,
        "kinds": time_by_kind(results, window),
    }


def time_by_kind(results: list[Result], window: tuple[float, float, int]) -> list[dict[str, float]]:
    """Per rank, ms per batch spent in each action kind inside the window; the rest is 'outside'
    (Lightning's loop, data, splitting between segments)."""
    start, end, batches = window
    table = []
    for result in results:
        spent = dict.fromkeys(KINDS, 0.0)
        for kind, begin, finish in result.get("timeline", []):
            if begin >= start and finish <= end:
                spent[kind] += finish - begin
        row = {kind: 1e3 * value / batches for kind, value in spent.items()}
        row["outside"] = 1e3 * (end - start) / batches - sum(row.values())
        table.append(row)
    return table


def predict_ms_per_batch(
    args: argparse.Namespace,
    config: Config,
    costs: list[dict[str, float]],
    bandwidth: float,
    ours: bool = True,
) -> float:
    """The simulator's steady-state time per batch for this pipeline. Our weight stashing copies
    nothing with SGD (the update is written out of place) and our Linear layers sum a batch's
    weight gradients inside the GEMM; torch's schedules add every microbatch's gradients into
    ``.grad``, so for them every backward pass but one in m also pays one gradient sum (costs
    without ``copy``/``accumulate`` were measured in the run, where those are inside the action
    times already)."""
    sync, m = sync_of(config), config.microbatches
    plan = Plan.from_balance(work.balance(args))
    message = work.message_bytes(args, config.microbatch_rows(args))
    stages = tuple(replace(s, output_bytes=message if s.index == 0 else 0.0) for s in plan.stages)
    schedule = build(replace(plan, stages=stages), sync, 16, m)
    forward = [c["forward"] for c in costs]
    summed = ours and m > 1 and sync not in ("async", "vertical_sync")
    adds = 0.0 if ours else (m - 1) / m
    backward = [
        c.get("summed backward", c["backward"])
        if summed
        else c["backward"] + adds * c.get("accumulate", 0.0)
        for c in costs
    ]
    result = simulate(
        schedule,
        forward_ms=forward,
        backward_ms=backward,
        bandwidth=bandwidth,
        step_ms=max(c["step"] for c in costs),
    )
    return result.time_per_minibatch_ms * m


def run_costs(results: list[Result], config: Config) -> list[dict[str, float]]:
    """Per stage, ms per microbatch of forward and backward and per update of step as the
    pipeline ran them (median over repeats): the simulator fed these checks the schedule model
    by itself."""
    m = config.microbatches
    updates = m if sync_of(config) in ("async", "vertical_sync") else 1
    costs = []
    for rank in range(NUM_STAGES):
        spent = {k: statistics.median(r["kinds"][rank][k] for r in results) for k in KINDS}
        costs.append(
            {
                "forward": spent["FORWARD"] / m,
                "backward": sum(spent[k] for k in KINDS if k.startswith("BACKWARD")) / m,
                "step": spent["STEP"] / updates,
            }
        )
    return costs


def median_costs(runs: list[Result]) -> Result:
    """Field-wise median over repeats of the stage costs (or of the bandwidths)."""
    first = runs[0]
    if isinstance(first, dict) and all(isinstance(v, float) for v in first.values()):
        return {k: statistics.median(r[k] for r in runs) for k in first}
    if isinstance(first, list):
        return [median_costs([r[i] for r in runs]) for i in range(len(first))]  # type: ignore[return-value]
    return {k: median_costs([r[k] for r in runs]) for k in first}


def simulated(
    args: argparse.Namespace,
    config: Config,
    results: list[Result],
    costs: Result,
    bandwidth: Result,
) -> tuple[float | None, float | None]:
    """Predicted ms per batch from stage costs measured alone, and from this run's action
    times."""
    if not config.piped or (config.owner == "ours" and stage_count(config.schedule) > NUM_STAGES):
        return None, None  # the stage costs are measured for one stage per rank
    rows = str(config.microbatch_rows(args))
    ours = config.owner == "ours"
    alone = predict_ms_per_batch(args, config, costs[rows], bandwidth[rows], ours)
    if not ours:
        return alone, None
    return alone, predict_ms_per_batch(args, config, run_costs(results, config), bandwidth[rows])
