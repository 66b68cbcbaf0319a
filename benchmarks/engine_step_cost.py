"""Fixed cost per step of the engine: ``pl_pipedream.Pipeline`` on 2 gloo ranks with a trivial
model (Linear(16)-ReLU | Linear(16), batch 8), so that a step is almost all overhead.

``python benchmarks/engine_step_cost.py`` prints rank 0's wall and CPU milliseconds per step over
the steps after ``--warmup``, for ``--sync`` (async and flush by default) with the default
``replan`` (``"off"``). ``--code A B`` runs each configuration once per checkout (as
``PYTHONPATH``), alternately, ``--repeats`` times, each run in fresh processes, so that two trees
can be compared on a shared machine; the summary gives each one's median and range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import harness

WIDTH, BATCH = 16, 8


def _rank(rank: int, world: int, sync: str, steps: int, warmup: int) -> tuple[float, float]:
    """This rank's wall and CPU ms per step (``harness.fork_ranks`` forms the group)."""
    import torch
    from torch import nn

    from pl_pipedream import Pipeline

    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()), nn.Linear(WIDTH, WIDTH)
    )
    pipeline = Pipeline(
        layers,
        nn.functional.mse_loss,
        lambda p: torch.optim.SGD(p, lr=0.05),
        sync=sync,
        balance=[1, 1],
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, BATCH, WIDTH, generator=g)
    y = x @ torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5
    wall, cpu = [], []
    for i in range(steps):
        pipeline.train_step((x[i], y[i]))
        wall.append(time.perf_counter())
        cpu.append(time.process_time())
    pipeline.drain()
    pipeline.close()
    n = steps - 1 - warmup
    return (wall[-1] - wall[warmup]) / n * 1e3, (cpu[-1] - cpu[warmup]) / n * 1e3


def run(sync: str, steps: int, warmup: int) -> tuple[float, float, float]:
    """Rank 0's wall ms/step, rank 0's and rank 1's CPU ms/step."""
    (wall, cpu0), (_, cpu1) = harness.fork_ranks(2, _rank, sync, steps, warmup)
    return wall, cpu0, cpu1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sync", nargs="*", default=["async", "flush"])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--code", nargs="*", default=[], help="checkouts to compare (PYTHONPATH)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child run: print one result
    args = parser.parse_args()
    if args.one:
        wall, cpu0, cpu1 = run(args.one, args.steps, args.warmup)
        print(f"RESULT {wall:.4f} {cpu0:.4f} {cpu1:.4f}", flush=True)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    found: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for _ in range(args.repeats):
        for sync in args.sync:
            for code in args.code or [""]:
                if code:
                    env["PYTHONPATH"] = code
                command = [sys.executable, __file__, "--one", sync, "--steps", str(args.steps)]
                command += ["--warmup", str(args.warmup)]
                out = subprocess.run(command, env=env, capture_output=True, text=True)
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
                if not lines:
                    raise RuntimeError(
                        f"a run failed ({code or 'this tree'}, {sync}): {out.stderr[-2000:]}"
                    )
                wall, cpu0, cpu1 = (float(v) for v in lines[0].split()[1:])
                found.setdefault((sync, code), []).append((wall, cpu0, cpu1))
                print(
                    f"[{code or '.'}] {sync}: {wall:.3f} ms/step, CPU {cpu0:.3f} / {cpu1:.3f}",
                    flush=True,
                )
    print(
        "sync   tree                          ms/step: wall (range)    CPU rank 0 (range)"
        "       CPU rank 1 (range)"
    )
    for (sync, code), values in found.items():
        cells = []
        for i in range(3):
            column = [v[i] for v in values]
            cells.append(f"{statistics.median(column):6.3f} ({min(column):.3f}-{max(column):.3f})")
        print(f"{sync:<6} {code or '.':<29} " + "   ".join(cells))


if __name__ == "__main__":
    main()
