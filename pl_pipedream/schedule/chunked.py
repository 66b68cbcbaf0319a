"""The orders of the modes that give each rank several stages (chunks), one batch at a time.

Both modes flush after every batch: batch ``t`` runs on version ``t`` of every stage, and each
stage steps once, right after its last weight gradient of the batch, so the result equals one
device. A token here is ``(kind, stage, minibatch)``; ``wrap`` adds the messages.

- ``interleaved`` (Megatron-LM's interleaved 1F1B, Narayanan et al., SC'21 section 2.2): rank
  ``r`` of ``p`` holds stages ``r + c p`` for chunks ``c < v``. Its ``k``-th forward is of chunk
  ``(k // p) mod v`` and microbatch ``(k // (p v)) p + k mod p`` (microbatches go in groups of
  ``p`` through one chunk, then the next); its ``k``-th backward the same with chunks reversed.
  A warm-up of ``2 (p - 1 - r) + (v - 1) p`` forwards, then one forward and one backward, then
  the backwards owed.
- ``zbv`` (ZB-V, Qi et al., ICLR'24 section 6; the order of torch's ``ScheduleZBVZeroBubble``):
  rank ``r`` holds stage ``r`` (chunk 0) and ``2p - 1 - r`` (chunk 1), backwards split into an
  input half ``I`` and a weight half ``W``. Warm-up: ``2 (p - r) - 1`` forwards of chunk 0, then
  ``r`` pairs (chunk 1, chunk 0), then ``p - r`` times F, I, W of chunk 1; steady: F, I, W of
  chunk 0 then of chunk 1; cool-down: input halves first, the weight halves they leave at the
  end. Counts are those of ``max(m, 2p - 1)`` microbatches, the ones past ``m`` dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule.actions import Action
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.wrap import place, wrap

__all__ = ["chunked_lists", "interleaved_order", "zbv_order"]

Token = tuple[str, int, int]  # kind, stage, minibatch (update number for "U")
_WEIGHT_GRADS = ("B", "W")


def chunked_lists(
    plan: Plan,
    sync: SyncMode,
    num_batches: int,
    microbatches: int,
    scope: frozenset[int] | None,
) -> tuple[tuple[Action, ...], ...]:
    """Every held rank's list (the others empty) of ``num_batches`` flushed batches."""
    lists: list[tuple[Action, ...]] = []
    for rank in range(plan.num_workers):
        if scope is not None and rank not in scope:
            lists.append(())
            continue
        places = {
            stage.index: place(plan, rank, stage.index) for stage in plan.stages_of_rank(rank)
        }
        out: list[Action] = []
        for batch in range(num_batches):
            for kind, stage, index in _batch_order(plan, sync, microbatches, rank, batch):
                wrap(plan, sync, microbatches, places[stage], (kind, index), out)
        lists.append(tuple(out))
    return tuple(lists)


def _batch_order(
    plan: Plan, sync: SyncMode, microbatches: int, rank: int, batch: int
) -> list[Token]:
    """Rank's tokens for one batch, each stage's update right after its last weight gradient."""
    ranks, first = plan.num_workers, batch * microbatches
    if sync is SyncMode.INTERLEAVED:
        local = interleaved_order(ranks, plan.chunks_per_rank, microbatches, rank)
    else:
        local = zbv_order(ranks, microbatches, rank)
    tokens = [(kind, stage, first + j) for kind, stage, j in local]
    last = {stage: pos for pos, (kind, stage, _) in enumerate(tokens) if kind in _WEIGHT_GRADS}
    out: list[Token] = []
    for pos, token in enumerate(tokens):
        out.append(token)
        if last.get(token[1]) == pos:
            out.append(("U", token[1], batch + 1))
    return out


def interleaved_order(ranks: int, chunks: int, microbatches: int, rank: int) -> list[Token]:
    """Megatron's interleaved 1F1B on ``rank`` for one batch (microbatches numbered from 0)."""
    total = microbatches * chunks
    group = ranks * chunks

    def forward(k: int) -> Token:
        chunk = (k // ranks) % chunks
        return ("F", chunk * ranks + rank, (k // group) * ranks + k % ranks)

    def backward(k: int) -> Token:
        chunk = chunks - 1 - (k // ranks) % chunks
        return ("B", chunk * ranks + rank, (k // group) * ranks + k % ranks)

    warmup = min(total, 2 * (ranks - 1 - rank) + (chunks - 1) * ranks)
    tokens = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        tokens += [forward(warmup + k), backward(k)]
    return tokens + [backward(k) for k in range(total - warmup, total)]


def zbv_order(ranks: int, microbatches: int, rank: int) -> list[Token]:
    """ZB-V on ``rank`` for one batch (microbatches numbered from 0)."""
    stages = (rank, 2 * ranks - 1 - rank)
    return [
        (kind, stages[chunk], j)
        for kind, chunk, j in _zbv_steps(ranks, max(microbatches, 2 * ranks - 1), rank)
        if j < microbatches
    ]


def _zbv_steps(ranks: int, n: int, rank: int) -> Iterator[tuple[str, int, int]]:
    """(kind, chunk, microbatch) of ZB-V's warm-up, steady state and cool-down over ``n``."""
    count = {("F", 0): 0, ("F", 1): 0, ("I", 0): 0, ("I", 1): 0, ("W", 0): 0, ("W", 1): 0}

    def run(kind: str, chunk: int) -> tuple[str, int, int]:
        j = count[(kind, chunk)]
        count[(kind, chunk)] += 1
        return (kind, chunk, j)

    for _ in range(2 * (ranks - rank) - 1):
        yield run("F", 0)
    for _ in range(rank):
        yield run("F", 1)
        yield run("F", 0)
    for _ in range(ranks - rank):
        yield from (run("F", 1), run("I", 1), run("W", 1))
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            yield run("F", 0)
        yield from (run("I", 0), run("W", 0), run("F", 1), run("I", 1), run("W", 1))
    for _ in range(rank):
        yield from (run("I", 0), run("I", 1))
    for _ in range(ranks - rank):
        yield from (run("I", 0), run("W", 0))
    while count[("W", 1)] < count[("I", 1)]:
        yield run("W", 1)
    while count[("W", 0)] < count[("I", 0)]:
        yield run("W", 0)
