"""Several stages (chunks) per rank: the two stage-to-rank mappings a schedule knows.

A plan over ``p`` ranks may cut the model into ``p v`` stages and give each rank ``v`` of them
(its chunks). Two mappings have schedules (module ``schedule.chunked``):

- interleaved (Megatron-LM's interleaved 1F1B, Narayanan et al., SC'21 section 2.2): stage ``s``
  runs on rank ``s mod p``, so rank ``r`` holds stages ``r, r + p, ..., r + (v - 1) p``;
- V (ZB-V, Qi et al., ICLR'24 section 6): ``v = 2``, rank ``r`` holds stages ``r`` and
  ``2p - 1 - r``, so the first and the last stage share rank 0 and the turn of the V (stages
  ``p - 1`` and ``p``) stays on rank ``p - 1``.

``placement_of`` names the mapping of a plan's stage ranks; ``Plan`` accepts the three mappings
(contiguous, interleaved, V) and raises ``PlanError`` for any other.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CONTIGUOUS",
    "INTERLEAVED",
    "PLACEMENTS",
    "V_SHAPE",
    "interleaved_ranks",
    "placement_of",
    "stage_ranks",
    "v_ranks",
]

CONTIGUOUS = "contiguous"  # one stage per rank (replicas allowed): PipeDream's plans
INTERLEAVED = "interleaved"
V_SHAPE = "v"
PLACEMENTS = (CONTIGUOUS, INTERLEAVED, V_SHAPE)


def interleaved_ranks(num_ranks: int, chunks: int) -> tuple[int, ...]:
    """The rank of each of the ``num_ranks * chunks`` stages: stage ``s`` on ``s mod p``."""
    return tuple(s % num_ranks for s in range(num_ranks * chunks))


def v_ranks(num_ranks: int) -> tuple[int, ...]:
    """The rank of each of the ``2 p`` stages of a V: ``0, 1, .., p - 1, p - 1, .., 1, 0``."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def stage_ranks(placement: str, num_ranks: int, chunks: int) -> tuple[int, ...]:
    """The rank of each stage under ``placement`` (``chunks`` per rank; a V has 2)."""
    if placement == INTERLEAVED:
        return interleaved_ranks(num_ranks, chunks)
    if placement == V_SHAPE:
        return v_ranks(num_ranks)
    return tuple(range(num_ranks))


def placement_of(ranks: Sequence[Sequence[int]]) -> str | None:
    """The mapping of a plan whose stage ``s`` runs on ``ranks[s]`` (one tuple per stage):
    ``CONTIGUOUS`` when every rank serves one stage, ``INTERLEAVED`` or ``V_SHAPE`` when each
    rank serves several single-replica stages in that order, None for any other mapping.

    With one rank and two stages both chunked mappings coincide; it is called interleaved.
    """
    flat = [rank for stage in ranks for rank in stage]
    if len(flat) == len(set(flat)):
        return CONTIGUOUS
    if any(len(stage) != 1 for stage in ranks):
        return None
    num_ranks = len(set(flat))
    if len(flat) % num_ranks:
        return None
    if tuple(flat) == interleaved_ranks(num_ranks, len(flat) // num_ranks):
        return INTERLEAVED
    if tuple(flat) == v_ranks(num_ranks):
        return V_SHAPE
    return None
