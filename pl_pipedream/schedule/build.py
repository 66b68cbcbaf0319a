"""Build the per-rank action lists of a plan for one sync mode.

Minibatch ``i = t * m + j`` is microbatch ``j`` of Lightning batch ``t``. At every stage it runs on
replica ``i mod r_s`` and its backward returns through the same replica (1F1B-RR, SOSP'19 section
3.2); messages go between the exact replica ranks. Each forward is wrapped as receive activation,
forward, send activation; each backward as receive gradient, backward, send gradient (in a mode
that splits it, the input half is wrapped so and its weight half stands alone); an update as
``ALLREDUCE`` (replicated stages only) then ``STEP``, right after the last backward it needs.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import partial

from pl_pipedream.planner.chunks import CONTIGUOUS
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import order, rules
from pl_pipedream.schedule.actions import Action, Schedule
from pl_pipedream.schedule.chunked import chunked_lists
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.wrap import place, wrap

__all__ = ["build"]


def build(
    plan: Plan,
    sync: SyncMode | str,
    num_batches: int,
    microbatches: int,
    ranks: Collection[int] | None = None,
) -> Schedule:
    """The schedule that feeds ``num_batches`` batches of ``microbatches`` through ``plan``.

    ``sync`` is a ``SyncMode`` or its name. The asynchronous modes (``async``, ``vertical_sync``,
    ``2bw``) never flush between batches and end with a drain; the others flush after every
    batch. ``ranks`` (default: all) are the ranks whose lists are built; the others stay
    empty (``Schedule.scope``). Raises ``ValueError`` for an unknown mode or counts the mode
    cannot serve. The modes of several stages per rank (``interleaved``, ``zbv``) take their
    order from module ``chunked``.
    """
    mode = rules.check_arguments(plan, sync, num_batches, microbatches)
    scope = None if ranks is None else frozenset(ranks)
    if scope is not None and not scope <= set(range(plan.num_workers)):
        raise ValueError(
            f"ranks must name workers of the plan (ranks: {sorted(scope)}, workers: "
            f"{plan.num_workers}); pass ranks from 0 to {plan.num_workers - 1}"
        )
    if mode.placement != CONTIGUOUS:
        chunked = chunked_lists(plan, mode, num_batches, microbatches, scope)
        return Schedule(mode, plan, num_batches, microbatches, chunked, scope)
    lists: list[tuple[Action, ...]] = [()] * plan.num_workers
    for stage in plan.stages:
        for replica, rank in enumerate(stage.ranks):
            if scope is not None and rank not in scope:
                continue
            tokens = replica_order(plan, mode, num_batches, microbatches, stage.index, replica)
            lists[rank] = tuple(expand(plan, mode, microbatches, rank, tokens))
    return Schedule(mode, plan, num_batches, microbatches, tuple(lists), scope)


def replica_order(
    plan: Plan, sync: SyncMode, num_batches: int, microbatches: int, stage: int, replica: int
) -> list[order.Token]:
    """Forwards, backwards and updates of one replica, in the order it runs them."""
    this = plan.stages[stage]
    mine = range(replica, num_batches * microbatches, this.replicas)
    if sync.flushes:
        tokens: list[order.Token] = []
        for batch in range(num_batches):
            ours = [i for i in mine if i // microbatches == batch]
            if sync.forwards_first:
                tokens += order.forwards_first(ours)
            elif sync.splits_backward:
                lag = rules.weight_lag(plan, sync, stage)
                tokens += order.split_one_f_one_b(ours, this.warmup, lag)
            else:
                tokens += order.one_f_one_b(ours, this.warmup)
    else:
        tokens = order.one_f_one_b(list(mine), this.warmup)
    return order.with_updates(tokens, partial(rules.update_of, plan, sync, microbatches, stage))


def expand(
    plan: Plan, sync: SyncMode, microbatches: int, rank: int, tokens: list[order.Token]
) -> list[Action]:
    """Turn one replica's tokens into actions, adding its messages and collectives."""
    where = place(plan, rank, plan.stage_of_rank(rank).index)
    out: list[Action] = []
    for token in tokens:
        wrap(plan, sync, microbatches, where, token, out)
    return out
