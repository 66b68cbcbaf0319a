"""What a stage's forward passes keep for their backward passes: counted, and with ``recompute``
only their inputs.

Every forward pass of a stage leaves tensors for its backward pass: the ones autograd saves (a
Linear's input, an activation function's output, a dropout mask), the tensors received and the
outputs sent on. ``Activations`` counts them per minibatch in flight through autograd's
saved-tensor hooks (each tensor once; the weights are counted elsewhere, so a tensor whose storage a
parameter or a stashed weight version owns is left out), and keeps the peak of their sum over the
minibatches in flight: the "activations in flight" of the memory report.

With ``recompute`` (activation recomputation, PipeDream-2BW's option) a forward pass keeps nothing
autograd would save: the hooks drop every saved tensor, and the outputs are detached once
computed, so the graph goes too. The forward still runs with gradients enabled, so that each
output says, exactly as without recomputation, whether it requires a gradient: the next stage
learns from that flag which gradients to send back. What the minibatch keeps is its input (and
its outputs until they are sent). Its backward pass first runs the forward again, with gradients,
on the weights the first forward used (the executor keeps them: the stashed version, or the
prediction), then backpropagates through that. The replay must compute the same values, so it
draws the same random numbers (dropout): the generators' states are saved before the first
forward and restored for the replay, and the states the replay leaves are put back afterwards,
so the rest of the run draws as if there had been no replay. Buffers (BatchNorm's running
statistics) are updated by the first forward only: the replay runs on copies of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pl_pipedream.trees import tensors

__all__ = ["Activations", "Replay", "rng_state", "set_rng_state"]


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state, and the device's when it is a GPU."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


@dataclass
class Replay:
    """What a recomputed minibatch keeps: its input and the generators' states before its
    forward pass, and its input tensors' version counters then (made before the forward: a
    write in place to the input since, which the replay would compute on, is caught)."""

    value: Any
    rng: tuple[torch.Tensor, torch.Tensor | None]
    versions: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.versions = _versions(self.value)


def _versions(value: Any) -> list[int]:
    """The version counters of ``value``'s tensors (autograd bumps one at every write in place),
    in the structure's order."""
    return [tensor._version for tensor in tensors(value)]


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The addresses of the tensors' storages (the weights': left out of the count)."""
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type != "meta"}


def _count(seen: dict[int, int], tensor: Any) -> None:
    """Add ``tensor``'s bytes under its address, each address once (its largest view): a
    microbatch is a view of its batch, and only its own rows count. A structure (tuple, list,
    dict) counts its tensors."""
    for found in tensors(tensor):
        if found.device.type != "meta":
            size = found.numel() * found.element_size()
            seen[found.data_ptr()] = max(seen.get(found.data_ptr(), 0), size)


class Activations:
    """The bytes each minibatch in flight keeps for its backward pass, and their peak sum.

    ``forward(i, value, weights, drop)`` is the context of minibatch ``i``'s forward pass on
    ``value``; ``done(i, tensors)`` adds what the executor itself holds for it (received inputs,
    outputs); ``release(i)`` forgets it after its backward pass. With ``drop`` (``recompute``,
    every stage but the last), ``forward`` keeps nothing autograd saves and ``replay`` runs the
    forward again for the backward pass.

    Counting costs a Python call per saved tensor, so it runs once per shape of the input: the
    bytes a forward keeps follow from its input's shapes (a model whose saved tensors depend on
    its values, not only their shapes, is counted by its first minibatch of each shape).
    """

    def __init__(self, recompute: bool, device: torch.device) -> None:
        self.recompute = recompute
        self.device = device
        self._sizes: dict[Any, int] = {}  # bytes kept, by the input's shapes
        self._pending: dict[int, tuple[Any, dict[int, int] | None]] = {}
        self.in_flight: dict[int, int] = {}
        self.peak_bytes = 0  # what the minibatches in flight keep, plus a replay's graph
        self.peak_kept_bytes = 0  # what the minibatches in flight keep
        self.peak_minibatches = 0
        self.replays = 0

    @contextmanager
    def forward(
        self, i: int, value: Any, weights: Iterable[torch.Tensor], drop: bool
    ) -> Iterator[None]:
        """Count the tensors autograd saves during minibatch ``i``'s forward on ``value`` (the
        weights' excepted), the first time its shapes are seen; with ``drop``, keep none."""
        key = (drop, _shapes(value))
        if drop:
            with torch.autograd.graph.saved_tensors_hooks(_drop, _unpack):
                yield
            self._pending[i] = (key, None)
            return
        if key in self._sizes:
            yield
            self._pending[i] = (key, None)
            return
        skip = _storages(weights)
        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> Any:
            if tensor.untyped_storage().data_ptr() not in skip:
                _count(seen, tensor)
            return tensor

        pack.passes_through = True  # type: ignore[attr-defined] # linear_sums still fuses
        with torch.autograd.graph.saved_tensors_hooks(pack, _same):
            yield
        self._pending[i] = (key, seen)

    def done(self, i: int, held: Iterable[torch.Tensor]) -> None:
        """Minibatch ``i``'s forward is over: it keeps what autograd saved and ``held``."""
        self.in_flight[i] = self._size(i, held)
        self._track(0)

    def _size(self, i: int, held: Iterable[torch.Tensor]) -> int:
        key, seen = self._pending.pop(i)
        if seen is None and key in self._sizes:
            return self._sizes[key]
        seen = seen if seen is not None else {}
        for tensor in held:
            _count(seen, tensor)
        self._sizes[key] = sum(seen.values())
        return self._sizes[key]

    def release(self, i: int) -> None:
        self.in_flight.pop(i, None)

    def replay(self, i: int, replay: Replay, module: nn.Module, params: dict[str, Any]) -> Any:
        """Minibatch ``i``'s forward again, with gradients, on ``params`` and copies of the
        buffers (the first forward updated them already), drawing the random numbers its first
        forward drew; the generators are left as they were before. Refused when the kept input
        was written in place since (the replay would compute on other values)."""
        if _versions(replay.value) != replay.versions:
            raise RuntimeError(
                "recompute=True replays a stage's forward on the input it kept, and that input "
                f"was changed in place since the first forward began (minibatch: {i}, input "
                f"versions: {replay.versions} then, {_versions(replay.value)} now); make the "
                "stage's first layer work out of place (x * 2, not x.mul_(2)), or train without "
                "recompute=True"
            )
        state = {**params, **{n: b.clone() for n, b in module.named_buffers()}}
        now = rng_state(self.device)
        set_rng_state(replay.rng, self.device)
        try:
            with torch.enable_grad(), self.forward(-1 - i, replay.value, params.values(), False):
                output = functional_call(module, state, (replay.value,))
        finally:
            set_rng_state(now, self.device)
        self._track(self._size(-1 - i, ()))  # the replayed graph lives until this backward ends
        self.replays += 1
        return output

    def _track(self, extra: int) -> None:
        kept = sum(self.in_flight.values())
        self.peak_kept_bytes = max(self.peak_kept_bytes, kept)
        self.peak_bytes = max(self.peak_bytes, kept + extra)
        self.peak_minibatches = max(self.peak_minibatches, len(self.in_flight))


def _shapes(value: Any) -> Any:
    """What determines the bytes a forward keeps: the shapes and dtypes of its input's tensors,
    in their structure."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_shapes(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _shapes(v)) for k, v in value.items())
    return type(value).__name__


def detached(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs without their graph, each still saying whether it requires a gradient."""
    return [
        t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t.detach()
        for t in outputs
    ]


def _drop(_: torch.Tensor) -> None:
    return None


def _same(tensor: Any) -> Any:
    return tensor


def _unpack(_: Any) -> Any:
    raise RuntimeError(
        "a recomputed stage backpropagated through its first forward pass, whose saved tensors "
        "were dropped (recompute=True); the executor must replay the forward first"
    )
