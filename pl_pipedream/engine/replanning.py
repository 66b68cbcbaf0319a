"""The engine's re-planning: ``Pipeline(replan="auto")`` checks its plan every ``replan_every``
steps against the measured stage times (``core.replanner``) and, when a plan pays, moves to it at
once (``Pipeline.replan``: drain, layers and optimizer state moved, runner rebuilt).

``replan="off"`` (the default) builds a ``Replanner`` that is never due: the timeline is not
recorded and a step pays one comparison. With ``"auto"`` the timeline is recorded, the
``LayerClock`` times the stage's layers, and every rank takes the timeline since the last check
(``StageExecutor.take_timeline``), so it never holds more than one interval's actions. The memory
limit (``memory=``, else the device's) and ``topology`` also bound re-planning, so they are
accepted beside a ``balance=`` or ``plan=`` when ``replan="auto"``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pl_pipedream.core.memory_limit import gather_memory, parse_memory
from pl_pipedream.core.planning import measure_bandwidth
from pl_pipedream.core.replanner import Replanner
from pl_pipedream.planner.replan import Decision
from pl_pipedream.planner.topology import Topology

__all__ = ["after_step", "check_plan", "make_replanner", "watch_stage"]

log = logging.getLogger(__name__)


def make_replanner(
    mode: str,
    every: int,
    threshold: float,
    history: str | os.PathLike | None,
    topology: Topology | None,
    memory: float | str | None,
    device: torch.device,
    microbatches: int,
) -> Replanner:
    """The rank's ``Replanner`` (every rank at the same point: with ``"auto"`` the memory
    limit is gathered and, without a topology, the link between ranks 0 and 1 measured, so that
    no check pays for it)."""
    limit = None
    if mode == "auto":
        limit = gather_memory(device, parse_memory(memory))
        if topology is None:
            topology = Topology.flat(dist.get_world_size(), measure_bandwidth(device))
    return Replanner(
        mode,
        every,
        threshold,
        topology=topology,
        memory=limit,
        profile=None,  # the first check's times are the reference (core.replanner)
        history=Path(history) if history is not None else None,
        microbatches=microbatches,
    )


def watch_stage(pipeline: Any) -> None:  # an engine.pipeline.Pipeline
    """Time the layers this rank holds now (named by their index, as the plan's nodes)."""
    pipeline.replanner.watch(dict(pipeline.local.module.named_children()))


def after_step(pipeline: Any) -> None:  # an engine.pipeline.Pipeline
    """Every rank after each step when re-planning is on: start measuring after a step of
    warm-up, or check when due."""
    replanner = pipeline.replanner
    if replanner.starts(pipeline.steps):
        pipeline._running().executor.take_timeline()
        replanner.reset()
    elif replanner.due(pipeline.steps):
        check_plan(pipeline)


def check_plan(pipeline: Any) -> Decision | None:  # an engine.pipeline.Pipeline
    """Every rank after a step that is a check: decide, warn, and move when the plan pays."""
    runner = pipeline._running()
    timeline = runner.executor.take_timeline()
    decision = pipeline.replanner.check(pipeline.steps, pipeline.plan, timeline, pipeline.rank)
    if decision is None:
        return None
    if pipeline.rank == 0:
        log.info("%s", pipeline.replanner.report)
        for warning in decision.warnings:
            warnings.warn(warning, stacklevel=3)
    if decision.move:
        start = time.perf_counter()
        pipeline.replan(decision.plan)
        seconds = time.perf_counter() - start
        pipeline.replanner.moved(pipeline.steps, seconds)
        watch_stage(pipeline)
        pipeline._running().executor.take_timeline()  # the move's own actions are not training
        if pipeline.rank == 0:
            log.info("step %d: %s, moved in %.3f s", pipeline.steps, decision.render(), seconds)
    return decision
