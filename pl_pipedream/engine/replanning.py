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
from torch import nn

from pl_pipedream.core.memory_limit import parse_memory
from pl_pipedream.core.replanner import Replanner, create_replanner, tied_straight
from pl_pipedream.planner.replan import Decision
from pl_pipedream.planner.topology import Topology
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["after_step", "check_plan", "make_replanner", "watch_stage"]

log = logging.getLogger(__name__)


def make_replanner(
    options: tuple[str, int, float, str | os.PathLike | None],
    topology: Topology | None,
    memory: float | str | None,
    device: torch.device,
    microbatches: int,
    sync: SyncMode,
    recompute: bool,
    layers: nn.Sequential,
) -> Replanner:
    """The ``Pipeline``'s ``Replanner`` (``core.replanner.create_replanner``, every rank at the
    same point) from its ``options`` (``replan``, ``replan_every``, ``replan_threshold``,
    ``replan_history``), bound by its ``topology`` and ``memory`` arguments."""
    mode, every, threshold, history = options
    return create_replanner(
        mode,
        every,
        threshold,
        history=Path(history) if history is not None else None,
        topology=topology,
        memory=parse_memory(memory),
        device=device,
        microbatches=microbatches,
        sync=sync,
        recompute=recompute,
        straight=tied_straight(sync, layers, layers),
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
