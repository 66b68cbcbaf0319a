"""CPU time of one microbatch's forward and backward on the probe's last stage, in one process.

Run: OMP_NUM_THREADS=1 python benchmarks/stage_microbatch_cost.py

The last stage of ``overhead_probe.py``'s model (Linear(16), 8 rows, mean-squared error) run by
a ``StageExecutor`` under ``flush`` with ``--microbatches`` per batch: the inputs are handed to
it, so no message is sent, and the CPU time of each batch's forwards and backwards is divided by
its microbatches; median over the batches after ``--warmup``. Without the channel, the Lightning
loop and the other rank, the figure is the executor's own cost per microbatch, steadier on a
shared machine than the probe's (run it once per checkout, alternately, to compare two).
``--fused-from 0`` fuses the Linear layer's gradient sums, which the default leaves to autograd
on this size (``runtime.linear_sums.fused_from``).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument(
        "--fused-from", type=int, default=None, help="fused_linear_min_elements (0: always fuse)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    m = args.microbatches
    torch.manual_seed(0)
    settings = update_settings(SyncMode.FLUSH, m, 1, args.fused_from)
    channel = Channel(1, torch.device("cpu"), timeout=5.0)
    executor = StageExecutor(nn.Sequential(nn.Linear(16, 16)), 1, 1, 2, channel, settings)
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=generator) for _ in range(m)]
    ys = [torch.randn(8, 16, generator=generator) for _ in range(m)]
    feed = Feed(lambda i: None, lambda out, i: nn.functional.mse_loss(out, ys[i % m]))
    spent = []
    for batch in range(args.batches):
        indices = range(batch * m, (batch + 1) * m)
        actions = []
        for i in indices:
            executor._received[i] = Message([xs[i % m].clone().requires_grad_()])
            actions += [Action(kind, 1, 1, 0, i, batch, batch) for kind in (K.FORWARD, K.BACKWARD)]
        start = time.process_time()
        executor.execute(actions, feed, flush=False)
        spent.append((time.process_time() - start) / m * 1e6)
        for i in indices:
            executor._flight.pop(i, None)  # what its SEND_GRAD (left out here) would do
        step = Action(K.STEP, 1, 1, 0, None, None, batch + 1)
        executor.execute([step], feed, lambda gradients, storage: 0)
    steady = spent[args.warmup :] or spent
    print(f"RESULT {statistics.median(steady):.1f} us CPU per microbatch (forward and backward)")


if __name__ == "__main__":
    main()
