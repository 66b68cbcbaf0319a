"""Re-planning inside a Lightning ``fit``: at a step boundary, a better plan moves the layers.

``PipeDreamStrategy(replan="auto")`` checks every ``replan_every`` optimizer steps whether a
plan for the measured stage times beats the plan in use by more than ``replan_threshold``
after paying for the move (``core.replanner``, collective). When it does, every rank, before
the same training step: drains the pipeline (the async modes keep minibatches in flight between
steps), moves the layers and their optimizer state point to point (``core.relayout``: the
optimizer objects are kept, so Lightning and the LR schedulers go on with them), rebuilds what
setup built over the plan (``engine.session.Session.move``: the stage's updates, the
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

from pl_pipedream.core.memory_limit import parse_memory
from pl_pipedream.core.replanner import HISTORY_NAME, Replanner
from pl_pipedream.core.stage import find_ties
from pl_pipedream.engine.replanning import ReplanChecks, make_replanner
from pl_pipedream.engine.session import Session
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import Decision
from pl_pipedream.strategy.host import Host
from pl_pipedream.strategy.planning import plan_folder, write_plan
from pl_pipedream.strategy.setup import patch_lightning

__all__ = ["Replanning", "move", "refused"]


class Replanning:
    """One strategy's re-planning: its options, its checks during a fit (``engine.replanning.
    ReplanChecks``, the driver every front end shares), a requested plan, and the boundary it
    is at."""

    def __init__(self, mode: str = "off", every: int = 50, threshold: float = 0.05) -> None:
        # (checked with the strategy's other options: engine.arguments.check_options)
        self.mode, self.every, self.threshold = mode, int(every), float(threshold)
        self.requested: Plan | None = None
        self.checks: ReplanChecks | None = None
        self.moves = 0  # moves made in this fit
        self._boundary = 0  # trainer.global_step at the last boundary

    @property
    def on(self) -> bool:
        """Whether checks run (and so the timeline is recorded)."""
        return self.mode != "off"

    @property
    def replanner(self) -> Replanner | None:
        """The fit's ``Replanner`` (``core.replanner``), while it checks."""
        return self.checks.replanner if self.checks is not None else None

    def request(self, plan: Plan) -> None:
        """Move to ``plan`` at the next step boundary (every rank asks in the same step)."""
        self.requested = plan

    def start(self, strategy: Host, trainer: Any) -> None:
        """At the setup of a fit, once the pipeline is built (every rank): fresh checks
        watching this rank's layers (``mode="auto"``), bound by the topology and the memory per
        worker (``memory=``, else a GPU's free memory: one collective)."""
        self.finish()
        self.moves = 0
        self._boundary = trainer.global_step
        if not self.on:
            return
        session, module = strategy.session, strategy.lightning_module
        assert session is not None and module is not None
        history = plan_folder(trainer) / HISTORY_NAME
        options = (self.mode, self.every, self.threshold, history)
        bounds = (strategy.topology, parse_memory(strategy.memory))
        replanner = make_replanner(options, *bounds, session, module)
        self.checks = ReplanChecks(
            replanner,
            session,
            lambda text: rank_zero_info(f"PipeDream {text}"),
            lambda text: rank_zero_warn(f"PipeDreamStrategy: {text}"),
        )

    def at_step(self, strategy: Host, trainer: Any) -> None:
        """Before each training step, on every rank: at a boundary, a requested plan or a due
        check's better plan is moved to."""
        step = trainer.global_step
        if step == self._boundary:
            return
        self._boundary = step
        new, decision = self.requested, None
        self.requested = None
        if self.checks is not None:
            decision = self.checks.at(step, check=new is None)
            if decision is not None and decision.move:
                new = decision.plan
        if new is None or new == strategy.plan:
            return
        old = strategy.plan
        assert old is not None
        refusal = refused(strategy, new)
        if refusal is not None:
            rank_zero_warn(f"PipeDreamStrategy: not re-planning at step {step}: {refusal}")
            return
        seconds = move(strategy, trainer, new)
        self.moves += 1
        if self.checks is not None:
            self.checks.moved(step, seconds)  # the next step is warm-up again
        announce_move(trainer, step, old, new, decision, seconds)

    def finish(self) -> None:
        """At the end of a fit (or its teardown): the history written, the hooks removed."""
        if self.checks is not None:
            checks, self.checks = self.checks, None
            checks.close()


def refused(strategy: Host, plan: Plan) -> str | None:
    """Why the pipeline cannot train under ``plan``, or None: a worker per process, replica
    counts that divide the microbatches, and the rules of the session's plans (its ties)."""
    if plan.num_workers != strategy.world_size:
        return f"the plan has {plan.num_workers} workers for {strategy.world_size} processes"
    odd = [s.replicas for s in plan.stages if strategy.microbatches % s.replicas]
    if odd:
        return (
            f"replica counts {odd} do not divide the microbatches ({strategy.microbatches}) of "
            "a batch, which replicas share round robin"
        )
    session = strategy.session
    assert session is not None
    try:
        session.check_plan(find_ties(session.root, session.layers, plan), plan)
    except ValueError as error:
        return str(error)
    return None


def move(strategy: Host, trainer: Any, plan: Plan) -> float:
    """Every rank: the session moves the layers and optimizer state to ``plan`` (``Session.
    move``: drain, ``core.relayout``, a runner over the new plan); then the patches over it.
    The optimizer objects are kept, so Lightning and the LR schedulers go on with them.
    Returns the seconds it took on this rank."""
    start = time.perf_counter()
    session: Session | None = strategy.session
    module = strategy.lightning_module
    assert session is not None and module is not None
    optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
    named = lambda: strategy.resume.name_parameters(module)  # noqa: E731 - the layers that came
    session.move(plan, optimizers, strategy.resume.groups, named)
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
