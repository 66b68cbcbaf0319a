"""What one re-plan check leaves behind: the line it reports (rank 0 logs it) and, for a move,
its line of ``pipedream_plan_history.jsonl`` (``core.replanner``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pl_pipedream.planner.measured import MeasuredModel, RankTimes
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import Decision

__all__ = ["check_report", "history_line"]


def history_line(
    step: int, plan: Plan, times: Sequence[RankTimes], model: MeasuredModel, decision: Decision
) -> dict[str, Any]:
    """The history line of the check at ``step`` (its ``seconds`` filled in once moved): the
    old and new plan, the measured stage milliseconds by rank, the speeds, what was predicted."""
    return {
        "step": step,
        "old_plan": plan.to_dict(),
        "new_plan": decision.plan.to_dict(),
        "measured_ms": {str(t.rank): stage_ms(t) for t in times},
        "speeds": list(model.speeds),
        "predicted_ms": {
            "current": decision.current_time * 1e3,
            "new": decision.new_time * 1e3,
            "old_stages": predicted_stages(plan, model),
            "new_stages": predicted_stages(decision.plan, model),
        },
        "predicted_move_seconds": decision.move_seconds,
        "seconds": None,
        "warnings": list(decision.warnings),
    }


def check_report(
    step: int,
    times: Sequence[RankTimes],
    model: MeasuredModel,
    unknown: Sequence[int],
    decision: Decision,
    held: Plan | None,
) -> str:
    """One line: the check's measured stage times per rank, the speeds, and its decision."""
    measured = " | ".join(
        f"{math.fsum(stage_ms(t).values()):.3g}" for t in sorted(times, key=lambda t: t.rank)
    )
    speeds = "speeds " + ", ".join(
        "?" if r in unknown else f"{s:.2f}" for r, s in enumerate(model.speeds)
    )
    if unknown:
        ranks = ", ".join(map(str, unknown))
        speeds += f" (rank {ranks}: a slow rank or costly layers, not told apart yet)"
    verdict = decision.render()
    if held is not None:
        verdict += f"; holding a move to {held.layout} until the next check finds it again"
    return (
        f"re-plan check at step {step}: measured {measured} ms per microbatch (forward and "
        f"backward, by rank), {speeds}; {verdict}"
    )


def stage_ms(times: RankTimes) -> dict[str, float]:
    """A rank's measured forward and backward milliseconds per microbatch, summed."""
    return {
        "forward": math.fsum(times.forward_ms.values()),
        "backward": math.fsum(times.backward_ms.values()),
    }


def predicted_stages(plan: Plan, model: MeasuredModel) -> list[float]:
    """Each stage's compute milliseconds per minibatch on the model, at its slowest rank."""
    out = []
    for stage in plan.stages:
        compute = math.fsum(model.profile.node(n).compute_ms for n in stage.nodes)
        out.append(compute / min(model.speeds[r] for r in stage.ranks))
    return out
