"""One rank's pipeline, staged as every front end drives it: plan, build, run, move, close.

``Pipeline`` and ``PipeDreamStrategy`` (Fabric and Accelerate sit on ``Pipeline``) each hold a
``Session`` and call its stages where their framework's call order puts them:

1. **plan**: the front end chooses the plan (``engine.arguments.choose_plan``, or the
   strategy's ``SetupPlanner``, which also reads a resumed checkpoint's) and calls ``cut``;
   this rank keeps its stage's layers (``core.stage.cut_stage``);
2. **build**: ``create`` fills the stage from pretrained weights or from the empty build's
   record (``core.materialize``); the front end may load its own state; ``place`` marks the
   other stages' parameters (``core.elsewhere``) and moves the module to the device;
3. **run**: ``start`` checks the plan's tied parameters against the mode, makes the stage's
   update through the front end's seam (``update_of``: the user's optimizer stepped inside the
   pipeline, or Lightning's precision plugin and hooks), wraps it in the staleness corrections
   the options ask for (``runtime.staleness``), and builds the ``PipelineRunner`` and the
   forward-only pipe over its channel; ``train`` runs one batch, ``judge`` the divergence check;
4. **move**: ``move`` drains, moves the layers and optimizer state to a new plan (``core.
   relayout``) and starts again over it, keeping the runner's running figures;
5. **close**: ``close`` gives back the runner's process groups; ``timeline`` is every action
   recorded, the replaced runners' included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from pl_pipedream.core.divergence import describe_optimizer, divergence_message
from pl_pipedream.core.elsewhere import mark_other_stages
from pl_pipedream.core.evaluation import ForwardPipe
from pl_pipedream.core.loss_watch import LossWatch
from pl_pipedream.core.materialize import EmptyBuild, materialize
from pl_pipedream.core.memory_report import StageMemory, report
from pl_pipedream.core.placement import move_to_device
from pl_pipedream.core.pretrained import Pretrained, load_stage
from pl_pipedream.core.relayout import Moved, relayout
from pl_pipedream.core.stage import LocalStage, cut_stage
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import Tie
from pl_pipedream.runtime import ranks
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.runtime.staleness import check_corrections, corrected_update
from pl_pipedream.runtime.ties import check_ties
from pl_pipedream.runtime.timeline import TimelineEvent
from pl_pipedream.runtime.update import Update
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.modes import SyncMode, check_chunked

__all__ = ["Session", "Settings", "UpdateOf"]

# The front end's seam for who applies an update: the stage's Update under a plan.
UpdateOf = Callable[[LocalStage, Plan], Update]


@dataclass(frozen=True)
class Settings:
    """What a session keeps from the front end's options to run its stage on any plan."""

    sync: SyncMode
    microbatches: int
    rank: int
    device: torch.device
    timeout: float
    precision: StagePrecision
    weight_prediction: bool = False
    lr_warmup_per_delay: int = 0
    delay_lr_updates: int | None = None
    recompute: bool = False
    keep_timeline: bool = False  # every action kept for a trace (timeline=)
    replanning: bool = False  # the plan may change: its checks read the actions too
    caller: str = "Pipeline"  # the front end's call, as its fixes spell it


class Session:
    """One rank's pipeline over ``layers`` (the pipeline's layers, inside ``root``: the
    LightningModule, or ``layers`` itself), run by ``settings``; ``update_of``: the stage's
    update under a plan; ``optimizers()``: the optimizers in use (for the corrections and the
    divergence message); ``pipe``: the forward-only pipe's class."""

    def __init__(
        self,
        root: nn.Module,
        layers: nn.Sequential,
        settings: Settings,
        update_of: UpdateOf,
        optimizers: Callable[[], list[Optimizer]],
        pipe: type[ForwardPipe] = ForwardPipe,
    ) -> None:
        self.root, self.layers, self.settings = root, layers, settings
        self.update_of, self.optimizers, self.pipe = update_of, optimizers, pipe
        self.plan: Plan | None = None
        self.local: LocalStage | None = None
        self.update: Update | None = None  # the front end's, before any correction
        self.runner: PipelineRunner | None = None
        self.forward: ForwardPipe | None = None
        self.earlier: list[TimelineEvent] = []  # the replaced runners' actions, kept
        self.describe = f"rank {settings.rank}"  # where errors say they happened (runtime.ranks)

    # ----- 1. plan, 2. build -------------------------------------------------------------------

    def cut(self, plan: Plan) -> LocalStage:
        """Keep this rank's stage of ``plan`` (the other layers stay where they were built)."""
        self.plan = plan
        self.local = cut_stage(self.root, self.layers, plan, self.settings.rank)
        self.describe = ranks.describe(self.settings.rank, self.local.stage.index)
        return self.local

    def create(self, weights: Pretrained | None, build: EmptyBuild | None) -> None:
        """The stage's tensors from ``weights`` (this rank reads its own), else created from the
        empty build's record where the layers were built on ``meta`` (``core.materialize``)."""
        local = self._local()
        initial = (self.root, self.layers, local.layer_indices, self.settings.device)
        if weights is not None:
            load_stage(weights, *initial, build or EmptyBuild())
        else:
            materialize(*initial, build or EmptyBuild())

    def place(self) -> None:
        """The other stages' parameters marked as held elsewhere, the module on the device."""
        assert self.plan is not None
        mark_other_stages(self.root, self.layers, self.plan, self.settings.rank)
        move_to_device(self.root, self.settings.device)

    # ----- 3. run ------------------------------------------------------------------------------

    def start(self) -> PipelineRunner:
        """Every rank at the same point (it makes process groups): the checks of the plan's
        ties, the stage's update and its corrections, the runner and the forward-only pipe."""
        local, plan, s = self._local(), self.plan, self.settings
        assert plan is not None
        self.check_plan(local.ties, plan)
        self.update = self.update_of(local, plan)
        corrections = (s.lr_warmup_per_delay, s.delay_lr_updates)  # checked: check_plan
        index = local.stage.index
        update = corrected_update(self.update, self.optimizers, plan, s.sync, index, *corrections)
        self.runner = PipelineRunner.create(
            plan,
            s.sync,
            s.microbatches,
            local.module,
            s.rank,
            update,
            s.device,
            s.timeout,
            record_timeline=s.keep_timeline or s.replanning,
            ties=local.ties,
            weight_prediction=s.weight_prediction,
            recompute=s.recompute,
            precision=s.precision,
        )
        self.forward = self.pipe(plan, local, self.runner.executor.channel, s.rank)
        return self.runner

    def check_plan(self, tied: Sequence[Tie], plan: Plan) -> None:
        """Raise where the mode does not build ``plan``'s tied parameters (``tied``: ``core.
        stage.find_ties`` under it), or a correction asked for does not cover them."""
        s = self.settings
        ties = [t.describe() for t in tied]
        check_ties(s.sync, ties, [stage.replicas for stage in plan.stages], s.caller)
        check_chunked(s.sync, ties, s.replanning, f"{s.caller}(sync='{{sync}}')")
        corrections = (s.weight_prediction, s.lr_warmup_per_delay, ties, s.delay_lr_updates)
        check_corrections(s.sync, *corrections)

    def running(self) -> PipelineRunner:
        """The runner in use; raises once the session is closed."""
        if self.runner is None:
            raise RuntimeError(
                f"the pipeline is closed ({self.describe}); build a new {self.settings.caller} "
                "to train again"
            )
        return self.runner

    def drain(self) -> None:
        """Finish every minibatch in flight (every rank at the same point); nothing to do
        before ``start`` or after ``close``."""
        if self.runner is not None:
            self.runner.drain()

    def judge(
        self, losses: LossWatch, step: int, warn: Callable[[str], None], clipping: str
    ) -> None:
        """The divergence check of the newest finished loss (``core.loss_watch``): every rank
        logs the same loss, so every rank acts alike; ``clipping``: the front end's call that
        clips gradients, named among the remedies."""
        runner = self.running()
        if runner.loss is None:
            return
        plan, sync = self.plan, self.settings.sync
        assert plan is not None

        def explain(reason: str) -> str:
            delays = [rules.update_delay(plan, sync, s) for s in range(plan.num_stages)]
            groups = [group for optimizer in self.optimizers() for group in optimizer.param_groups]
            optimizer = describe_optimizer(groups)
            caller = self.settings.caller
            return divergence_message(reason, step, sync, delays, optimizer, caller, clipping)

        losses.check(runner.loss, runner.loss_batch, step, explain, self.drain, warn)

    # ----- 4. move -----------------------------------------------------------------------------

    def move(
        self,
        plan: Plan,
        optimizers: Sequence[Optimizer],
        names: Sequence[Sequence[Sequence[str]]],
        moved: Callable[[], None] = lambda: None,
    ) -> Moved:
        """Every rank, at the same step: drain, move the stages' layers and the state of
        ``optimizers`` (``names``: each group's parameter names over the whole module) to
        ``plan`` point to point, call ``moved()`` (the front end takes note of its new stage),
        and start again over it with the running figures kept."""
        runner, local, old = self.running(), self._local(), self.plan
        assert old is not None
        runner.drain()
        self.take_timeline()
        self.runner = None  # closed: a failed move leaves no pipeline to train with
        runner.close()
        s = self.settings
        done = relayout(
            self.root, self.layers, local, old, plan, s.rank, list(optimizers), names, s.device,
            s.timeout,
        )  # fmt: skip
        self.plan, self.local = plan, done.local
        self.describe = ranks.describe(s.rank, done.local.stage.index)
        moved()
        self.start().carry_over(runner)
        return done

    def memory_report(self, say: Callable[[str], None]) -> list[StageMemory]:
        """Every rank, on drained weights: this rank's measured memory beside the plan's
        estimate (``core.memory_report``), every rank's row gathered; ``say`` prints the table on
        rank 0. [] before ``start`` or after ``close``."""
        runner, local, plan, s = self.runner, self.local, self.plan, self.settings
        if runner is None or local is None or plan is None:
            return []
        stashed, activations = runner.executor.memory_peaks()
        channel = runner.executor.channel
        frames = (channel.peak_sent_bytes, channel.peak_received_bytes)
        measured = (local.module, stashed, activations, self.optimizers(), s.device, s.sync)
        return report(say, s.rank, plan, *measured, s.microbatches, frames, s.recompute)

    # ----- 5. close ----------------------------------------------------------------------------

    def timeline(self) -> list[TimelineEvent]:
        """Every action recorded: the replaced runners' and the runner's in use."""
        current = self.runner.executor.timeline if self.runner is not None else []
        return self.earlier + current

    def take_timeline(self) -> list[TimelineEvent]:
        """The runner's actions since the last take (its record starts again empty), kept for
        ``timeline`` when a trace is asked for."""
        events = self.running().executor.take_timeline()
        if self.settings.keep_timeline:
            self.earlier += events
        return events

    def close(self, failed: bool = False) -> None:
        """Give back the runner's process groups (without waiting on peers after a failure);
        a second call does nothing."""
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close(failed=failed)

    def _local(self) -> LocalStage:
        if self.local is None:
            raise RuntimeError("the session has no stage yet: call cut(plan) first")
        return self.local
