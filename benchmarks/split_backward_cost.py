"""What a split backward's two halves cost against one whole backward, in one process.

Run: OMP_NUM_THREADS=1 python benchmarks/split_backward_cost.py

One stage of the mlp workload (4 x Linear(1024) with ReLU, 128 rows per microbatch, 8
microbatches per batch) run by a ``StageExecutor`` as the last stage of 2 (it receives
activations and computes the loss) and as the first (it receives gradients): the CPU time of
the ``BACKWARD`` actions under ``flush`` against the ``BACKWARD_INPUT`` and ``BACKWARD_WEIGHT``
actions under ``zero_bubble``, per batch, median over batches. CPU time, not wall time: the
figure is the work each half does, which a shared machine does not change as it changes the
wall clock. The forwards and the step are not timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.frames import Message
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import SyncMode, update_settings

K = ActionKind


def make_stage(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))
    )


def _actions(stage: int, batch: int):  # type: ignore[no-untyped-def]
    """Actions of ``batch`` on ``stage``: on version ``batch`` unless given."""

    def act(kind: ActionKind, i: int | None, version: int = batch) -> Action:
        return Action(kind, stage, stage, 0, i, batch if i is not None else None, version)

    return act


def batch_cost(sync: str, stage: int, args: argparse.Namespace) -> dict[str, float]:
    """ms of CPU time per batch in each backward action kind (median over batches)."""
    m = args.microbatches
    executor = StageExecutor(
        make_stage(args.width, args.layers),
        stage,
        stage,
        2,
        Channel(stage, torch.device("cpu"), timeout=5.0),
        update_settings(SyncMode(sync), m, 1),
    )
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.rows, args.width, generator=generator) for _ in range(m)]
    ys = [torch.randn(args.rows, args.width, generator=generator) for _ in range(m)]
    feed = Feed(lambda i: xs[i % m], lambda out, i: nn.functional.mse_loss(out, ys[i % m]))
    kinds = [K.BACKWARD] if sync == "flush" else [K.BACKWARD_INPUT, K.BACKWARD_WEIGHT]
    spent: dict[str, list[float]] = {kind.value: [] for kind in kinds}
    for batch in range(args.batches):
        act = _actions(stage, batch)
        indices = range(batch * m, (batch + 1) * m)
        for i in indices:
            if stage == 1:
                executor._received[i] = Message([xs[i % m].clone().requires_grad_()])
            else:
                executor._gradients[i] = Message([ys[i % m]])
        executor.execute([act(K.FORWARD, i) for i in indices], feed, flush=False)
        for kind in kinds:
            start = time.process_time()
            executor.execute([act(kind, i) for i in indices], feed, flush=False)
            spent[kind.value].append(1e3 * (time.process_time() - start))
        executor.execute([act(K.STEP, None, batch + 1)], feed, lambda g, s: 0, flush=False)
        executor._flight.clear()  # the last stage's wait for their SEND_GRAD, left out here
    return {kind: statistics.median(values[1:]) for kind, values in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batches", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"one stage of {args.layers} x Linear({args.width}), {args.rows} rows per microbatch, "
        f"{args.microbatches} microbatches; ms of CPU time per batch, median of "
        f"{args.batches - 1} batches"
    )
    for stage, name in ((1, "last stage"), (0, "first stage")):
        whole = batch_cost("flush", stage, args)["BACKWARD"]
        split = batch_cost("zero_bubble", stage, args)
        halves = split["BACKWARD_INPUT"] + split["BACKWARD_WEIGHT"]
        print(
            f"  {name}: flush backward {whole:.1f}; zero_bubble input half "
            f"{split['BACKWARD_INPUT']:.1f} + weight half {split['BACKWARD_WEIGHT']:.1f} = "
            f"{halves:.1f} ({halves / whole:.2f}x)"
        )


if __name__ == "__main__":
    main()
