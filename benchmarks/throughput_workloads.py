"""The models, samples and losses that benchmarks/pipeline_throughput.py trains, one per workload.

* ``mlp``: ``--depth`` blocks of Linear(``--width``) (+ ReLU but the last), mean-squared error
  against random targets; half the blocks per stage (a quarter with 4 stages).
* ``gpt``: a GPT-style decoder: the token and position embedding, ``--depth`` pre-LayerNorm
  blocks (causal self-attention, then an MLP; ``pl_pipedream.models.gpt``'s blocks) and the head
  (final LayerNorm, projection to ``--vocab``, untied so that torch's pipelining, which cannot
  tie a parameter across stages, trains the same model), cross-entropy against random tokens.
  Stage 0 holds the embedding and the first half of the blocks, stage 1 the rest and the head.
  Every boundary is one float tensor ``(rows, --sequence, --width)``.
* ``overhead``: Linear(16)-ReLU-Linear(16) at 8 rows, the mlp workload at a size where only the
  fixed cost of a step and of a microbatch shows.

A "row" is one sample (a vector for the MLPs, a window of tokens for gpt). Every process builds
the same model from seed 0 and the same samples from seed 1.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WORKLOADS = ("mlp", "gpt", "overhead")
DISTINCT_BATCHES = 4  # batches are cycled: the figures do not depend on the values

# per workload: the defaults of the arguments the user leaves out
DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": {"width": 1024, "depth": 8, "microbatch": 128, "steps": 32, "warmup": 5},
    "gpt": {"width": 256, "depth": 4, "microbatch": 8, "steps": 16, "warmup": 3},
    "overhead": {"width": 16, "depth": 2, "microbatch": 8, "steps": 600, "warmup": 50},
}
QUICK: dict[str, dict[str, Any]] = {  # --quick: seconds, for the tests
    "mlp": {"width": 64, "depth": 4, "microbatch": 16, "steps": 8, "warmup": 2},
    "gpt": {"width": 32, "depth": 2, "microbatch": 8, "steps": 6, "warmup": 2, "sequence": 16},
    "overhead": {"width": 16, "depth": 2, "microbatch": 8, "steps": 40, "warmup": 5},
}
GPT_SHAPE = {"sequence": 128, "heads": 4, "vocab": 256}


def fill_defaults(args: argparse.Namespace) -> None:
    """Every size argument left as None takes the workload's default (its quick one with
    ``--quick``)."""
    chosen = {**GPT_SHAPE, **DEFAULTS[args.workload]}
    if args.quick:
        chosen.update(QUICK[args.workload])
    for name, value in chosen.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def make_layers(args: argparse.Namespace) -> nn.Sequential:
    """The whole model as the pipeline's layers; the same seed in every process."""
    torch.manual_seed(0)
    if args.workload == "gpt":  # imported here: the module imports Lightning (4 s)
        from pl_pipedream.models.gpt import Block, Embedding, Head

        blocks = [Block(args.width, args.heads) for _ in range(args.depth)]
        return nn.Sequential(
            Embedding(args.vocab, args.sequence, args.width), *blocks, Head(args.vocab, args.width)
        )
    linear = [
        nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.depth - 1)
    ]
    return nn.Sequential(*linear, nn.Sequential(nn.Linear(args.width, args.width)))


def balance(args: argparse.Namespace, stages: int = 2) -> list[int]:
    """Layers per stage, in stage order: the blocks in ``stages`` equal parts (gpt: the
    embedding with the first, the head with the last). Our pipelines and torch's cut the same
    layers for the same number of stages."""
    if args.depth % stages:
        raise ValueError(
            f"the blocks are cut into {stages} equal stages (depth: {args.depth}); give a "
            f"--depth that {stages} divides"
        )
    sizes = [args.depth // stages] * stages
    if args.workload == "gpt":
        sizes[0] += 1
        sizes[-1] += 1
    return sizes


def stage_layers(layers: nn.Sequential, args: argparse.Namespace, stage: int) -> nn.Sequential:
    sizes = balance(args)
    start = sum(sizes[:stage])
    return layers[start : start + sizes[stage]]


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean-squared error for the MLPs; cross-entropy over the vocabulary for gpt (long
    targets)."""
    if target.dtype == torch.long:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)


def sample(
    args: argparse.Namespace, rows: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of ``rows`` samples: (inputs, targets)."""
    if args.workload == "gpt":
        shape = (rows, args.sequence)
        return (
            torch.randint(args.vocab, shape, generator=generator),
            torch.randint(args.vocab, shape, generator=generator),
        )
    shape = (rows, args.width)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def make_batches(args: argparse.Namespace, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``--steps`` batches of ``rows`` samples (a few distinct ones, cycled)."""
    generator = torch.Generator().manual_seed(1)
    distinct = [sample(args, rows, generator) for _ in range(min(args.steps, DISTINCT_BATCHES))]
    return [distinct[i % len(distinct)] for i in range(args.steps)]


def activation_shape(args: argparse.Namespace, rows: int) -> tuple[int, ...]:
    """The tensor stage 0 sends stage 1 for ``rows`` samples."""
    if args.workload == "gpt":
        return (rows, args.sequence, args.width)
    return (rows, args.width)


def message_bytes(args: argparse.Namespace, rows: int) -> int:
    return 4 * int(torch.Size(activation_shape(args, rows)).numel())


def stage_sample(
    args: argparse.Namespace, stage: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``stage`` receives for ``rows`` samples (the inputs, or stage 0's activations) and
    the targets."""
    generator = torch.Generator().manual_seed(2)
    inputs, targets = sample(args, rows, generator)
    if stage > 0:
        inputs = torch.randn(activation_shape(args, rows), generator=generator)
    return inputs, targets


def describe(args: argparse.Namespace) -> str:
    if args.workload == "gpt":
        return (
            f"GPT: embedding + {args.depth} decoder blocks (width {args.width}, {args.heads} "
            f"heads, sequence {args.sequence}) + head (vocabulary {args.vocab})"
        )
    return f"{args.workload}: MLP {args.depth} x Linear({args.width})"
