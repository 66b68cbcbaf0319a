"""At setup: does the LightningModule's ``forward`` compute what its pipeline computes?

Under the strategy only the layers of ``configure_pipeline()`` run, and ``self(x)`` in a step
returns their output; a ``forward`` that does more (or something else) would be skipped without
a word. So at setup, while rank 0 still holds every layer, it runs ``forward(sample)`` and the
pipeline on the same sample (one microbatch of the first stage's input, the one planning
profiles), both in eval mode, without gradients and from the same RNG state, and compares the
results; it broadcasts its verdict so that every rank stops with the same error. The pipeline
runs layer by layer (``profile.handoff``): a layer that cannot take what the layer before it
returned stops every rank with an error naming both layers and the value, not torch's bare
``TypeError`` on rank 0 alone.

Not checked: a module that does not override ``LightningModule.forward`` (under the strategy
``self(x)`` simply is the pipeline: nothing is skipped), a setup with no sample (no training
batch and no ``example_input_array``), and a setup after the first (other stages' layers are on
``meta`` by then; the first setup checked them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.profile.handoff import HandoffError, run_layers
from pl_pipedream.trees import map_tensors

__all__ = ["check_forward", "forward_difference", "forward_is_checked"]

RTOL, ATOL = 1e-4, 1e-6
_WHERE = "rank 0 at setup (the forward check, before the pipeline is cut into stages)"


def forward_is_checked(module: nn.Module, layers: nn.Sequential) -> bool:
    """Whether there is a user ``forward`` to compare and every layer is still whole (the same
    answer on every rank, so no collective is needed to skip)."""
    if "forward" in vars(module) or type(module).forward is LightningModule.forward:
        return False
    return not any(t.is_meta for t in (*layers.parameters(), *layers.buffers()))


def check_forward(module: nn.Module, layers: nn.Sequential, sample: Any) -> None:
    """Rank 0 compares ``forward(sample)`` with ``layers(sample)`` (``sample``: rank 0's, None
    elsewhere or when there is none) and every rank raises ``PipelineSetupError`` when they differ
    or the layers raise (every rank must call it; on rank 0 the layers' error is chained)."""
    if not forward_is_checked(module, layers):
        return
    box: list[str | None] = [None]
    cause: Exception | None = None
    if dist.get_rank() == 0 and sample is not None:
        try:
            box[0] = forward_difference(module, layers, sample)
        except Exception as error:  # noqa: BLE001 - every rank must learn of it
            box[0], cause = _raised(error), error
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise PipelineSetupError(box[0]) from cause


def forward_difference(module: nn.Module, layers: nn.Sequential, sample: Any) -> str | None:
    """None when ``module.forward(sample)`` equals ``layers(sample)``, else the error text; a
    layer that cannot take the previous one's output raises ``profile.handoff.HandoffError``."""
    name = type(module).__name__
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    modes = {sub: sub.training for sub in module.modules()}
    rng = [device.index or 0] if device.type == "cuda" else []
    try:
        module.eval()
        with torch.no_grad():
            with torch.random.fork_rng(devices=rng):
                # a copy each: a layer may work in place
                expected = run_layers(layers, _to(sample, device), _WHERE)
            with torch.random.fork_rng(devices=rng):
                try:
                    got = module.forward(_to(sample, device))
                except Exception as error:  # noqa: BLE001 - reported as the verdict
                    return _explain(name, f"{name}.forward raised {type(error).__name__}: {error}")
    finally:
        for sub, training in modes.items():
            sub.training = training
    difference = _difference(got, expected)
    return None if difference is None else _explain(name, difference)


def _raised(error: Exception) -> str:
    """The verdict when the pipeline's layers raised on the sample."""
    if isinstance(error, HandoffError):
        return str(error)
    lines = str(error).strip().splitlines()
    return (
        f"the layers of configure_pipeline() must run on one microbatch of the first stage's "
        f"input ({_WHERE}: {type(error).__name__}: {lines[0] if lines else ''}); fix the layer "
        "that raised (rank 0's traceback shows it)"
    )


def _explain(name: str, detail: str) -> str:
    return (
        f"only the layers of configure_pipeline() run under PipeDreamStrategy, and self(x) returns "
        f"their output, but {name}.forward computes something else (checked at setup on one "
        f"microbatch of the first stage's input, on rank 0: {detail}); make forward run the same "
        "layers (e.g. `return self.configure_pipeline()(x)`), or move the extra work into a layer "
        "of configure_pipeline()"
    )


def _difference(got: Any, expected: Any, where: str = "output") -> str | None:
    """Where ``got`` (forward's) and ``expected`` (the pipeline's) differ, or None."""
    if isinstance(expected, Tensor) or isinstance(got, Tensor):
        if not (isinstance(expected, Tensor) and isinstance(got, Tensor)):
            return f"{where}: forward returned {_kind(got)}, the pipeline {_kind(expected)}"
        if got.shape != expected.shape:
            return (
                f"{where}: forward returned shape {tuple(got.shape)}, the pipeline "
                f"{tuple(expected.shape)}"
            )
        if not torch.allclose(got.double(), expected.double(), RTOL, ATOL, equal_nan=True):
            gap = (got.double() - expected.double()).abs().nan_to_num(float("inf")).max()
            return f"{where}: values differ by up to {float(gap):.3g}"
        return None
    if isinstance(expected, (tuple, list)) and isinstance(got, (tuple, list)):
        if len(got) != len(expected):
            return f"{where}: forward returned {len(got)} values, the pipeline {len(expected)}"
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            found = _difference(a, b, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, dict) and isinstance(got, dict):
        if sorted(got, key=str) != sorted(expected, key=str):
            return (
                f"{where}: forward returned keys {sorted(got, key=str)}, the pipeline "
                f"{sorted(expected, key=str)}"
            )
        for key in expected:
            found = _difference(got[key], expected[key], f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    if type(got) is not type(expected) or got != expected:
        return f"{where}: forward returned {_kind(got)}, the pipeline {_kind(expected)}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _to(value: Any, device: torch.device) -> Any:
    """A copy of ``value`` on ``device``: a first layer that changes its input in place (``x.mul_``)
    must see the same input in both runs, and leave the caller's sample (planning's) as it was."""
    return map_tensors(lambda t: t.to(device, copy=True), value)
