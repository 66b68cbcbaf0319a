"""The strategy's setup and teardown: the environment, the session, and what the fit ends with.

``set_up_environment`` joins the process group and places the rank. ``set_up``, in order: the
checks on the Trainer and the precision, the plan (``planning``), and the strategy's session
(``engine.session``, the driver every front end shares) staged in Lightning's call order: this
rank's stage cut from the LightningModule, created from its empty build or filled from
pretrained weights (not read when ``fit(ckpt_path=...)`` resumes, ``stage_weights``), a resumed
checkpoint's state of the stage loaded (``core.resume``), converted to the precision plugin's
dtype, placed and started, with Lightning's updates (``updates``) as its update seam and the
LightningModule's hooks at the end of its evaluation pipe (``evaluation``); then the optimizers
with the divergence watch and re-planning when fitting, and last the Lightning internals the
pipeline needs (``lightning_patches``). ``end_fit`` reports the fit's memory and timeline;
``tear_down`` undoes what the fit set up.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_pipedream.core.materialize import model_tensors
from pl_pipedream.core.placement import (
    bind_to_cpu_share,
    join_process_group,
    keep_local_parameters,
    move_to_device,
    process_group_backend,
)
from pl_pipedream.core.pretrained import Pretrained
from pl_pipedream.core.resume import Resume
from pl_pipedream.core.stage import LocalStage, pipeline_layers
from pl_pipedream.engine.session import Session, Settings
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.affinity import bind_threads
from pl_pipedream.runtime.memory import retain_freed_memory
from pl_pipedream.runtime.timeline import gather_trace
from pl_pipedream.strategy import lightning_patches
from pl_pipedream.strategy.batches import shape_forward
from pl_pipedream.strategy.evaluation import EvaluationPipe
from pl_pipedream.strategy.host import Host
from pl_pipedream.strategy.planning import SetupPlanner
from pl_pipedream.strategy.precision import (
    check_optimizers,
    check_precision,
    convert_stage,
    stage_precision,
)
from pl_pipedream.strategy.preemption import stop_fit
from pl_pipedream.strategy.updates import (
    LightningUpdates,
    TrainerUpdates,
    check_trainer,
    lightning_updates,
)

__all__ = [
    "attached_trainer",
    "end_fit",
    "new_session",
    "patch_lightning",
    "set_up",
    "set_up_environment",
    "stage_weights",
    "tear_down",
]


def set_up(strategy: Host, trainer: pl.Trainer) -> None:
    """``PipeDreamStrategy.setup`` after the accelerator's: the strategy's ``session``
    (``engine.session``) planned, built and started (see the module docstring)."""
    module = strategy.lightning_module
    assert module is not None
    check_trainer(strategy.sync, trainer)
    check_precision(strategy.precision_plugin, strategy.sync)
    layers = pipeline_layers(module)
    built_empty = any(tensor.is_meta for tensor in model_tensors(module))
    strategy.loader_seeds.agree()
    if trainer.ckpt_path is None:
        strategy.resume.forget()  # a checkpoint of an earlier fit is not this run's
    resumed = strategy.resume.saved_plan
    planner = SetupPlanner(
        strategy._given_plan,
        strategy.balance,
        strategy.plan,
        resumed,
        strategy.topology,
        strategy.microbatches,
        strategy.world_size,
        strategy.batch_to_device,
        strategy.memory,
        strategy.recompute,
        sync=strategy.sync,
        chunks=strategy.chunks_per_rank,
    )
    plan = planner.plan(trainer, module, layers)
    strategy.setup_seconds = planner.seconds or strategy.setup_seconds
    session = strategy.session = new_session(strategy, trainer, module, layers)
    local_stage = session.cut(plan)
    strategy.resume.check_plan(plan, local_stage.stage.index)  # keyed by position?
    weights = stage_weights(strategy.pretrained, trainer, built_empty, strategy.resume)
    session.create(weights, strategy.empty_build)
    if weights is None:
        strategy.resume.load_stage(module)  # built whole: a sharded checkpoint's state of it
    convert_stage(strategy.precision_plugin, module)  # the true precisions: the stage's dtype
    session.place()
    session.start()
    if trainer.state.fn == TrainerFn.FITTING:
        strategy.setup_optimizers(trainer)
        check_optimizers(strategy.precision_plugin, strategy.optimizers)
        strategy.steps.start_fit()
        strategy.resume.record(module, strategy.optimizers)  # configure_optimizers' names
        keep_local_parameters(module, strategy.optimizers)
        strategy.replanning.start(strategy, trainer)
    strategy.setup_precision_plugin()
    patch_lightning(strategy, trainer)


def new_session(
    strategy: Host, trainer: pl.Trainer, module: nn.Module, layers: nn.Sequential
) -> Session:
    """The strategy's session: its options as ``engine.session.Settings``, Lightning's updates
    (``updates``: the precision plugin and the hooks) as the update seam, the evaluation pipe
    with the LightningModule's hooks as the forward-only pipe."""
    device = strategy.root_device
    settings = Settings(
        strategy.sync,
        strategy.microbatches,
        strategy.global_rank,
        device,
        strategy.timeout,
        stage_precision(strategy.precision_plugin, device),
        strategy.weight_prediction,
        strategy.lr_warmup_per_delay,
        strategy.delay_lr_updates,
        strategy.recompute,
        keep_timeline=strategy.timeline is not None,
        replanning=strategy.replanning.on,
        caller="PipeDreamStrategy",
    )
    optimizers = partial(getattr, strategy, "optimizers")  # read when used: set up later

    def update_of(local: LocalStage, plan: Plan) -> LightningUpdates:
        replicas, elsewhere = local.stage.replicas, local.ties_counted_elsewhere()
        return lightning_updates(
            strategy.sync, local.module, optimizers, trainer, replicas, device, elsewhere
        )

    return Session(module, layers, settings, update_of, optimizers, EvaluationPipe)


def patch_lightning(strategy: Host, trainer: pl.Trainer) -> None:
    """The Lightning internals the pipeline needs (``lightning_patches``), over the strategy's
    pipeline in use: at setup, and again after a re-plan built another (``replanning``)."""
    module, session = strategy.lightning_module, strategy.session
    assert session is not None and module is not None
    pipe, runner, updates = session.forward, session.running(), session.update
    assert isinstance(pipe, EvaluationPipe)
    clip = updates.clip_global_norm if isinstance(updates, TrainerUpdates) else None

    def at_step() -> None:  # before each training step: a preemption's stop, a re-plan's move
        strategy.preemption.at_step(
            strategy.timeout, lambda signum: stop_fit(trainer, strategy.drain, signum)
        )
        strategy.replanning.at_step(strategy, trainer)

    lightning_patches.patch_for_pipeline(
        trainer,
        module,
        shape_forward(pipeline_layers(module)),
        strategy.precision_plugin,
        clip,
        pipe.metrics_source,
        runner.executor.channel.flush,
        at_step,
    )


def stage_weights(
    pretrained: Pretrained | None, trainer: Any, built_empty: bool, resume: Resume
) -> Pretrained | None:
    """The weights that fill this rank's stage at setup (``core.pretrained``), or None: when
    ``fit(ckpt_path=...)`` resumes, the checkpoint wins (said on rank 0). A module built empty
    is created from the checkpoint: from the shards of its stage's names (``Resume.weights``),
    or from the whole state Lightning loaded into its ``meta`` tensors, where it is lost; a
    module built whole was restored by Lightning, or is by ``Resume.load_stage``."""
    if not trainer.ckpt_path:
        return pretrained
    if pretrained is not None:
        rank_zero_info(
            f"PipeDreamStrategy: resuming from {trainer.ckpt_path}; the pretrained weights "
            f"({pretrained.describe()}) are not read, the checkpoint's weights continue"
        )
    if not built_empty:
        return None
    if resume.lazy:
        return Pretrained(resume.weights())
    state = lightning_patches.resumed_state_dict(trainer)
    return Pretrained(state) if state is not None else None


def set_up_environment(strategy: Host) -> None:
    """``PipeDreamStrategy.setup_environment``: this rank in the cluster environment, the
    process group, and on CPU the allocator kept and the rank bound to its share of the cores
    (``placement``)."""
    environment = strategy.cluster_environment
    assert environment is not None
    processes, node_rank = strategy.num_processes, strategy.node_rank
    environment.set_global_rank(node_rank * processes + strategy.local_rank)
    environment.set_world_size(strategy.num_nodes * processes)
    on_cpu = strategy.root_device.type == "cpu"
    backend = process_group_backend(strategy.root_device, strategy._process_group_backend)
    strategy._process_group_backend = backend
    if strategy.retain_freed_memory and on_cpu:
        retain_freed_memory()
    timeout = timedelta(seconds=strategy.timeout)
    rank, world = environment.global_rank(), environment.world_size()
    join_process_group(
        environment.main_address, environment.main_port, rank, world, backend, timeout
    )
    rank_zero_info(f"PipeDreamStrategy: {world} processes joined (backend: {backend})")
    if strategy.bind_cpus and on_cpu:
        node = range(node_rank * processes, (node_rank + 1) * processes)
        bound = bind_to_cpu_share(strategy.global_rank, strategy.world_size, node)
        strategy._unbound_cpus, strategy.cpu_binding = bound or (None, None)


def tear_down(strategy: Host) -> None:
    """``PipeDreamStrategy.teardown`` before Lightning's plugins': the preemption handlers, the
    pipeline closed (without waiting on peers after a failure), the module back on the CPU, the
    rank's cores given back."""
    trainer = attached_trainer(strategy.lightning_module)
    failed = trainer is not None and trainer.interrupted
    strategy.preemption.finish(failed)
    strategy.replanning.finish()
    if strategy.session is not None:
        strategy.session.close(failed=failed)
    if strategy.lightning_module is not None:
        move_to_device(strategy.lightning_module, torch.device("cpu"))
    if strategy._unbound_cpus is not None:
        bind_threads(strategy._unbound_cpus)
        strategy._unbound_cpus = strategy.cpu_binding = None


def attached_trainer(module: Any) -> Any | None:
    """The trainer ``module`` is attached to, or None (the ``trainer`` property raises)."""
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:
        return None


def end_fit(strategy: Host) -> None:
    """At the end of training, on drained weights: the memory report (printed by rank 0) and,
    with ``timeline=``, the Chrome trace with the measured bubble per rank."""
    session = strategy.session
    strategy.memory_report = session.memory_report(rank_zero_info) if session is not None else []
    strategy.replanning.finish()
    timeline = strategy.timeline
    if timeline is not None and session is not None and session.runner is not None:
        strategy.bubbles = gather_trace(session.timeline(), timeline) or {}  # every runner's
        if strategy.bubbles:
            summary = ", ".join(f"rank {r}: {b:.3f}" for r, b in strategy.bubbles.items())
            rank_zero_info(f"PipeDream timeline written to {timeline}; bubble {summary}")
