"""``PipeDreamFabricStrategy``: ``Fabric(strategy="pipedream")``, a thin adapter over ``Pipeline``.

Fabric starts the ranks and joins them (DDP's launchers and process group, inherited); at
``fabric.setup(model, optimizer)`` every rank builds the plain engine, ``pl_pipedream.Pipeline``,
which plans, cuts, checks the data, judges divergence, agrees on preemption, ties parameters
and checkpoints exactly as it does under ``torchrun``. Fabric's calls then map onto it
(``docs/fabric.md``): the module's call runs one batch's schedule and returns the loss on every
rank (``module.PipelineModule``), ``fabric.backward`` and ``optimizer.step()`` confirm what the
schedule already did, ``fabric.save``/``fabric.load`` write and read the sharded checkpoint
(``checkpoint``), and what a pipeline cannot do (clipping from the loop, the true low
precisions, a model set up without its optimizer, a sampler per rank) is refused, naming the
alternative. Fabric's ``precision="bf16-mixed"`` and ``"16-mixed"`` become the engine's
(``engine.precision``: autocast around each stage's forward passes, one loss scale for fp16).

Lightning internals touched: ``DDPStrategy._get_process_group_backend`` (overridden, so that a
GPU run also has gloo for the CPU collectives the core runs), ``_backward_sync_control`` (the
object ``fabric.no_backward_sync`` asks, here one that refuses: ``module.NoAccumulation``), and
the precision plugin's ``convert_input``, which ``_FabricModule`` applies to the call's batch:
the pipeline's batch holds the targets, which a mixed precision must not cast to its dtype
(``loss_fn(model(x), y)`` on one device sees ``y`` as given).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, MixedPrecision, Precision
from lightning.fabric.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from pl_pipedream.core.materialize import EmptyBuild
from pl_pipedream.core.placement import process_group_backend
from pl_pipedream.engine import Pipeline
from pl_pipedream.engine.options import FRONT_ENDS, checked_options, option_defaults
from pl_pipedream.fabric.checkpoint import loop_state, restore
from pl_pipedream.fabric.module import NoAccumulation, PipelineModule

__all__ = ["PipeDreamFabricStrategy"]

SETUP = "model, optimizer = fabric.setup(model, optimizer)"


class PipeDreamFabricStrategy(DDPStrategy):
    """PipeDream's pipeline under Fabric; the arguments are ``Pipeline``'s (docs/engine.md).

    Args:
        loss_fn: ``loss_fn(output, targets) -> loss``, run on the last stage.
        start_method: ``"popen"`` (``fabric.launch()`` re-runs the script per rank), or
            ``"spawn"`` / ``"fork"`` (``fabric.launch(function)``), as DDP's.
        options: ``pl_pipedream.Pipeline``'s keyword arguments (``engine.options``), each
            checked here, but the device, the precision and an empty build, which come from
            Fabric: ``sync``, ``microbatches``, a layout (``balance``, ``plan``, or
            ``example_input`` to plan from one microbatch of the input), ``pretrained`` (weights
            each rank reads for its stage), ``replan``, ...
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        *,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        **options: Any,
    ) -> None:
        self.engine_arguments, _ = checked_options(options, FRONT_ENDS["Fabric"])
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=options.get("timeout", option_defaults()["timeout"])),
            start_method=start_method,
        )
        self._backward_sync_control = NoAccumulation()  # type: ignore[assignment]
        self.loss_fn = loss_fn
        self._module: PipelineModule | None = None
        self._build = EmptyBuild()  # what fabric.init_module(empty_init=True) recorded

    @property
    def pipeline(self) -> Pipeline:
        """The engine this rank runs (``drain``, ``eval_step``, ``predict_step``, ``close``)."""
        return self._set_up().pipeline

    @property
    @override
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        """None: every rank of a pipeline reads the same batches (the engine checks it)."""
        return None

    @override
    def _get_process_group_backend(self) -> str:
        return process_group_backend(self.root_device, self._process_group_backend)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Build the pipeline from the model's layers and its optimizer (cut to the stage's)."""
        self._check_setup(optimizers)
        layers = cast(nn.Sequential, module)  # or a list of modules: the engine checks it
        loss_fn = cast(Callable[[Any, Any], Tensor], self.loss_fn)  # checked above
        pipeline = Pipeline(
            layers,
            loss_fn,
            optimizers[0],
            device=self.root_device,
            precision=engine_precision(self.precision),
            empty_build=self._build,
            **self.engine_arguments,
        )
        self._module = PipelineModule(pipeline)
        # the call's batch holds the targets too: Fabric would cast its floating tensors to the
        # precision's dtype; they reach the pipeline as given and autocast casts per operation
        self.precision.convert_input = _as_given  # type: ignore[method-assign]
        return self._module, optimizers, scheduler

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: the model is built on ``meta`` with its
        initialisation recorded; at ``fabric.setup`` each rank creates only its stage, with
        the values of the whole build or the ``pretrained`` weights (``core.materialize``)."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(self._build.record())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Nothing before the cut: at ``fabric.setup`` each rank places only its stage on its
        device (the whole model is never on one device; a model built empty stays on meta)."""

    @override
    def setup_module(self, module: nn.Module) -> Any:
        raise ValueError(
            f"the pipeline is built from the model and its optimizer together, each rank keeping "
            f"its stage's parameters (optimizers: 0); write {SETUP}"
        )

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise ValueError(
            f"the pipeline is built from the model and its optimizer together, each rank keeping "
            f"its stage's parameters (optimizer: {type(optimizer).__name__} alone); write {SETUP}"
        )

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._set_up().accept_backward(tensor)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if "closure" in kwargs:
            raise ValueError(
                "optimizer.step(closure) cannot run under the pipeline, whose forward and "
                "backward passes run inside the schedule (closure: given); call "
                "loss = model((inputs, targets)), then optimizer.step()"
            )
        self._set_up().confirm_step()

    @override
    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: Any, *a: Any, **k: Any):  # type: ignore[no-untyped-def]
        raise self._no_clipping(
            f"max_norm: {max_norm}", f"PipeDreamFabricStrategy(clip_grad_norm={max_norm})"
        )

    @override
    def clip_gradients_value(self, module: Any, optimizer: Any, clip_val: Any) -> None:
        raise self._no_clipping(
            f"clip_val: {clip_val}",
            f'Trainer(strategy="pipedream", gradient_clip_val={clip_val}, '
            'gradient_clip_algorithm="value")',
        )

    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Every rank: the sharded checkpoint directory (``Pipeline.save``), the loop's other
        entries in stage 0's shard."""
        if storage_options is not None or filter:
            given = "filter" if filter else "storage_options"
            raise ValueError(
                f"fabric.save under the pipeline writes the sharded checkpoint whole ({given}: "
                f"given); call fabric.save(path, state) without it, and read single tensors "
                "back with pl_pipedream.consolidate_checkpoint(path)"
            )
        module = self._set_up()
        saved = loop_state(state, self._objects())
        module.pipeline.save(path, saved)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Every rank: this stage's tensors and optimizer state from ``fabric.save``'s
        directory (saved under any plan over the same layers), the loop's entries into
        ``state``; returns the saved entries ``state`` did not ask for."""
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"fabric.load under the pipeline restores into the objects it is given (state: "
                f"{type(state).__name__}); write fabric.load(path, {{'model': model, "
                "'optimizer': optimizer, ...}), or read the whole model's weights with "
                "pl_pipedream.consolidate_checkpoint(path)"
            )
        saved = self._set_up().pipeline.load(path)
        return restore(state, saved, self._objects(), strict)

    @override
    def teardown(self) -> None:
        """Close the pipeline (its messages under way, its process groups), then Fabric's."""
        if self._module is not None:
            self._module.pipeline.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, method in (
            ("pipedream", "popen"),
            ("pipedream_spawn", "spawn"),
            ("pipedream_fork", "fork"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"PipeDream's pipeline (pl_pipedream), start_method={method!r}",
                start_method=method,
            )

    def _check_setup(self, optimizers: list[Optimizer]) -> None:
        """What the pipeline needs beyond the engine's own checks, named for Fabric."""
        if self._module is not None:
            raise ValueError(
                "a Fabric process runs one pipeline (fabric.setup: called before); set the model "
                f"and its optimizer up once per process: {SETUP}"
            )
        arguments = self.engine_arguments
        layouts = ("balance", "plan", "example_input")
        if not callable(self.loss_fn) or all(arguments.get(name) is None for name in layouts):
            raise ValueError(
                f"the pipeline needs its loss function and its layout on the strategy (loss_fn: "
                f"{type(self.loss_fn).__name__}, balance: {arguments.get('balance')}, plan: "
                f"{arguments.get('plan')}, example_input: None); write Fabric(strategy="
                "PipeDreamFabricStrategy(loss_fn=nn.functional.cross_entropy, balance=[2, 2]), "
                "...) (layers per stage, one rank each), plan=pl_pipedream.plan(profile, "
                "topology), or example_input=x to plan from one microbatch of the input"
            )
        if len(optimizers) != 1:
            raise ValueError(
                f"the pipeline steps one optimizer per stage (optimizers: {len(optimizers)}); "
                "build one optimizer over the model's parameters (parameter groups for "
                f"different settings) and write {SETUP}"
            )

    def _set_up(self) -> PipelineModule:
        if self._module is None:
            raise RuntimeError(
                f"the pipeline is built by fabric.setup (fabric.setup: not called yet); write "
                f"{SETUP} first"
            )
        return self._module

    def _objects(self) -> list[Any]:
        """The pipeline's own entries of a checkpoint's state: the module, its optimizer."""
        module = self._set_up()
        return [obj for obj in (module, module.pipeline.optimizer) if obj is not None]

    @staticmethod
    def _no_clipping(given: str, trainer_flag: str) -> RuntimeError:
        return RuntimeError(
            f"fabric.clip_gradients has no gradients to clip under the pipeline: they exist "
            f"only inside the schedule, between a stage's backward passes and its update "
            f"({given}); leave clip_gradients out and clip inside the schedule: "
            f"{trainer_flag}"
        )


def _as_given(data: Any) -> Any:
    return data


def engine_precision(precision: Precision) -> str:
    """The engine's flag for Fabric's precision plugin: ``"32-true"``, or the mixed precisions
    (the engine applies autocast around each forward pass and scales fp16 losses itself)."""
    if type(precision) is Precision:
        return "32-true"
    name = getattr(precision, "precision", type(precision).__name__)
    if isinstance(precision, MixedPrecision) and name in ("bf16-mixed", "16-mixed"):
        return str(name)
    raise ValueError(
        f'the pipeline under Fabric trains in "32-true", "bf16-mixed" or "16-mixed" precision '
        f'(precision: {name}); write Fabric(strategy="pipedream", precision="bf16-mixed"), or '
        'train the true low precisions with Trainer(strategy="pipedream", precision=...)'
    )
