"""What each sync mode keeps in memory per stage: weight versions, minibatches in flight, bytes.

The one statement of a mode's memory that the memory report, the planner's fit (``memory=``)
and the docs read. The counts are those of the built schedule once the pipeline is full
(``footprint`` counts them action by action; a test holds the two equal for every mode):

- weight versions a replica holds (the live one included): a version is kept while it is the
  newest or some forward or backward ahead still names it (weight stashing, SOSP'19 3.3). The
  flushed modes keep 1, ``2bw`` 2. In ``async`` and ``vertical_sync`` a replica whose oldest
  minibatch in flight is its ``k``-th holds version ``k`` (the newest) and every version that
  minibatch ``k`` or a later one uses up to ``k``: ``w_s + 1`` in ``async``; in
  ``vertical_sync`` on a straight pipeline ``1 + w_0`` at every stage, since every stage runs
  on the input stage's version (with replicas at most ``rules.stash_limit``, fewer where some
  versions are used by no minibatch of this replica).
- minibatches in flight (forwarded, not yet backpropagated): ``w_s + 1`` in the modes that do not
  flush; in ``flush`` at most the batch's share of a replica; in ``gpipe`` the whole share; in
  ``zero_bubble`` a minibatch holds them until its weight half, ``rules.weight_lag`` more.
- messages in flight per link (``frames_in_flight``): sent and not yet received, the most the
  built schedule allows (``schedule.in_flight``); a rank's channel holds that many sent frames
  per link, and one receive frame per link it receives on (posted ahead).
- bytes: weights x versions plus activations x minibatches in flight (the paper's rule); with
  ``recompute`` a stage but the last keeps its inputs instead, plus one minibatch's activations
  for the replay; plus the frames, each the size of what crosses its link (``frame_bytes``).
"""

from __future__ import annotations

import math

from pl_pipedream.planner.chunks import CONTIGUOUS
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.actions import Action
from pl_pipedream.schedule.build import build, expand, replica_order
from pl_pipedream.schedule.footprint import in_flight_counts
from pl_pipedream.schedule.in_flight import (
    Outgoing,
    every_rank_sends_in_flight,
    sends_in_flight,
    sends_in_flight_between,
)
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.rules import weight_version

__all__ = [
    "activations_kept",
    "frame_bytes",
    "frames_in_flight",
    "kept_bytes",
    "minibatches_in_flight",
    "rank_frame_bytes",
    "stage_bytes",
    "versions_kept",
]


def versions_kept(plan: Plan, sync: SyncMode, microbatches: int, stage: int) -> int:
    """The most weight versions a replica of ``stage`` holds once the pipeline is full."""
    if sync.flushes:
        return 1
    if not sync.updates_per_minibatch:
        return 2  # 2bw: the version the batch runs on and the newest
    this, first = plan.stages[stage], plan.stages[0]
    # Past the warm-up the count repeats every r_0 minibatches of a replica (r_0 more of them
    # move every version along by r_0); take the most over one such period per replica.
    start = (plan.num_workers + 1) * first.replicas
    return max(
        len(_held(plan, sync, stage, replica, oldest))
        for replica in range(this.replicas)
        for oldest in range(start, start + first.replicas)
    )


def _held(plan: Plan, sync: SyncMode, stage: int, replica: int, oldest: int) -> set[int]:
    """The versions a replica holds while its ``oldest``-th minibatch is the oldest in flight
    (per-minibatch modes): its newest, ``oldest``, and every version that minibatch or a later
    one runs on up to it."""
    replicas = plan.stages[stage].replicas
    held, local = {oldest}, oldest
    while (used := weight_version(plan, sync, 1, stage, local * replicas + replica)) <= oldest:
        held.add(used)
        local += 1
    return held


def minibatches_in_flight(plan: Plan, sync: SyncMode, microbatches: int, stage: int) -> int:
    """The most minibatches a replica of ``stage`` holds activations for at once (in a mode of
    several stages per rank, counted on the built schedule of one batch)."""
    if sync.placement != CONTIGUOUS:
        schedule = build(plan, sync, 1, microbatches)
        (rank,) = plan.stages[stage].ranks
        return max(in_flight_counts([a for a in schedule.actions[rank] if a.stage == stage]))
    this = plan.stages[stage]
    share = max(1, microbatches // this.replicas)
    if sync.forwards_first:
        return share
    if sync.flushes:
        return min(share, this.warmup + 1 + rules.weight_lag(plan, sync, stage))
    return this.warmup + 1


def stage_bytes(
    plan: Plan, sync: SyncMode, microbatches: int, stage: int, recompute: bool = False
) -> float:
    """The bytes a replica of ``stage`` needs under ``sync``: ``kept_bytes`` plus the frames of
    its messages in flight."""
    kept = kept_bytes(plan, sync, microbatches, stage, recompute)
    return kept + frame_bytes(plan, sync, microbatches, stage)


def kept_bytes(
    plan: Plan, sync: SyncMode, microbatches: int, stage: int, recompute: bool = False
) -> float:
    """A replica of ``stage``'s weights times the versions it keeps plus what its minibatches in
    flight keep for their backward passes (no message frames)."""
    weights = versions_kept(plan, sync, microbatches, stage) * plan.stages[stage].parameter_bytes
    return weights + activations_kept(plan, sync, microbatches, stage, recompute)


def activations_kept(
    plan: Plan, sync: SyncMode, microbatches: int, stage: int, recompute: bool = False
) -> float:
    """What the minibatches in flight at ``stage`` keep for their backward passes: their
    activations, or with ``recompute`` (a stage but the last) their inputs plus one minibatch's
    activations for the replay."""
    this = plan.stages[stage]
    flight = minibatches_in_flight(plan, sync, microbatches, stage)
    if recompute and stage < plan.num_stages - 1:
        return flight * this.input_bytes + this.activation_bytes
    return flight * this.activation_bytes


def frames_in_flight(
    plan: Plan, sync: SyncMode, microbatches: int, rank: int
) -> dict[Outgoing, int]:
    """For each link ``rank`` sends on, keyed (peer, ``"a"`` or ``"g"``), the most messages
    sent on it and not yet received at once (``schedule.in_flight``), over a run long enough
    for the count to repeat (the pipeline full for a whole batch; ``tests/schedule/
    test_memory.py`` holds it equal to longer runs). On a straight pipeline only the rank's and
    its neighbours' lists are built, so the cost does not grow with the stages."""
    batches, mode = _run_length(plan, sync, microbatches)
    if _replicated(plan) or plan.chunks_per_rank > 1:
        return sends_in_flight(build(plan, mode, batches, microbatches), rank)
    mine = _rank_list(plan, mode, batches, microbatches, rank)
    counts: dict[Outgoing, int] = {}
    for peer in (rank - 1, rank + 1):
        if 0 <= peer < plan.num_workers:
            theirs = _rank_list(plan, mode, batches, microbatches, peer)
            counts |= sends_in_flight_between(mine, theirs, rank, peer)
    return counts


def _run_length(plan: Plan, sync: SyncMode, microbatches: int) -> tuple[int, SyncMode]:
    batches = 1 + math.ceil(plan.num_workers / microbatches)
    return batches, rules.check_arguments(plan, sync, batches, microbatches)


def _replicated(plan: Plan) -> bool:
    return any(stage.replicas > 1 for stage in plan.stages)


def _rank_list(
    plan: Plan, sync: SyncMode, batches: int, microbatches: int, rank: int
) -> list[Action]:
    stage = plan.stage_of_rank(rank)
    tokens = replica_order(plan, sync, batches, microbatches, stage.index, stage.ranks.index(rank))
    return expand(plan, sync, microbatches, rank, tokens)


def frame_bytes(plan: Plan, sync: SyncMode, microbatches: int, stage: int) -> float:
    """The most bytes of message frames a replica of ``stage`` holds (``rank_frame_bytes``)."""
    ranks = plan.stages[stage].ranks
    if _replicated(plan):  # one pass over the schedule for every rank
        batches, mode = _run_length(plan, sync, microbatches)
        every = every_rank_sends_in_flight(build(plan, mode, batches, microbatches))
        return max(sum(_frame_bytes(plan, rank, every[rank])) for rank in ranks)
    return max(sum(rank_frame_bytes(plan, sync, microbatches, rank)) for rank in ranks)


def rank_frame_bytes(
    plan: Plan, sync: SyncMode, microbatches: int, rank: int
) -> tuple[float, float]:
    """The bytes of the frames ``rank`` holds: sent (on each link it sends on, its messages in
    flight, ``frames_in_flight``) and posted to receive (one per link it receives on, posted
    ahead). A frame is the size of what crosses its link: an activation of the lower stage of
    the two, or the gradient of it."""
    return _frame_bytes(plan, rank, frames_in_flight(plan, sync, microbatches, rank))


def _frame_bytes(plan: Plan, rank: int, in_flight: dict[Outgoing, int]) -> tuple[float, float]:
    here = plan.stage_of_rank(rank).index
    sent = sum(count * _link_bytes(plan, here, peer) for (peer, _), count in in_flight.items())
    return sent, sum(_link_bytes(plan, here, peer) for peer in _neighbours(plan, rank))


def _neighbours(plan: Plan, rank: int) -> set[int]:
    """The ranks ``rank`` exchanges messages with: the replicas of the stages before and after
    it that serve its minibatches (round robin, ``rules.rank_of``)."""
    stage = plan.stage_of_rank(rank)
    replica, peers = stage.ranks.index(rank), set()
    for index in (stage.index - 1, stage.index + 1):
        if 0 <= index < plan.num_stages:
            other = plan.stages[index]
            period = stage.replicas * other.replicas
            peers |= {rules.rank_of(other, i) for i in range(replica, period, stage.replicas)}
    return peers


def _link_bytes(plan: Plan, stage: int, peer: int) -> float:
    """What one message between a rank of ``stage`` and ``peer`` carries: the output of the
    lower of the two stages (its activation forward, the gradient of it back)."""
    lower = min(stage, plan.stage_of_rank(peer).index)
    return plan.stages[lower].output_bytes
