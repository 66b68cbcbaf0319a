"""Re-planning a running pipeline with drifting costs: samples/s of ``replan="auto"`` against
``"off"`` and against the best static plan in hindsight, on gloo ranks of this machine.

Each run starts ``--ranks`` processes (one thread each) that train a chain of ``--layers`` blocks
with ``pl_pipedream.Pipeline`` in ``--sync`` mode, ``--microbatches`` microbatches of ``--batch``
rows in all, from an equal split, for ``--steps`` steps. A block is Linear(``--width``)-Tanh
whose work is, with ``--work sleep`` (the default), a sleep of ``--cost-ms`` in its forward and
twice that in its backward: the machine's cores are shared with other jobs, and sleeps keep the
figures repeatable while the engine, the measurement, the decision and the moves are the real
ones; ``--work matmul`` repeats the Linear instead. Scenarios:

* ``slow-rank``: from the middle of the run the last rank is ``--slow`` times slower. A global
  forward hook sleeps after each pipeline layer the rank runs ``slow - 1`` times the layer's
  forward time, and a hook on its output as much again for twice that in the backward, so the
  slowdown follows the layers the rank holds after a move, as a slower or shared device would.
* ``costly-layer``: the second-to-last layer's cost grows linearly from 1x to ``--grow`` x over
  the run, wherever it runs.

``off`` trains on the equal split throughout; ``auto`` re-plans every ``--every`` steps
(threshold 0.05); ``static`` runs each plan that ``auto`` used from the start with ``"off"``
and keeps the fastest by median. Each configuration runs ``--repeats`` times, interleaved (one
round: off, auto, each static plan), and the table gives medians and ranges. Throughput is rank
0's samples over the wall time of the training loop (moves included). For each auto run the
seconds are split into the first half, the slowed steps up to the first move, the moves, and the
rest. Targets, read on the medians: ``auto`` >= 1.3x ``off`` for the slowed rank, and ``auto``
within 10% of the best static plan.

Command: ``python benchmarks/replan_throughput.py --sync async`` (or ``flush``; about 3-4
minutes on two shared cores); ``--tiny`` for a quick check of the harness.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import harness
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream import Pipeline
from pl_pipedream.planner.plan import Plan

SCENARIOS = ("slow-rank", "costly-layer")


class Work(torch.autograd.Function):
    """Identity that sleeps ``seconds`` in the forward and twice that in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class Block(nn.Module):
    """Linear-Tanh doing ``repeat`` units of work: sleeps of ``cost`` seconds (``cost`` > 0), or
    the Linear run ``repeat`` times (the extra runs add zero)."""

    def __init__(self, width: int, cost: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.cost, self.repeat = cost, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.cost > 0:
            y = Work.apply(y, self.cost * self.repeat)
        else:
            for _ in range(self.repeat - 1):
                y = y + 0.0 * self.linear(x)
        return torch.tanh(y)


class SlowDown:
    """Global hooks: after each forward of one of ``layers``, sleep ``extra`` times its time,
    and in its backward ``extra`` times twice that."""

    def __init__(self, layers: Sequence[nn.Module], extra: float) -> None:
        self.ids, self.extra, self.started = {id(m) for m in layers}, extra, 0.0
        self.handles = [
            nn.modules.module.register_module_forward_pre_hook(self._start),
            nn.modules.module.register_module_forward_hook(self._stop),
        ]

    def _start(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.ids:
            self.started = time.perf_counter()

    def _stop(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in self.ids:
            seconds = self.extra * (time.perf_counter() - self.started)
            time.sleep(seconds)
            if output.requires_grad:
                output.register_hook(lambda grad: time.sleep(2 * seconds))


def _run(rank: int, world: int, o: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    cost = o["cost_ms"] / 1e3 if o["work"] == "sleep" else 0.0
    layers = nn.Sequential(*[Block(o["width"], cost) for _ in range(o["layers"])])
    costly = layers[o["layers"] - 2]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(o["batch"], o["width"], generator=generator)
    batch = (x, torch.randn(o["batch"], o["width"], generator=generator))
    pipeline = Pipeline(
        layers,
        nn.functional.mse_loss,
        lambda params: torch.optim.SGD(params, lr=0.01),
        sync=o["sync"],
        microbatches=o["microbatches"],
        plan=Plan.from_dict(o["plan"]),
        replan=o["mode"],
        replan_every=o["every"],
        replan_threshold=0.05,
        timeout=120.0,
    )
    steps, slow, ends = o["steps"], None, []
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        if o["scenario"] == "costly-layer":
            costly.repeat = 1 + round((o["grow"] - 1) * step / max(steps - 1, 1))
        elif step == steps // 2 and rank == world - 1:
            slow = SlowDown(list(layers), o["slow"] - 1)
        pipeline.train_step(batch)
        ends.append(time.perf_counter() - start)
    pipeline.drain()  # the asynchronous modes keep minibatches in flight
    seconds = time.perf_counter() - start
    records = pipeline.replanner.records
    pipeline.close()
    if slow is not None:
        for handle in slow.handles:
            handle.remove()
    return {
        "samples_per_s": steps * o["batch"] / seconds,
        "plans": [r["new_plan"] for r in records],
        "moves": [(r["step"], r["seconds"]) for r in records],
        "final": pipeline.plan.to_dict(),
        "ends": ends,  # seconds from the start to the end of each step (rank 0's)
    }


def launch(options: dict[str, Any], ranks: int) -> dict[str, Any]:
    """Rank 0's result of one run on ``ranks`` fresh processes."""
    result = harness.fork_ranks(ranks, _run, options)[0]
    print(
        f"  {options['scenario']} {options['mode']:<4} {layout(options['plan']):<10} "
        f"{result['samples_per_s']:6.0f} samples/s"
        + (f", moves {[layout(p) for p in result['plans']]}" if result["plans"] else ""),
        file=sys.stderr,
        flush=True,
    )
    return result


def layout(plan: dict[str, Any]) -> str:
    return "|".join(
        f"{s['nodes'][0]}-{s['nodes'][-1]}" + (f"x{s['replicas']}" if s["replicas"] > 1 else "")
        for s in plan["stages"]
    )


def scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """off, auto and every static plan auto used, ``--repeats`` rounds, interleaved: each round
    runs off, auto, then each plan auto has used so far with ``"off"``; a plan first used in a
    later round is topped up to ``--repeats`` runs at the end. Medians and ranges of samples/s."""
    per_stage = [args.layers // args.ranks] * args.ranks
    per_stage[-1] += args.layers - sum(per_stage)
    first = Plan.from_balance(per_stage).to_dict()
    names = ("width", "layers", "batch", "microbatches", "steps", "work", "cost_ms", "sync")
    base = {k: getattr(args, k) for k in names}
    base |= {"every": args.every, "slow": args.slow, "grow": args.grow, "scenario": name}
    plans = {layout(first): first}
    runs: dict[str, list[float]] = {"off": [], "auto": []}
    statics: dict[str, list[float]] = {layout(first): runs["off"]}
    autos = []
    for _ in range(args.repeats):
        runs["off"].append(
            launch({**base, "mode": "off", "plan": first}, args.ranks)["samples_per_s"]
        )
        auto = launch({**base, "mode": "auto", "plan": first}, args.ranks)
        runs["auto"].append(auto["samples_per_s"])
        autos.append(auto)
        for plan in auto["plans"]:
            plans.setdefault(layout(plan), plan)
        for key, plan in plans.items():
            if key != layout(first):
                run = launch({**base, "mode": "off", "plan": plan}, args.ranks)
                statics.setdefault(key, []).append(run["samples_per_s"])
    for key, values in statics.items():
        while len(values) < args.repeats:
            values.append(
                launch({**base, "mode": "off", "plan": plans[key]}, args.ranks)["samples_per_s"]
            )
    median = {key: statistics.median(values) for key, values in statics.items()}
    best = max(median, key=median.__getitem__)
    return {
        "scenario": name,
        "off": statistics.median(runs["off"]),
        "auto": statistics.median(runs["auto"]),
        "static": median[best],
        "static_plan": best,
        "statics": median,
        "runs": {**runs, **{f"static {k}": v for k, v in statics.items()}},
        "moves": [a["moves"] for a in autos],
        "plans": [[layout(first)] + [layout(p) for p in a["plans"]] for a in autos],
        "segments": [segments(a, args) for a in autos],
    }


def segments(auto: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Where an auto run's seconds went: the steps before the middle, the middle up to the first
    move's step, the moves themselves, and the rest."""
    ends, half = auto["ends"], args.steps // 2
    first = next((step for step, _ in auto["moves"] if step > half), None)
    moved = sum(seconds or 0.0 for _, seconds in auto["moves"])
    upto = ends[first - 1] if first is not None else ends[-1]
    return {
        "before": ends[half - 1],
        "until_move": upto - ends[half - 1],
        "moves": moved,
        "after": ends[-1] - upto - (moved if first is not None else 0.0),
        "first_move_step": float(first or 0),
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--slow", type=float, default=3.0)
    parser.add_argument("--grow", type=float, default=6.0)
    parser.add_argument("--sync", default="flush")
    parser.add_argument("--work", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--cost-ms", type=float, default=2.0, help="a block's forward sleep")
    parser.add_argument("--scenario", choices=(*SCENARIOS, "both"), default="both")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long check of the harness")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.batch, args.steps, args.every = 4, 16, 8, 12, 3
        args.repeats = 1
    names = SCENARIOS if args.scenario == "both" else (args.scenario,)
    results = [scenario(name, args) for name in names]
    print(
        f"{args.sync}, {args.steps} steps, medians (ranges) of samples/s over {args.repeats} runs"
    )
    print(
        "scenario      off             auto            static (plan)"
        "               auto/off  auto/static"
    )
    for r in results:
        best = r["runs"][f"static {r['static_plan']}"]
        print(
            f"{r['scenario']:<12}  {harness.spread(r['runs']['off']):<15} "
            f"{harness.spread(r['runs']['auto']):<15} {harness.spread(best)} ({r['static_plan']})"
            f"  {r['auto'] / r['off']:8.2f}  {r['auto'] / r['static']:11.2f}"
        )
        for plans, moves, part in zip(r["plans"], r["moves"], r["segments"], strict=True):
            line = f"  auto {' -> '.join(plans)} at steps {[step for step, _ in moves]}"
            if r["scenario"] == "slow-rank":
                line += (
                    f"; seconds: first half {part['before']:.2f}, then to the first move"
                    f" {part['until_move']:.2f}, moves {part['moves']:.2f},"
                    f" rest {part['after']:.2f}"
                )
            print(line)
    for r in results:
        gain, near = r["auto"] / r["off"], r["auto"] / r["static"]
        if r["scenario"] == "slow-rank":
            print(f"slow-rank: auto/off {gain:.2f} >= 1.3: {'met' if gain >= 1.3 else 'missed'}")
        print(
            f"{r['scenario']}: auto/static {near:.2f} >= 0.9: {'met' if near >= 0.9 else 'missed'}"
        )
    if args.json:
        harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
