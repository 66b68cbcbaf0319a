"""Every place where the strategy replaces, bypasses or reads a Lightning internal.

A Lightning upgrade should need only this file. Each function names the Lightning 2.6 attribute
it touches and checks that the attribute is there before it patches, so a Lightning that moved it
fails at setup with the attribute's name instead of training on with the patch silently gone;
``tests/strategy/test_lightning_patches.py`` checks each against the installed Lightning.

What needs patching, and why (ARCHITECTURE.md, "Lightning internals still touched"):

* ``_TrainingEpochLoop._broadcast_sigterm_tensor``: rank 0 broadcasts a SIGTERM flag before
  every training step; that collective would put every stage in lock-step. Each rank checks its
  own flag instead, and runs the preemption agreement there (``core.preemption``).
* Preemption: ``_SignalConnector._slurm_sigusr_handler_fn`` (Lightning's SLURM requeue, run at
  the agreed step rather than in the handler).
* ``_LoggerConnector.update_eval_epoch_metrics``: metrics are logged on the last stage only; every
  rank must see them, since callbacks monitor them on every rank.
* ``Precision.clip_grad_by_norm`` (an instance attribute over the plugin's method): Lightning
  clips by the norm of one rank's gradients; a flushed pipeline clips by the norm over all
  stages, as one device would.
* ``LightningModule.forward`` (an instance attribute): the model summary runs
  ``forward(example_input_array)`` on every rank, where other stages' layers are on ``meta``.
* torchmetrics' ``Metric.sync_on_compute``: a metric would gather its state over every rank on
  ``compute()``, but only the last stage's first replica evaluates.
* ``_AcceleratorConnector.use_distributed_sampler`` (which ``_DataConnector.
  _requires_distributed_sampler`` reads): Lightning would replace each DataLoader's sampler by a
  ``DistributedSampler`` that shuffles every training loader; every stage must see the batches
  the user's own sampler gives, as one device would (``core.data``).
* ``_ResultCollection.update_metrics`` (``trainer._results``) and ``_LoggerConnector.
  _current_fx``: the strategy logs ``train_loss`` at every step; after the first step of an
  epoch it updates the registered metric directly (``log_step_value``), which skips the
  per-call checks and device moves of ``LightningModule.log``, the public way, which costs
  about a third of a millisecond per call, 11 times the update in place
  (``benchmarks/log_cost.py``; docs/performance.md).
* ``LightningModule.log`` (an instance attribute, while the strategy runs ``training_step`` on the
  last stage, ``capture_logs``): what ``training_step`` logs is captured there and logged on
  every rank once the batch's loss reaches it (``strategy.step_logs``).
* Read-only: ``ParallelStrategy._layer_sync`` (what ``Trainer(sync_batchnorm=True)`` sets;
  refused before launch, ``core.arguments``), ``_FitLoop._data_source`` (the first
  training batch, to plan with), and ``_CheckpointConnector._loaded_checkpoint`` (a resumed
  checkpoint's weights: Lightning restores them before the strategy's setup, into a module
  built empty on ``meta``, where they are lost; setup fills the stage from them).
* Private classes and functions used as they are: ``_SubprocessScriptLauncher`` (the popen
  launcher's base, for Lightning's ``launcher.kill`` on SIGTERM and Ctrl-C; its ``launch`` is
  replaced, so its observer thread never starts), ``_MultiProcessingLauncher`` and
  ``_WorkerOutput`` (the spawn launcher).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn

from pl_pipedream.core.errors import LightningChangedError
from pl_pipedream.core.loader_state import untouched_draw
from pl_pipedream.runtime.channel import PeerError
from pl_pipedream.trees import map_tensors

__all__ = [
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "capture_logs",
    "WorkerOutput",
    "clip_by_global_norm",
    "first_training_batch",
    "check_sigterm_per_rank",
    "slurm_requeue",
    "keep_user_samplers",
    "layer_sync",
    "patch_for_pipeline",
    "share_evaluation_metrics",
    "stop_metric_sync",
    "summary_forward",
]

SubprocessScriptLauncher = _SubprocessScriptLauncher
MultiProcessingLauncher = _MultiProcessingLauncher
WorkerOutput = _WorkerOutput

SUPPORTED = "lightning>=2.6,<2.7"


def _require(owner: Any, attribute: str, where: str) -> Any:
    if not hasattr(owner, attribute):
        raise LightningChangedError(
            f"PipeDreamStrategy relies on a Lightning internal that is missing ({where}."
            f"{attribute}); install {SUPPORTED}, the versions pl_pipedream supports"
        )
    return getattr(owner, attribute)


def patch_for_pipeline(
    trainer: Any,
    module: nn.Module,
    summary: Callable[..., Any],
    precision: Any,
    clip: Callable[[Any, float], None] | None,
    metrics_source: int,
    before_sharing: Callable[[], None],
    at_step: Callable[[], None] | None = None,
) -> None:
    """Every patch a pipeline's setup applies: the model summary runs ``summary``, metrics
    compute locally, evaluation metrics come from rank ``metrics_source`` (after
    ``before_sharing``), clipping by norm uses ``clip`` (the flushed modes' global norm; None
    keeps Lightning's), each rank checks its own SIGTERM flag and runs ``at_step`` before each
    training step, and DataLoaders keep their own samplers. A re-plan applies them again, over
    its new pipeline."""
    keep_user_samplers(trainer)
    summary_forward(module, summary)
    stop_metric_sync(module)
    share_evaluation_metrics(trainer, metrics_source, before_sharing)
    if clip is not None:
        clip_by_global_norm(precision, clip)
    check_sigterm_per_rank(trainer, at_step)


def layer_sync(strategy: ParallelStrategy) -> Any | None:
    """The ``LayerSync`` plugin the Trainer handed the strategy (``ParallelStrategy.
    _layer_sync``: ``TorchSyncBatchNorm`` for ``Trainer(sync_batchnorm=True)``), or None."""
    return _require(strategy, "_layer_sync", "ParallelStrategy")


def keep_user_samplers(trainer: Any) -> None:
    """Stop Lightning from putting a ``DistributedSampler`` into the DataLoaders
    (``trainer._accelerator_connector.use_distributed_sampler``, read by ``_DataConnector.
    _requires_distributed_sampler`` when each dataloader is set up, after the strategy's setup)."""
    connector = trainer._accelerator_connector
    _require(connector, "use_distributed_sampler", "_AcceleratorConnector")
    connector.use_distributed_sampler = False


def check_sigterm_per_rank(trainer: Any, at_step: Callable[[], None] | None = None) -> None:
    """Replace the per-step SIGTERM broadcast (``trainer.fit_loop.epoch_loop.
    _broadcast_sigterm_tensor``, called before each training step) by a check of this rank's
    own flag, then ``at_step()``."""
    epoch_loop = trainer.fit_loop.epoch_loop
    _require(epoch_loop, "_broadcast_sigterm_tensor", "_TrainingEpochLoop")

    def check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()
        if at_step is not None:
            at_step()

    epoch_loop._broadcast_sigterm_tensor = check


def slurm_requeue(trainer: Any, signum: int) -> None:
    """Under SLURM with ``auto_requeue``, run Lightning's requeue handler
    (``trainer._signal_connector._slurm_sigusr_handler_fn``: loggers finalized, an ``hpc_ckpt``
    saved by every rank, ``scontrol requeue`` from rank 0) on every rank; else nothing."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = trainer.strategy.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        connector = trainer._signal_connector
        _require(connector, "_slurm_sigusr_handler_fn", "_SignalConnector")(signum, None)


def share_evaluation_metrics(trainer: Any, source: int, before: Callable[[], None]) -> None:
    """Wrap ``trainer._logger_connector.update_eval_epoch_metrics`` so that, after each
    evaluation, every rank adopts the metrics rank ``source`` logged (``before()``, then one
    broadcast; every rank runs the evaluation loop). The connector's properties
    ``callback_metrics``, ``progress_bar_metrics`` and ``logged_metrics`` are read on the source;
    the other ranks update the stores behind them (``_callback_metrics``, ...). Patching again
    (a re-plan's new pipeline, another fit) replaces the wrapper instead of wrapping it."""
    connector = trainer._logger_connector
    epoch_metrics = _require(connector, "update_eval_epoch_metrics", "_LoggerConnector")
    epoch_metrics = getattr(epoch_metrics, "unwrapped", epoch_metrics)
    names = ("callback_metrics", "progress_bar_metrics", "logged_metrics")
    for name in names:
        _require(connector, name, "_LoggerConnector")
        _require(connector, f"_{name}", "_LoggerConnector")

    def update_eval_epoch_metrics() -> Any:
        outputs = epoch_metrics()
        before()
        shared: list[Any] = [None]
        if dist.get_rank() == source:
            shared[0] = _cpu((outputs, *(getattr(connector, name) for name in names)))
        try:
            dist.broadcast_object_list(shared, src=source)
        except RuntimeError as error:  # gloo's "Connection closed by peer" names no rank
            raise PeerError(
                f"every rank adopts the metrics the last stage logged after an evaluation (rank "
                f"{dist.get_rank()} could not receive them from rank {source}: "
                f"{str(error).split('. ')[0]}); rank {source} has probably failed: look for its "
                "error above"
            ) from error
        outputs, *metrics = shared[0]
        if dist.get_rank() != source:
            for name, values in zip(names, metrics, strict=True):
                getattr(connector, f"_{name}").update(values)
        return outputs

    update_eval_epoch_metrics.unwrapped = epoch_metrics  # type: ignore[attr-defined]
    connector.update_eval_epoch_metrics = update_eval_epoch_metrics


def clip_by_global_norm(precision: Any, clip: Callable[[Any, float], None]) -> None:
    """Make the precision plugin clip gradient norms with ``clip(optimizer, clip_val)``
    (``Precision.clip_grad_by_norm``, which ``Precision.clip_gradients`` calls)."""
    _require(precision, "clip_grad_by_norm", type(precision).__name__)
    precision.clip_grad_by_norm = clip


def summary_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Give the LightningModule a forward for calls outside the pipeline (the model summary's
    ``forward(example_input_array)``); the strategy replaces it inside its own steps."""
    module.forward = forward  # type: ignore[method-assign]


def stop_metric_sync(module: nn.Module) -> None:
    """Turn off torchmetrics' gather over all ranks on ``compute()`` for every metric of
    ``module``: ``Metric.sync_on_compute``, and ``Metric._to_sync``, which ``compute()`` reads
    and which is copied from it only when the metric is built and on each forward call."""
    for sub in module.modules():
        metric: Any = sub  # a torchmetrics Metric, recognised by its attributes
        if hasattr(metric, "sync_on_compute") and hasattr(metric, "compute"):
            metric.sync_on_compute = False
            if hasattr(metric, "_to_sync"):
                metric._to_sync = False


def log_step_value(module: Any, name: str, value: Tensor) -> None:
    """``module.log(name, value, prog_bar=True, on_step=True, on_epoch=False)`` inside a
    training step. Once that call has registered the metric in this epoch's results
    (``trainer._results``, key ``"<hook>.<name>"``) and the value stays on the metric's device,
    the metric is updated as ``_ResultCollection.log`` ends (``update_metrics``, then
    ``_LoggerConnector._current_fx``) without repeating the first call's checks; the metric's
    settings cannot change between the calls, since only this function logs it this way."""
    trainer = module.trainer
    results = getattr(trainer, "_results", None)
    connector = trainer._logger_connector
    fx = module._current_fx_name
    key = f"{fx}.{name}"
    metric = results.get(key) if results is not None and fx is not None else None
    fast = (
        metric is not None
        and results is not None
        and results.dataloader_idx is None
        and not connector.should_reset_tensors(fx)
        and isinstance(metric.value, Tensor)
        and metric.value.device == value.device
    )
    if not fast or results is None:
        module.log(name, value, prog_bar=True, on_step=True, on_epoch=False, sync_dist=False)
        return
    _require(results, "update_metrics", "_ResultCollection")
    results.update_metrics(key, value, results.batch_size or 1)
    connector._current_fx = fx


@contextlib.contextmanager
def capture_logs(module: nn.Module, record: Callable[..., None]) -> Iterator[None]:
    """For the duration, ``module.log(name, value, **options)`` (``LightningModule.log``, which
    ``log_dict`` calls once per key) calls ``record(name, value, **options)`` instead."""
    _require(module, "log", type(module).__name__)
    attributes = module.__dict__  # (not nn.Module's __setattr__: this runs per microbatch)
    previous = attributes.get("log")
    attributes["log"] = record
    try:
        yield
    finally:
        if previous is None:
            del attributes["log"]
        else:
            attributes["log"] = previous


def first_training_batch(trainer: Any) -> Any | None:
    """The first batch of the training dataloader while fitting (``trainer.fit_loop.
    _data_source``), or None; the loader is left as it was (``core.loader_state``)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return None
    source = _require(trainer.fit_loop, "_data_source", "_FitLoop")
    if source is None or not source.is_defined():
        return None
    return untouched_draw(source.dataloader())


def resumed_state_dict(trainer: Any) -> dict[str, Tensor] | None:
    """The model state of the checkpoint ``fit(ckpt_path=...)`` loaded (``trainer.
    _checkpoint_connector._loaded_checkpoint``, from before the strategy's setup to the end of
    the restore), or None."""
    connector = _require(trainer, "_checkpoint_connector", "Trainer")
    loaded = _require(connector, "_loaded_checkpoint", "_CheckpointConnector")
    return loaded.get("state_dict") if loaded else None


def _cpu(value: Any) -> Any:
    return map_tensors(lambda t: t.detach().cpu(), value)
