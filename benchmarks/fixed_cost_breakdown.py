"""Where a training step's fixed cost goes: py-spy samples of ``overhead_probe.py``, by part.

    OMP_NUM_THREADS=1 py-spy record -r 500 -f raw -o spy.txt --subprocesses -- \
        python benchmarks/overhead_probe.py --sync flush --m 8
    python benchmarks/fixed_cost_breakdown.py spy.txt --ms-per-step 18.4 --microbatches 8

Only samples inside Lightning's training loop (``_TrainingEpochLoop.advance``) count. Each is
given to the first part, in the order of ``PARTS``, whose key is in its stack; the parts' shares
of a rank's samples are scaled to ``--ms-per-step`` (the probe's wall time per step, measured
without the sampler) and divided by ``--microbatches``. Waiting in gloo counts: the sampler sees
a waiting thread as busy, as the wall clock does.
"""

from __future__ import annotations

import argparse
import collections

PARTS = [
    ("gloo: waiting for a message, or for a send to leave", ["Channel._wait"]),
    ("gloo: posting isend/irecv", ["Channel._isend", "Channel._post"]),
    ("data check: the microbatch's fingerprint", ["Fingerprints.", "SameData.__call__"]),
    ("frames: layout, pack, unpack", ["frames.py"]),
    ("preemption agreement (an all-reduce per step)", ["Preemption.at_step"]),
    ("data finiteness note", ["finite_data.py"]),
    ("Linear layers' fused gradient sums (flushed modes)", ["linear_sums.py"]),
    ("backward: autograd and gradient sums", ["StageExecutor._backward"]),
    ("forward: the stage's module, the loss", ["StageExecutor._forward"]),
    ("update: optimizer step and its hooks", ["StageExecutor._step"]),
    ("channel bookkeeping", ["Channel."]),
    ("executor loop: dispatch, lookahead, weight versions", ["StageExecutor"]),
    ("runner: segments, drain, losses", ["PipelineRunner"]),
    ("strategy step: slicing, logging, divergence", ["TrainingSteps.run"]),
    ("the probe's clock callback", ["Clock.on_train_batch_end"]),
    ("Lightning: loop, hooks, optimizer closure", [""]),
]


def breakdown(path: str) -> dict[str, collections.Counter[str]]:
    """Per process (a rank's stacks follow those of the processes that started it), the
    samples of each part."""
    parts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if "_TrainingEpochLoop.advance" not in stack:
                continue
            frames = stack.split(";")
            process = [f for f in frames if f.startswith("process ")][-1].split(":")[0]
            name = next(n for n, keys in PARTS if any(k in stack for k in keys))
            parts[process][name] += int(count)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("raw", help="py-spy record -f raw output")
    parser.add_argument("--ms-per-step", type=float, required=True)
    parser.add_argument("--microbatches", type=int, default=1)
    args = parser.parse_args()
    scale = args.ms_per_step / args.microbatches
    for process, counts in breakdown(args.raw).items():
        total = sum(counts.values())
        print(f"{process}: {total} samples; ms per microbatch at {scale:.2f}")
        for name, _ in PARTS:
            share = counts[name] / total
            print(f"  {share * scale:5.2f}  {share:6.1%}  {name}")


if __name__ == "__main__":
    main()
