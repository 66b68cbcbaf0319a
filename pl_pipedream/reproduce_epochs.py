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
times ``batch``, parameter bytes as they are. Pure Python (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pl_pipedream.planner.plan import Plan
from pl_pipedream.profile.graph import Node, Profile

__all__ = ["Epochs", "bubble", "epochs", "gpipe_microbatches", "scale_profile"]


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
