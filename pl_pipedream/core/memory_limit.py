"""The memory a plan may use per rank, and the plan that fits it.

Automatic planning takes each rank's memory from its device: the free memory of a GPU
(``torch.cuda.mem_get_info``), or the number a front end was given (bytes, or a string such as
``"8GiB"``) on CPU, where the process has no budget of its own to ask for. The smallest over the
ranks bounds every stage by what the sync mode keeps (``schedule.memory.stage_bytes``: weights x
the versions the schedule keeps plus activations x its minibatches in flight plus the frames of
its messages in flight). The planner's own limit (``planner.costs.held_bytes``, PipeDream's
ceil(workers after the stage / replicas) x (weights + activations), plus the frames) is lowered
until its plan fits by that rule. If no plan fits, the error names the smallest memory with
which one would, found by bisection. A plan of several stages per rank (the chunked modes) is
cut by compute alone (``planner.chunk_plan``) and only checked: each rank holds all its stages.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.planner.costs import held_bytes
from pl_pipedream.planner.plan import Plan, PlanError, Stage
from pl_pipedream.schedule.memory import kept_bytes, stage_bytes
from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "MemoryFit",
    "check_ranks_fit",
    "device_memory",
    "fitting",
    "gather_memory",
    "need",
    "parse_memory",
    "plan_within",
    "planner_bytes",
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
                f"{value!r}); for example memory='8GiB'"
            )
        number = float(found.group(1)) * _UNITS[unit]
    if not number > 0:
        raise ValueError(
            f"memory must be positive (memory: {value!r}); for example memory='8GiB', or omit it"
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


def need(plan: Plan, sync: SyncMode, microbatches: int, recompute: bool = False) -> float:
    """The most bytes a stage of ``plan`` needs per worker by what ``sync`` keeps
    (``schedule.memory.stage_bytes``): the one rule setup, re-planning and the planner's fit
    hold a plan to."""
    stages = range(plan.num_stages)
    return max(stage_bytes(plan, sync, microbatches, s, recompute) for s in stages)


@dataclass(frozen=True)
class MemoryFit:
    """``memory`` bytes per worker as a plan must fit it under ``sync`` (``need``): whether a
    plan does, and the best plan of a planner that does (``fitting``); what re-planning is
    bound by (``planner.replan.decide``)."""

    memory: float
    sync: SyncMode
    microbatches: int
    recompute: bool = False

    def fits(self, plan: Plan) -> bool:
        return need(plan, self.sync, self.microbatches, self.recompute) <= self.memory

    def best(self, make: Callable[[float | None], Plan]) -> Plan:
        return fitting(make, self.memory, self.sync, self.microbatches, self.recompute)


def fitting(
    make: Callable[[float | None], Plan],
    memory: float,
    sync: SyncMode,
    microbatches: int,
    recompute: bool = False,
) -> Plan:
    """A plan whose every stage fits ``memory`` by what ``sync`` keeps (``need``). The
    planner's own limit holds ``planner_bytes``, which counts neither the sync mode nor the
    live weights, so it is lowered by the overshoot until the plan it gives fits (with
    ``recompute``, from no limit at all: the planner's figure is not a bound then)."""
    limit: float | None = None if recompute else memory
    for _ in range(64):
        plan = make(limit)
        over = need(plan, sync, microbatches, recompute) - memory
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
            else ("more devices, recompute=True or a smaller batch")
        )
        raise PipelineSetupError(
            f"no pipeline fits the memory per device (memory: {_size(memory)}, the smallest that "
            f"fits: {_size(need)}, sync: {sync}); use {fixes}, or allow memory= of at least that"
        ) from None


def check_ranks_fit(
    plan: Plan, memory: float, sync: SyncMode, microbatches: int, recompute: bool = False
) -> None:
    """Raise when a rank's stages together need more than ``memory`` by what ``sync`` keeps
    (``schedule.memory.kept_bytes``: weights x versions plus activations in flight; the message
    frames of a rank of several stages are not modelled, so this is a lower bound)."""
    for rank in range(plan.num_workers):
        stages = plan.stages_of_rank(rank)
        need = sum(kept_bytes(plan, sync, microbatches, s.index, recompute) for s in stages)
        if need > memory:
            raise PipelineSetupError(
                f"a rank holds every one of its stages, and rank {rank}'s need more than the "
                f"memory per device (memory: {_size(memory)}, rank {rank}: {_size(need)} for "
                f"stages {[s.index for s in stages]}, sync: {sync}); use more devices, "
                "recompute=True or a smaller batch"
            )


def _size(value: float) -> str:
    """``value`` bytes, and in the largest binary unit it reaches: "1536 bytes (1.5 KiB)"."""
    unit, scale = "bytes", 1
    for name, size in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if value >= size:
            unit, scale = name, size
    shown = f"{value:.0f} bytes"
    return shown if scale == 1 else f"{shown} ({value / scale:.3g} {unit})"
