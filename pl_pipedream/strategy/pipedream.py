"""``PipeDreamStrategy``: PipeDream's pipeline inside Lightning's own training loop.

Every rank runs its own Lightning loop over the same batches. In each training step the rank
runs its segment of the schedule for that batch (``PipelineRunner``); ranks are coupled only by
the activations and gradients they exchange. The loss exists on the last stage; it travels back
with the gradients, so every rank (rank 0 with the progress bar and the loggers included) logs
``train_loss`` without a collective.

This class is the Lightning-shaped shell: ``setup`` chooses the plan (``planning``), cuts this
rank's stage (``stage``), places it (``placement``) and builds the pipeline; each hook delegates
to the module that does the job: ``updates`` (who applies updates, per sync mode), ``batches``
(microbatches, ``self(x)``), ``evaluation``, ``checkpoint``, and ``lightning_patches`` for every
Lightning internal touched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.runtime.affinity import bind_threads
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.memory import retain_freed_memory
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.timeline import write_trace
from pl_pipedream.schedule.modes import SyncMode, update_settings
from pl_pipedream.strategy import checkpoint as sharded
from pl_pipedream.strategy import lightning_patches
from pl_pipedream.strategy.batches import TrainingBatch, shape_forward
from pl_pipedream.strategy.evaluation import EvaluationPipe
from pl_pipedream.strategy.launcher import PipelineSpawnLauncher
from pl_pipedream.strategy.placement import bind_to_cpu_share, keep_local_parameters, move_to_device
from pl_pipedream.strategy.planning import announce, choose_plan, plan_at_setup, sample_input
from pl_pipedream.strategy.stage import LocalStage, cut_stage, pipeline_layers
from pl_pipedream.strategy.updates import StageUpdates, TrainerUpdates, check_trainer, stage_updates

__all__ = ["PipeDreamStrategy"]


class PipeDreamStrategy(ParallelStrategy):
    """Pipeline-parallel training with PipeDream's 1F1B, 1F1B-RR and weight stashing.

    Args:
        sync: ``"async"`` (weight stashing), ``"vertical_sync"``, ``"2bw"``, ``"flush"`` or
            ``"gpipe"``; the update rules are in DESIGN.md.
        microbatches: each Lightning batch is split along dim 0 into this many equal slices.
        balance: layers per stage of a straight pipeline (``sum(balance)`` must equal the number
            of layers ``configure_pipeline()`` returns and ``len(balance)`` the device count).
        plan: a ``Plan`` (replicated stages); its layer ids are the pipeline indices "0", "1", ...
            With neither ``balance`` nor ``plan``, rank 0 profiles the layers at setup and plans
            with PipeDream's optimizer for ``topology``.
        topology: the cluster the planner optimises for (``Topology``); by default one level
            whose bandwidth is measured between ranks 0 and 1 at setup.
        timeout: seconds a rank waits for a peer before it stops with an error naming the peer.
        timeline: a path; every executed action is recorded with its start and end, and at the
            end of training rank 0 writes them there as a Chrome trace (open it in Perfetto) and
            prints the measured bubble fraction per rank.
        start_method: ``"popen"`` (re-run the script per rank, like DDP) or ``"spawn"``.
        retain_freed_memory: on CPU with glibc, each rank keeps the memory it frees instead of
            returning it to the kernel (``pl_pipedream.runtime.memory``): a stage frees and
            allocates tensors of a layer's size every minibatch, and fresh pages cost a fault
            each. The process keeps its peak memory. ``False`` leaves the allocator alone.
        bind_cpus: on CPU, each rank is bound to its own share of the cores while the strategy
            is set up (``strategy.placement``). Ranks a launcher has already bound are left
            alone; teardown restores the cores the process had. ``False`` leaves placement to
            the kernel.
    """

    strategy_name = "pipedream"

    def __init__(
        self,
        sync: str = "async",
        microbatches: int = 1,
        balance: list[int] | None = None,
        plan: Plan | None = None,
        topology: Topology | None = None,
        timeout: float = 300.0,
        timeline: str | os.PathLike | None = None,
        start_method: str = "popen",
        retain_freed_memory: bool = True,
        bind_cpus: bool = True,
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
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(
                f"microbatches must be a positive integer (microbatches: {microbatches!r})"
            )
        if start_method not in ("popen", "spawn", "fork"):
            raise ValueError(
                f"start_method must be 'popen', 'spawn' or 'fork' (start_method: {start_method!r})"
            )
        self.sync = SyncMode.parse(sync)
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
        self.cpu_binding: frozenset[int] | None = None  # this rank's cores while bound
        self._unbound_cpus: frozenset[int] | None = None  # the cores to restore at teardown
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.local_stage: LocalStage | None = None
        self.runner: PipelineRunner | None = None
        self.updates: StageUpdates | None = None
        self.evaluation: EvaluationPipe | None = None
        self._groups: list[Any] = []  # replica groups of this setup, destroyed at teardown
        self._resume: tuple[dict[str, Any], list[dict[str, Any]]] | None = None

    # ----- the launch -------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage must see every batch, in the same order: one "replica" for the sampler.
        return {"num_replicas": 1, "rank": 0}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = lightning_patches.SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = PipelineSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        on_cpu = self.root_device.type == "cpu"
        backend = self._process_group_backend or ("gloo" if on_cpu else "nccl")
        self._process_group_backend = backend
        if self.retain_freed_memory and on_cpu:
            retain_freed_memory()
        lightning_patches.init_dist_connection(
            self.cluster_environment, backend, timeout=timedelta(seconds=self.timeout)
        )
        if self.bind_cpus and on_cpu:
            first = self.node_rank * self.num_processes
            node_ranks = range(first, first + self.num_processes)
            bound = bind_to_cpu_share(self.global_rank, self.world_size, node_ranks)
            if bound is not None:
                self._unbound_cpus, self.cpu_binding = bound
        super().setup_environment()

    # ----- setup ------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        check_trainer(self.sync, trainer)
        layers = pipeline_layers(module)
        self.plan = self._choose_plan(trainer, module, len(layers))
        self.local_stage = cut_stage(module, layers, self.plan, self.global_rank)
        move_to_device(module, self.root_device)
        self._build_pipeline(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            keep_local_parameters(module, self.optimizers)
        self.setup_precision_plugin()
        self._patch_lightning(trainer, module, layers)

    def _choose_plan(self, trainer: pl.Trainer, module: pl.LightningModule, layers: int) -> Plan:
        def plan_automatically() -> Plan:
            sample = None
            if self.global_rank == 0:
                sample = sample_input(trainer, module, self.microbatches, self.batch_to_device)
            plan, self.setup_seconds = plan_at_setup(
                pipeline_layers(module), sample, self.topology, self.root_device, self.microbatches
            )
            announce(trainer, plan, self.setup_seconds)
            return plan

        return choose_plan(
            given=self._given_plan,
            balance=self.balance,
            previous=self.plan,
            resumed=Plan.from_dict(self._resume[0]["plan"]) if self._resume else None,
            num_layers=layers,
            world_size=self.world_size,
            plan_automatically=plan_automatically,
        )

    def _build_pipeline(self, trainer: pl.Trainer) -> None:
        """The channel, the stage's executor and updates, the runner, the evaluation pipe."""
        assert self.local_stage is not None and self.plan is not None
        stage = self.local_stage.stage
        groups = [
            dist.new_group(list(s.ranks)) if s.replicas > 1 else None for s in self.plan.stages
        ]
        self._groups = [group for group in groups if group is not None]
        # Pipeline messages get a process group of their own for each setup: a receive posted
        # ahead that training never matched stays posted and must not take a later run's message.
        messages = dist.new_group(list(range(self.world_size)))
        describe = f"rank {self.global_rank} (stage {stage.index})"
        channel = Channel(self.global_rank, self.root_device, self.timeout, describe, messages)
        executor = StageExecutor(
            self.local_stage.module,
            self.global_rank,
            stage.index,
            self.plan.num_stages,
            channel,
            update_settings(self.sync, self.microbatches, stage.replicas),
            replica_group=groups[stage.index],
            num_replicas=stage.replicas,
            device=self.root_device,
            record_timeline=self.timeline is not None,
        )
        self.updates = stage_updates(
            self.sync,
            self.local_stage.module,
            lambda: self.optimizers,
            trainer,
            stage.replicas,
            self.root_device,
        )
        self.runner = PipelineRunner(
            self.plan, self.sync, self.microbatches, executor, self.updates
        )
        self.evaluation = EvaluationPipe(self.plan, self.local_stage, channel, self.global_rank)

    def _patch_lightning(
        self, trainer: pl.Trainer, module: pl.LightningModule, layers: torch.nn.Sequential
    ) -> None:
        assert self.evaluation is not None and self.runner is not None
        lightning_patches.summary_forward(module, shape_forward(layers))
        lightning_patches.stop_metric_sync(module)
        lightning_patches.share_evaluation_metrics(
            trainer, self.evaluation.metrics_source, self.runner.executor.channel.flush
        )
        if isinstance(self.updates, TrainerUpdates):
            lightning_patches.clip_by_global_norm(
                self.precision_plugin, self.updates.clip_global_norm
            )
        lightning_patches.check_sigterm_per_rank(trainer)

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
        describe = f"rank {self.global_rank}, stage {self.local_stage.stage.index}"
        work = TrainingBatch(module, batch, batch_idx, self.microbatches, describe)
        self.runner.train_batch(work.inputs, work.loss, drain=self._must_drain(module.trainer))
        return self._log_train_loss(work.losses)

    def _must_drain(self, trainer: pl.Trainer) -> bool:
        if self.sync.flushes or lightning_patches.is_last_batch(trainer):
            return True
        return 0 < trainer.max_steps <= trainer.global_step + 1

    def _log_train_loss(self, losses: list[float]) -> Tensor:
        """The loss of the newest minibatches this rank knows of, logged as ``train_loss``."""
        assert self.runner is not None
        if losses:
            value: float | None = sum(losses) / len(losses)
        else:
            newest = self.runner.executor.newest_loss
            value = None if newest is None else newest.value
        if value is None:
            return torch.tensor(float("nan"), device=self.root_device)
        loss = torch.tensor(value, device=self.root_device)
        self.lightning_module.log(
            "train_loss", loss, prog_bar=True, on_step=True, on_epoch=False, sync_dist=False
        )
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.updates is None:
            return closure_loss
        return self.updates.backward(closure_loss)

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
        if self.timeline is not None and self.runner is not None:
            self._write_timeline(self.runner.executor.timeline)

    def _write_timeline(self, events: list[Any]) -> None:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, events)
        if self.global_rank != 0:
            return
        assert self.timeline is not None
        everything = [event for part in gathered for event in part]
        self.bubbles = write_trace(everything, self.timeline)
        summary = ", ".join(f"rank {r}: {b:.3f}" for r, b in self.bubbles.items())
        rank_zero_info(f"PipeDream timeline written to {self.timeline}; bubble {summary}")

    # ----- evaluation -------------------------------------------------------------------------

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.evaluation is not None
        result = self._evaluate("predict_step", *args, **kwargs)
        return self.evaluation.predictions_to_rank_zero(result, args[1] if len(args) > 1 else 0)

    def _evaluate(self, hook: str, batch: Any, batch_idx: int = 0, *rest: Any, **kw: Any) -> Any:
        assert self.evaluation is not None
        return self.evaluation.run(self.lightning_module, hook, batch, batch_idx, *rest, **kw)

    @override
    def on_validation_start(self) -> None:
        self.drain()

    @override
    def on_test_start(self) -> None:
        self.drain()

    @override
    def on_predict_start(self) -> None:
        self.drain()

    # ----- checkpoints ------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's state under the LightningModule's names (drains first)."""
        self.drain()
        assert self.local_stage is not None
        return self.local_stage.state_dict(self.lightning_module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        assert self.local_stage is not None and self.plan is not None
        stage = self.local_stage.stage
        if self.global_rank == stage.ranks[0]:
            sharded.write_shard(filepath, stage.index, checkpoint)
        if self.global_rank == 0:
            sharded.write_description(filepath, self.sync, self.microbatches, self.plan)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a sharded checkpoint: every stage's weights merged, the rest from stage 0."""
        if not (Path(checkpoint_path) / sharded.META_FILE).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only)
        meta, shards = sharded.read_shards(checkpoint_path)
        self._resume = (meta, shards)
        merged = sharded.merge_states(shard["state_dict"] for shard in shards)
        return {**shards[0], "state_dict": merged}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each stage takes the optimizer state its own stage saved."""
        if self._resume is None:
            return super().load_optimizer_state_dict(checkpoint)
        assert self.local_stage is not None and self.plan is not None
        meta, shards = self._resume
        sharded.check_layout(Plan.from_dict(meta["plan"]), self.plan)
        states = shards[self.local_stage.stage.index]["optimizer_states"]
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:
            sharded.remove(filepath)

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every stage's state gathered to every rank (a collective: all ranks call it)."""
        mine = self.lightning_module_state_dict()
        gathered: list[dict[str, Tensor]] = [{}] * self.world_size
        dist.all_gather_object(gathered, mine)
        return sharded.merge_states(gathered)

    # ----- collectives Lightning asks for (setup, evaluation, checkpoints) ----------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        shared = [obj]
        dist.broadcast_object_list(shared, src=src)
        return shared[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        op, mean = _reduce_op(reduce_op)
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=op, group=group)
        return tensor / dist.get_world_size(group) if mean else tensor

    # ----- teardown ---------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            trainer = getattr(self.lightning_module, "_trainer", None)
            failed = trainer is not None and trainer.interrupted
            groups, self._groups = self._groups, []
            try:
                runner.executor.channel.close(flush=not failed)
            finally:
                for group in groups:
                    dist.destroy_process_group(group)
        module = self.lightning_module
        if module is not None:
            for param in module.parameters():
                if param.device.type != "meta":
                    param.data = param.data.cpu()
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


def _reduce_op(reduce_op: Any) -> tuple[dist.ReduceOp, bool]:
    """torch's reduce op for Lightning's ``reduce_op`` (a ``ReduceOp`` or its name, or
    "mean"/"avg"), and whether to divide by the world size afterwards (gloo has no AVG)."""
    if reduce_op is None:
        return dist.ReduceOp.SUM, False
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in ("mean", "avg"):
            return dist.ReduceOp.SUM, True
        if name in ("sum", "max", "min", "product"):
            return getattr(dist.ReduceOp, name.upper()), False
        raise ValueError(
            f"reduce_op must be a torch.distributed.ReduceOp or one of 'sum', 'mean', 'avg', "
            f"'max', 'min', 'product' (reduce_op: {reduce_op!r})"
        )
    if reduce_op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, True
    return reduce_op, False
