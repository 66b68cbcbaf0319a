"""``prepare_pipeline``: an Accelerator's processes become one PipeDream pipeline.

The name follows Accelerate's own ``accelerator.prepare(model, optimizer)``: it takes what a user
would hand to ``prepare`` and returns the object to train with, here the plain engine's
``Pipeline``, whose ``train_step(batch)`` runs the pipeline's schedule (forward and backward
passes, the optimizer's steps) and returns the loss on every rank. The Accelerator decides what
it decides on one device: the process group (which ``accelerate launch`` made Accelerate start;
the pipeline joins it), this process's device (``accelerator.device``: the CPU under ``--cpu``
and gloo, ``cuda:LOCAL_RANK`` under NCCL) and the mixed precision (``accelerate.precision``).
``accelerate.guards`` refuses the loop calls that a pipeline makes meaningless, and
``accelerate.state`` saves and restores the pipeline with ``accelerator.save_state``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import Tensor, nn
from torch.optim import Optimizer

from pl_pipedream.accelerate import guards, state
from pl_pipedream.accelerate.precision import carry_scaler, engine_precision
from pl_pipedream.engine import Pipeline
from pl_pipedream.engine.options import FRONT_ENDS, checked_options

__all__ = ["prepare_pipeline"]

LAUNCHED = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def prepare_pipeline(
    accelerator: Any,
    model: nn.Sequential | Sequence[nn.Module],
    optimizer: Optimizer | Callable[[list[nn.Parameter]], Optimizer],
    loss_fn: Callable[[Any, Any], Tensor],
    **options: Any,
) -> Pipeline:
    """This process's part of a pipeline over ``model``'s layers (an ``nn.Sequential`` or a
    list of modules, the same on every process, not passed to ``accelerator.prepare``),
    trained by ``optimizer`` (built over ``model.parameters()`` before any step, or a function
    of a stage's parameters) on ``loss_fn(output, targets)``. ``options`` are ``Pipeline``'s
    keyword arguments (``engine.options``; docs/engine.md: ``sync``, ``microbatches``, a layout
    as ``balance``/``plan`` or planned from ``example_input``, ``pretrained``/``empty_build``
    for a model larger than one process, ``replan="auto"`` to re-plan from measured stage times,
    docs/replan.md, ...), checked before anything starts; the device and the precision are the
    Accelerator's."""
    checked_options(options, FRONT_ENDS["Accelerate"])
    check_accelerator(accelerator)
    precision = engine_precision(accelerator)
    pipeline = Pipeline(
        model,
        loss_fn,
        optimizer,
        device=device_of(accelerator),
        precision=precision,
        **options,
    )
    carry_scaler(accelerator, pipeline.scaler)
    guards.install(accelerator, pipeline, optimizer if isinstance(optimizer, Optimizer) else None)
    state.register(accelerator, pipeline)
    return pipeline


def device_of(accelerator: Any) -> torch.device:
    """The Accelerator's device; the CPU as one device (Accelerate numbers it per process)."""
    device = torch.device(accelerator.device)
    return torch.device("cpu") if device.type == "cpu" else device


def check_accelerator(accelerator: Any) -> None:
    """Raise for an Accelerator set up for something other than plain processes, or for
    gradient accumulation."""
    kind = accelerator.distributed_type
    if kind not in LAUNCHED:
        raise ValueError(
            f"prepare_pipeline runs on the processes of a multi-process launch, one stage (or "
            f"replica) each, without DeepSpeed, FSDP or Megatron-LM (distributed type: {kind}); "
            "on GPUs: accelerate launch --multi_gpu --num_processes N script.py; on CPUs (gloo): "
            "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N script.py "
            "(accelerate launch --cpu starts one process unless given --mpirun_hostfile)"
        )
    steps = accelerator.gradient_accumulation_steps
    if steps != 1:
        raise ValueError(
            "a pipeline already accumulates: each batch is split into microbatches whose mean "
            f"gradient makes one step (gradient accumulation steps: {steps}); use "
            f"Accelerator(gradient_accumulation_steps=1) and a batch {steps} times larger with "
            f"prepare_pipeline(..., microbatches={steps} * m)"
        )
