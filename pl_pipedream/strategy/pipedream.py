"""``PipeDreamStrategy``: PipeDream's pipeline inside Lightning's own training loop.

Every rank runs its own Lightning loop over the same batches. In each training step the rank
runs its segment of the schedule for that batch (``PipelineRunner``); ranks are coupled only by
the activations and gradients they exchange. The losses exist on the last stage; they travel back
with the gradients, so every rank (rank 0 with the progress bar and the loggers included) logs
the same ``train_loss``, a finished batch's mean, without a collective (``runtime.losses``).

This class is the Lightning-shaped shell: ``setup`` chooses the plan (``planning``), cuts this
rank's stage (``stage``), places it (``placement``) and builds the pipeline; each hook delegates
to the module that does the job: ``updates`` (who applies updates, per sync mode), ``batches``
(microbatches, ``self(x)``), ``evaluation``, ``checkpoint``, and ``lightning_patches`` for every
Lightning internal touched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.runtime import ranks
from pl_pipedream.runtime.affinity import bind_threads
from pl_pipedream.runtime.memory import retain_freed_memory
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.staleness import WarmedUpdate, check_corrections, stage_delay
from pl_pipedream.runtime.timeline import gather_trace
from pl_pipedream.runtime.update import Update
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy import lightning_patches, memory_report
from pl_pipedream.strategy.arguments import (
    check_arguments,
    check_layer_sync,
    check_memory_layout,
)
from pl_pipedream.strategy.batches import TrainingBatch, shape_forward
from pl_pipedream.strategy.checkpoint import ShardedCheckpointHooks
from pl_pipedream.strategy.collectives import CollectiveHooks
from pl_pipedream.strategy.data import Fingerprints, SameData, broadcast_seed, seed_loader
from pl_pipedream.strategy.divergence import (
    BadData,
    DivergenceWatch,
    TrainingDiverged,
    bad_data_message,
    describe_optimizer,
    divergence_message,
    stops,
)
from pl_pipedream.strategy.elsewhere import mark_other_stages
from pl_pipedream.strategy.evaluation import EvaluationHooks, EvaluationPipe
from pl_pipedream.strategy.finite_data import FiniteData
from pl_pipedream.strategy.launcher import PipelineScriptLauncher, PipelineSpawnLauncher
from pl_pipedream.strategy.materialize import EmptyBuild, materialize
from pl_pipedream.strategy.placement import (
    bind_to_cpu_share,
    keep_local_parameters,
    move_to_device,
    process_group_backend,
)
from pl_pipedream.strategy.planning import SetupPlanner
from pl_pipedream.strategy.precision import (
    check_optimizers,
    check_precision,
    convert_stage,
    stage_precision,
)
from pl_pipedream.strategy.preemption import Preemption, parse_signals
from pl_pipedream.strategy.stage import LocalStage, cut_stage, pipeline_layers
from pl_pipedream.strategy.step_logs import log_finished
from pl_pipedream.strategy.updates import (
    StageUpdates,
    TrainerUpdates,
    check_ties,
    check_trainer,
    stage_updates,
)

__all__ = ["PipeDreamStrategy"]


class PipeDreamStrategy(EvaluationHooks, ShardedCheckpointHooks, CollectiveHooks, ParallelStrategy):
    """Pipeline-parallel training with PipeDream's 1F1B, 1F1B-RR and weight stashing.

    Args:
        sync: ``"async"`` (weight stashing), ``"vertical_sync"``, ``"2bw"``, ``"flush"`` or
            ``"gpipe"`` (``schedule.modes.SyncMode``); the update rules are in DESIGN.md.
        microbatches: each Lightning batch is split along dim 0 into this many equal slices.
        balance: layers per stage of a straight pipeline (``len(balance)`` stages).
        plan: a ``Plan`` (replicated stages) over the pipeline indices "0", "1", ... With neither
            ``balance`` nor ``plan``, rank 0 profiles and plans at setup (``strategy.planning``).
        topology: the cluster the planner optimises for; by default one level whose bandwidth
            is measured between ranks 0 and 1 at setup.
        timeout: seconds a rank waits for a peer before it stops with an error naming the peer.
        timeline: a path for a Chrome trace of every executed action, written by rank 0 at the
            end of training with the measured bubble per rank (``runtime.timeline``).
        start_method: ``"popen"`` (re-run the script per rank, like DDP), ``"spawn"`` or ``"fork"``.
        retain_freed_memory: on CPU with glibc, keep freed memory in the process
            (``runtime.memory``); ``False`` leaves the allocator alone.
        bind_cpus: on CPU, bind each rank to its own share of the cores from setup to teardown
            (``strategy.placement``); ``False`` leaves placement to the kernel.
        weight_prediction: in ``async`` and ``vertical_sync``, run each minibatch on its stale
            weights extrapolated by its delay d, W_v + d (W_v - W_(v-1)) (``runtime.staleness``).
        lr_warmup_per_delay: in ``async`` and ``vertical_sync``, ramp each stage's learning rate
            linearly over this many updates per update of its delay (0: no warm-up).
        divergence: what a diverging training loss does (``strategy.divergence``), judged on
            every rank at the same step. ``"error"`` (default): a non-finite loss stops every
            rank with ``TrainingDiverged`` (``BadData`` when the batch's data held a NaN or
            inf), and a loss that gave back its progress warns once and trains on; ``"strict"``
            stops on both; ``"warn"`` warns once on either and trains on; ``"off"`` watches
            nothing, as one device. The messages name the sync mode, the optimizer's settings
            and the remedies, and speak of stale weights (with the stage delays) only in
            ``async``, ``vertical_sync`` and ``2bw``.
        divergence_rise, divergence_patience, divergence_window: when a loss gave back its
            progress: the median of the last ``window`` logged losses above best + ``rise`` x
            (start - best) for ``patience`` logged losses in a row (start: the first window's
            median, best: the lowest; progress within the batch noise does not count), from the
            20th logged loss on; the defaults separate measured healthy and diverging runs
            (docs/divergence.md).
        preempt_signals: signals that stop every rank at one step with ``last.ckpt`` saved and
            exit status 128 + signal (``strategy.preemption``); ``()`` leaves them to Lightning.
        recompute: stages keep only minibatches' inputs and recompute (``runtime.recompute``).
        memory: bytes per rank (or ``"8GiB"``) an automatic plan must fit; on GPU the free
            memory by default. A fit's memory per stage: ``memory_report``, printed at its end.
    """

    strategy_name = "pipedream"

    def __init__(
        self,
        sync: str | SyncMode = SyncMode.ASYNC,
        microbatches: int = 1,
        balance: list[int] | None = None,
        plan: Plan | None = None,
        topology: Topology | None = None,
        timeout: float = 300.0,
        timeline: str | os.PathLike | None = None,
        start_method: str = "popen",
        retain_freed_memory: bool = True,
        bind_cpus: bool = True,
        weight_prediction: bool = False,
        lr_warmup_per_delay: int = 0,
        divergence: str = "error",
        divergence_rise: float = 0.9,
        divergence_patience: int = 3,
        divergence_window: int = 5,
        preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        recompute: bool = False,
        memory: int | float | str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_arguments(microbatches, start_method, divergence, timeout)
        self.sync = SyncMode.parse(sync)
        check_corrections(self.sync, weight_prediction, lr_warmup_per_delay)
        self.weight_prediction = weight_prediction
        self.lr_warmup_per_delay = lr_warmup_per_delay
        self.microbatches = microbatches
        self.balance = list(balance) if balance is not None else None
        self.plan = plan  # the plan in use; set at setup when planned or built from balance
        self._given_plan = plan
        self.topology = topology
        self.setup_seconds = 0.0
        self.timeout = float(timeout)
        self.timeline = Path(timeline) if timeline is not None else None
        self.bubbles: dict[int, float] = {}
        self._start_method = start_method
        self.retain_freed_memory = retain_freed_memory
        self.bind_cpus = bind_cpus
        self.divergence = divergence
        self._divergence_rule = (divergence_rise, divergence_patience, divergence_window)
        DivergenceWatch(*self._divergence_rule)  # refuses bad thresholds now
        self._watch: DivergenceWatch | None = None  # this fit's, while it still watches
        self._finite_data = FiniteData()  # this fit's notes of the batches fed (while watched)
        self._fingerprints = Fingerprints()  # the data check's weights, kept from batch to batch
        self.cpu_binding: frozenset[int] | None = None  # this rank's cores while bound
        self._unbound_cpus: frozenset[int] | None = None  # the cores to restore at teardown
        self._process_group_backend = process_group_backend
        self.num_nodes = 1  # set by Lightning from Trainer(num_nodes=...)
        self.local_stage: LocalStage | None = None
        self.runner: PipelineRunner | None = None
        self.updates: StageUpdates | None = None
        self.evaluation: EvaluationPipe | None = None
        self._resume: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
        self._data_seed: int | None = None  # the same on every rank (strategy.data)
        self._loaders_seeded = 0
        self.preemption = Preemption(parse_signals(preempt_signals))
        self.empty_build = EmptyBuild()  # what configure_model() built on meta (materialize)
        self.recompute = bool(recompute)
        self.memory = memory_report.parse_memory(memory)
        check_memory_layout(self.memory, balance, plan)
        self.memory_report: list[memory_report.StageMemory] = []  # the last fit's, per rank

    # ----- the launch -------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:  # read by Lightning's accelerator connector, not a hook
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage must see every batch, in the same order: one "replica" for the sampler.
        return {"num_replicas": 1, "rank": 0}

    @override
    def _configure_launcher(self) -> None:
        # Lightning has just handed over Trainer(sync_batchnorm=...): refused before any launch
        check_layer_sync(lightning_patches.layer_sync(self))
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = PipelineScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, self.timeout
            )
        else:
            method = cast(Literal["spawn", "fork"], self._start_method)  # check_arguments saw it
            self._launcher = PipelineSpawnLauncher(self, start_method=method)

    @override
    def setup_environment(self) -> None:
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        on_cpu = self.root_device.type == "cpu"
        backend = process_group_backend(self.root_device, self._process_group_backend)
        self._process_group_backend = backend
        if self.retain_freed_memory and on_cpu:
            retain_freed_memory()
        lightning_patches.init_dist_connection(
            self.cluster_environment, backend, timeout=timedelta(seconds=self.timeout)
        )
        if self.bind_cpus and on_cpu:
            node = range(
                self.node_rank * self.num_processes, (self.node_rank + 1) * self.num_processes
            )
            bound = bind_to_cpu_share(self.global_rank, self.world_size, node)
            self._unbound_cpus, self.cpu_binding = bound or (None, None)
        super().setup_environment()

    # Lightning's @contextmanager types its return as a generator's; callers only enter it.
    @override
    def tensor_init_context(  # type: ignore[override]
        self, empty_init: bool | None = None
    ) -> AbstractContextManager[object]:
        """``configure_model()`` and ``trainer.init_module(empty_init=True)`` build on ``meta``;
        setup creates this rank's stage only (``strategy.materialize``)."""
        return self.empty_build.context(self, empty_init, super().tensor_init_context)

    # ----- setup ------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        check_trainer(self.sync, trainer)
        check_precision(self.precision_plugin, self.sync)
        layers = pipeline_layers(module)
        self._data_seed = broadcast_seed()
        resumed = Plan.from_dict(self._resume[0]["plan"]) if self._resume else None
        planner = SetupPlanner(
            self._given_plan,
            self.balance,
            self.plan,
            resumed,
            self.topology,
            self.microbatches,
            self.world_size,
            self.batch_to_device,
            self.memory,
            self.recompute,
            sync=self.sync,
        )
        self.plan = planner.plan(trainer, module, layers)
        self.setup_seconds = planner.seconds or self.setup_seconds
        self.local_stage = cut_stage(module, layers, self.plan, self.global_rank)
        local = [int(node) for node in self.local_stage.stage.nodes]
        materialize(module, layers, local, self.root_device, self.empty_build)
        convert_stage(self.precision_plugin, module)  # the true precisions: the stage's dtype
        replicas = [s.replicas for s in self.plan.stages]
        ties = [tie.describe() for tie in self.local_stage.ties]
        check_ties(self.sync, ties, replicas)
        check_corrections(self.sync, self.weight_prediction, self.lr_warmup_per_delay, ties)
        mark_other_stages(module, layers, self.plan, self.global_rank)
        move_to_device(module, self.root_device)
        self._build_pipeline(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            check_optimizers(self.precision_plugin, self.optimizers)
            on = self.divergence != "off"
            self._watch = DivergenceWatch(*self._divergence_rule) if on else None
            self._finite_data = FiniteData()
            keep_local_parameters(module, self.optimizers)
        self.setup_precision_plugin()
        assert self.evaluation is not None and self.runner is not None
        clip = self.updates.clip_global_norm if isinstance(self.updates, TrainerUpdates) else None
        lightning_patches.patch_for_pipeline(
            trainer,
            module,
            shape_forward(layers),
            self.precision_plugin,
            clip,
            self.evaluation.metrics_source,
            self.runner.executor.channel.flush,
            lambda: self.preemption.at_step(trainer, self),
        )

    def _build_pipeline(self, trainer: pl.Trainer) -> None:
        """The stage's updates, the pipeline that runs it, the evaluation pipe."""
        assert self.local_stage is not None and self.plan is not None
        stage, module = self.local_stage.stage, self.local_stage.module
        optimizers = lambda: self.optimizers  # noqa: E731 - set up after the pipeline
        self.updates = stage_updates(
            self.sync,
            module,
            optimizers,
            trainer,
            stage.replicas,
            self.root_device,
            self.local_stage.ties_counted_elsewhere(),
        )
        apply: Update = self.updates
        if self.lr_warmup_per_delay:  # (the per-minibatch modes only: checked at __init__)
            steps = self.lr_warmup_per_delay * stage_delay(self.plan, self.sync, stage.index)
            apply = WarmedUpdate(self.updates, optimizers, steps)
        self.runner = PipelineRunner.create(
            self.plan,
            self.sync,
            self.microbatches,
            module,
            self.global_rank,
            apply,
            self.root_device,
            self.timeout,
            record_timeline=self.timeline is not None,
            ties=self.local_stage.tied_groups(),
            weight_prediction=self.weight_prediction,
            recompute=self.recompute,
            precision=stage_precision(self.precision_plugin, self.root_device),
        )
        channel = self.runner.executor.channel
        self.evaluation = EvaluationPipe(self.plan, self.local_stage, channel, self.global_rank)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Every rank's loader draws the same order (``data.seed_loader``)."""
        if self._data_seed is None:
            return dataloader
        self._loaders_seeded += 1
        return seed_loader(dataloader, self._data_seed + 2 * self._loaders_seeded)

    @override
    def model_to_device(self) -> None:
        if self.lightning_module is not None:
            move_to_device(self.lightning_module, self.root_device)

    # ----- training ---------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self.runner is not None and self.local_stage is not None
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        module = self.lightning_module
        describe = ranks.describe(self.global_rank, self.local_stage.stage.index)
        # A non-finite loss travels on like any other: every rank sees it logged and all act
        # alike (divergence=...), knowing whether the batch's data were finite.
        work = TrainingBatch(module, batch, batch_idx, self.microbatches, describe)
        step = module.trainer.global_step
        same = SameData(work.slices, describe, step, batch_idx, self._fingerprints)
        drain = self._must_drain(module.trainer)
        if self._watch is not None:
            self._finite_data.note(self.runner.batches, batch, self.microbatches)
        self.runner.train_batch(
            work.inputs, work.loss, drain=drain, fingerprint=same, logged=work.logged
        )
        loss = work.log_loss(self.runner.loss, self.root_device)
        log_finished(module, self.runner.take_logged(), self.root_device)
        if self._watch is not None and self.runner.loss is not None:
            self._check_divergence(self._watch, self.runner.loss, module.trainer.global_step)
        return loss

    def _check_divergence(self, watch: DivergenceWatch, loss: float, step: int) -> None:
        """Every rank sees the same logged losses and holds the same batches, so every rank
        decides alike, at one step, with one message."""
        assert self.plan is not None and self.runner is not None
        verdict = watch.observe(loss)
        batch = self.runner.loss_batch
        if verdict is None:
            if batch is not None:
                self._finite_data.forget_through(batch)
            return
        bad = None if verdict.finite or batch is None else self._finite_data.first_bad(batch)
        if bad is not None:
            message = bad_data_message(loss, step, *bad)
            error: TrainingDiverged = BadData(message)
        else:
            stages = range(len(self.plan.stages))
            delays = [rules.update_delay(self.plan, self.sync, s) for s in stages]
            groups = [g for optimizer in self.optimizers for g in optimizer.param_groups]
            optimizer = describe_optimizer(groups)
            message = divergence_message(verdict.reason, step, self.sync, delays, optimizer)
            error = TrainingDiverged(message)
        if stops(self.divergence, verdict):
            self.drain()  # every rank stops at this step: the messages in flight arrive first
            raise error
        rank_zero_warn(message + " (not checked again in this fit)")
        self._watch = None

    def _must_drain(self, trainer: pl.Trainer) -> bool:
        if self.sync.flushes or lightning_patches.is_last_batch(trainer):
            return True
        return 0 < trainer.max_steps <= trainer.global_step + 1

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward of a step: the pipeline ran it. In the flushed modes this is
        where the batch's gradient reaches ``.grad``, between ``on_before_backward`` and
        ``on_after_backward`` as on one device; the other modes run their hooks per update."""
        if self.updates is None or self.updates.steps_in_pipeline:
            return closure_loss
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.updates.backward(closure_loss)
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if self.sync.updates_in_pipeline:
            return closure()  # runs training_step; the stages stepped inside the pipeline
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def drain(self) -> None:
        """Finish every minibatch in flight (all ranks must call this at the same point)."""
        if self.runner is not None:
            self.runner.drain()

    @override
    def on_train_end(self) -> None:
        self.drain()
        self.memory_report = memory_report.of_fit(self)  # printed by rank 0
        if self.timeline is not None and self.runner is not None:
            self.bubbles = gather_trace(self.runner.executor.timeline, self.timeline) or {}
            if self.bubbles:
                summary = ", ".join(f"rank {r}: {b:.3f}" for r, b in self.bubbles.items())
                rank_zero_info(f"PipeDream timeline written to {self.timeline}; bubble {summary}")

    # Evaluation runs on drained weights.
    on_validation_start = on_test_start = on_predict_start = drain

    # ----- teardown ---------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        failed = trainer is not None and trainer.interrupted
        self.preemption.finish(failed)
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.close(failed=failed)
        if self.lightning_module is not None:
            move_to_device(self.lightning_module, torch.device("cpu"))
        if self._unbound_cpus is not None:
            bind_threads(self._unbound_cpus)
            self._unbound_cpus = self.cpu_binding = None
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "pipedream", cls, description="PipeDream pipeline parallelism (1F1B, weight stashing)"
        )
