"""What keeping the measured times costs per training step, on one CPU thread.

Three costs, each measured here: (1) the executor recording its timeline (two clock readings and
one list append per action; ``record_timeline``), as the wall time per step of ``Pipeline`` on
one rank with it off and on, interleaved, medians of ``--repeats`` blocks of ``--steps`` steps;
(2) ``core.stage_clock.rank_times`` over a window of ``--window`` minibatches; (3) ``LayerClock``,
the per-layer forward hooks, per layer forward. Model: ``--layers`` x Linear(``--width``)-ReLU,
batch ``--batch`` in ``--microbatches`` microbatches, flush, SGD, on ``--device``.

Command: ``python benchmarks/stage_clock_cost.py`` (about 20 s); on a GPU
``python benchmarks/stage_clock_cost.py --device cuda --width 1024 --batch 256 --steps 100``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import harness
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.core.stage_clock import LayerClock, rank_times
from pl_pipedream.engine import Pipeline
from pl_pipedream.profile.graph import Profile
from pl_pipedream.runtime.streams import settle


def model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    )


def per_step(pipeline: Pipeline, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> float:
    settle(pipeline.device)
    start = time.perf_counter()
    for _ in range(steps):
        pipeline.train_step(batch)
    settle(pipeline.device)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    port = harness.free_port()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        layers = model(args.layers, args.width)
        optimizer = torch.optim.SGD(layers.parameters(), lr=1e-3)
        batch = (torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))
        pipeline = Pipeline(
            layers,
            nn.functional.mse_loss,
            optimizer,
            microbatches=args.microbatches,
            balance=[args.layers],
            device=args.device,
            divergence="off",
        )
        executor = pipeline._running().executor
        per_step(pipeline, batch, 50)  # warm up
        off, on = [], []
        for _ in range(args.repeats):
            executor.record_timeline = False
            off.append(per_step(pipeline, batch, args.steps))
            executor.record_timeline = True
            on.append(per_step(pipeline, batch, args.steps))
        events = executor.timeline
        actions = len(events) / (args.repeats * args.steps)
        names = [f"layer{i}" for i in range(args.layers)]
        profile = Profile.chain(
            [1.0] * args.layers, [2.0] * args.layers, [1.0] * args.layers, [0.0] * args.layers
        )
        start = time.perf_counter()
        for _ in range(100):
            rank_times(events, names, profile, 0, args.window)
        window_s = (time.perf_counter() - start) / 100
        x = torch.randn(args.batch // args.microbatches, args.width, device=args.device)
        plain = _forward_s(layers, x)
        clock = LayerClock({n: layers[i] for i, n in enumerate(names)})
        hooked = _forward_s(layers, x)
        clock.remove()
        pipeline.close()
    finally:
        dist.destroy_process_group()
    median_off, median_on = statistics.median(off), statistics.median(on)
    record = _recording_s()
    spread = lambda xs: ", ".join(f"{t * 1e3:.3f}" for t in xs)  # noqa: E731
    print(
        f"model: {args.layers} x Linear({args.width})-ReLU, batch {args.batch}, microbatches "
        f"{args.microbatches}, flush, 1 rank on {args.device}, 1 thread; {actions:.0f} actions "
        "per step"
    )
    print(f"step, timeline off      {median_off * 1e3:8.3f} ms   (blocks: {spread(off)})")
    print(f"step, timeline on       {median_on * 1e3:8.3f} ms   (blocks: {spread(on)})")
    print(
        f"recording alone         {record * 1e6:8.3f} us per action, "
        f"{record * actions * 1e6:.2f} us per step"
    )
    print(
        f"rank_times, window {args.window:<4} {window_s * 1e6:8.1f} us per check "
        f"over {len(events)} events"
    )
    hooks = hooked - plain
    per_layer = hooks / args.layers * 1e6
    print(
        f"LayerClock              {per_layer:8.2f} us per layer forward "
        f"({hooks * 1e6:.1f} us per microbatch forward of {args.layers} layers)"
    )


def _recording_s(repeats: int = 200_000) -> float:
    """The executor's recording statements alone: one clock reading and one append per action
    beyond what it does anyway (``start`` is read either way)."""
    kept: list[tuple[object, float, float]] = []
    action = object()
    start = time.perf_counter()
    for _ in range(repeats):
        began = time.perf_counter()
        kept.append((action, began, time.perf_counter()))
    recording = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        began = time.perf_counter()
    return (recording - (time.perf_counter() - start)) / repeats


def _forward_s(layers: nn.Sequential, x: torch.Tensor, repeats: int = 2000) -> float:
    with torch.no_grad():
        for _ in range(100):
            layers(x)
        start = time.perf_counter()
        for _ in range(repeats):
            layers(x)
    return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    main()
