"""What a plan predicted slower than data parallelism would need, in one printable line.

PipeDream's DP includes data parallelism (one stage replicated on every worker), so a plan slower
than it always has a reason outside the cost model: the microbatches per batch admit fewer replica
counts (``planner.admission``), the model was built empty and planned straight, or a memory limit
rules the whole-model replicas out. The line names the change that would admit a faster plan and
falls back on data parallelism itself (DDP) when the pipeline cannot win.
"""

from __future__ import annotations

from pl_pipedream.planner.admission import fewest_microbatches
from pl_pipedream.planner.plan import Plan

__all__ = ["advise", "slower_than_data_parallel"]

_MARGIN = 1e-9  # a plan that is data parallelism can differ from its own time in the last bits


def slower_than_data_parallel(plan: Plan) -> bool:
    """Whether ``plan`` is predicted slower than data parallelism on the same workers."""
    return plan.speedup_over_data_parallel < 1.0 - _MARGIN


def advise(
    plan: Plan, free: Plan | None, microbatches: int | None, straight_because: str | None = None
) -> str | None:
    """The advice for ``plan``, or None when it is predicted at least as fast as data parallelism.

    ``free`` is the best plan without the microbatch constraint (None when not planned);
    ``straight_because`` why replication was ruled out (e.g. a model built empty).
    """
    if not slower_than_data_parallel(plan):
        return None
    speedup = plan.speedup_over_data_parallel
    needs = []
    if (
        free is not None
        and microbatches is not None
        and free.slowest_stage_time < plan.slowest_stage_time
    ):
        more = fewest_microbatches(free, microbatches)
        needs.append(
            f"microbatches={more} admits the {free.shape} plan "
            f"({free.speedup_over_data_parallel:.2f}x; replica counts must divide the "
            f"microbatches per batch, now {microbatches})"
        )
    if straight_because:
        needs.append(f"replicated stages (ruled out: {straight_because})")
    if plan.memory is not None:
        needs.append("more memory per device (the limit rules out larger replicated stages)")
    needs.append("data parallelism, Trainer(strategy='ddp'), where the model fits one device")
    return f"predicted slower than data parallelism ({speedup:.2f}x); faster: " + "; or ".join(
        needs
    )
