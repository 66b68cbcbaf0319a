"""Cut each rank's list into one segment per Lightning training step.

Lightning step ``t`` runs segment ``t``: a rank's list is cut right before the first forward of
batch ``t + 1`` (before the receive that feeds that forward), and the last segment keeps the
drain. The builder keeps every forward of batch ``t`` ahead of any forward of batch ``t + 1``.

The rule that makes this safe: inside segment ``t`` a rank never waits for something another
rank only does in a later segment. A receive's send lies in the same or an earlier segment, and the
replicas of an ``ALLREDUCE`` meet in the same segment. Then ranks that end every step together
(a barrier between steps) still finish: whatever a segment waits for is in its own or an earlier
segment. ``validate`` checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pl_pipedream.schedule.actions import Action, ActionKind, Schedule

__all__ = ["segment_indices", "segments"]


def cuts(actions: Sequence[Action], num_batches: int) -> list[int]:
    """Where each segment starts in one rank's list (``num_batches`` entries, the first 0)."""
    starts = [0]
    for pos, action in enumerate(actions):
        if action.kind is not ActionKind.FORWARD or action.batch is None:
            continue
        while len(starts) < num_batches and action.batch >= len(starts):
            start = pos - 1 if pos > 0 and _feeds(actions[pos - 1], action) else pos
            starts.append(max(start, starts[-1]))
    starts += [len(actions)] * (num_batches - len(starts))
    return starts


def _feeds(receive: Action, forward: Action) -> bool:
    return receive.kind is ActionKind.RECV_ACTIVATION and receive.minibatch == forward.minibatch


def segments(schedule: Schedule, rank: int) -> list[tuple[Action, ...]]:
    """Rank's actions for each Lightning step, in order; the last one includes the drain."""
    actions = schedule.actions[rank]
    starts = cuts(actions, schedule.num_batches) + [len(actions)]
    return [tuple(actions[a:b]) for a, b in zip(starts, starts[1:], strict=False)]


def segment_indices(schedule: Schedule) -> list[list[int]]:
    """For every rank and action, the segment (Lightning step) the action belongs to (an empty
    list for a rank outside the schedule's scope)."""
    out: list[list[int]] = []
    for rank, actions in enumerate(schedule.actions):
        if not schedule.holds(rank):
            out.append([])
            continue
        starts = cuts(actions, schedule.num_batches)
        index, current = [], 0
        for pos in range(len(actions)):
            while current + 1 < len(starts) and pos >= starts[current + 1]:
                current += 1
            index.append(current)
        out.append(index)
    return out
