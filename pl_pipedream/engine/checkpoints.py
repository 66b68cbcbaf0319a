"""``Pipeline.save`` and ``Pipeline.load``: the sharded checkpoint directory the strategy writes.

``save(path)`` writes ``core.checkpoint``'s format: one shard per stage, per rank in the chunked
modes (the stage's tensors under ``layers.state_dict()``'s names, its optimizer's state keyed by
parameter name: ``core.named_state``) and ``pipeline.json``, published whole by rank 0
(``core.atomic``). ``pl_pipedream.consolidate_checkpoint(path)`` gives the whole model's
``state_dict`` back for one device, and ``load(path)`` resumes it under any plan over the same
layers: each rank reads only the shards that hold its stage's names (``core.resume.Resume``). The
caller's own state (a loop's counters, an LR scheduler's state: the same on every rank) rides along
under ``EXTRA`` in stage 0's shard, where the format keeps state outside the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pl_pipedream.core import checkpoint as sharded
from pl_pipedream.core import collectives, named_state
from pl_pipedream.core.errors import CheckpointError
from pl_pipedream.core.resume import Resume
from pl_pipedream.core.stage import LocalStage
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["EXTRA", "load", "save"]

EXTRA = "extra"  # the key of the caller's own state in stage 0's shard


def save(
    path: str | Path,
    layers: nn.Sequential,
    local: LocalStage,
    optimizer: Optimizer | None,
    steps: int,
    rank: int,
    layout: tuple[Plan, SyncMode, int, float],
    extra: dict[str, Any] | None = None,
) -> None:
    """Every rank, on drained weights: this rank's shard (if it is its stage's first replica),
    published by rank 0, ``extra`` in stage 0's; returns once the checkpoint is on disk (a
    barrier)."""
    plan, sync, microbatches, timeout = layout
    names = {id(param): name for name, param in layers.named_parameters()}
    own = named_state.group_names(optimizer.param_groups, names) if optimizer else None
    full = every_stages_groups(own, plan)  # (a collective: every rank takes part)
    states = []
    if optimizer is not None and own is not None:
        states.append(named_state.to_named(optimizer.state_dict(), full, own))
    checkpoint: dict[str, Any] = {
        "state_dict": local.state_dict(layers),
        "optimizer_states": states,
        "global_step": steps,
    }
    if local.stage.index == 0:
        checkpoint[EXTRA] = dict(extra or {})
    sharded.save(checkpoint, path, rank, plan, str(sync), microbatches, timeout)
    collectives.barrier()


def every_stages_groups(own: list[list[str]] | None, plan: Plan) -> list[list[str]]:
    """Per parameter group, the names of every stage's parameters in it, in stage order (the
    named form lists a group's whole membership, so that any plan resumes it); ``own``: this
    rank's groups (None: a stage without parameters)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    stages = [gathered[stage.ranks[0]] for stage in plan.stages]
    counts = [len(groups) for groups in stages if groups is not None]
    if len(set(counts)) > 1:
        raise CheckpointError(
            f"a checkpoint's optimizer state needs the same parameter groups on every stage "
            f"(groups per stage: {counts}); build every stage's optimizer with as many groups, "
            "e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        )
    full: list[list[str]] = [[] for _ in range(counts[0] if counts else 0)]
    for groups in stages:
        for number, group in enumerate(groups or []):
            full[number].extend(n for n in group if n not in full[number])  # a tie: once
    return full


def load(
    path: str | Path, layers: nn.Sequential, optimizer: Optimizer | None
) -> tuple[int, dict[str, Any]]:
    """Every rank: this stage's tensors and optimizer state from the checkpoint at ``path``
    (saved under any plan over the same layers); returns the steps it had trained and the
    caller's own state saved with it (``{}`` for none)."""
    if not sharded.is_sharded(path):
        raise CheckpointError(
            f"Pipeline.load reads the directory Pipeline.save writes (path: {path}); pass the "
            "path given to save(), or load a state_dict() with load_state_dict()"
        )
    resume = Resume()
    checkpoint = resume.read(path, dict)
    if not resume.lazy:
        raise CheckpointError(
            f"Pipeline.load reads checkpoints whose optimizer states are keyed by name (path: "
            f"{path}); resave it with this version's Pipeline.save or PipeDreamStrategy"
        )
    resume.check_model(layers.state_dict(), checkpoint, strict=True)  # names and shapes
    resume.load_stage(layers)  # the shards holding this stage's names, and only those
    if optimizer is not None:
        resume.record(layers, [optimizer])
        resume.load_optimizers(checkpoint, [optimizer])
    return int(checkpoint.get("global_step") or 0), dict(checkpoint.get(EXTRA) or {})
