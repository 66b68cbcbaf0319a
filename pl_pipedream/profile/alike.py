"""Equal costs for identical layers, so that profiling noise cannot decide between equal plans.

Layers of the same structure (the same module, parameter shapes and input and output shapes:
the ``keys`` the profiler gives) cost the same; measured, their times still differ by noise, and
the planner's choice between cuts that differ only in which of them a stage holds would follow
that noise from run to run. Each group of such layers gets the mean of its measured forward and
backward times (``math.fsum``: exact, in any order). A group whose times differ by more than
noise (the slowest over ``SPREAD`` times the fastest, and by more than ``FLOOR_MS``) is left as
measured: the structure did not show what makes them differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from pl_pipedream.profile.graph import Node, Profile, ProfileError

__all__ = ["FLOOR_MS", "SPREAD", "equalise"]

SPREAD = 1.5  # slowest / fastest compute time still taken for noise
FLOOR_MS = 0.05  # differences below this are noise whatever the ratio


def equalise(profile: Profile, keys: Sequence[str]) -> Profile:
    """``profile`` with the layers of equal ``keys`` (one per node) given their mean times."""
    if len(keys) != len(profile.nodes):
        raise ProfileError(
            f"give one key per node (nodes: {len(profile.nodes)}, keys: {len(keys)})"
        )
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    nodes = list(profile.nodes)
    for members in groups.values():
        if len(members) > 1 and _noise_only([nodes[i] for i in members]):
            forward = math.fsum(nodes[i].forward_ms for i in members) / len(members)
            backward = math.fsum(nodes[i].backward_ms for i in members) / len(members)
            for i in members:
                nodes[i] = replace(nodes[i], forward_ms=forward, backward_ms=backward)
    return replace(profile, nodes=tuple(nodes))


def _noise_only(nodes: Sequence[Node]) -> bool:
    """Whether the nodes' compute times differ by no more than noise."""
    times = [node.compute_ms for node in nodes]
    low, high = min(times), max(times)
    return high - low <= FLOOR_MS or high <= SPREAD * low
