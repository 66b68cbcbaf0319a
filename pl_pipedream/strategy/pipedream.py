"""``PipeDreamStrategy``: PipeDream's pipeline inside Lightning's own training loop.

Every rank runs its own Lightning loop over the same batches. In each training step the rank
runs its segment of the schedule for that batch (``PipelineRunner``); ranks are coupled only by
the activations and gradients they exchange, and every rank logs the same ``train_loss``.

The class holds Lightning's hooks in the order Lightning calls them, each delegating to the
module that does the job: ``setup``, ``step`` (and ``replanning``), ``updates``, ``evaluation``,
``checkpoint`` and ``resume``, ``collectives``; ``lightning_patches`` holds every internal touched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from pl_pipedream.core import arguments, collectives
from pl_pipedream.core import checkpoint as sharded
from pl_pipedream.core.data import LoaderSeeds
from pl_pipedream.core.materialize import EmptyBuild
from pl_pipedream.core.memory_limit import parse_memory
from pl_pipedream.core.memory_report import StageMemory
from pl_pipedream.core.placement import move_to_device
from pl_pipedream.core.preemption import Preemption, parse_signals
from pl_pipedream.core.pretrained import Pretrained
from pl_pipedream.core.resume import Resume
from pl_pipedream.engine.arguments import CHECKED, check_options
from pl_pipedream.engine.options import FRONT_ENDS, checked_options
from pl_pipedream.engine.session import Session
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy import lightning_patches
from pl_pipedream.strategy.evaluation import evaluation_step
from pl_pipedream.strategy.launcher import PipelineScriptLauncher, PipelineSpawnLauncher
from pl_pipedream.strategy.replanning import Replanning
from pl_pipedream.strategy.setup import end_fit, set_up, set_up_environment, tear_down
from pl_pipedream.strategy.step import TrainingSteps, backward

__all__ = ["PipeDreamStrategy"]


class PipeDreamStrategy(ParallelStrategy):
    """Pipeline-parallel training with PipeDream's 1F1B, 1F1B-RR and weight stashing.

    The options it shares with every front end are ``pl_pipedream.Pipeline``'s, less those
    Lightning decides (the device, the precision, gradient clipping, ...: ``engine.options.
    FRONT_ENDS``, which names where each is set; passing one here is refused naming it). They
    mean what they mean for ``Pipeline`` and are checked by the same rule (``engine.
    arguments``). Its defaults that differ: ``sync="async"`` (PipeDream's own mode), and
    ``preempt_signals`` SIGTERM and SIGUSR1 (each stops every rank at one step with
    ``last.ckpt`` saved; ``()`` leaves them to Lightning). With neither ``balance`` nor
    ``plan``, rank 0 profiles the first batch and plans (``strategy.planning``). Its own:

    Args:
        start_method: ``"popen"`` (re-run the script per rank, like DDP), ``"spawn"`` or ``"fork"``.
        retain_freed_memory, bind_cpus: on CPU, keep freed memory; give each rank its cores.
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
        delay_lr_updates: int | None = None,
        divergence: str = "error",
        divergence_rise: float = 0.9,
        divergence_patience: int = 3,
        divergence_window: int = 5,
        preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        recompute: bool = False,
        memory: int | float | str | None = None,
        pretrained: str | os.PathLike | Pretrained | None = None,
        replan: str = "off",
        replan_every: int = 50,
        replan_threshold: float = 0.05,
        chunks_per_rank: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **lightning_decides: Any,
    ) -> None:
        checked_options(lightning_decides, FRONT_ENDS["PipeDreamStrategy"])  # raises for any
        options = {k: v for k, v in locals().items() if k in CHECKED}  # as every front end's
        self.sync = check_options(options, FRONT_ENDS["PipeDreamStrategy"].call)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        arguments.check_start_method(start_method)
        self.weight_prediction, self.lr_warmup_per_delay = weight_prediction, lr_warmup_per_delay
        self.delay_lr_updates = delay_lr_updates
        self.balance = list(balance) if balance is not None else None
        self._given_plan = plan
        self.topology, self.setup_seconds, self.timeout = topology, 0.0, float(timeout)
        self.timeline = Path(timeline) if timeline is not None else None
        self.bubbles: dict[int, float] = {}
        self._start_method, self.divergence = start_method, divergence
        self.retain_freed_memory, self.bind_cpus = retain_freed_memory, bind_cpus
        rule = (divergence_rise, divergence_patience, divergence_window)
        self.steps = TrainingSteps(divergence, rule)  # refuses bad thresholds now
        self.cpu_binding: frozenset[int] | None = None  # this rank's cores while bound
        self._unbound_cpus: frozenset[int] | None = None  # the cores to restore at teardown
        self._process_group_backend = process_group_backend
        self.num_nodes = 1  # set by Lightning from Trainer(num_nodes=...)
        self.session: Session | None = None  # the pipeline, staged by setup.set_up
        self.resume = Resume()  # the checkpoint resumed, the optimizers' names (core.resume)
        self.loader_seeds = LoaderSeeds()  # agreed at setup (core.data)
        self.preemption = Preemption(parse_signals(preempt_signals))
        self.empty_build = EmptyBuild()  # what configure_model() built on meta (materialize)
        self.recompute, self.pretrained = bool(recompute), Pretrained.parse(pretrained)
        self.memory, self.microbatches = parse_memory(memory), microbatches
        self.chunks_per_rank = chunks_per_rank
        self.replanning = Replanning(replan, replan_every, replan_threshold)
        layout = (balance, plan, self.replanning.on)
        arguments.check_planning_options({"topology": topology, "memory": self.memory}, *layout)
        self.memory_report: list[StageMemory] = []  # the last fit's, per rank

    @property
    def plan(self) -> Plan | None:
        """The plan in use: the given one until setup planned (``strategy.planning``)."""
        if self.session is not None and self.session.plan is not None:
            return self.session.plan
        return self._given_plan

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
        arguments.check_layer_sync(lightning_patches.layer_sync(self))
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
        set_up_environment(self)
        super().setup_environment()

    # Lightning's @contextmanager types its return as a generator's; callers only enter it.
    @override
    def tensor_init_context(  # type: ignore[override]
        self, empty_init: bool | None = None
    ) -> AbstractContextManager[object]:
        """``configure_model()`` and ``trainer.init_module(empty_init=True)`` build on ``meta``;
        setup creates this rank's stage only (``core.materialize``)."""
        connected = self.lightning_module is not None
        precision = self.precision_plugin.tensor_init_context
        return self.empty_build.context(
            connected, precision, empty_init, super().tensor_init_context
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        set_up(self, trainer)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Every rank's loader draws the same order (``data.seed_loader``)."""
        return self.loader_seeds.seed_loader(dataloader)

    @override
    def model_to_device(self) -> None:
        if self.lightning_module is not None:
            move_to_device(self.lightning_module, self.root_device)

    # ----- training ---------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        return self.steps.run(self.session, self.lightning_module, batch, batch_idx)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return backward(self.session, self.lightning_module, self.precision_plugin, closure_loss)

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if self.sync.updates_in_pipeline:
            return closure()  # runs training_step; the stages stepped inside the pipeline
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def drain(self) -> None:
        """Finish every minibatch in flight (all ranks must call this at the same point)."""
        if self.session is not None:
            self.session.drain()

    # ----- evaluation: forward only, on drained weights ---------------------------------------

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", *args, **kwargs)

    def _evaluation_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        parts = (self.session, self.precision_plugin, self.lightning_module)
        return evaluation_step(*parts, hook, *args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        self.drain()

    @override
    def on_test_start(self) -> None:
        self.drain()

    @override
    def on_predict_start(self) -> None:
        self.drain()

    # ----- checkpoints: one shard per stage (core.checkpoint) -----------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's state under the LightningModule's names (drains first)."""
        self.drain()
        assert self.session is not None and self.session.local is not None
        assert self.lightning_module is not None
        return self.session.local.state_dict(self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: Any, filepath: Any, storage_options: Any = None) -> None:
        assert self.plan is not None
        args = (self.global_rank, self.plan, self.sync, self.microbatches, self.timeout)
        sharded.save(checkpoint, filepath, *args)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Keyed by parameter name, so that any plan resumes it (``core.named_state``)."""
        return self.resume.state_of(self.optimizers, optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        base = super().load_checkpoint
        return self.resume.read(checkpoint_path, lambda: base(checkpoint_path, weights_only))

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Wrong names fail on every rank first; a sharded checkpoint's weights load at setup."""
        assert self.lightning_module is not None
        if self.resume.check_model(self.lightning_module.state_dict(), checkpoint, strict):
            super().load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each optimizer takes the state of the parameters its stage holds (``core.resume``)."""
        self.resume.load_optimizers(checkpoint, self.optimizers)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:
            sharded.remove(filepath)

    # ----- collectives: every rank of the pipeline (core.collectives) ---------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return collectives.reduce(tensor, group, reduce_op)

    @override
    def on_train_end(self) -> None:
        self.drain()
        end_fit(self)

    @override
    def teardown(self) -> None:
        tear_down(self)
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("pipedream", cls, description="PipeDream pipeline parallelism")
