"""The checks ``PipeDreamStrategy`` runs on its plain arguments and on the Trainer flags Lightning
hands it, before anything starts: each refusal names the argument, the value given and an example
that works."""

from __future__ import annotations

from typing import Any

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.modes import SyncMode, check_chunked, check_chunks_per_rank

__all__ = [
    "check_start_method",
    "check_chunk_options",
    "check_layer_sync",
    "check_planning_options",
    "check_placement",
]


def check_start_method(start_method: str) -> None:
    """How the strategy starts its ranks: its launchers' methods."""
    if start_method not in ("popen", "spawn", "fork"):
        raise ValueError(
            f"start_method must be 'popen', 'spawn' or 'fork' (start_method: {start_method!r})"
        )


def check_placement(plan: Plan, sync: SyncMode, call: str, chunks: int | None = None) -> None:
    """``schedule.rules.check_placement`` at a front end's setup: a sync mode runs the plans of
    its placement; ``call`` is the front end's, quoted in the fix with a mode in ``{sync}``.
    ``chunks``: the ``chunks_per_rank`` given, which the plan must have."""
    try:
        rules.check_placement(plan, sync, call)
    except ValueError as error:
        raise PipelineSetupError(str(error)) from None
    if chunks is not None and sync.chunked and plan.chunks_per_rank != chunks:
        raise PipelineSetupError(
            f"the plan must give each rank the chunks_per_rank stages asked for (chunks_per_rank: "
            f"{chunks}, plan: {plan.num_stages} stages on {plan.num_workers} ranks); give "
            f"{chunks * plan.num_workers} stages (balance= of {chunks * plan.num_workers} "
            f"counts), or chunks_per_rank={plan.chunks_per_rank}"
        )


def check_chunk_options(
    sync: SyncMode,
    chunks: Any,
    memory: float | None,
    balance: Any,
    plan: Any,
    replanning: bool,
    call: str = "PipeDreamStrategy({args})",
) -> None:
    """``chunks_per_rank`` fits ``sync`` (``schedule.modes.check_chunks_per_rank``) and the
    layout given (each rank the same number of stages: a balance of a multiple of it, a plan of
    that many per rank); ``memory=`` is refused with a chunked mode, whose plan is cut by compute
    alone (``planner.chunk_plan``) while the limit is what automatic planning fits, and so is
    ``replanning`` (``schedule.modes.check_chunked``; the tied parameters, known at setup, are
    checked there). ``call``: the front end's, with its arguments in ``{args}``."""
    check_chunked(sync, (), replanning, call.format(args="sync='{sync}'"))
    check_chunks_per_rank(sync, chunks, call)
    if memory is not None and sync.chunked:
        fits = call.format(args=f"sync='{SyncMode.ZERO_BUBBLE}', memory=...")
        raise ValueError(
            f"memory= is the limit automatic planning fits, and a chunked mode's plan is cut by "
            f"compute alone (memory: {memory:.0f} bytes, sync: '{sync}'); leave out memory=, or "
            f"use {fits} to plan within it"
        )
    if chunks is None:
        return
    if isinstance(plan, Plan) and plan.chunks_per_rank != chunks:
        raise ValueError(
            f"the plan given must hold chunks_per_rank stages on each rank (chunks_per_rank: "
            f"{chunks}, plan: {plan.chunks_per_rank} per rank); leave out chunks_per_rank or "
            f"give a plan of {chunks} stages per rank"
        )
    if balance is not None and len(balance) % chunks:
        raise ValueError(
            f"a balance gives each rank chunks_per_rank stages, so it has a multiple of it "
            f"(chunks_per_rank: {chunks}, balance: {list(balance)}); give devices x {chunks} "
            "layer counts, or leave out chunks_per_rank"
        )


def check_planning_options(
    options: dict[str, Any], balance: Any, plan: Any, replanning: bool
) -> None:
    """``options`` (name -> value, None where not given: ``topology``, ``memory``, a sample to
    profile) serve automatic planning. Beside a layout given by hand (``balance=``, ``plan=``)
    they would go unused without a word, so they are refused, unless the pipeline re-plans
    (``replanning``: ``replan="auto"``, whose plans they bound; pass ``False`` for what does
    not bound it)."""
    given = [(name, value) for name, value in options.items() if value is not None]
    if not given or (balance is None and plan is None) or replanning:
        return
    name, value = given[0]
    if isinstance(value, (int, float)):
        shown = f"{value:.0f} bytes"
    else:
        shown = repr(value) if isinstance(value, str) else "given"
    layout = f"balance: {list(balance)}" if balance is not None else "plan: given"
    names = ", ".join(f"{n}=" for n, _ in given)
    bounds = "they bound" if len(given) > 1 else "it bounds"
    bound = all(n in ("topology", "memory") for n, _ in given)  # what re-planning is held to
    also = f', or add replan="auto", whose plans {bounds}' if bound else ""
    raise ValueError(
        f"{names} only serve{'s' if len(given) == 1 else ''} automatic planning, which a layout "
        f"given by hand replaces ({name}: {shown}, {layout}); leave out balance=/plan= so "
        f"that the planner chooses a layout, leave out {names}{also}"
    )


def check_layer_sync(layer_sync: Any) -> None:
    """``Trainer(sync_batchnorm=True)`` (a ``LayerSync`` plugin) is refused: SyncBatchNorm would
    take statistics over every rank of the world in each forward, a collective that other stages
    never join, while a pipeline's BatchNorm normalises each microbatch by its own statistics,
    as one device accumulating gradients over the same microbatches does. Replicated stages
    combine their running statistics at every update instead (``runtime.running_stats``)."""
    if layer_sync is None:
        return
    raise ValueError(
        "synchronised BatchNorm is not supported by the pipedream strategy: each microbatch is "
        "normalised by its own statistics, as on one device accumulating gradients over the "
        f"same microbatches (sync_batchnorm: True, layer_sync: {type(layer_sync).__name__}); "
        "use Trainer(sync_batchnorm=False): the replicas of a stage combine their BatchNorm "
        "running statistics at every update (docs/batchnorm.md)"
    )
