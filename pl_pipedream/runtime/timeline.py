"""What the ranks actually did: a Chrome trace (opens in Perfetto) and measured bubbles.

Each executed action is an event with its start and end on ``time.perf_counter``, a clock shared
by the processes of one machine. A rank's bubble is the share of its span (first start to last
end) in which it ran no forward, backward or update: waiting for messages counts as bubble,
as it does in the simulator.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from pl_pipedream.schedule.actions import Action
from pl_pipedream.schedule.result import BUSY_KINDS, bubble_fraction

__all__ = [
    "Recording",
    "TimelineEvent",
    "bubble_fractions",
    "chrome_trace",
    "gather_trace",
    "write_trace",
]


@dataclass(frozen=True)
class TimelineEvent:
    """One executed action with its wall-clock start and end (seconds, ``time.perf_counter``)."""

    rank: int
    action: str
    kind: str
    start: float
    end: float


class Recording:
    """The actions a rank ran, each kept as the action and two clock readings and named only
    when read (1.4 us each); a rank of several stages keeps one (``runtime.chunks``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._kept: list[tuple[Action, float, float]] = []

    def add(self, action: Action, start: float, end: float) -> None:
        self._kept.append((action, start, end))

    @property
    def events(self) -> list[TimelineEvent]:
        return [TimelineEvent(self.rank, str(a), a.kind.value, s, e) for a, s, e in self._kept]

    def take(self) -> list[TimelineEvent]:
        """The events so far, which then start again empty."""
        events = self.events
        self._kept.clear()
        return events


def bubble_fractions(events: Sequence[TimelineEvent]) -> dict[int, float]:
    """Per rank: 1 - busy time / (last end - first start)."""
    by_rank: dict[int, list[TimelineEvent]] = {}
    for event in events:
        by_rank.setdefault(event.rank, []).append(event)
    out = {}
    for rank, mine in sorted(by_rank.items()):
        busy = [(e.start, e.end) for e in mine if e.kind in BUSY_KINDS]
        out[rank] = bubble_fraction(busy, min(e.start for e in mine), max(e.end for e in mine))
    return out


def chrome_trace(events: Sequence[TimelineEvent]) -> dict[str, object]:
    """The Trace Event Format: one thread per rank, times in microseconds from the first start."""
    origin = min((e.start for e in events), default=0.0)
    trace = [
        {
            "name": event.action,
            "cat": event.kind,
            "ph": "X",
            "pid": 0,
            "tid": event.rank,
            "ts": (event.start - origin) * 1e6,
            "dur": (event.end - event.start) * 1e6,
        }
        for event in events
    ]
    ranks = sorted({e.rank for e in events})
    trace += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in ranks
    ]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_trace(events: Sequence[TimelineEvent], path: str | Path) -> dict[int, float]:
    """Write the trace JSON to ``path``; return the bubble fraction per rank."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events)))
    return bubble_fractions(events)


def gather_trace(events: Sequence[TimelineEvent], path: str | Path) -> dict[int, float] | None:
    """Gather every rank's events (a collective); rank 0 writes the trace to ``path`` and
    returns the bubble fraction per rank, the other ranks None."""
    gathered: list[Sequence[TimelineEvent]] = [()] * dist.get_world_size()
    dist.all_gather_object(gathered, list(events))
    if dist.get_rank() != 0:
        return None
    return write_trace([event for part in gathered for event in part], path)
