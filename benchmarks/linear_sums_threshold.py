"""Where fusing the Linear gradient sums pays: fused against autograd's gradients added, by size.

Run: OMP_NUM_THREADS=1 python benchmarks/linear_sums_threshold.py [--device cuda]

A stage of Linear(w, w)-ReLU-Linear(w, w), ``--microbatches`` backward passes summed into one
update, as a flushed mode sums them: once with the layers captured (``runtime.linear_sums``: the
weight gradients added inside the GEMM) and once with autograd's gradients added by
``GradientSums``. Prints the time per microbatch of each (median over the repeats; on a GPU,
synchronized per update) and the difference, by width, and the cost of one add pass over a
gradient of the same size. ``runtime.linear_sums.fused_from`` is set from where the difference
changes sign (docs/fixed-cost.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pl_pipedream.runtime.gradient_sums import GradientSums
from pl_pipedream.runtime.linear_sums import LinearGradientSums


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_microbatch(width: int, fused: bool, args: argparse.Namespace) -> float:
    """us per microbatch of forward, backward and summing, median over ``args.repeats``."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)]
    module = nn.Sequential(*layers).to(device)
    params = dict(module.named_parameters())
    leaves = list(params.values())
    xs = [
        torch.randn(args.rows, width, device=device, requires_grad=True)
        for _ in range(args.microbatches)
    ]
    linear = LinearGradientSums()
    spent = []
    for _ in range(args.repeats):
        sums = GradientSums()
        _sync(device)
        start = time.perf_counter()
        for x in xs:
            if fused:
                with linear.capture(params):
                    out = module(x)
            else:
                out = module(x)
            found = torch.autograd.grad(out.square().mean(), [*leaves, x], allow_unused=True)
            sums.add(list(params), found[: len(leaves)])
        sums.add_totals(linear.take())
        _sync(device)
        spent.append((time.perf_counter() - start) / args.microbatches * 1e6)
    return statistics.median(spent[len(spent) // 4 :])


def add_pass(elements: int, args: argparse.Namespace) -> float:
    """us of one ``held += grad`` over ``elements`` elements."""
    device = torch.device(args.device)
    held, grad = torch.randn(elements, device=device), torch.randn(elements, device=device)
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.repeats * 10):
        held += grad
    _sync(device)
    return (time.perf_counter() - start) / (args.repeats * 10) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--widths", type=int, nargs="*", default=[16, 64, 256, 320, 448, 512, 1024])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"{args.device}, {args.rows} rows, {args.microbatches} microbatches per update; us per")
    print("microbatch: autograd + GradientSums, fused, fused - autograd; one add pass per weight")
    for width in args.widths:
        plain = per_microbatch(width, False, args)
        fused = per_microbatch(width, True, args)
        print(
            f"  width {width:5d} ({width * width:9d} elements): {plain:9.1f} {fused:9.1f} "
            f"{fused - plain:+9.1f}   add pass {add_pass(width * width, args):7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
