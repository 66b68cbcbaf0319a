"""What the Accelerator's training-loop calls mean once a pipeline trains the model.

``pipeline.train_step(batch)`` runs the whole step: the forward and backward passes of the
schedule and the optimizer's step, where the schedule says. So the loop's other calls either
have nothing left to do, or would act on gradients that no longer exist; each is refused the
moment it is made, naming what to do instead, rather than silently doing nothing:

* ``accelerator.backward(loss)`` on the loss ``train_step`` returned (a detached tensor);
* ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` over the pipeline's parameters (the
  gradients are applied and cleared inside ``train_step``);
* ``optimizer.step()`` of the optimizer the pipeline steps, called outside ``train_step`` (an
  optimizer step pre-hook; the pipeline's own steps pass).

The Accelerator's methods are replaced on this instance only; other models prepared with the
same Accelerator keep Accelerate's own behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from pl_pipedream.engine import Pipeline

__all__ = ["install"]

BACKWARD = (
    "the pipeline's train_step runs the backward passes and the optimizer step itself; its "
    "loss is detached (loss: {}); drop accelerator.backward(loss) and optimizer.step() from "
    "the loop: loss = pipeline.train_step(batch)"
)
CLIP = (
    "a pipeline applies and clears each stage's gradients inside train_step, so clipping after "
    "it would clip nothing ({}: over the pipeline's parameters); remove the call and let the "
    "pipeline clip inside the schedule: prepare_pipeline(..., clip_grad_norm=1.0)"
)
STEP = (
    "the pipeline steps this optimizer inside train_step, where the schedule says (optimizer: "
    "{} stepped outside train_step); drop optimizer.step() and optimizer.zero_grad() from the "
    "loop: loss = pipeline.train_step(batch)"
)


def install(accelerator: Any, pipeline: Pipeline, optimizer: Optimizer | None) -> None:
    """Refuse ``accelerator.backward`` on a pipeline's loss, clipping the pipeline's gradients,
    and stepping ``optimizer`` (the one the caller holds, if built) outside ``train_step``."""
    accelerator.backward = _guard_backward(accelerator.backward)
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        setattr(accelerator, name, _guard_clip(getattr(accelerator, name), name, pipeline))
    if optimizer is not None:

        def outside_train_step(stepped: Optimizer, args: Any, kwargs: Any) -> None:
            if not pipeline.updates.stepping:
                raise RuntimeError(STEP.format(type(stepped).__name__))

        optimizer.register_step_pre_hook(outside_train_step)


def _guard_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(loss: Any, **kwargs: Any) -> Any:
        if isinstance(loss, torch.Tensor) and not loss.requires_grad:
            raise RuntimeError(BACKWARD.format("a tensor without grad_fn"))
        return backward(loss, **kwargs)

    return guarded


def _guard_clip(clip: Callable[..., Any], name: str, pipeline: Pipeline) -> Callable[..., Any]:
    def guarded(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        ours = {id(p) for p in pipeline.layers.parameters()}
        if any(id(p) in ours for p in given):
            raise RuntimeError(CLIP.format(f"accelerator.{name}"))
        return clip(given, *args, **kwargs)

    return guarded
