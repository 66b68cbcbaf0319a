"""One epoch of data parallelism, PipeDream and GPipe from a plan, for ``pl-pipedream reproduce``.

All three come from the planner's cost model, so they differ only in how they use the stages:

* **data parallelism**: every worker holds the whole model; ``Plan.data_parallel_time`` is its
  time per minibatch (compute over the workers plus the all-reduce of every parameter byte at
  each level's bandwidth, ``4 (n - 1) / n * bytes / bandwidth`` per level, not overlapped with
  compute: ``planner.optimize.data_parallel_time``). An epoch is ``N`` such minibatches.
* **PipeDream** (1F1B, weight stashing): in steady state the pipeline finishes one minibatch per
  slowest-stage time ``t`` (``Plan.slowest_stage_time``, replicas and transfers included); the
  epoch pays the pipeline's fill once: ``(N + S - 1) * t`` for ``S`` stages.
* **GPipe**: the same stages, flushed every ``m`` microbatches (one minibatch is one microbatch
  here); each flush fills and drains the pipeline, ``(m + S - 1) * t``, so an epoch is
  ``ceil(N / m) * (m + S - 1) * t`` and the idle share is the bubble ``(S - 1) / (m + S - 1)``.
  Stage times keep PipeDream's per-minibatch all-reduce of replicated stages (same cost model).

``N`` is the epoch's samples over the per-GPU minibatch, rounded up. The closed forms are the
steady state that ``schedule.simulate`` reaches on the same stage times; an epoch of ImageNet is
tens of thousands of minibatches per worker, too many actions to simulate one by one here.

``scale_profile`` turns a one-sample profile measured on this CPU into a profile of the paper's
per-GPU minibatch on the target GPU: times times ``batch / speed_factor``, activation bytes
times ``batch``, parameter bytes as they are. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pl_pipedream.planner.plan import Plan
from pl_pipedream.profile.graph import Node, Profile

__all__ = [
    "DEFAULT_SPEED_FACTOR",
    "DEVICE_TFLOPS",
    "EPOCH_SAMPLES",
    "PER_GPU_BATCH",
    "Epochs",
    "bubble",
    "epochs",
    "gpipe_microbatches",
    "scale_profile",
]

# The paper's per-GPU minibatch per model: read off PipeDream's published profiles (their
# activation sizes over one sample's) where one exists, else the model paper's training setting
# (AWD-LSTM: 80 on the Penn Treebank) or our choice (S2VT: 32).
PER_GPU_BATCH: Mapping[str, int] = MappingProxyType(
    {
        "VGG-16": 64,
        "AlexNet": 256,
        "ResNet-50": 128,
        "GNMT-8": 64,
        "GNMT-16": 64,
        "AWD-LM": 80,
        "S2VT": 32,
    }
)
# Samples per epoch: ImageNet's 1,281,167 training images; WMT16 En-De's 4,500,966 training
# sentence pairs; the Penn Treebank's 929,589 training words in 70-word windows (13,280); MSVD's
# 1,200 training videos with their 48,774 captions (one sample per caption).
EPOCH_SAMPLES: Mapping[str, int] = MappingProxyType(
    {
        "VGG-16": 1_281_167,
        "AlexNet": 1_281_167,
        "ResNet-50": 1_281_167,
        "GNMT-8": 4_500_966,
        "GNMT-16": 4_500_966,
        "AWD-LM": 13_280,
        "S2VT": 48_774,
    }
)
# fp32 peak TFLOP/s of each cluster's GPU (V100: 15.7; Titan X, Pascal: 11.0). --speed-factor
# is for a V100; cluster C's GPU is taken as 11.0 / 15.7 of that.
DEVICE_TFLOPS: Mapping[str, float] = MappingProxyType({"A": 15.7, "B": 15.7, "C": 11.0})
# A V100's 15.7 TFLOP/s over the ~112 GFLOP/s one thread of this machine's CPU reaches on an
# fp32 1024x1024 matrix product (measured with every profile and printed under the table).
DEFAULT_SPEED_FACTOR = 140.0


@dataclass(frozen=True)
class Epochs:
    """Seconds per epoch of each scheme, and the figures they were computed from."""

    minibatches: int
    stages: int
    microbatches: int
    data_parallel: float
    pipedream: float
    gpipe: float

    @property
    def pipedream_speedup(self) -> float:
        return self.data_parallel / self.pipedream

    @property
    def gpipe_speedup(self) -> float:
        return self.data_parallel / self.gpipe

    def to_dict(self) -> dict[str, float | int]:
        return {
            "minibatches": self.minibatches,
            "stages": self.stages,
            "gpipe_microbatches": self.microbatches,
            "data_parallel_s": self.data_parallel,
            "pipedream_s": self.pipedream,
            "gpipe_s": self.gpipe,
            "pipedream_speedup": self.pipedream_speedup,
            "gpipe_speedup": self.gpipe_speedup,
            "gpipe_bubble": bubble(self.stages, self.microbatches),
        }


def gpipe_microbatches(stages: int, per_stage: int = 4) -> int:
    """GPipe's microbatches per flush by default: ``per_stage`` per stage (4, GPipe's advice)."""
    return per_stage * stages


def bubble(stages: int, microbatches: int) -> float:
    """The idle share of a GPipe flush: ``(S - 1) / (m + S - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def epochs(result: Plan, samples: int, batch: int, microbatches: int | None = None) -> Epochs:
    """An epoch of ``samples`` in minibatches of ``batch`` per worker, under the three schemes."""
    if samples < 1 or batch < 1:
        raise ValueError(
            f"an epoch needs samples and a minibatch of at least one (samples: {samples}, "
            f"batch: {batch}); pass the dataset's size and the per-GPU minibatch"
        )
    count = math.ceil(samples / batch)
    stages = result.num_stages
    m = gpipe_microbatches(stages) if microbatches is None else microbatches
    if m < 1:
        raise ValueError(f"GPipe needs at least one microbatch per flush (microbatches: {m})")
    t = result.slowest_stage_time
    return Epochs(
        minibatches=count,
        stages=stages,
        microbatches=m,
        data_parallel=count * result.data_parallel_time,
        pipedream=(count + stages - 1) * t,
        gpipe=math.ceil(count / m) * (m + stages - 1) * t,
    )


def scale_profile(profile: Profile, batch: int, speed_factor: float) -> Profile:
    """A one-sample CPU profile as one of ``batch`` samples on a device ``speed_factor`` faster."""
    if batch < 1 or not speed_factor > 0:
        raise ValueError(
            f"scaling needs a minibatch of at least one and a positive speed factor (batch: "
            f"{batch}, speed factor: {speed_factor}); pass e.g. --speed-factor 140"
        )
    time_scale = batch / speed_factor
    nodes = [
        Node(
            node.node_id,
            node.desc,
            node.forward_ms * time_scale,
            node.backward_ms * time_scale,
            tuple(size * batch for size in node.activation_bytes),
            node.parameter_bytes,
            node.stage_id,
        )
        for node in profile.nodes
    ]
    return Profile(tuple(nodes), profile.edges, batch, dict(profile.meta))
