"""The memory each stage used in a fit, beside the plan's estimate for it.

At the end of a fit (``PipeDreamStrategy``) or when asked (``Pipeline.memory_report``; both
through ``engine.session.Session.memory_report``) every rank measures its stage: the weights it
holds, the peak of the stashed weight versions beyond the live ones (``runtime.stash``), the
peak of the activations its minibatches in flight kept for their backward passes
(``runtime.recompute``, a replay's graph included), the optimizer's state, the peaks of the
message frames its channel held (sent and not yet known to have left, and receives posted
ahead: ``runtime.channel``; evaluation's included), and on a GPU the allocator's peak. Rank 0
gathers the rows and prints one table beside the estimate the plan gives for the same parts;
every rank gets the rows (``strategy.memory_report`` after a fit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from pl_pipedream.core.memory_limit import planner_bytes
from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.schedule.memory import (
    activations_kept,
    rank_frame_bytes,
    versions_kept,
)
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["StageMemory", "estimate", "estimate_frames", "measure", "render", "report"]


@dataclass(frozen=True)
class StageMemory:
    """One rank's figures in bytes: measured (``weights`` ... ``device_peak``, None off GPU;
    ``frames_sent`` and ``frames_received``, the channel's peaks) and the plan's estimate
    (``estimate_*``, None when the plan was not profiled)."""

    rank: int
    stage: int
    weights: int
    stashed: int
    activations: int
    optimizer: int
    device_peak: int | None
    estimate_weights: float | None
    estimate_stashed: float | None
    estimate_activations: float | None
    planner: float | None  # what the planner's constraint counts for this stage
    frames_sent: int = 0
    frames_received: int = 0
    estimate_frames_sent: float | None = None
    estimate_frames_received: float | None = None

    @property
    def frames(self) -> int:
        return self.frames_sent + self.frames_received

    @property
    def estimate_frames(self) -> float | None:
        if self.estimate_frames_sent is None or self.estimate_frames_received is None:
            return None
        return self.estimate_frames_sent + self.estimate_frames_received

    @property
    def total(self) -> int:
        return self.weights + self.stashed + self.activations + self.optimizer + self.frames

    @property
    def estimate_total(self) -> float | None:
        parts = (self.estimate_weights, self.estimate_stashed, self.estimate_activations)
        known = [p for p in parts if p is not None]
        if len(known) != len(parts):
            return None
        return sum(known) + (self.estimate_frames or 0.0)


def estimate(
    plan: Plan, stage: Stage, sync: SyncMode, microbatches: int, recompute: bool
) -> tuple[float | None, float | None, float | None, float | None]:
    """The plan's estimate of ``stage``: weights, stashed versions beyond the live one,
    activations in flight (``schedule.memory``: what the schedule of ``sync`` keeps), and the
    planner's constraint figure. Nones for a plan without profiled sizes."""
    if stage.parameter_bytes == 0 and stage.activation_bytes == 0:
        return None, None, None, None
    versions = versions_kept(plan, sync, microbatches, stage.index)
    weights = stage.parameter_bytes
    activations = activations_kept(plan, sync, microbatches, stage.index, recompute)
    return weights, (versions - 1) * weights, activations, planner_bytes(plan, stage)


def estimate_frames(
    plan: Plan, rank: int, sync: SyncMode, microbatches: int
) -> tuple[float | None, float | None]:
    """The plan's estimate of the frames ``rank`` holds, sent and posted to receive
    (``schedule.memory.rank_frame_bytes``); Nones for a plan without profiled sizes."""
    stages = plan.stages_of_rank(rank)
    if len(stages) > 1 or (stages[0].parameter_bytes == 0 and stages[0].activation_bytes == 0):
        return None, None  # a rank of several stages: its links' sizes are not modelled
    return rank_frame_bytes(plan, sync, microbatches, rank)


def measure(
    rank: int,
    plan: Plan,
    module: torch.nn.Module,
    stashed: int,
    activations: int,
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    sync: SyncMode,
    microbatches: int,
    frames: tuple[int, int] = (0, 0),
    recompute: bool = False,
) -> StageMemory:
    """This rank's row: its stages' peaks (``stashed``: the weight stash's, ``activations``:
    the executor's meter's, ``frames``: the channel's, sent and posted to receive), its
    weights' and optimizer state's bytes now; the estimates count what ``recompute`` keeps. A
    rank of several stages (chunks) adds up its stages' estimates (and their peaks: at most
    the sum)."""
    stages = plan.stages_of_rank(rank)
    weights = _bytes(p for p in module.parameters() if p.device.type != "meta")
    state = (t for o in optimizers for s in o.state.values() for t in s.values())
    optimizer = _bytes(t for t in state if isinstance(t, torch.Tensor))
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    each = [estimate(plan, stage, sync, microbatches, recompute) for stage in stages]
    return StageMemory(
        rank,
        stages[0].index,
        weights,
        int(stashed),
        int(activations),
        optimizer,
        peak,
        *_sums(each),
        *frames,
        *estimate_frames(plan, rank, sync, microbatches),
    )


def gather(row: StageMemory) -> list[StageMemory]:
    """Every rank's row, on every rank (every rank must call it)."""
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, asdict(row))
    return [StageMemory(**r) for r in every if r is not None]


def report(say: Callable[[str], None], rank: int, plan: Plan, *measured: Any) -> list[StageMemory]:
    """Measure this rank (``measure``'s other arguments), gather every rank's row, ``say`` the
    table on rank 0 (every rank must call it); returns the rows."""
    rows = gather(measure(rank, plan, *measured))
    if rank == 0:
        say(render(rows))
    return rows


def render(rows: Iterable[StageMemory]) -> str:
    """One line per rank: measured parts, total, the estimate's parts and total (MiB)."""
    head = (
        f"{'rank':>4} {'stage':>5} | {'weights':>8} {'stashed':>8} {'activ.':>8} {'frames':>8} "
        f"{'optim.':>8} {'total':>8} {'device':>8} | {'est. w':>8} {'est. st':>8} "
        f"{'est. act':>8} {'est. fr':>8} {'est. tot':>8} {'planner':>8}"
    )
    lines = ["PipeDream memory per stage (MiB; measured peaks | the plan's estimate)", head]
    for r in rows:
        lines.append(
            f"{r.rank:>4} {r.stage:>5} | {_mib(r.weights)} {_mib(r.stashed)} "
            f"{_mib(r.activations)} {_mib(r.frames)} {_mib(r.optimizer)} {_mib(r.total)} "
            f"{_mib(r.device_peak)} | {_mib(r.estimate_weights)} {_mib(r.estimate_stashed)} "
            f"{_mib(r.estimate_activations)} {_mib(r.estimate_frames)} {_mib(r.estimate_total)} "
            f"{_mib(r.planner)}"
        )
    return "\n".join(lines)


def _sums(
    estimates: Sequence[tuple[float | None, ...]],
) -> tuple[float | None, float | None, float | None, float | None]:
    """Each part of several stages' estimates added up (None where any stage has none)."""
    parts = [None if None in part else sum(part) for part in zip(*estimates, strict=True)]
    return parts[0], parts[1], parts[2], parts[3]  # type: ignore[arg-type]


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _mib(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value / 2**20:>8.3f}"
