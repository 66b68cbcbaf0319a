"""Re-planning inside a Lightning ``fit``: at a step boundary, a better plan moves the layers.

``PipeDreamStrategy(replan="auto")`` checks every ``replan_every`` optimizer steps whether a
plan for the measured stage times beats the plan in use by more than ``replan_threshold``
after paying for the move (``core.replanner``, collective). When it does, every rank, before
the same training step: drains the pipeline (the async modes keep minibatches in flight between
steps), moves the layers and their optimizer state point to point (``core.relayout``: the
optimizer objects are kept, so Lightning and the LR schedulers go on with them), rebuilds what
setup built over the plan (``setup.build_pipeline``: the stage's updates, the
``PipelineRunner``, the evaluation pipe) and the Lightning patches that captured them, rewrites
``pipedream_plan.json`` and logs the move (rank 0's log and the Trainer's loggers).

The boundary is the first training step after an optimizer step (``trainer.global_step``
changed since the last boundary), so a move never splits a window of
``accumulate_grad_batches``. ``request(plan)`` asks for a given plan at the next boundary, with
no check: every rank must ask for the same plan in the same step (a callback's
``on_train_batch_end`` does).
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from pl_pipedream.core.relayout import relayout
from pl_pipedream.core.replanner import (
    HISTORY_NAME,
    Replanner,
    create_replanner,
    tied_straight,
)
from pl_pipedream.core.stage import find_ties, pipeline_layers
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import Decision
from pl_pipedream.runtime.ties import check_ties
from pl_pipedream.runtime.timeline import TimelineEvent
from pl_pipedream.strategy.planning import plan_folder, write_plan
from pl_pipedream.strategy.setup import build_pipeline, patch_lightning

__all__ = ["Replanning", "move", "refused", "straight_only"]


class Replanning:
    """One strategy's re-planning: its options, its ``Replanner`` during a fit, a requested
    plan, the boundary it is at, and the timeline of the pipelines it replaced."""

    def __init__(self, mode: str = "off", every: int = 50, threshold: float = 0.05) -> None:
        # (checked with the strategy's other options: engine.arguments.check_options)
        self.mode, self.every, self.threshold = mode, int(every), float(threshold)
        self.requested: Plan | None = None
        self.replanner: Replanner | None = None
        self.moves = 0  # moves made in this fit
        self.earlier: list[TimelineEvent] = []  # actions taken from the runners, for timeline=
        self._boundary = 0  # trainer.global_step at the last boundary

    @property
    def on(self) -> bool:
        """Whether checks run (and so the timeline is recorded)."""
        return self.mode != "off"

    def request(self, plan: Plan) -> None:
        """Move to ``plan`` at the next step boundary (every rank asks in the same step)."""
        self.requested = plan

    def start(self, strategy: Any, trainer: Any) -> None:
        """At the setup of a fit, once the pipeline is built (every rank): a fresh
        ``Replanner`` watching this rank's layers (``mode="auto"``), bound by the topology and
        the memory per worker (``memory=``, else a GPU's free memory: one collective)."""
        self.finish()
        self.moves, self.earlier = 0, []
        self._boundary = trainer.global_step
        if not self.on:
            return
        self.replanner = create_replanner(
            self.mode,
            self.every,
            self.threshold,
            history=plan_folder(trainer) / HISTORY_NAME,
            topology=strategy.topology,
            memory=strategy.memory,
            device=strategy.root_device,
            microbatches=strategy.microbatches,
            sync=strategy.sync,
            recompute=strategy.recompute,
            straight=straight_only(strategy),
        )
        self._watch(strategy)

    def at_step(self, strategy: Any, trainer: Any) -> None:
        """Before each training step, on every rank: at a boundary, a requested plan or a due
        check's better plan is moved to."""
        step = trainer.global_step
        if step == self._boundary:
            return
        self._boundary = step
        new, decision = self.requested, None
        self.requested = None
        replanner = self.replanner
        if replanner is not None and replanner.starts(step):  # the steps before: warm-up
            self._take(strategy)
            replanner.reset()
        elif new is None and replanner is not None and replanner.due(step):
            decision = self._check(strategy, step)
            new = decision.plan if decision is not None and decision.move else None
        if new is None or new == strategy.plan:
            return
        refusal = refused(strategy, new)
        if refusal is not None:
            rank_zero_warn(f"PipeDreamStrategy: not re-planning at step {step}: {refusal}")
            return
        old = strategy.plan
        self._take(strategy)
        seconds = move(strategy, trainer, new)
        self.moves += 1
        if replanner is not None:
            replanner.moved(step, seconds)  # the next step is warm-up again
            self._watch(strategy)
        announce_move(trainer, step, old, new, decision, seconds)

    def timeline(self, runner: Any) -> list[TimelineEvent]:
        """Every action of this fit (with ``timeline=``): those taken from the runners, the
        replaced ones' included, and ``runner``'s since."""
        return self.earlier + (runner.executor.timeline if runner is not None else [])

    def finish(self) -> None:
        """At the end of a fit (or its teardown): the history written, the hooks removed."""
        if self.replanner is not None:
            replanner, self.replanner = self.replanner, None
            replanner.close()

    def _take(self, strategy: Any) -> list[TimelineEvent]:
        """The runner's actions since the last take (its timeline starts again empty), kept
        for the trace when ``timeline=`` asks for one."""
        events = strategy.runner.executor.take_timeline()
        if strategy.timeline is not None:
            self.earlier += events
        return events

    def _check(self, strategy: Any, step: int) -> Decision | None:
        assert self.replanner is not None
        since = self._take(strategy)
        decision = self.replanner.check(step, strategy.plan, since, strategy.global_rank)
        if decision is not None:
            rank_zero_info(f"PipeDream {self.replanner.report}")
        for warning in decision.warnings if decision is not None else ():
            rank_zero_warn(f"PipeDreamStrategy: {warning}")
        return decision

    def _watch(self, strategy: Any) -> None:
        assert self.replanner is not None and strategy.local_stage is not None
        self.replanner.watch(dict(strategy.local_stage.module.named_children()))


def straight_only(strategy: Any) -> bool:
    """``core.replanner.tied_straight`` of the strategy's module."""
    module = strategy.lightning_module
    return tied_straight(strategy.sync, module, pipeline_layers(module))


def refused(strategy: Any, plan: Plan) -> str | None:
    """Why the pipeline cannot train under ``plan``, or None: a worker per process, replica
    counts that divide the microbatches, and tied parameters' rule (``runtime.ties``)."""
    if plan.num_workers != strategy.world_size:
        return f"the plan has {plan.num_workers} workers for {strategy.world_size} processes"
    odd = [s.replicas for s in plan.stages if strategy.microbatches % s.replicas]
    if odd:
        return (
            f"replica counts {odd} do not divide the microbatches ({strategy.microbatches}) of "
            "a batch, which replicas share round robin"
        )
    module = strategy.lightning_module
    ties = find_ties(module, pipeline_layers(module), plan)
    try:
        check_ties(strategy.sync, [t.describe() for t in ties], [s.replicas for s in plan.stages])
    except ValueError as error:
        return str(error)
    return None


def move(strategy: Any, trainer: Any, plan: Plan) -> float:
    """Every rank: drain, move the layers and optimizer state to ``plan`` (``core.relayout``),
    rebuild the pipeline and the patches over it; returns the seconds it took on this rank."""
    start = time.perf_counter()
    strategy.drain()
    module = strategy.lightning_module
    old = strategy.runner
    moved = relayout(
        module,
        pipeline_layers(module),
        strategy.local_stage,
        strategy.plan,
        plan,
        strategy.global_rank,
        [getattr(o, "_optimizer", o) for o in strategy.optimizers],
        strategy.resume.groups,
        strategy.root_device,
        strategy.timeout,
    )
    strategy.plan, strategy.local_stage = plan, moved.local
    strategy.resume.name_parameters(module)  # the parameters created for the layers that came
    old.close()
    build_pipeline(strategy, trainer)
    strategy.runner.carry_over(old)
    patch_lightning(strategy, trainer)
    return time.perf_counter() - start


def announce_move(
    trainer: Any, step: int, old: Plan, new: Plan, decision: Decision | None, seconds: float
) -> None:
    """Rank 0: the move in the log, in the Trainer's loggers and in ``pipedream_plan.json``."""
    if trainer.global_rank != 0:
        return
    why = decision.render() if decision is not None else "requested"
    rank_zero_info(
        f"PipeDream re-planned at step {step}: {old.shape} -> {new.shape} ({why}); moved in "
        f"{seconds:.3f} s (rank 0)\nold plan:\n{old.render()}\nnew plan:\n{new.render()}"
    )
    metrics = {"pipedream/replan_seconds": seconds, "pipedream/stages": float(new.num_stages)}
    if decision is not None:
        metrics["pipedream/replan_gain"] = decision.gain
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
    write_plan(trainer, new)
