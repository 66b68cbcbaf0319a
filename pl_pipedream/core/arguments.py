"""The checks ``PipeDreamStrategy`` runs on its plain arguments and on the Trainer flags Lightning
hands it, before anything starts: each refusal names the argument, the value given and an example
that works."""

from __future__ import annotations

from typing import Any

from pl_pipedream.core.divergence import DIVERGENCE_ACTIONS
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "check_arguments",
    "check_layer_sync",
    "check_memory_layout",
    "check_placement",
]


def check_arguments(microbatches: Any, start_method: str, divergence: str, timeout: Any) -> None:
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"microbatches must be a positive integer (microbatches: {microbatches!r}); for "
            "example PipeDreamStrategy(microbatches=4)"
        )
    if not isinstance(timeout, (int, float)) or not timeout > 0:  # 0 would fail every wait
        raise ValueError(
            f"timeout must be a positive number of seconds (timeout: {timeout!r}); for example "
            "PipeDreamStrategy(timeout=300)"
        )
    if start_method not in ("popen", "spawn", "fork"):
        raise ValueError(
            f"start_method must be 'popen', 'spawn' or 'fork' (start_method: {start_method!r})"
        )
    if divergence not in DIVERGENCE_ACTIONS:
        raise ValueError(
            f"divergence must be one of {', '.join(DIVERGENCE_ACTIONS)} (divergence: "
            f'{divergence!r}); for example PipeDreamStrategy(divergence="warn")'
        )


def check_placement(plan: Plan, sync: SyncMode, call: str) -> None:
    """``schedule.rules.check_placement`` at a front end's setup: a sync mode runs the plans of
    its placement; ``call`` is the front end's, quoted in the fix with a mode in ``{sync}``."""
    try:
        rules.check_placement(plan, sync, call)
    except ValueError as error:
        raise PipelineSetupError(str(error)) from None


def check_memory_layout(
    memory: float | None, balance: Any, plan: Any, replanning: bool = False
) -> None:
    """``memory=`` is the limit automatic planning fits; a layout given by hand (``balance=``,
    ``plan=``) has no profiled sizes to hold against it, so the two together would leave the
    limit unchecked without a word: refused, unless the strategy re-plans (``replan="auto"``:
    the limit bounds the plans it moves to)."""
    if memory is None or (balance is None and plan is None) or replanning:
        return
    given = f"balance: {list(balance)}" if balance is not None else "plan: given"
    raise ValueError(
        f"memory= is the limit automatic planning fits and is not checked against a layout given "
        f"by hand (memory: {memory:.0f} bytes, {given}); leave out balance=/plan= so that the "
        'planner chooses a layout that fits, or leave out memory= (with replan="auto" it also '
        "bounds the plans moved to)"
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
