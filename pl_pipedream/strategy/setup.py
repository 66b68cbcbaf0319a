"""The strategy's setup and teardown: the environment, the plan, this rank's stage, the pipeline.

``set_up_environment`` joins the process group and places the rank. ``set_up``, in order: the
checks on the Trainer and the precision, the plan (``planning``), this rank's stage cut from the
LightningModule (``stage``) and created from its empty build (``materialize``) or filled from
pretrained weights (``core.pretrained``; not read when ``fit(ckpt_path=...)`` resumes), with a
resumed checkpoint's state of the stage loaded (``core.resume``), the other
stages' parameters marked (``elsewhere``) and the stage placed (``placement``); then the stage's
updates (``updates``), the ``PipelineRunner`` that runs its segment of the schedule, the
evaluation pipe, the optimizers with the divergence watch when fitting, and last the Lightning
internals the pipeline needs (``lightning_patches``). ``end_fit`` reports the fit's memory and
timeline; ``tear_down`` undoes what the fit set up.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from pl_pipedream.core.elsewhere import mark_other_stages
from pl_pipedream.core.materialize import materialize, model_tensors
from pl_pipedream.core.placement import (
    bind_to_cpu_share,
    join_process_group,
    keep_local_parameters,
    move_to_device,
    process_group_backend,
)
from pl_pipedream.core.pretrained import Pretrained, load_stage
from pl_pipedream.core.resume import Resume
from pl_pipedream.core.stage import cut_stage, pipeline_layers
from pl_pipedream.runtime.affinity import bind_threads
from pl_pipedream.runtime.memory import retain_freed_memory
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.staleness import check_corrections, corrected_update
from pl_pipedream.runtime.timeline import gather_trace
from pl_pipedream.schedule.modes import check_chunked
from pl_pipedream.strategy import lightning_patches, memory_report
from pl_pipedream.strategy.batches import shape_forward
from pl_pipedream.strategy.evaluation import EvaluationPipe
from pl_pipedream.strategy.planning import SetupPlanner
from pl_pipedream.strategy.precision import (
    check_optimizers,
    check_precision,
    convert_stage,
    stage_precision,
)
from pl_pipedream.strategy.preemption import stop_fit
from pl_pipedream.strategy.updates import (
    TrainerUpdates,
    check_ties,
    check_trainer,
    lightning_updates,
)

__all__ = [
    "attached_trainer",
    "build_pipeline",
    "end_fit",
    "patch_lightning",
    "set_up",
    "set_up_environment",
    "stage_weights",
    "tear_down",
]


def set_up(strategy: Any, trainer: pl.Trainer) -> None:
    """``PipeDreamStrategy.setup`` after the accelerator's: sets the strategy's ``plan``,
    ``local_stage``, ``updates``, ``runner`` and ``evaluation`` (see the module docstring)."""
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
    strategy.plan = planner.plan(trainer, module, layers)
    strategy.setup_seconds = planner.seconds or strategy.setup_seconds
    local_stage = cut_stage(module, layers, strategy.plan, strategy.global_rank)
    strategy.local_stage = local_stage
    strategy.resume.check_plan(strategy.plan, local_stage.stage.index)  # keyed by position?
    initial = (
        module,
        layers,
        local_stage.layer_indices,
        strategy.root_device,
        strategy.empty_build,
    )
    weights = stage_weights(strategy.pretrained, trainer, built_empty, strategy.resume)
    if weights is not None:
        load_stage(weights, *initial)
    else:
        materialize(*initial)
        strategy.resume.load_stage(module)  # built whole: a sharded checkpoint's state of it
    convert_stage(strategy.precision_plugin, module)  # the true precisions: the stage's dtype
    replicas = [s.replicas for s in strategy.plan.stages]
    ties = [tie.describe() for tie in local_stage.ties]
    check_ties(strategy.sync, ties, replicas)
    check_chunked(strategy.sync, ties, strategy.replanning.on, "PipeDreamStrategy(sync='{sync}')")
    check_corrections(strategy.sync, strategy.weight_prediction, strategy.lr_warmup_per_delay, ties)
    mark_other_stages(module, layers, strategy.plan, strategy.global_rank)
    move_to_device(module, strategy.root_device)
    build_pipeline(strategy, trainer)
    if trainer.state.fn == TrainerFn.FITTING:
        strategy.setup_optimizers(trainer)
        check_optimizers(strategy.precision_plugin, strategy.optimizers)
        strategy.steps.start_fit()
        strategy.resume.record(module, strategy.optimizers)  # configure_optimizers' names
        keep_local_parameters(module, strategy.optimizers)
        strategy.replanning.start(strategy, trainer)
    strategy.setup_precision_plugin()
    patch_lightning(strategy, trainer)


def patch_lightning(strategy: Any, trainer: pl.Trainer) -> None:
    """The Lightning internals the pipeline needs (``lightning_patches``), over the strategy's
    pipeline in use: at setup, and again after a re-plan built another (``replanning``)."""
    module = strategy.lightning_module
    assert strategy.evaluation is not None and strategy.runner is not None
    updates = strategy.updates
    clip = updates.clip_global_norm if isinstance(updates, TrainerUpdates) else None

    def at_step() -> None:  # before each training step: a preemption's stop, a re-plan's move
        strategy.preemption.at_step(
            strategy.timeout, lambda signum: stop_fit(trainer, strategy, signum)
        )
        strategy.replanning.at_step(strategy, trainer)

    lightning_patches.patch_for_pipeline(
        trainer,
        module,
        shape_forward(pipeline_layers(module)),
        strategy.precision_plugin,
        clip,
        strategy.evaluation.metrics_source,
        strategy.runner.executor.channel.flush,
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


def build_pipeline(strategy: Any, trainer: pl.Trainer) -> None:
    """The stage's updates, the pipeline that runs it, the evaluation pipe."""
    assert strategy.local_stage is not None and strategy.plan is not None
    stage, module = strategy.local_stage.stage, strategy.local_stage.module
    optimizers = lambda: strategy.optimizers  # noqa: E731 - set up after the pipeline
    strategy.updates = lightning_updates(
        strategy.sync,
        module,
        optimizers,
        trainer,
        stage.replicas,
        strategy.root_device,
        strategy.local_stage.ties_counted_elsewhere(),
    )
    # the learning-rate corrections (the per-minibatch modes only: checked at __init__)
    apply = corrected_update(
        strategy.updates,
        optimizers,
        strategy.plan,
        strategy.sync,
        stage.index,
        lr_warmup_per_delay=strategy.lr_warmup_per_delay,
    )
    strategy.runner = PipelineRunner.create(
        strategy.plan,
        strategy.sync,
        strategy.microbatches,
        module,
        strategy.global_rank,
        apply,
        strategy.root_device,
        strategy.timeout,
        record_timeline=strategy.timeline is not None or strategy.replanning.on,
        ties=strategy.local_stage.ties,
        weight_prediction=strategy.weight_prediction,
        recompute=strategy.recompute,
        precision=stage_precision(strategy.precision_plugin, strategy.root_device),
    )
    channel = strategy.runner.executor.channel
    strategy.evaluation = EvaluationPipe(
        strategy.plan, strategy.local_stage, channel, strategy.global_rank
    )


def set_up_environment(strategy: Any) -> None:
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


def tear_down(strategy: Any) -> None:
    """``PipeDreamStrategy.teardown`` before Lightning's plugins': the preemption handlers, the
    pipeline closed (without waiting on peers after a failure), the module back on the CPU, the
    rank's cores given back."""
    trainer = attached_trainer(strategy.lightning_module)
    failed = trainer is not None and trainer.interrupted
    strategy.preemption.finish(failed)
    strategy.replanning.finish()
    if strategy.runner is not None:
        runner, strategy.runner = strategy.runner, None
        runner.close(failed=failed)
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


def end_fit(strategy: Any) -> None:
    """At the end of training, on drained weights: the memory report (printed by rank 0) and,
    with ``timeline=``, the Chrome trace with the measured bubble per rank."""
    strategy.memory_report = memory_report.of_fit(strategy)
    strategy.replanning.finish()
    timeline, runner = strategy.timeline, strategy.runner
    if timeline is not None and runner is not None:
        events = strategy.replanning.timeline(runner)  # the replaced pipelines' too
        strategy.bubbles = gather_trace(events, timeline) or {}
        if strategy.bubbles:
            summary = ", ".join(f"rank {r}: {b:.3f}" for r, b in strategy.bubbles.items())
            rank_zero_info(f"PipeDream timeline written to {timeline}; bubble {summary}")
