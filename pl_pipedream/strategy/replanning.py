"""Re-planning inside a Lightning ``fit``: at a step boundary, a better plan moves the layers.

``PipeDreamStrategy(replan="auto")`` checks every ``replan_every`` optimizer steps whether a
plan for the measured stage times beats the plan in use by more than ``replan_threshold``
after paying for the move (``core.replanner``). When it does, every rank, before the same
training step: drains the pipeline (the async modes keep minibatches in flight between steps),
moves the layers and their optimizer state point to point (``core.relayout``: the optimizer
objects are kept, so Lightning and the LR schedulers go on with them), rebuilds what setup built
over the plan (the stage's updates, the ``PipelineRunner``, the evaluation pipe) and the
Lightning patches that captured them, rewrites ``pipedream_plan.json`` and logs the move.

The boundary is the first step after an optimizer step (``trainer.global_step`` changed since
the last boundary), so a move never splits a window of ``accumulate_grad_batches``.
``request(plan)`` asks for a given plan at the next boundary: every rank must ask for the same
plan in the same step (a callback's ``on_train_batch_end`` does).
"""

from __future__ import annotations

import numbers
from typing import Any

from pl_pipedream.planner.plan import Plan

__all__ = ["REPLAN_MODES", "Replanning", "check_replan"]

REPLAN_MODES = ("off", "auto")


def check_replan(mode: Any, every: Any, threshold: Any) -> None:
    """Refuse options ``Replanning`` cannot honour, naming the option, its value and the fix."""
    if mode not in REPLAN_MODES:
        yaml = (
            " (YAML reads an unquoted off as false: write replan: 'off')"
            if isinstance(mode, bool)
            else ""
        )
        raise ValueError(
            f'replan must be "off" or "auto" (replan: {mode!r}); for example '
            f'PipeDreamStrategy(replan="auto"){yaml}'
        )
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(
            f"replan_every must be a positive number of optimizer steps (replan_every: "
            f"{every!r}); for example PipeDreamStrategy(replan_every=50)"
        )
    number = isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)
    if not number or not threshold >= 0:
        raise ValueError(
            f"replan_threshold must be a fraction of at least 0 (replan_threshold: "
            f"{threshold!r}); for example PipeDreamStrategy(replan_threshold=0.05)"
        )


class Replanning:
    """One strategy's re-planning: its options, a requested plan, and the boundary it is at."""

    def __init__(self, mode: str = "off", every: int = 50, threshold: float = 0.05) -> None:
        check_replan(mode, every, threshold)
        self.mode, self.every, self.threshold = mode, int(every), float(threshold)
        self.requested: Plan | None = None
        self.moves = 0  # moves made in this fit

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def request(self, plan: Plan) -> None:
        """Move to ``plan`` at the next step boundary (every rank asks in the same step)."""
        self.requested = plan
