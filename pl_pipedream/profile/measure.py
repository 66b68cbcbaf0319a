"""Measure the per-layer costs of an ``nn.Sequential`` with stock PyTorch.

PipeDream's planner needs, for every layer, its forward and backward time, the bytes of the
activation it outputs and the bytes of its parameters (SOSP'19, section 3.1). This module times
each layer on its own, in training mode, on the input the real chain feeds it:

* layer ``k`` receives the output of layer ``k - 1`` as its single argument, exactly as
  ``nn.Sequential.forward`` passes it (a layer returning a tuple hands the whole tuple on);
* one run makes a fresh copy of the input, times the forward (autograd recording included), then
  times ``torch.autograd.backward`` from a gradient of ones into the layer's parameters and its
  input. The input asks for a gradient when it would in training: for layer 0 when the sample
  does, afterwards when the previous layer's output did. A layer whose output needs no gradient
  (no parameters, no differentiable input) gets a backward time of 0;
* a first, untimed pass runs every layer ``warmup`` times so that the memory allocator and the
  caches reach the state training would keep them in (without it, the first call in a fresh CPU
  process overstated a large first layer up to 5x); the timed pass then runs each layer
  ``warmup + repeats`` times, drops the first ``warmup`` and keeps the median of the rest. On
  CUDA the device is synchronised around every timed region.

The model is left as it was: parameter values and ``.grad`` tensors, buffers (e.g. BatchNorm
running statistics), train/eval flags and the random number generator state are all restored.
A layer stored on another device than ``device`` is measured on a temporary copy.

A model too large to be whole in one process is profiled by ``profile_layers_one_at_a_time``:
the caller loads each layer's tensors just before it is timed and frees them right after.

A call costs about ``2 * warmup + repeats`` training steps of the model. Layers that take a
millisecond or more are reproducible to a few percent between calls; sub-millisecond layers are
noisier but weigh little in a stage, and a machine whose other cores are busy makes every layer
noisier: profile on an otherwise idle machine. ``benchmarks/profile_stability.py`` measures both
and its header records the figures.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pl_pipedream.profile.alike import equalise
from pl_pipedream.profile.graph import Profile, ProfileError
from pl_pipedream.profile.handoff import handoff_message
from pl_pipedream.trees import map_tensors, tensors

__all__ = ["profile_layers", "profile_layers_one_at_a_time"]

_DESC_CHARS = 80


def profile_layers(
    layers: nn.Sequential,
    sample: Tensor | tuple[Any, ...],
    *,
    device: torch.device | str | None = None,
    warmup: int = 2,
    repeats: int = 5,
) -> Profile:
    """Time every layer of ``layers`` on ``sample`` and return the chain ``layer0..layerN-1``.

    ``device`` defaults to the device of the first parameter, else of the sample, else CPU.
    """
    _check_arguments(layers, warmup, repeats)
    target = _resolve_device(device, layers, sample)
    value = map_tensors(lambda t: t.to(target), sample)
    with torch.random.fork_rng(devices=_rng_devices(target)), torch.enable_grad():
        if warmup:
            _time_chain(layers, value, target, runs=warmup)  # settles allocator and caches
        timings = _time_chain(layers, value, target, runs=warmup + repeats)
    return _chain_profile(layers, sample, target, timings, warmup, repeats)


def profile_layers_one_at_a_time(
    layers: nn.Sequential,
    sample: Tensor | tuple[Any, ...],
    load: Callable[[nn.Module], contextlib.AbstractContextManager[nn.Module]],
    *,
    device: torch.device | str,
    warmup: int = 2,
    repeats: int = 5,
) -> Profile:
    """``profile_layers`` for a model that is never whole in memory: ``load(layer)`` gives the
    layer with its tensors on ``device`` for one block and frees them after it, so only one
    layer and its input are alive at a time. Each layer runs ``warmup + repeats`` times while
    loaded (the first ``warmup`` settle its allocations and are dropped); there is no separate
    pass over the whole chain first."""
    _check_arguments(layers, warmup, repeats)
    target = _resolve_device(device, layers, sample)
    value = map_tensors(lambda t: t.to(target), sample)
    timings = []
    with torch.random.fork_rng(devices=_rng_devices(target)), torch.enable_grad():
        for index, layer in enumerate(layers):
            before = _before(layers, index)
            with load(layer) as module:
                timing, value = _time_layer(index, module, value, target, warmup + repeats, before)
            timings.append(timing)
    return _chain_profile(layers, sample, target, timings, warmup, repeats)


def _chain_profile(
    layers: nn.Sequential,
    sample: Any,
    target: torch.device,
    timings: list[_Timing],
    warmup: int,
    repeats: int,
) -> Profile:
    """The chain ``layer0..layerN-1`` from every layer's timings (medians after ``warmup``),
    identical layers given equal times (``profile.alike``)."""
    profile = Profile.chain(
        forward_ms=[statistics.median(t.forward_ms[warmup:]) for t in timings],
        backward_ms=[statistics.median(t.backward_ms[warmup:]) for t in timings],
        activation_bytes=[t.activation_bytes for t in timings],
        parameter_bytes=[_parameter_bytes(layer) for layer in layers],
        descs=[_describe(layer) for layer in layers],
        batch_size=_batch_size(sample),
        meta={
            "device": str(target),
            "torch": torch.__version__,
            "threads": str(torch.get_num_threads()),
            "warmup": str(warmup),
            "repeats": str(repeats),
        },
    )
    return equalise(profile, [t.structure for t in timings])


@dataclass(frozen=True)
class _Timing:
    """Every run's times of one layer, and the bytes of the output it produced."""

    forward_ms: list[float]
    backward_ms: list[float]
    activation_bytes: tuple[float, ...]
    structure: str  # equal for layers that compute the same thing on the same shapes


def _time_chain(
    layers: nn.Sequential, sample: Any, device: torch.device, runs: int
) -> list[_Timing]:
    """Run each layer ``runs`` times on the output of the layer before it, as the chain would."""
    timings = []
    value = sample
    for index, layer in enumerate(layers):
        timing, value = _time_layer(index, layer, value, device, runs, _before(layers, index))
        timings.append(timing)
    return timings


def _before(layers: nn.Sequential, index: int) -> str | None:
    """The layer before ``layers[index]``, as the error names it (None for the first)."""
    return f"layer {index - 1}: {type(layers[index - 1]).__name__}" if index else None


def _time_layer(
    index: int,
    layer: nn.Module,
    value: Any,
    device: torch.device,
    runs: int,
    before: str | None = None,
) -> tuple[_Timing, Any]:
    """Time ``runs`` forward and backward passes of one layer; also return its last output.
    ``before`` names the layer whose output ``value`` is, for the error."""
    module = layer if _lives_on(layer, device) else copy.deepcopy(layer).to(device)
    forward: list[float] = []
    backward: list[float] = []
    try:
        with _preserved(module):
            for _ in range(runs):
                forward_ms, backward_ms, output = _run_once(module, value, device)
                forward.append(forward_ms)
                backward.append(backward_ms)
    except Exception as error:
        where = f"{device}, while profiling"
        raise ProfileError(handoff_message(index, layer, before, where, value, error)) from error
    sizes = tuple(float(t.numel() * t.element_size()) for t in tensors(output))
    return _Timing(forward, backward, sizes or (0.0,), _structure(layer, value, output)), output


def _structure(layer: nn.Module, value: Any, output: Any) -> str:
    """The layer's class, its full repr, its parameters' and buffers' shapes and dtypes, and its
    input's and output's: what its cost depends on, not its values."""
    state = [*layer.named_parameters(), *layer.named_buffers()]
    shapes = [(name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in state]
    kind = f"{type(layer).__module__}.{type(layer).__qualname__}"
    grads = [t.requires_grad for t in tensors(value)]  # the input's gradient costs too
    return repr((kind, repr(layer), shapes, _summarise(value), grads, _summarise(output)))


def _run_once(module: nn.Module, value: Any, device: torch.device) -> tuple[float, float, Any]:
    """One forward and one backward of ``module``; returns both times and the output."""
    inputs = map_tensors(_fresh_input, value)
    _synchronize(device)
    start = time.perf_counter()
    output = module(inputs)
    _synchronize(device)
    forward_ms = (time.perf_counter() - start) * 1e3
    roots = [t for t in tensors(output) if t.requires_grad]
    if not roots:
        return forward_ms, 0.0, output
    leaves: list[Tensor] = [p for p in module.parameters() if p.requires_grad]
    leaves += [t for t in tensors(inputs) if t.requires_grad]
    grads = [torch.ones_like(t) for t in roots]
    _synchronize(device)
    start = time.perf_counter()
    torch.autograd.backward(roots, grads, inputs=leaves)
    _synchronize(device)
    backward_ms = (time.perf_counter() - start) * 1e3
    for parameter in module.parameters():
        parameter.grad = None
    return forward_ms, backward_ms, output


def _fresh_input(tensor: Tensor) -> Tensor:
    """A private copy of ``tensor``: in-place layers may overwrite it run after run.

    When it needs a gradient, the copy is a non-leaf (as a real activation is), so in-place
    layers such as ``ReLU(inplace=True)`` work and the backward stops at it.
    """
    if not tensor.requires_grad:
        return tensor.detach().clone()
    return tensor.detach().requires_grad_(True).clone()


@contextlib.contextmanager
def _preserved(module: nn.Module) -> Iterator[None]:
    """Train ``module`` inside the block; restore its modes, gradients and buffers afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    for parameter, _ in grads:
        parameter.grad = None
    module.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for parameter, grad in grads:
            parameter.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _check_arguments(layers: nn.Sequential, warmup: int, repeats: int) -> None:
    if not isinstance(layers, nn.Sequential):
        raise TypeError(
            f"profile_layers measures an nn.Sequential (layers: {type(layers).__name__}); "
            "wrap the model's layers in nn.Sequential(...)"
        )
    if len(layers) == 0:
        raise ProfileError(
            "profile_layers needs at least one layer (layers: nn.Sequential() with 0 layers); "
            "pass the model's layers in order"
        )
    if warmup < 0 or repeats < 1:
        raise ProfileError(
            f"profiling needs warmup >= 0 and repeats >= 1 (warmup: {warmup}, repeats: "
            f"{repeats}); pass e.g. warmup=2, repeats=5"
        )


def _resolve_device(
    device: torch.device | str | None, layers: nn.Module, sample: Any
) -> torch.device:
    if device is None:
        candidates = [*layers.parameters(), *tensors(sample)]
        device = candidates[0].device if candidates else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _lives_on(module: nn.Module, device: torch.device) -> bool:
    return all(t.device == device for t in (*module.parameters(), *module.buffers()))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index] if device.type == "cuda" and device.index is not None else []


def _parameter_bytes(layer: nn.Module) -> float:
    return float(sum(p.numel() * p.element_size() for p in layer.parameters()))


def _describe(layer: nn.Module) -> str:
    """The layer's repr on one line, short enough for a graph.txt line."""
    text = " ".join(repr(layer).split()).replace(" -- ", " - ")
    return text if len(text) <= _DESC_CHARS else text[: _DESC_CHARS - 3] + "..."


def _summarise(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"Tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_summarise(item) for item in value) + ")"
    return type(value).__name__


def _batch_size(sample: Any) -> int | None:
    found = [t for t in tensors(sample) if t.dim() > 0]
    return int(found[0].shape[0]) if found else None
