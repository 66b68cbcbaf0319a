"""pl-pipedream: PipeDream pipeline-parallel training as a PyTorch Lightning strategy.

The pure layers (profiles, planner, schedules) import neither torch nor Lightning; the runtime
and the strategy do.
"""

from __future__ import annotations

__version__ = "0.1.0"

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.planner.topology import Level, Topology
from pl_pipedream.profile.graph import Profile

__all__ = ["Level", "Plan", "Profile", "Stage", "Topology", "__version__", "plan"]
