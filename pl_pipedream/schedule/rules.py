"""The update rules of every sync mode: which weights a minibatch uses, which update it feeds.

These functions are the single statement of the rules in docs/guide.md ("The sync modes"); the
builder places actions so that they hold and the validator checks them. Stage ``s`` has ``r_s``
replicas and ``w_s`` warm-up forwards per replica (``Stage.warmup``); minibatch ``i`` runs on
replica ``i mod r_s`` as that replica's local minibatch ``n = i // r_s`` (1F1B-RR, SOSP'19
section 3.2).

- ``async`` (weight stashing, section 3.3): version ``max(0, n - w_s)``; update ``u`` averages the
  gradients of minibatches ``(u-1) r_s .. u r_s - 1``, one per replica.
- ``vertical_sync``: every stage uses the weights that cover as many minibatches as the input
  stage's version does, ``c(i) = r_0 max(0, i // r_0 - w_0)``, i.e. version ``c(i) // r_s``; the
  updates are those of ``async``.
- ``2bw`` (PipeDream-2BW): batch ``t`` uses version ``max(0, t - 1)``; one update per batch.
- ``flush``, ``gpipe`` and ``zero_bubble``: batch ``t`` uses version ``t``; one update per batch.
  ``zero_bubble`` runs each backward as an input half and, ``weight_lag`` minibatches later, a
  weight half on the same weights.
- ``interleaved`` and ``zbv``: the same rule at every one of the stages a rank holds (module
  ``chunked``); each stage keeps its own version count and steps once per batch.
"""

from __future__ import annotations

import math

from pl_pipedream.planner import admission
from pl_pipedream.planner.chunks import CONTIGUOUS, stage_ranks
from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.schedule.modes import SYNC_MODES, SyncMode

__all__ = [
    "SYNC_MODES",
    "check_arguments",
    "check_placement",
    "fewest_microbatches",
    "num_updates",
    "rank_of",
    "stash_limit",
    "update_delay",
    "update_of",
    "weight_lag",
    "weight_version",
]


def rank_of(stage: Stage, minibatch: int) -> int:
    """The rank of the replica that serves ``minibatch`` at ``stage`` (round robin)."""
    return stage.ranks[minibatch % stage.replicas]


def weight_version(
    plan: Plan, sync: SyncMode, microbatches: int, stage: int, minibatch: int
) -> int:
    """The version of ``stage``'s weights that the forward and backward of ``minibatch`` use."""
    this = plan.stages[stage]
    if sync is SyncMode.ASYNC:
        return max(0, minibatch // this.replicas - this.warmup)
    if sync is SyncMode.VERTICAL_SYNC:
        first = plan.stages[0]
        covered = first.replicas * max(0, minibatch // first.replicas - first.warmup)
        return covered // this.replicas
    batch = minibatch // microbatches
    if sync is SyncMode.TWO_BW:
        return max(0, batch - 1)
    return batch


def weight_lag(plan: Plan, sync: SyncMode, stage: int) -> int:
    """How many weight halves a replica of ``stage`` holds back behind its input halves, so that
    they fill the drain's bubble (ZB-H1): ``w_0 - w_s``, which keeps a stage's activations in
    flight at the input stage's 1F1B peak, ``w_0 + 1``. Zero in a mode that does not split."""
    if not sync.splits_backward or sync.placement != CONTIGUOUS:
        return 0  # zbv orders its weight halves itself (module chunked)
    return max(0, plan.stages[0].warmup - plan.stages[stage].warmup)


def update_delay(plan: Plan, sync: SyncMode, stage: int) -> int:
    """How many of ``stage``'s own updates its weights lack when a minibatch runs on them, once
    the pipeline is full: ``w_s`` in ``async``; in ``vertical_sync`` the input stage's ``w_0``
    minibatches of its ``r_0`` replicas counted in this stage's updates, ``ceil(r_0 w_0 / r_s)``;
    one (batch) in ``2bw``; none in the flushed modes."""
    this, first = plan.stages[stage], plan.stages[0]
    if sync is SyncMode.ASYNC:
        return this.warmup
    if sync is SyncMode.VERTICAL_SYNC:
        return math.ceil(first.replicas * first.warmup / this.replicas)
    return 1 if sync is SyncMode.TWO_BW else 0


def update_of(plan: Plan, sync: SyncMode, microbatches: int, stage: int, minibatch: int) -> int:
    """The update (1, 2, ...) of ``stage`` that the gradient of ``minibatch`` goes into."""
    if sync.updates_per_minibatch:
        return minibatch // plan.stages[stage].replicas + 1
    return minibatch // microbatches + 1


def num_updates(plan: Plan, sync: SyncMode, num_batches: int, microbatches: int, stage: int) -> int:
    """How many updates ``stage`` applies over the whole schedule, drain included."""
    if sync.updates_per_minibatch:
        return num_batches * microbatches // plan.stages[stage].replicas
    return num_batches


def stash_limit(plan: Plan, sync: SyncMode, stage: int) -> int:
    """The most weight versions a replica of ``stage`` may hold at once.

    ``async`` keeps ``Stage.weight_versions`` (``w_s + 1``, NOAM at the input stage). Vertical
    sync must also keep the versions between the input stage's version and its own newest one:
    ``1 + ceil(r_0 w_0 / r_s)``. 2BW keeps two buffers; the flushed modes one.
    """
    this = plan.stages[stage]
    if sync is SyncMode.ASYNC:
        return this.weight_versions
    if sync is SyncMode.VERTICAL_SYNC:
        first = plan.stages[0]
        return 1 + math.ceil(first.replicas * first.warmup / this.replicas)
    if sync is SyncMode.TWO_BW:
        return 2
    return 1


def check_arguments(
    plan: Plan, sync: SyncMode | str, num_batches: int, microbatches: int
) -> SyncMode:
    """The ``SyncMode`` that ``sync`` names, once the arguments are checked.

    Raises ``ValueError`` when no schedule can be built from them; the message names the
    fewest microbatches that work (``fewest_microbatches``).
    """
    mode = SyncMode.parse(sync)
    for name, value in (("num_batches", num_batches), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer ({name}: {value!r}); pass >= 1")
    check_placement(plan, mode)
    fix = _use(fewest_microbatches(plan, mode, microbatches), mode)
    if mode is SyncMode.INTERLEAVED and microbatches % plan.num_workers:
        raise ValueError(
            f"{mode} feeds microbatches in groups of one per rank (microbatches: {microbatches}, "
            f"ranks: {plan.num_workers}); {fix}"
        )
    for stage in plan.stages:
        if microbatches % stage.replicas:
            raise ValueError(
                f"each batch must split evenly over a stage's replicas (stage {stage.index}: "
                f"replicas {stage.replicas}, microbatches: {microbatches}); {fix}"
            )
    if microbatches < mode.min_microbatches(plan.num_stages):
        raise ValueError(
            f"{mode} needs at least as many microbatches per batch as stages (microbatches: "
            f"{microbatches}, stages: {plan.num_stages}); {fix}, or sync='{SyncMode.FLUSH}'"
        )
    if mode is SyncMode.TWO_BW:
        _check_two_buffers(plan, microbatches, fix)
    return mode


def check_placement(
    plan: Plan, mode: SyncMode, call: str = "pl-pipedream simulate --sync {sync}"
) -> None:
    """A mode runs the stage-to-rank mapping it is built for (``SyncMode.placement``); ``call``
    is how the user picks a mode, quoted in the fix with the plan's mode in ``{sync}``."""
    if mode.placement == CONTIGUOUS and plan.placement == CONTIGUOUS:
        return
    ranks = tuple(stage.ranks[0] for stage in plan.stages)
    if mode.placement != CONTIGUOUS and plan.placement != CONTIGUOUS:
        if ranks == stage_ranks(mode.placement, plan.num_workers, plan.chunks_per_rank):
            return  # on one rank the interleaved and the V placement coincide
    fitting = next(m for m in SyncMode if m.placement == plan.placement)
    how = "Plan.from_balance([...], placement=" + repr(mode.placement) + ")"
    if mode.placement != CONTIGUOUS:
        how += f" or planner.recut.recut(plan, {mode.placement!r})"
    raise ValueError(
        f"sync='{mode}' runs plans placed {mode.placement!r}, and this plan is placed "
        f"{plan.placement!r} ({plan.chunks_per_rank} stage(s) per rank); use "
        f"{call.format(sync=fitting)} for this plan, or a plan placed {mode.placement!r}: {how}"
    )


def _check_two_buffers(plan: Plan, microbatches: int, fix: str) -> None:
    """2BW holds two versions only if a batch outlasts the pipeline's warm-up at every stage."""
    for stage in plan.stages:
        per_replica = microbatches // stage.replicas
        if per_replica < stage.warmup:
            raise ValueError(
                f"{SyncMode.TWO_BW} needs each replica to get at least its warm-up count of "
                f"microbatches per batch (stage {stage.index}: warm-up {stage.warmup}, "
                f"microbatches per replica {per_replica}); {fix}"
            )


def fewest_microbatches(plan: Plan, sync: SyncMode, at_least: int = 1) -> int:
    """The smallest count from ``at_least`` up that ``check_arguments`` accepts for ``plan``.

    It is a multiple of every stage's replicas and at least ``sync.min_microbatches``; 2BW also
    needs, at every stage, the warm-up forwards of each replica.
    """
    need = max(at_least, sync.min_microbatches(plan.num_stages))
    if sync is SyncMode.TWO_BW:
        need = max([need] + [stage.warmup * stage.replicas for stage in plan.stages])
    if sync is SyncMode.INTERLEAVED:
        return plan.num_workers * math.ceil(need / plan.num_workers)
    return admission.fewest_microbatches(plan, need)


def _use(microbatches: int, mode: SyncMode) -> str:
    """How a user asks for ``microbatches``: every front end's argument and the CLI's flag."""
    return f"use microbatches={microbatches} (pl-pipedream simulate --microbatches {microbatches})"
