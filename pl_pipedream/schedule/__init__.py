"""Per-rank action lists for every sync mode, with a validator, a renderer and a simulator.

Pure Python (no torch): ``SyncMode`` states what each mode implies; ``build`` turns a ``Plan``
into a ``Schedule``; ``validate`` checks it; ``render`` prints it as a step x rank table;
``simulate`` times it; ``segments`` cuts a rank's list into one piece per Lightning training
step, and ``SegmentStream`` gives those pieces for any step without building the whole run.
"""

from pl_pipedream.schedule.actions import BUSY_KINDS, Action, ActionKind, Schedule, ScheduleError
from pl_pipedream.schedule.build import build
from pl_pipedream.schedule.modes import CONTIGUOUS_MODES, SYNC_MODES, SyncMode
from pl_pipedream.schedule.render import render
from pl_pipedream.schedule.result import SimulationResult, bubble_fraction
from pl_pipedream.schedule.segments import segments
from pl_pipedream.schedule.simulate import simulate
from pl_pipedream.schedule.stream import SegmentStream
from pl_pipedream.schedule.validate import validate

__all__ = [
    "BUSY_KINDS",
    "CONTIGUOUS_MODES",
    "SYNC_MODES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "SegmentStream",
    "SimulationResult",
    "SyncMode",
    "bubble_fraction",
    "build",
    "render",
    "segments",
    "simulate",
    "validate",
]
