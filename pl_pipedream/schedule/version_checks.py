"""The version rules a schedule must keep: the mode's versions, updates in order, the stash.

Every forward and backward uses the version ``rules.weight_version`` gives; updates come as
1, 2, ... on each rank, each replicated one right after its ``ALLREDUCE``; a backward (the weight
half of a split one) lands after
the step before its update and before its update; a version is used only after the ``STEP`` that
produces it; the drain applies every update; and a replica never holds more versions than the
mode stashes (``rules.stash_limit``).
"""

from __future__ import annotations

from pl_pipedream.planner.plan import Stage
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.actions import COMPUTE, WEIGHT_GRADS, Action, ActionKind, Schedule
from pl_pipedream.schedule.footprint import live_version_counts
from pl_pipedream.schedule.problem import Problem

__all__ = ["check_versions"]


def check_versions(schedule: Schedule) -> Problem | None:
    """Versions follow the mode's rule, exist when used, and fit the weight stash; each stage a
    rank holds (several in a chunked mode) counts its own versions."""
    for rank in schedule.held_ranks:
        for stage in schedule.plan.stages_of_rank(rank):
            entries = [
                (pos, action)
                for pos, action in enumerate(schedule.actions[rank])
                if action.stage == stage.index
            ]
            problem = _check_stage_versions(schedule, rank, stage, entries)
            if problem is not None:
                return problem
    return None


Entries = list[tuple[int, Action]]  # (position in the rank's list, action) of one stage


def _check_stage_versions(
    schedule: Schedule, rank: int, stage: Stage, entries: Entries
) -> Problem | None:
    """Walk one stage's actions in a rank's list, counting the steps it has applied so far."""
    plan, sync, m = schedule.plan, schedule.sync, schedule.microbatches
    steps = reduced = 0
    for pos, action in entries:
        here = ((rank, pos),)
        if action.kind in COMPUTE:
            i = action.minibatch
            expected = rules.weight_version(plan, sync, m, stage.index, i)  # type: ignore[arg-type]
            if action.version != expected:
                return Problem(
                    f"{sync} fixes the weight version of each minibatch (action {action}: version "
                    f"{action.version}, expected {expected}); see rules.weight_version",
                    here,
                )
            if expected > steps:
                return Problem(
                    f"a version is used only after the step that produces it (action {action}: "
                    f"steps applied {steps}); move the step earlier",
                    here,
                )
            update = rules.update_of(plan, sync, m, stage.index, i)  # type: ignore[arg-type]
            if action.kind in WEIGHT_GRADS and not steps == update - 1 >= reduced:
                return Problem(
                    f"a backward lands between the step before its update and its update "
                    f"(action {action}: update {update}, steps applied {steps}); "
                    "keep each update's backwards together",
                    here,
                )
        elif action.kind is ActionKind.ALLREDUCE:
            if action.version != steps + 1:
                return Problem(
                    f"updates come in order (action {action}: expected v{steps + 1}); "
                    "renumber the updates",
                    here,
                )
            reduced = steps + 1
        elif action.kind is ActionKind.STEP:
            if action.version != steps + 1 or (stage.replicas > 1 and reduced != steps + 1):
                return Problem(
                    f"updates come in order, each replicated one after its ALLREDUCE (action "
                    f"{action}: steps applied {steps}); insert the missing update",
                    here,
                )
            steps += 1
    return _check_totals(schedule, rank, stage, entries, steps)


def _check_totals(
    schedule: Schedule, rank: int, stage: Stage, entries: Entries, steps: int
) -> Problem | None:
    """Every update applied by the end, and never more versions held than the stash allows."""
    plan, sync = schedule.plan, schedule.sync
    wanted = rules.num_updates(plan, sync, schedule.num_batches, schedule.microbatches, stage.index)
    if steps != wanted:
        return Problem(
            f"the drain applies every update (rank {rank}: steps {steps}, expected {wanted}); "
            "end the list with the missing updates",
            ((rank, entries[-1][0]),) if entries else (),
        )
    limit = rules.stash_limit(plan, sync, stage.index)
    counts = live_version_counts([action for _, action in entries])
    for index, count in enumerate(counts):
        if count > limit:
            return Problem(
                f"a replica holds no more weight versions than {sync} stashes (rank {rank}: "
                f"{count} versions, limit {limit}); run the backwards that free old versions "
                "sooner",
                ((rank, entries[max(0, index - 1)][0]),),
            )
    return None
