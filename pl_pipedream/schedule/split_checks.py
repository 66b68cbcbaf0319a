"""The rules of a split backward, one function each; each returns a ``Problem`` or None.

A mode that splits the backward (``SyncMode.splits_backward``) runs, for every minibatch at every
stage, one input half (``BACKWARD_INPUT``) and one weight half (``BACKWARD_WEIGHT``) and no whole
``BACKWARD``; the other modes run no half. The weight half comes after the input half on the same
rank, since it reads the graph and the output gradient that the input half used, and it uses the
weights of the minibatch's forward: the gradient it adds is that of the weights the activations
came from (weight stashing, SOSP'19 section 3.3). ``checks.CHECKS`` runs these before the pairing
and version rules, so a broken split is named as such.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterator

from pl_pipedream.schedule.actions import Action, ActionKind, Schedule
from pl_pipedream.schedule.problem import Cell, Problem

__all__ = ["cells_of", "check_split_counts", "check_split_order", "check_split_versions"]

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD
_I, _W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_HALVES = (_I, _W)
_COMPUTES = (_F, _B, _I, _W)

Key = tuple[ActionKind, int, int | None]  # kind, stage, minibatch


def _computes(schedule: Schedule) -> Iterator[tuple[Cell, Action]]:
    for rank in schedule.held_ranks:
        for pos, action in enumerate(schedule.actions[rank]):
            if action.kind in _COMPUTES:
                yield (rank, pos), action


def cells_of(schedule: Schedule, kinds: Collection[ActionKind]) -> dict[Key, list[Cell]]:
    """Where each action of ``kinds`` in the held lists ran, by (kind, stage, minibatch); a key
    that none has reads as an empty list."""
    seen: dict[Key, list[Cell]] = defaultdict(list)
    for rank in schedule.held_ranks:
        for pos, action in enumerate(schedule.actions[rank]):
            if action.kind in kinds:
                seen[(action.kind, action.stage, action.minibatch)].append((rank, pos))
    return seen


def _minibatches(schedule: Schedule) -> Iterator[tuple[int, int, dict[ActionKind, list[Cell]]]]:
    """Each minibatch of each stage whose every replica's list is held (module ``scope``), with
    where each compute kind of it ran."""
    seen = cells_of(schedule, _COMPUTES)
    for stage in schedule.plan.stages:
        if all(schedule.holds(rank) for rank in stage.ranks):
            for i in range(schedule.num_minibatches):
                yield stage.index, i, {kind: seen[(kind, stage.index, i)] for kind in (_F, _I, _W)}


def check_split_counts(schedule: Schedule) -> Problem | None:
    """Split modes: one input and one weight half per minibatch and stage, no whole backward;
    the other modes: no half."""
    split = schedule.sync.splits_backward
    for cell, action in _computes(schedule):
        if (action.kind is _B and split) or (action.kind in _HALVES and not split):
            wanted = "input and weight halves" if split else "whole backwards"
            return Problem(
                f"{schedule.sync} runs {wanted} (action {action}: {action.kind.name}); build "
                "the schedule with build(plan, sync, ...)",
                (cell,),
            )
    if not split:
        return None
    for stage, i, cells in _minibatches(schedule):
        inputs, weights = cells[_I], cells[_W]
        if len(inputs) != 1 or len(weights) != 1:
            return Problem(
                f"a split backward runs one input half and one weight half per minibatch and "
                f"stage (stage {stage}, minibatch {i}: input halves {len(inputs)}, weight "
                f"halves {len(weights)}); give every minibatch both halves once",
                tuple(inputs + weights),
            )
    return None


def check_split_order(schedule: Schedule) -> Problem | None:
    """The weight half of a minibatch runs after its input half, on the same rank."""
    if not schedule.sync.splits_backward:
        return None
    for stage, i, cells in _minibatches(schedule):
        inputs, weights = cells[_I], cells[_W]
        if len(inputs) != 1 or len(weights) != 1:
            continue  # check_split_counts names it
        (i_rank, i_pos), (w_rank, w_pos) = inputs[0], weights[0]
        if i_rank != w_rank or w_pos < i_pos:
            return Problem(
                f"a weight half runs after its input half on the same rank (stage {stage}, "
                f"minibatch {i}: input half at rank {i_rank} position {i_pos}, weight half "
                f"at rank {w_rank} position {w_pos}); move the weight half later",
                (inputs[0], weights[0]),
            )
    return None


def check_split_versions(schedule: Schedule) -> Problem | None:
    """The weight half of a minibatch uses the weight version of its forward."""
    if not schedule.sync.splits_backward:
        return None
    for stage, i, cells in _minibatches(schedule):
        forwards, weights = cells[_F], cells[_W]
        if len(forwards) != 1 or len(weights) != 1:
            continue  # check_split_counts and check_pairs name it
        forward = schedule.actions[forwards[0][0]][forwards[0][1]]
        weight = schedule.actions[weights[0][0]][weights[0][1]]
        if weight.version != forward.version:
            return Problem(
                f"a weight half uses the weights of its forward (stage {stage}, minibatch "
                f"{i}: forward {forward}, weight half {weight}); stash the forward's version "
                "until the weight half",
                (forwards[0], weights[0]),
            )
    return None
