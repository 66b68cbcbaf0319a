"""``PipeDreamStrategy``: PipeDream's pipeline inside Lightning's own training loop.

Every rank runs its own Lightning loop over the same batches. In each training step the rank
runs its segment of the schedule for that batch (``PipelineRunner``); ranks are coupled only by
the activations and gradients they exchange. How the two kinds of sync modes meet Lightning's
automatic optimisation (``training_step`` -> ``zero_grad`` -> ``backward`` -> ``step``):

* ``async``, ``vertical_sync``, ``2bw``: the updates happen inside the pipeline, when the schedule
  says (the optimizer steps on this stage's parameters); Lightning's own backward and step are
  skipped, while its step counter, ``max_steps`` and LR schedulers advance once per batch.
* ``flush``, ``gpipe``: the pipeline computes the batch's mean gradient inside ``training_step``
  and hands it over in ``backward``; Lightning then clips, accumulates and steps as usual.

The training loss exists on the last stage; it travels back with the gradients, so every rank
(rank 0 with the progress bar and the loggers included) logs ``train_loss`` without a collective.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.runtime import update
from pl_pipedream.runtime.affinity import bind_threads, cpu_share, current_cpus
from pl_pipedream.runtime.channel import Channel, Message
from pl_pipedream.runtime.executor import StageExecutor, as_tensors
from pl_pipedream.runtime.memory import retain_freed_memory
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.timeline import write_trace
from pl_pipedream.schedule.rules import SYNC_MODES
from pl_pipedream.strategy.autoplan import plan_at_setup
from pl_pipedream.strategy.checkpoint import META_FILE, read_shards, shard_name
from pl_pipedream.strategy.launcher import PipelineSpawnLauncher
from pl_pipedream.strategy.stage import LocalStage, PipelineSetupError, cut_stage, pipeline_layers

__all__ = ["PipeDreamStrategy"]

FLUSHED = ("flush", "gpipe")
TAG_EVALUATION = 3
TAG_PREDICTIONS = 4


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
            is set up (``pl_pipedream.runtime.affinity``): the kernel can otherwise run two
            stages on one core while another idles, and the pipeline then runs at that core's
            pace. Ranks a launcher has already bound are left alone; teardown restores the
            cores the process had. ``False`` leaves placement to the kernel.
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
        if sync not in SYNC_MODES:
            raise ValueError(
                f"sync must be one of {', '.join(SYNC_MODES)} (sync: {sync!r}); for example "
                "PipeDreamStrategy(sync='async')"
            )
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(
                f"microbatches must be a positive integer (microbatches: {microbatches!r})"
            )
        if start_method not in ("popen", "spawn", "fork"):
            raise ValueError(
                f"start_method must be 'popen', 'spawn' or 'fork' (start_method: {start_method!r})"
            )
        self.sync = sync
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
        self._groups: list[Any] = []  # replica groups of this setup, destroyed at teardown
        self._handover: dict[str, Tensor] = {}
        self._resume: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
        self._batch_losses: list[float] = []

    # ----- topology of the launch -------------------------------------------------------------

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
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = PipelineSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        super().setup_environment()

    def _setup_distributed(self) -> None:
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        backend = self._process_group_backend or (
            "nccl" if self.root_device.type == "cuda" else "gloo"
        )
        self._process_group_backend = backend
        if self.retain_freed_memory and self.root_device.type == "cpu":
            retain_freed_memory()
        _init_dist_connection(
            self.cluster_environment, backend, timeout=timedelta(seconds=self.timeout)
        )
        if self.bind_cpus and self.root_device.type == "cpu":
            self._bind_to_cpu_share()

    def _bind_to_cpu_share(self) -> None:
        """Bind this rank to its share of the cores its node's ranks may all use (one
        all-gather of every rank's cores, once per setup)."""
        pool = current_cpus()
        pools: list[frozenset[int] | None] = [None] * self.world_size
        dist.all_gather_object(pools, pool)
        first = self.node_rank * self.num_processes
        share = cpu_share(pools, range(first, first + self.num_processes), self.global_rank)
        if share is None or pool is None:
            return
        try:
            bind_threads(share)
        except OSError as error:
            warnings.warn(
                f"Rank {self.global_rank} could not be bound to cores {sorted(share)} ({error}); "
                "it runs where the kernel places it. PipeDreamStrategy(bind_cpus=False) "
                "skips binding.",
                stacklevel=2,
            )
            return
        self._unbound_cpus, self.cpu_binding = pool, share

    # ----- setup, in the order Lightning calls it ---------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self._check_trainer(trainer)
        plan = self._resolve_plan(trainer, module)
        self.local_stage = cut_stage(module, pipeline_layers(module), plan, self.global_rank)
        self.plan = plan
        self._move_to_device(module)
        groups = [
            dist.new_group(list(stage.ranks)) if stage.replicas > 1 else None
            for stage in plan.stages
        ]
        self._groups = [group for group in groups if group is not None]
        stage = self.local_stage.stage
        # Pipeline messages get a process group of their own for each setup: a receive posted
        # ahead that training never matched stays posted and must not take a later run's message.
        messages = dist.new_group(list(range(self.world_size)))
        # A batch-mean update divides by the microbatches through the loss seed when 1/m is
        # exact in every float format (m a power of two), else after summing, at the update.
        m = self.microbatches
        scale, divide = (m, 1) if m & (m - 1) == 0 else (1, m)
        per_minibatch = self.sync in ("async", "vertical_sync")  # one update per minibatch
        executor = StageExecutor(
            self.local_stage.module,
            self.global_rank,
            stage.index,
            plan.num_stages,
            Channel(
                self.global_rank,
                self.root_device,
                self.timeout,
                f"rank {self.global_rank} (stage {stage.index})",
                group=messages,
            ),
            replica_group=groups[stage.index],
            num_replicas=stage.replicas,
            apply_update=self._apply_update,
            update_size=stage.replicas if per_minibatch else divide,
            loss_scale=1.0 if per_minibatch else 1 / scale,
            sum_linear_gradients=not per_minibatch and m > stage.replicas,  # backwards/update
            device=self.root_device,
            record_timeline=self.timeline is not None,
        )
        self.runner = PipelineRunner(plan, self.sync, self.microbatches, executor)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._keep_local_parameters()
        self.setup_precision_plugin()
        module.forward = _shape_forward(pipeline_layers(module))  # type: ignore[method-assign]
        # torchmetrics would gather metric states over every rank on compute(); only the last
        # stage's first replica evaluates, so that gather must not happen.
        for sub in module.modules():
            if hasattr(sub, "sync_on_compute") and hasattr(sub, "compute"):
                sub.sync_on_compute = False
        # Evaluation metrics are logged on the last stage; every rank must see them (callbacks
        # such as ModelCheckpoint and EarlyStopping monitor them on every rank).
        connector = trainer._logger_connector
        epoch_metrics = connector.update_eval_epoch_metrics
        connector.update_eval_epoch_metrics = lambda: self._share_evaluation_metrics(  # type: ignore[method-assign]
            trainer, epoch_metrics()
        )
        if self.sync in FLUSHED:
            # Lightning clips by the norm of this rank's gradients; a flushed pipeline clips by
            # the norm over all stages, as single-device training would.
            self.precision_plugin.clip_grad_by_norm = self._clip_global_norm  # type: ignore[method-assign]
        # Lightning broadcasts a SIGTERM flag from rank 0 before every step; that collective
        # would put every stage in lock-step. Each rank checks its own flag instead.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self._check_sigterm  # type: ignore[method-assign]

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        if self.sync not in FLUSHED and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"gradient accumulation needs a flushed pipeline (sync: {self.sync}, "
                f"accumulate_grad_batches: {trainer.accumulate_grad_batches}); use "
                "PipeDreamStrategy(sync='flush') or raise microbatches instead"
            )

    def _resolve_plan(self, trainer: pl.Trainer, module: pl.LightningModule) -> Plan:
        if self._given_plan is not None and self.balance is not None:
            raise PipelineSetupError("pass either balance= or plan= to PipeDreamStrategy, not both")
        layers = pipeline_layers(module)
        if self._given_plan is not None:
            plan = self._given_plan
        elif self.plan is not None:
            plan = self.plan  # a later trainer.validate/test/predict keeps the training layout
        elif self.balance is None and self._resume is not None:
            plan = Plan.from_dict(self._resume[0]["plan"])  # resume under the saved plan
        elif self.balance is not None:
            plan = Plan.from_balance(self.balance, [str(i) for i in range(len(layers))])
        else:
            sample = self._sample_input(trainer, module) if self.global_rank == 0 else None
            plan, self.setup_seconds = plan_at_setup(
                layers, sample, self.topology, self.root_device, self.microbatches
            )
            self._announce(trainer, plan)
        if plan.num_workers != self.world_size:
            raise PipelineSetupError(
                f"the plan needs one process per worker (plan workers: {plan.num_workers}, "
                f"devices: {self.world_size}); use Trainer(devices={plan.num_workers}) or a "
                f"plan for {self.world_size} workers"
            )
        return plan

    def _sample_input(self, trainer: pl.Trainer, module: pl.LightningModule) -> Any:
        """One microbatch of the first stage's input: from the first training batch, else
        from ``example_input_array``."""
        batch = None
        source = getattr(trainer.fit_loop, "_data_source", None)
        if trainer.state.fn == TrainerFn.FITTING and source is not None and source.is_defined():
            batch = next(iter(source.dataloader()))
            batch = self.batch_to_device(batch)
        if batch is not None:
            inputs, _ = self._split(batch)
            return inputs[0]
        example = getattr(module, "example_input_array", None)
        if example is None:
            raise PipelineSetupError(
                "planning at setup needs a sample input: fit with a training dataloader, set "
                "example_input_array on the LightningModule, or pass balance= or plan="
            )
        return example.to(self.root_device) if isinstance(example, Tensor) else example

    def _announce(self, trainer: pl.Trainer, plan: Plan) -> None:
        """Rank 0 prints the plan and writes it beside the logs."""
        if self.global_rank != 0:
            return
        note = f"\n{plan.meta['note']}" if plan.meta.get("note") else ""
        rank_zero_info(
            f"PipeDream plan ({self.setup_seconds:.1f} s to profile and plan):\n"
            f"{plan.render()}{note}"
        )
        # trainer.log_dir broadcasts from rank 0: only rank 0 is here, so ask the logger itself.
        folder = Path(getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pipedream_plan.json").write_text(plan.to_json())

    def _move_to_device(self, module: pl.LightningModule) -> None:
        """Move the stage's layers and the module's non-pipeline state to this rank's device."""
        device = self.root_device
        for sub in module.modules():
            for param in list(sub._parameters.values()):
                if param is not None and param.device.type != "meta":
                    param.data = param.data.to(device)
            for name, buffer in list(sub._buffers.items()):
                if buffer is not None and buffer.device.type != "meta":
                    sub._buffers[name] = buffer.to(device)

    def _keep_local_parameters(self) -> None:
        """Optimizers keep only this stage's parameters (plus any outside the pipeline)."""
        local = {id(p) for p in self.lightning_module.parameters() if p.device.type != "meta"}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in local]

    @override
    def model_to_device(self) -> None:
        if self.lightning_module is not None:
            self._move_to_device(self.lightning_module)

    # ----- training ---------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self.runner is not None
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        trainer = self.lightning_module.trainer
        inputs, microbatches = self._split(batch)
        self._batch_losses = []

        def loss(output: Any, j: int) -> Tensor:
            return self._user_loss(microbatches[j], batch_idx, output)

        self.runner.train_batch(lambda j: inputs[j], loss, drain=self._must_drain(trainer))
        return self._report_loss()

    def _split(self, batch: Any) -> tuple[list[Any], list[Any]]:
        """Split a batch into microbatches: the first stage's inputs and the full slices."""
        module = self.lightning_module
        split = getattr(module, "pipeline_split_batch", None)
        m = self.microbatches
        slices = _slice_batch(batch, m)
        inputs = []
        for piece in slices:
            if split is not None:
                inputs.append(split(piece)[0])
            elif isinstance(piece, (tuple, list)) and len(piece) >= 1:
                inputs.append(piece[0])
            else:
                raise ValueError(
                    f"a pipeline batch must be (inputs, targets) (got: {type(piece).__name__}); "
                    "return such pairs from the dataloader or define "
                    "pipeline_split_batch(batch) -> (inputs, targets) on the LightningModule"
                )
        return inputs, slices

    def _user_loss(self, microbatch: Any, batch_idx: int, output: Any) -> Tensor:
        """Run the user's training_step on the last stage, with ``self(x)`` returning ``output``."""
        module = self.lightning_module
        with _forward_returns(module, output):
            result = module.training_step(microbatch, batch_idx)
        loss = result["loss"] if isinstance(result, dict) else result
        if not isinstance(loss, Tensor):
            raise ValueError(
                "training_step must return the loss tensor (or a dict with 'loss') on the last "
                f"stage (returned: {type(result).__name__})"
            )
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(
                f"the training loss is not finite (loss: {value}, rank {self.global_rank}, stage "
                f"{self.local_stage.stage.index if self.local_stage else '?'}, global step "
                f"{module.trainer.global_step}); lower the learning rate or check the data"
            )
        self._batch_losses.append(value)
        return loss

    def _must_drain(self, trainer: pl.Trainer) -> bool:
        if self.sync in FLUSHED:
            return True
        epoch_loop = trainer.fit_loop.epoch_loop
        if epoch_loop.batch_progress.is_last_batch:
            return True
        return 0 < trainer.max_steps <= trainer.global_step + 1

    def _report_loss(self) -> Tensor:
        """The loss of the newest minibatch this rank knows of, logged as ``train_loss``."""
        assert self.runner is not None
        if self._batch_losses:
            value = sum(self._batch_losses) / len(self._batch_losses)
        else:
            value = self.runner.executor.newest_loss
        if value is None:
            return torch.tensor(float("nan"), device=self.root_device)
        loss = torch.tensor(value, device=self.root_device)
        self.lightning_module.log(
            "train_loss", loss, prog_bar=True, on_step=True, on_epoch=False, sync_dist=False
        )
        return loss

    def _apply_update(
        self, gradients: dict[str, Tensor], version: int, fresh: dict[str, Tensor]
    ) -> int:
        """Called by the executor at each update of this stage; returns the bytes copied to keep
        a stashed weight version intact (none when SGD steps every parameter)."""
        assert self.local_stage is not None
        params = dict(self.local_stage.module.named_parameters())
        if self.sync in FLUSHED:
            self._handover = gradients
            # Lightning steps later, in place: a stashed version keeps a copy
            return update.move_storage({params[n]: t for n, t in fresh.items()})
        trainer = self.lightning_module.trainer
        for name, param in params.items():
            param.grad = gradients.get(name)
        clip = trainer.gradient_clip_val
        if clip:
            grads = [p for p in params.values() if p.grad is not None]
            if trainer.gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(grads, clip)
            else:
                torch.nn.utils.clip_grad_norm_(grads, clip)
        targets: dict[Tensor, Tensor] = {params[name]: t for name, t in fresh.items()}
        stepped = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        # a parameter no optimizer steps keeps its values; it still leaves the shared storage
        copied = update.move_storage({p: t for p, t in targets.items() if id(p) not in stepped})
        for optimizer in self.optimizers:
            copied += update.step(optimizer, targets)
            optimizer.zero_grad(set_to_none=True)
        return copied

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.sync not in FLUSHED or self.local_stage is None:
            return closure_loss
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        for name, param in self.local_stage.module.named_parameters():
            grad = self._handover.get(name)
            if grad is None:
                continue
            if scale != 1.0:  # a copy of the stage's gradients costs as much as a small backward
                grad = grad * scale
            param.grad = grad if param.grad is None else param.grad + grad
        self._handover = {}
        return closure_loss

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if self.sync in FLUSHED:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return closure()

    def _check_sigterm(self) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if getattr(self.lightning_module.trainer, "received_sigterm", False):
            raise SIGTERMException()

    # ----- draining around evaluation and checkpoints -------------------------------------------

    def drain(self) -> None:
        """Finish every minibatch in flight (all ranks must call this at the same point)."""
        if self.runner is not None:
            self.runner.drain()

    # ----- evaluation: forward-only through the first replica of every stage -----------------

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        result = self._evaluate("predict_step", *args, **kwargs)
        return self._predictions_to_rank_zero(result, args[1] if len(args) > 1 else 0)

    def _evaluate(
        self, hook: str, batch: Any, batch_idx: int = 0, *rest: Any, **kwargs: Any
    ) -> Any:
        """Run this stage's layers on the batch; the last stage runs the user's ``hook``."""
        assert self.local_stage is not None and self.runner is not None and self.plan is not None
        stage = self.local_stage.stage
        if self.global_rank != stage.ranks[0]:
            return None
        channel = self.runner.executor.channel
        what = f"the {hook.split('_')[0]} activations of batch {batch_idx}"
        with torch.no_grad():
            if stage.index == 0:
                inputs = as_tensors(self._split_one(batch))
            else:
                source = self.plan.stages[stage.index - 1].ranks[0]
                inputs = channel.recv(source, TAG_EVALUATION, what).tensors
            output = self.local_stage.module(*inputs)
            if stage.index < self.plan.num_stages - 1:
                target = self.plan.stages[stage.index + 1].ranks[0]
                channel.send(Message(as_tensors(output)), target, TAG_EVALUATION, what)
                return None
            module = self.lightning_module
            with _forward_returns(module, output):
                return getattr(module, hook)(batch, batch_idx, *rest, **kwargs)

    def _split_one(self, batch: Any) -> Any:
        split = getattr(self.lightning_module, "pipeline_split_batch", None)
        if split is not None:
            return split(batch)[0]
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def _predictions_to_rank_zero(self, result: Any, batch_idx: int) -> Any:
        """The last stage's predictions travel to rank 0, which returns them to the user."""
        assert self.plan is not None and self.runner is not None
        last = self.plan.stages[-1].ranks[0]
        if last == 0:
            return result
        channel = self.runner.executor.channel
        what = f"the predictions of batch {batch_idx}"
        if self.global_rank == last:
            channel.send(Message(as_tensors(result)), 0, TAG_PREDICTIONS, what)
            return None
        if self.global_rank == 0:
            tensors = channel.recv(last, TAG_PREDICTIONS, what).tensors
            return tensors[0] if len(tensors) == 1 else tuple(tensors)
        return None

    def _share_evaluation_metrics(
        self, trainer: pl.Trainer, outputs: dict[str, Any]
    ) -> dict[str, Any]:
        """Every rank adopts the metrics the last stage logged (a broadcast per evaluation)."""
        assert self.plan is not None and self.runner is not None
        self.runner.executor.channel.flush()
        connector = trainer._logger_connector
        source = self.plan.stages[-1].ranks[0]
        box: list[Any] = [None]
        if self.global_rank == source:
            box[0] = _cpu(
                (
                    outputs,
                    connector.callback_metrics,
                    connector.progress_bar_metrics,
                    connector.logged_metrics,
                )
            )
        dist.broadcast_object_list(box, src=source)
        shared, callback, progress, logged = box[0]
        if self.global_rank != source:
            connector._callback_metrics.update(callback)
            connector._progress_bar_metrics.update(progress)
            connector._logged_metrics.update(logged)
        return shared

    @override
    def on_validation_start(self) -> None:
        self.drain()

    @override
    def on_test_start(self) -> None:
        self.drain()

    @override
    def on_predict_start(self) -> None:
        self.drain()

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

    def _clip_global_norm(self, optimizer: Any, clip_val: float) -> None:
        """Scale gradients so their norm over every stage is at most ``clip_val``."""
        assert self.local_stage is not None
        replicas = self.local_stage.stage.replicas
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        square = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for grad in grads:
            square += grad.detach().double().pow(2).sum()
        square /= replicas
        dist.all_reduce(square)
        coefficient = float(clip_val) / (float(square.sqrt()) + 1e-6)
        if coefficient < 1.0:
            for grad in grads:
                grad.mul_(coefficient)

    # ----- checkpoints ------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's state under the LightningModule's names (drains first)."""
        self.drain()
        assert self.local_stage is not None
        state = {
            self.local_stage.names[name]: tensor.detach().cpu()
            for name, tensor in self.local_stage.module.state_dict(keep_vars=True).items()
        }
        if self.local_stage.stage.index == 0:
            full = self.lightning_module.state_dict()
            state.update({name: full[name] for name in self.local_stage.shared if name in full})
        return state

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        assert self.local_stage is not None and self.plan is not None
        stage = self.local_stage.stage
        root = Path(filepath)
        if self.global_rank == stage.ranks[0]:
            root.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, root / shard_name(stage.index))
        if self.global_rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            meta = {
                "format": "pl-pipedream sharded checkpoint",
                "sync": self.sync,
                "microbatches": self.microbatches,
                "plan": self.plan.to_dict(),
                "shards": [shard_name(s.index) for s in self.plan.stages],
            }
            (root / META_FILE).write_text(json.dumps(meta, indent=1))

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a sharded checkpoint: every stage's weights merged, the rest from stage 0."""
        if not (Path(checkpoint_path) / META_FILE).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only)
        meta, shards = read_shards(checkpoint_path)
        self._resume = (meta, shards)
        checkpoint = dict(shards[0])
        merged: dict[str, Tensor] = {}
        for shard in shards:
            for name, tensor in shard["state_dict"].items():
                merged.setdefault(name, tensor)
        checkpoint["state_dict"] = merged
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each stage takes the optimizer state its own stage saved."""
        if self._resume is None:
            return super().load_optimizer_state_dict(checkpoint)
        assert self.local_stage is not None and self.plan is not None
        meta, shards = self._resume
        saved = Plan.from_dict(meta["plan"])
        layout = [(s.nodes, s.replicas) for s in saved.stages]
        if layout != [(s.nodes, s.replicas) for s in self.plan.stages]:
            raise PipelineSetupError(
                f"a checkpoint resumes only under the plan that saved it (saved: {saved.shape} "
                f"with layers {[list(s.nodes) for s in saved.stages]}, now: {self.plan.shape} with "
                f"layers {[list(s.nodes) for s in self.plan.stages]}); resume with "
                f"PipeDreamStrategy(plan=...) from the checkpoint's pipeline.json, or load only "
                "the weights with consolidate_checkpoint()"
            )
        states = shards[self.local_stage.stage.index]["optimizer_states"]
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0 and os.path.isdir(filepath):
            shutil.rmtree(filepath)

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every stage's state gathered to every rank (a collective: all ranks call it)."""
        mine = self.lightning_module_state_dict()
        gathered: list[dict[str, Tensor] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        merged: dict[str, Tensor] = {}
        for part in gathered:
            assert part is not None
            for name, tensor in part.items():
                merged.setdefault(name, tensor)
        return merged

    # ----- collectives Lightning asks for (setup, evaluation, checkpoints) ----------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        if reduce_op in ("mean", "avg") or str(reduce_op).lower().endswith("mean"):
            tensor = tensor / self.world_size
        return tensor

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


def _slice_batch(batch: Any, m: int) -> list[Any]:
    """Split every tensor of a batch along dim 0 into ``m`` equal parts."""
    if isinstance(batch, Tensor):
        size = batch.shape[0] if batch.dim() else 0
        if size % m != 0 or size == 0:
            raise ValueError(
                f"a batch must split into equal microbatches (batch size: {size}, microbatches: "
                f"{m}); use a batch size that is a multiple of {m} (and drop_last=True in the "
                "DataLoader)"
            )
        return list(batch.chunk(m))
    if isinstance(batch, (tuple, list)):
        parts = [_slice_batch(item, m) for item in batch]
        return [
            type(batch)(p[j] for p in parts) if isinstance(batch, tuple) else [p[j] for p in parts]
            for j in range(m)
        ]
    if isinstance(batch, dict):
        parts = {key: _slice_batch(value, m) for key, value in batch.items()}
        return [{key: value[j] for key, value in parts.items()} for j in range(m)]
    return [batch] * m


@contextmanager
def _forward_returns(module: torch.nn.Module, output: Any):  # type: ignore[no-untyped-def]
    """Make ``module(x)`` return ``output`` (the pipeline's result) for the duration."""
    previous = module.__dict__.get("forward")
    module.forward = lambda *args, **kwargs: output  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous  # type: ignore[method-assign]


def _shape_forward(layers: torch.nn.Sequential) -> Callable[..., Any]:
    """A forward for calls outside the pipeline (Lightning's model summary): it runs every
    layer on the ``meta`` device, so it yields the right shapes without the other stages'
    weights."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        value: Any = tuple(_to_meta(a) for a in args)
        for layer in layers:
            state = {n: _to_meta(t) for n, t in (*layer.named_parameters(), *layer.named_buffers())}
            value = torch.func.functional_call(
                layer, state, value if isinstance(value, tuple) else (value,)
            )
        return value

    return forward


def _cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    return value


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value
