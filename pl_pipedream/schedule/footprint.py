"""Memory a rank's list implies: stashed weight versions and activations in flight.

A replica holds weight version ``v`` from the ``STEP`` that produces it (version 0 from the start)
while ``v`` is its newest version or some later forward or backward still needs it (weight
stashing, SOSP'19 section 3.3). An activation is in flight from a minibatch's forward until its
backward (its weight half, in a split backward: that half still reads the graph).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pl_pipedream.schedule.actions import COMPUTE, WEIGHT_GRADS, Action, ActionKind

__all__ = ["in_flight_counts", "live_version_counts"]


def live_version_counts(actions: Sequence[Action]) -> list[int]:
    """Versions held after each action of one rank's list (entry 0: before the first action).

    A version used before any ``STEP`` produced it is not counted; the validator reports it.
    """
    created: dict[int, int] = {0: -1}
    last_use: dict[int, int] = {}
    for pos, action in enumerate(actions):
        if action.kind is ActionKind.STEP and action.version is not None:
            created.setdefault(action.version, pos)
        elif action.kind in COMPUTE and action.version is not None:
            last_use[action.version] = pos
    change = [0] * (len(actions) + 2)
    for version, start in created.items():
        superseded = created.get(version + 1, math.inf)
        end = max(last_use.get(version, -1), superseded)
        stop = len(actions) if end == math.inf else int(end)
        if stop > start:
            change[start + 1] += 1
            change[stop + 1] -= 1
    counts, running = [], 0
    for delta in change[:-1]:
        running += delta
        counts.append(running)
    return counts


def in_flight_counts(actions: Sequence[Action]) -> list[int]:
    """Activations held after each action (entry 0: before the first action)."""
    counts, running = [0], 0
    for action in actions:
        if action.kind is ActionKind.FORWARD:
            running += 1
        elif action.kind in WEIGHT_GRADS:
            running -= 1
        counts.append(running)
    return counts
