"""DECIDE: PipeDream's optimizer over a profile and a topology, producing a ``Plan``.

Pure Python and numpy: no torch import.
"""

from pl_pipedream.planner.optimize import data_parallel_time, plan
from pl_pipedream.planner.plan import Plan, PlanError, Stage
from pl_pipedream.planner.states import StateSpaceError
from pl_pipedream.planner.topology import Level, Topology, TopologyError

__all__ = [
    "Level",
    "Plan",
    "PlanError",
    "Stage",
    "StateSpaceError",
    "Topology",
    "TopologyError",
    "data_parallel_time",
    "plan",
]
