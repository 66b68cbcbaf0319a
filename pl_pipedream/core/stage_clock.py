"""One rank's measured layer times, from the timeline the executor already records.

The executor keeps every action's start and end (``runtime.timeline``; ``record_timeline``).
``rank_times`` takes a rank's last ``window`` forward and backward actions, takes their median, and
splits the stage's median forward and backward milliseconds among its layers: in proportion to
the layers' own forward times when a ``LayerClock`` timed them (forward hooks, so a layer that
became costly shows in its own share; the median call, as for the stage's total), else to the
profile's. The result, one ``RankTimes`` per
rank gathered to every rank (``gather_rank_times``, one collective), is what
``planner.measured.measured_model`` turns into per-layer costs and per-rank speeds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from pl_pipedream.planner.measured import RankTimes
from pl_pipedream.profile.graph import Profile
from pl_pipedream.runtime.timeline import TimelineEvent

__all__ = ["LayerClock", "gather_rank_times", "rank_times"]


class LayerClock:
    """Forward seconds per layer, each call timed by forward pre- and post-hooks
    (``perf_counter``). A layer's time is the median of its calls times their number, so that
    one call during which the process lost its core (a shared machine) does not shift the
    layers' shares, as ``rank_times`` takes the median action for the stage's total."""

    def __init__(self, layers: Mapping[str, nn.Module]) -> None:
        self.calls: dict[str, list[float]] = {name: [] for name in layers}
        self._started: dict[str, float] = {}
        self._handles: list[RemovableHandle] = []
        for name, layer in layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._start(name)))
            self._handles.append(layer.register_forward_hook(self._stop(name)))

    def _start(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object) -> None:
            self._started[name] = time.perf_counter()

        return hook

    def _stop(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object, output: object) -> None:
            self.calls[name].append(time.perf_counter() - self._started.pop(name))

        return hook

    def shares(self) -> dict[str, float]:
        """Each layer's share of the forward time timed so far (empty: nothing timed yet)."""
        seconds = {n: statistics.median(c) * len(c) if c else 0.0 for n, c in self.calls.items()}
        total = math.fsum(seconds.values())
        return {n: s / total for n, s in seconds.items()} if total > 0 else {}

    def reset(self) -> None:
        self.calls = {name: [] for name in self.calls}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def rank_times(
    events: Sequence[TimelineEvent],
    nodes: Sequence[str],
    profile: Profile,
    rank: int,
    window: int,
    forward_shares: Mapping[str, float] | None = None,
) -> RankTimes:
    """``rank``'s median per-layer milliseconds over its last ``window`` forwards and backwards."""
    forward = _median_ms(events, rank, "FORWARD", window)
    backward = _median_ms(events, rank, "BACKWARD", window)
    profiled = [profile.node(n) for n in nodes]
    if forward_shares:
        weights = [forward_shares.get(n.node_id, 0.0) for n in profiled]
        # A layer's backward grows as its forward does: its profiled backward times its ratio.
        ratios = [
            w / n.forward_ms if n.forward_ms > 0 else 0.0
            for w, n in zip(weights, profiled, strict=True)
        ]
        back_weights = [n.backward_ms * r for n, r in zip(profiled, ratios, strict=True)]
    else:
        weights = [n.forward_ms for n in profiled]
        back_weights = [n.backward_ms for n in profiled]
    return RankTimes(
        rank,
        _split(forward, nodes, weights),
        _split(backward, nodes, back_weights),
        steps=window,
    )


def gather_rank_times(times: RankTimes) -> list[RankTimes]:
    """Every rank's ``RankTimes``, on every rank (``all_gather_object``: one collective)."""
    gathered: list[RankTimes | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return [t for t in gathered if t is not None]


def _median_ms(events: Sequence[TimelineEvent], rank: int, kind: str, window: int) -> float:
    """Median milliseconds of ``rank``'s last ``window`` actions of ``kind`` (0: none): an
    action during which the process lost its core (a shared machine) does not count as the
    stage's cost."""
    durations: list[float] = []
    for event in reversed(events):
        if event.rank == rank and event.kind == kind:
            durations.append(event.end - event.start)
            if len(durations) == window:
                break
    return 1000.0 * statistics.median(durations) if durations else 0.0


def _split(total: float, nodes: Sequence[str], weights: Sequence[float]) -> dict[str, float]:
    """``total`` shared among ``nodes`` in proportion to ``weights`` (equally if all are 0)."""
    whole = math.fsum(weights)
    if whole <= 0:
        return {n: total / len(nodes) for n in nodes} if nodes else {}
    return {n: total * w / whole for n, w in zip(nodes, weights, strict=True)}
