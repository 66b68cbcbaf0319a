"""A plan of one stage per rank recut into chunks, so that a chunked schedule can be weighed
against the others on the same ranks with the same work per rank.

The model's layers (the stages' nodes in order) are cut into ``p v`` consecutive chunks as evenly
as their count allows and placed interleaved or in a V (module ``chunks``). The plan holds no
per-layer times, so each chunk on rank ``r`` gets ``1 / v`` of stage ``r``'s forward and backward
times, weights and activations, and every boundary carries the largest activation the plan sends:
each rank keeps its work and the messages keep their size, which is the comparison the closed
forms make (Narayanan et al., SC'21 section 2.2; Qi et al., ICLR'24 section 6).
"""

from __future__ import annotations

from dataclasses import replace

from pl_pipedream.planner.chunks import CONTIGUOUS, V_SHAPE, stage_ranks
from pl_pipedream.planner.plan import Plan, PlanError, Stage, with_warmup

__all__ = ["recut"]


def recut(plan: Plan, placement: str, chunks: int = 2) -> Plan:
    """``plan`` (one single-replica stage per rank) as ``chunks`` stages per rank."""
    if plan.placement != CONTIGUOUS or any(stage.replicas > 1 for stage in plan.stages):
        raise PlanError(
            f"only a straight plan of one single-replica stage per rank can be recut into "
            f"chunks (shape: {plan.shape}, placement: {plan.placement}); plan with --straight"
        )
    if placement == V_SHAPE:
        chunks = 2
    ranks = plan.num_stages
    count = ranks * chunks
    layers = [node for stage in plan.stages for node in stage.nodes]
    if len(layers) < count:
        raise PlanError(
            f"{placement} needs a layer per chunk (layers: {len(layers)}, chunks: {count}); "
            "profile the model at a finer grain"
        )
    mapping = stage_ranks(placement, ranks, chunks)
    boundary = max(stage.output_bytes for stage in plan.stages)
    stages, start = [], 0
    for index, rank in enumerate(mapping):
        size = len(layers) // count + (1 if index < len(layers) % count else 0)
        own = plan.stages[rank]
        stages.append(
            Stage(
                index=index,
                nodes=tuple(layers[start : start + size]),
                replicas=1,
                ranks=(rank,),
                forward_ms=own.forward_ms / chunks,
                backward_ms=own.backward_ms / chunks,
                parameter_bytes=own.parameter_bytes / chunks,
                input_bytes=boundary if index > 0 else plan.stages[0].input_bytes,
                output_bytes=boundary if index < count - 1 else 0.0,
                activation_bytes=own.activation_bytes / chunks,
            )
        )
        start += size
    meta = {**plan.meta, "recut": f"{placement}, {chunks} chunks per rank"}
    return replace(plan, stages=with_warmup(stages), meta=meta)
