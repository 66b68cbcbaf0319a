"""``Pipeline``: PipeDream's pipeline driven from a plain PyTorch loop, without a framework.

Every rank of a process group the user started (``torchrun``, or ``torch.multiprocessing`` with
``init_process_group``) builds the same model and calls ``Pipeline(layers, loss_fn, optimizer,
...)`` at the same point; each keeps only its stage's layers (``core.stage.cut_stage``; the
other layers move to ``meta`` in place) and runs its segment of the schedule for each batch it
is given (``runtime.pipeline.PipelineRunner``), the same code the Lightning strategy runs. A
batch is ``(inputs, targets)``: every rank passes the same batch (checked: ``core.data``), it is
split along dim 0 into ``microbatches`` slices (``core.microbatches``), the first layer takes
each slice's inputs and the last stage calls ``loss_fn(output, targets)``.

``train_step`` returns the same loss on every rank: the mean loss of the newest batch whose
every backward pass has finished (``PipelineRunner.loss``), batch ``t`` itself in the flushed
modes and lagging by the pipeline's depth in the others (NaN while it first fills). The stage's
optimizer steps inside the pipeline when the schedule says (``engine.updates``).
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from pl_pipedream.core.data import Fingerprints, SameData
from pl_pipedream.core.evaluation import ForwardPipe
from pl_pipedream.core.loss_watch import LossWatch
from pl_pipedream.core.materialize import EmptyBuild
from pl_pipedream.core.memory_limit import gather_memory, parse_memory
from pl_pipedream.core.memory_report import StageMemory
from pl_pipedream.core.microbatches import slice_batch
from pl_pipedream.core.placement import keep_local_parameters
from pl_pipedream.core.planning import plan_at_setup
from pl_pipedream.core.preemption import Preempted, Preemption, exit_code, parse_signals
from pl_pipedream.core.pretrained import Pretrained
from pl_pipedream.core.relayout import Moved, check_plans
from pl_pipedream.core.replanner import Replanner
from pl_pipedream.core.stage import LocalStage, find_ties
from pl_pipedream.engine import checkpoints
from pl_pipedream.engine.arguments import (
    batch_pair,
    check_arguments,
    check_automatic,
    check_built_optimizer,
    check_options,
    choose_plan,
    pipeline_of,
)
from pl_pipedream.engine.group import default_device, join_launched_group
from pl_pipedream.engine.moving import group_names_of, to_move
from pl_pipedream.engine.precision import choose_precision
from pl_pipedream.engine.replanning import ReplanChecks, log, make_replanner
from pl_pipedream.engine.session import Session, Settings
from pl_pipedream.engine.updates import OptimizerUpdate, clipping
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.runtime.timeline import gather_trace
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.trees import map_tensors

__all__ = ["Pipeline"]

POSITIONAL = ("layers", "loss_fn", "optimizer")  # the rest are options (engine.options)


class Pipeline:
    """One rank's part of a PipeDream pipeline over ``layers``, trained by ``optimizer`` (a
    function of the stage's parameters, or an optimizer over ``layers.parameters()`` with no
    state yet, which keeps only the stage's) on ``loss_fn(output, targets)``.

    ``sync``: ``flush`` (1F1B flushed every batch: equals one device), ``zero_bubble`` (flush
    with each backward split, its weight half in the bubbles: docs/zero-bubble.md), ``gpipe``,
    ``2bw``, ``async`` or ``vertical_sync`` (rules: docs/guide.md), ``interleaved`` or ``zbv``
    (``chunks_per_rank`` stages per rank, default 2: docs/chunked-planning.md);
    ``microbatches``: slices per batch; the layout as ``balance`` (layers per stage, one rank
    each), ``plan``, or planned automatically (``core.planning``) from ``example_input`` (one
    microbatch of the first layer's input, profiled on rank 0) for ``topology`` (default: one
    level, the link between ranks 0 and 1 measured) within ``memory`` per rank (bytes or
    ``"8GiB"``); ``device``: this rank's device (default: ``cuda:LOCAL_RANK`` when the group
    runs NCCL, else the CPU); ``timeout``: seconds a rank waits for a peer before it fails
    naming it; ``divergence``: what a diverging loss does (``core.loss_watch``: ``"error"``
    stops on a non-finite one, ``"strict"`` on any divergence, ``"warn"``, ``"off"``;
    ``divergence_rise``, ``_patience``, ``_window``: when a loss has given back its progress,
    docs/divergence.md); ``preempt_signals``: signals (e.g. ``("SIGTERM", "SIGUSR1")``) that
    stop every rank at one agreed step (``core.preemption``), where ``train_step`` drains and
    raises ``Preempted``; ``precision``: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"``
    (``engine.precision``), or a ``StagePrecision``; ``clip_grad_norm``: the largest gradient
    norm at each update (``core.clipping``: over every stage in the flushed modes, as one
    device; over the stage in the other modes); ``pretrained``: weights to start from (a path or
    a ``Pretrained``: each rank reads its stage's tensors); ``empty_build``: the record of
    ``pl_pipedream.empty_build()`` when ``layers`` were built on ``meta``, from which each rank
    creates only its stage; ``replan``: ``"auto"`` checks the plan every ``replan_every`` steps
    against the measured stage times and moves to a plan faster by more than
    ``replan_threshold`` (``engine.replanning``; each move a line of ``replan_history``, a
    JSON-lines file), ``"off"``; ``recompute``: stages keep only their minibatches' inputs and
    recompute (``runtime.recompute``); ``weight_prediction``, ``lr_warmup_per_delay``,
    ``delay_lr_updates``: the staleness corrections of ``async`` and ``vertical_sync``
    (``runtime.staleness``; the last divides each stage's learning rate by its delay, for good
    with 0, returning to the base rate over that many updates otherwise);
    ``timeline``: a path for a Chrome trace of every rank's actions, written at ``close``."""

    def __init__(
        self,
        layers: nn.Sequential | Sequence[nn.Module],
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: Optimizer | Callable[[list[nn.Parameter]], Optimizer],
        *,
        sync: str | SyncMode = SyncMode.FLUSH,
        microbatches: int = 1,
        balance: Sequence[int] | None = None,
        plan: Plan | None = None,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        recompute: bool = False,
        weight_prediction: bool = False,
        lr_warmup_per_delay: int = 0,
        delay_lr_updates: int | None = None,
        divergence: str = "error",
        divergence_rise: float = 0.9,
        divergence_patience: int = 3,
        divergence_window: int = 5,
        preempt_signals: Sequence[str | int] = (),
        precision: str | StagePrecision = "32-true",
        clip_grad_norm: float | None = None,
        example_input: Any = None,
        topology: Topology | None = None,
        memory: float | str | None = None,
        pretrained: str | os.PathLike | Pretrained | None = None,
        empty_build: EmptyBuild | None = None,
        replan: str = "off",
        replan_every: int = 50,
        replan_threshold: float = 0.05,
        replan_history: str | os.PathLike | None = None,
        chunks_per_rank: int | None = None,
        timeline: str | os.PathLike | None = None,
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", *POSITIONAL)}
        self.layers = pipeline_of(layers)
        check_arguments(loss_fn, optimizer)
        self.sync = check_options(options)  # what the Fabric and Accelerate front ends checked
        replanning = replan == "auto"
        self._group_names: list[list[list[str]]] | None = None  # the whole module's (replan)
        if isinstance(optimizer, Optimizer):
            check_built_optimizer(optimizer, self.layers)
            self._group_names = [group_names_of(self.layers, optimizer)]  # before the cut
        self.losses = LossWatch(
            divergence, (divergence_rise, divergence_patience, divergence_window)
        )
        self.preemption = Preemption(parse_signals(preempt_signals))
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.timeout = float(timeout)
        self.timeline = Path(timeline) if timeline is not None else None
        self.bubbles: dict[int, float] = {}  # the trace's bubble per rank (timeline=)
        join_launched_group(self.timeout)
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        check_automatic(balance, plan, example_input, topology, memory, world, replanning)
        self.device = torch.device(device) if device is not None else default_device()
        chosen = choose_precision(precision, self.sync, self.device)
        self.precision, self.scaler = chosen.stage, chosen.scaler
        self._clip = clip_grad_norm
        self.optimizer: Optimizer | None = None
        settings = Settings(
            self.sync, microbatches, self.rank, self.device, self.timeout, self.precision,
            weight_prediction, lr_warmup_per_delay, delay_lr_updates, recompute,
            self.timeline is not None, replanning,
        )  # fmt: skip
        self.session = Session(
            self.layers, self.layers, settings, self._update_of, self._optimizers
        )

        def automatically() -> Plan:
            limit = gather_memory(self.device, parse_memory(memory))
            sample = self._to_device(example_input)  # one microbatch, profiled on rank 0
            sizes = (self.device, microbatches, limit, recompute, self.sync, chunks_per_rank)
            return plan_at_setup(self.layers, sample, topology, *sizes)[0]

        layout = (balance, plan, len(self.layers), world, automatically, self.sync)
        self.session.cut(choose_plan(*layout, chunks_per_rank))
        self.session.create(Pretrained.parse(pretrained), empty_build)
        self.session.place()
        params = list(self.module.parameters())
        self._factory = None if isinstance(optimizer, Optimizer) else optimizer
        if isinstance(optimizer, Optimizer):
            keep_local_parameters(self.layers, [optimizer])  # groups and settings kept
            self.optimizer = optimizer
        else:
            self.optimizer = optimizer(params) if params else None
        history = Path(replan_history) if replan_history is not None else None
        checks = (replan, replan_every, replan_threshold, history)
        bounds = (topology, parse_memory(memory))
        replanner = make_replanner(checks, *bounds, self.session, self.layers)
        self.session.start()
        self.replanning = ReplanChecks(replanner, self.session, log.info, self._warn)
        self.steps = 0  # batches trained
        self._fingerprints = Fingerprints()

    def _update_of(self, local: LocalStage, plan: Plan) -> OptimizerUpdate:
        """The session's update seam: the stage's optimizer steps inside the pipeline."""
        norm = clipping(self._clip, self.sync, local, plan, self.device)
        elsewhere = local.ties_counted_elsewhere()
        return OptimizerUpdate(local.module, self.optimizer, self.scaler, norm, elsewhere)

    def _optimizers(self) -> list[Optimizer]:
        return [self.optimizer] if self.optimizer is not None else []

    @property
    def plan(self) -> Plan:
        """The plan in use."""
        assert self.session.plan is not None
        return self.session.plan

    @property
    def local(self) -> LocalStage:
        """This rank's stage under the plan in use."""
        assert self.session.local is not None
        return self.session.local

    @property
    def runner(self) -> PipelineRunner | None:
        """The runner in use (None once closed)."""
        return self.session.runner

    @property
    def describe(self) -> str:
        """Where this rank's errors say they happened (``rank 1 (stage 1)``), under the plan in
        use (``Session.describe``, kept by a re-plan)."""
        return self.session.describe

    @property
    def replanner(self) -> Replanner:
        """The re-planner (``core.replanner``; never due with ``replan="off"``)."""
        return self.replanning.replanner

    @property
    def updates(self) -> OptimizerUpdate:
        """The stage's update (``engine.updates``)."""
        assert isinstance(self.session.update, OptimizerUpdate)
        return self.session.update

    @property
    def stage(self) -> int:
        """The index of this rank's stage."""
        return self.local.stage.index

    @property
    def module(self) -> nn.Sequential:
        """This rank's stage's layers (children named by their index in ``layers``)."""
        return self.local.module

    def train_step(self, batch: Any) -> Tensor:
        """Run this rank's part of one batch ``(inputs, targets)``; return the newest finished
        batch's mean loss (the same on every rank; NaN until a batch has finished)."""
        runner = self._running()
        self.preemption.at_step(self.timeout, self._stop)
        self.local.module.train()
        batch = self._to_device(batch)
        slices = slice_batch(batch, self.microbatches)
        pairs = [batch_pair(piece) for piece in slices]
        same = SameData(slices, self.describe, self.steps, self.steps, self._fingerprints, batch)
        self.losses.note(runner.batches, batch, self.microbatches)
        runner.train_batch(
            lambda j: pairs[j][0],
            lambda output, j: self.loss_fn(output, pairs[j][1]),
            drain=self.sync.flushes,
            fingerprint=same,
        )
        runner.take_logged()  # the engine's loss function logs nothing: drop the empty records
        self.steps += 1
        self.session.judge(self.losses, self.steps, self._warn, "Pipeline(..., clip_grad_norm=1.0)")
        loss = torch.tensor(math.nan if runner.loss is None else runner.loss)
        if self.replanner.on:
            self._check_plan()  # may move to a new plan (a new runner)
        return loss

    def _check_plan(self) -> None:
        """Every rank after a step when re-planning is on: move when a due check says so."""
        decision = self.replanning.at(self.steps)
        if decision is None or not decision.move:
            return
        start = time.perf_counter()
        self.replan(decision.plan)
        seconds = time.perf_counter() - start
        self.replanning.moved(self.steps, seconds)
        if self.rank == 0:
            log.info("step %d: %s, moved in %.3f s", self.steps, decision.render(), seconds)

    def _warn(self, text: str) -> None:
        if self.rank == 0:
            warnings.warn(text, stacklevel=4)

    def _stop(self, signum: int) -> None:
        """At the step every rank agreed on after a preemption signal: drain, then raise."""
        self.drain()
        raise Preempted(exit_code(signum))

    def eval_step(self, batch: Any) -> Tensor:
        """The loss of one batch ``(inputs, targets)`` without training (the whole batch at once,
        through every stage in order, after a drain), on every rank."""
        runner = self._running()
        self.drain()
        self.local.module.eval()
        inputs, targets = batch_pair(self._to_device(batch))
        what = f"the evaluation activations of step {self.steps}"
        with self.precision.forward():
            loss = self._pipe.forward(lambda: inputs, lambda o: self.loss_fn(o, targets), what)
        loss = self._pipe.to_every_rank(loss, f"the evaluation loss of step {self.steps}")
        runner.executor.channel.flush()
        return loss.detach()

    def predict_step(self, inputs: Any) -> Any:
        """The last layer's output for ``inputs`` (the whole batch at once, through every stage
        in order, after a drain), on every rank."""
        runner = self._running()
        self.drain()
        self.local.module.eval()
        what = f"the predictions of step {self.steps}"
        with self.precision.forward():
            output = self._pipe.forward(lambda: self._to_device(inputs), lambda o: o, what)
        output = self._pipe.to_every_rank(output, what)
        runner.executor.channel.flush()
        return output

    def memory_report(self) -> list[StageMemory]:
        """Every rank at the same step, after a drain: the memory each rank's stage holds and
        held at its peaks, beside the plan's estimate (``core.memory_report``); rank 0 prints
        the table. Returns every rank's row."""
        self.drain()
        return self.session.memory_report(print)

    def drain(self) -> None:
        """Finish every minibatch in flight and apply its update (the asynchronous modes keep
        minibatches in flight between steps); every rank must call it at the same step."""
        self._running().drain()

    def replan(self, new_plan: Plan) -> Moved:
        """Every rank at the same step: drain, move the stages' layers and their optimizer
        state to ``new_plan`` (``core.relayout``: point to point, no file), and go on training
        on it with the same optimizer and ``steps``; returns what the move did on this rank."""
        self._running()
        check_plans(self.plan, new_plan, len(self.layers))  # refused before anything stops
        ties = find_ties(self.layers, self.layers, new_plan)
        self.session.check_plan(ties, new_plan)
        self.session.drain()
        names = (self._group_names, self.layers, self.plan)  # the names: recorded, or gathered
        optimizer, self._group_names = to_move(self.optimizer, self._factory, *names, self.device)

        def keep() -> None:  # after the layers moved: the optimizer, if the stage holds any
            holds = any(group["params"] for group in optimizer.param_groups)
            self.optimizer = optimizer if holds or self._factory is None else None

        return self.session.move(new_plan, [optimizer], self._group_names, keep)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, after a drain, copied: its stage's tensors under the names
        ``layers.state_dict()`` gives them (on the CPU), its optimizer's state, the plan and
        the steps taken. Each rank saves its own (``torch.save(p.state_dict(), f"rank{r}.pt")``)."""
        self.drain()
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        state = {"model": self.local.state_dict(self.layers), "optimizer": optimizer}
        # a snapshot: on the CPU the tensors above are the live ones, which training updates
        return {
            "plan": self.plan.to_json(),
            "stage": self.stage,
            **copy.deepcopy(state),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned on a rank of the same stage under the same plan."""
        saved = Plan.from_json(state["plan"])
        if saved != self.plan or state["stage"] != self.stage:
            raise ValueError(
                f"a Pipeline state loads into the same stage of the same plan (saved: stage "
                f"{state['stage']} of {saved.shape}, here: stage {self.stage} of "
                f"{self.plan.shape}); build the Pipeline with plan=Plan.from_json(state['plan']) "
                "and load each rank's own state"
            )
        self.drain()
        local = {name: state["model"][full] for name, full in self.local.names.items()}
        self.local.module.load_state_dict(local)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Every rank: a sharded checkpoint directory at ``path`` after a drain (``core.
        checkpoint``'s format; ``pl_pipedream.consolidate_checkpoint(path)`` gives the whole
        model's ``state_dict`` for one device); ``extra``: the caller's own state (the same on
        every rank: rank 0's is kept), which ``load`` returns."""
        self.drain()
        layout = (self.plan, self.sync, self.microbatches, self.timeout)
        checkpoints.save(
            path, self.layers, self.local, self.optimizer, self.steps, self.rank, layout, extra
        )

    def load(self, path: str | Path) -> dict[str, Any]:
        """Every rank: resume from ``save``'s directory, saved under this plan or another one
        over the same layers (each rank reads the shards holding its stage's names); returns
        the ``extra`` saved with it (``{}`` for none)."""
        self.drain()
        self.steps, extra = checkpoints.load(path, self.layers, self.optimizer)
        return extra

    def close(self) -> None:
        """Write the trace asked for (``timeline=``: every rank's actions, gathered), wait for the
        messages still under way, then give back the pipeline's process groups (the user's
        default group stays); a second call does nothing."""
        if self.timeline is not None and self.runner is not None:
            self.drain()
            self.bubbles = gather_trace(self.session.timeline(), self.timeline) or {}
        self.preemption.finish(failed=False)
        self.replanning.close()
        self.session.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is None:
            self.close()
            return
        failed = not isinstance(error, Preempted)
        self.preemption.finish(failed)
        self.replanning.close()
        self.session.close(failed=failed)

    def _running(self) -> PipelineRunner:
        return self.session.running()

    @property
    def _pipe(self) -> ForwardPipe:
        assert self.session.forward is not None
        return self.session.forward

    def _to_device(self, batch: Any) -> Any:
        return map_tensors(lambda t: t.to(self.device, non_blocking=True), batch)
