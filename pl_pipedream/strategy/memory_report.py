"""Memory per stage: the planner's limit from the device, and the peaks measured in a fit.

At setup, automatic planning takes each rank's memory from its device: the free memory of a GPU
(``torch.cuda.mem_get_info``), or ``PipeDreamStrategy(memory=...)`` (bytes, or a string such as
``"8GiB"``) on CPU, where the process has no budget of its own to ask for. The smallest over
the ranks bounds every stage by what the sync mode keeps (``schedule.memory.stage_bytes``:
weights x the versions the schedule keeps plus activations x its minibatches in flight plus the
frames of its messages in flight). The planner's own limit (``planner.costs.held_bytes``,
PipeDream's ceil(workers after the stage / replicas) x (weights + activations), plus the
frames) is lowered until its plan fits by that rule. If no plan fits, setup stops naming the
smallest memory with which one would, found by bisection.

At the end of a fit every rank measures its stage: the weights it holds, the peak of the stashed
weight versions beyond the live ones (``runtime.stash``), the peak of the activations its
minibatches in flight kept for their backward passes (``runtime.recompute``, a replay's graph
included), the optimizer's state, the peaks of the message frames its channel held (sent and
not yet known to have left, and receives posted ahead: ``runtime.channel``; evaluation's
included), and on a GPU the allocator's peak. Rank 0 gathers the rows,
prints one table beside the estimate the plan gives for the same parts, and every rank keeps
the rows as ``strategy.memory_report``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.planner.costs import held_bytes
from pl_pipedream.planner.plan import Plan, PlanError, Stage
from pl_pipedream.runtime.recompute import Activations
from pl_pipedream.schedule.memory import (
    activations_kept,
    rank_frame_bytes,
    stage_bytes,
    versions_kept,
)
from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "StageMemory",
    "estimate",
    "estimate_frames",
    "gather_memory",
    "measure",
    "parse_memory",
    "plan_within",
    "planner_bytes",
    "of_fit",
    "render",
    "report",
    "smallest_fitting",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(value: Any) -> float | None:
    """Bytes from ``None``, a number of bytes, or a string such as ``"8GiB"`` or ``"512 MB"``."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        found = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = found.group(2).lower() if found else None
        if found is None or unit not in _UNITS:
            raise ValueError(
                f"memory must be a number of bytes or a size such as '8GiB' or '512MB' (memory: "
                f"{value!r}); for example PipeDreamStrategy(memory='8GiB')"
            )
        number = float(found.group(1)) * _UNITS[unit]
    if not number > 0:
        raise ValueError(
            f"memory must be positive (memory: {value!r}); for example "
            "PipeDreamStrategy(memory='8GiB'), or omit it"
        )
    return number


def device_memory(device: torch.device, given: float | None) -> float | None:
    """This rank's memory for the planner: ``given``, else a GPU's free memory, else None."""
    if given is not None:
        return given
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    return None


def gather_memory(device: torch.device, given: float | None) -> float | None:
    """The smallest memory over the ranks (every rank must call it); None: unconstrained."""
    mine = device_memory(device, given)
    every: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    known = [m for m in every if m is not None]
    return min(known) if known else None


def smallest_fitting(make: Callable[[float | None], Plan], low: float, high: float) -> float:
    """The smallest memory (to 0.1 %) with which ``make`` finds a plan, between ``low``, where
    none fits, and ``high``, where one does."""
    while high - low > max(1.0, 1e-3 * high):
        middle = (low + high) / 2
        try:
            make(middle)
        except PlanError:
            low = middle
        else:
            high = middle
    return high


def planner_bytes(plan: Plan, stage: Stage) -> float:
    """The figure the planner's DP holds under its limit (``planner.dp``, PipeDream's):
    ceil(workers after the stage / replicas) x (weights + activations), plus the frames of
    its messages in flight (``planner.costs.held_bytes``)."""
    after = sum(s.replicas for s in plan.stages[stage.index + 1 :])
    both = stage.activation_bytes + stage.parameter_bytes
    received = stage.input_bytes if stage.index > 0 else 0.0
    return float(held_bytes(both, after, stage.replicas, received, stage.output_bytes))


def fitting(
    make: Callable[[float | None], Plan],
    memory: float,
    sync: SyncMode,
    microbatches: int,
    recompute: bool = False,
) -> Plan:
    """A plan whose every stage fits ``memory`` by what ``sync`` keeps
    (``schedule.memory.stage_bytes``). The planner's own limit holds ``planner_bytes``, which
    counts neither the sync mode nor the live weights, so it is lowered by the overshoot until
    the plan it gives fits (with ``recompute``, from no limit at all: the planner's figure is
    not a bound then)."""
    limit: float | None = None if recompute else memory
    for _ in range(64):
        plan = make(limit)
        need = (stage_bytes(plan, sync, microbatches, s, recompute) for s in range(plan.num_stages))
        over = max(need) - memory
        if over <= 0:
            return plan
        figure = max(planner_bytes(plan, stage) for stage in plan.stages)
        limit = min(figure, limit if limit is not None else figure) - over
        if limit <= 0:
            break
    raise PlanError(f"no plan fits {memory} bytes per worker")


def plan_within(
    make: Callable[[float | None], Plan],
    memory: float | None,
    total_bytes: float,
    sync: SyncMode,
    microbatches: int,
    recompute: bool = False,
) -> Plan:
    """``make(None)`` without a limit; else a plan whose stages fit ``memory`` under ``sync``
    with ``microbatches`` per batch (``fitting``), or an error naming the smallest memory with
    which one would (``total_bytes``, the whole model's weights and activations, bounds the
    search)."""
    if memory is None:
        return make(None)
    limited = lambda m: fitting(make, m, sync, microbatches, recompute)  # noqa: E731
    try:
        return limited(memory)
    except PlanError:
        high = max(memory, 1.0) * 2
        while high < 4 * make(None).num_workers * max(total_bytes, 1.0):
            try:
                limited(high)
                break
            except PlanError:
                high *= 2
        need = smallest_fitting(limited, memory, high)
        fixes = (
            "more devices or a smaller batch"
            if recompute
            else ("more devices, PipeDreamStrategy(recompute=True) or a smaller batch")
        )
        raise PipelineSetupError(
            f"no pipeline fits the memory per device (memory: {_size(memory)}, the smallest that "
            f"fits: {_size(need)}, sync: {sync}); use {fixes}, or allow memory= of at least that"
        ) from None


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
    stage = plan.stage_of_rank(rank)
    if stage.parameter_bytes == 0 and stage.activation_bytes == 0:
        return None, None
    return rank_frame_bytes(plan, sync, microbatches, rank)


def measure(
    rank: int,
    plan: Plan,
    module: torch.nn.Module,
    stashed: int,
    activations: Activations,
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
    sync: SyncMode,
    microbatches: int,
    frames: tuple[int, int] = (0, 0),
) -> StageMemory:
    """This rank's row: its stage's peaks (``stashed``: the weight stash's, ``activations``:
    the executor's meter, ``frames``: the channel's, sent and posted to receive), its
    weights' and optimizer state's bytes now."""
    stage = plan.stage_of_rank(rank)
    weights = _bytes(p for p in module.parameters() if p.device.type != "meta")
    state = (t for o in optimizers for s in o.state.values() for t in s.values())
    optimizer = _bytes(t for t in state if isinstance(t, torch.Tensor))
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return StageMemory(
        rank,
        stage.index,
        weights,
        int(stashed),
        int(activations.peak_bytes),
        optimizer,
        peak,
        *estimate(plan, stage, sync, microbatches, activations.recompute),
        *frames,
        *estimate_frames(plan, rank, sync, microbatches),
    )


def gather(row: StageMemory) -> list[StageMemory]:
    """Every rank's row, on every rank (every rank must call it)."""
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, asdict(row))
    return [StageMemory(**r) for r in every if r is not None]


def report(rank: int, plan: Plan, *measured: Any) -> list[StageMemory]:
    """Measure this rank (``measure``'s other arguments), gather every rank's row, print the
    table on rank 0 (every rank must call it); returns the rows."""
    rows = gather(measure(rank, plan, *measured))
    rank_zero_info(render(rows))
    return rows


def of_fit(strategy: Any) -> list[StageMemory]:
    """``report`` for a ``PipeDreamStrategy`` at the end of its fit ([] without a pipeline)."""
    runner, local, plan = strategy.runner, strategy.local_stage, strategy.plan
    if runner is None or local is None or plan is None:
        return []
    executor = runner.executor
    measured: tuple[Any, ...] = (local.module, executor.stash.peak_bytes, executor.activations)
    measured += (strategy.optimizers, strategy.root_device)
    channel = executor.channel
    frames = (channel.peak_sent_bytes, channel.peak_received_bytes)
    return report(
        strategy.global_rank, plan, *measured, strategy.sync, strategy.microbatches, frames
    )


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


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _mib(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value / 2**20:>8.3f}"


def _size(value: float) -> str:
    """``value`` bytes, and in the largest binary unit it reaches: "1536 bytes (1.5 KiB)"."""
    unit, scale = "bytes", 1
    for name, size in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if value >= size:
            unit, scale = name, size
    shown = f"{value:.0f} bytes"
    return shown if scale == 1 else f"{shown} ({value / scale:.3g} {unit})"
