"""A batch drawn from the user's loader at setup without moving the loader on.

Setup takes one training batch on rank 0 (the forward check, profiling for the plan). Drawing it
starts an epoch of the loader: a shuffling sampler draws a permutation from its generator, a
``DataLoader`` draws its workers' base seed from its own, a torchdata ``StatefulDataLoader``
keeps the new iterator (and drops a mid-epoch state it was to resume from). Had only rank 0
drawn, rank 0 would train on another order than every other rank and than one device.

``untouched_draw`` draws inside ``LoaderState``: the attributes of the loader, its sampler, its
batch sampler and its dataset (one level deep: which objects they name, and the state of every
``torch.Generator`` among them) and the global RNGs of torch, Python and NumPy are saved before
and put back after. Then it draws again and compares the two batches' fingerprints: a loader
with state the draw moved out of this module's sight (a position kept inside a container the
dataset holds, a file it reads on from) gives another batch the second time, and setup stops,
naming the way around it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from pl_pipedream.core.data import fingerprint
from pl_pipedream.core.errors import PipelineSetupError

__all__ = ["LoaderState", "untouched_draw"]


def _holders(loader: Any) -> list[Any]:
    """The loader, the samplers it draws its order with and its dataset (each once)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = [
        loader,
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(loader, "dataset", None),
    ]
    unique = {id(h): h for h in found if h is not None}
    return list(unique.values())


def _generators(loader: Any) -> list[torch.Generator]:
    """Every ``torch.Generator`` the loader and its samplers hold as attributes (each once)."""
    found: dict[int, torch.Generator] = {}
    for holder in _holders(loader):
        for value in getattr(holder, "__dict__", {}).values():
            if isinstance(value, torch.Generator) and value.device.type == "cpu":
                found[id(value)] = value
    return list(found.values())


class LoaderState:
    """What a draw from ``loader`` can move, saved at construction; ``restore`` puts it back."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.generators = [(g, g.get_state()) for g in _generators(loader)]
        holders = [h for h in _holders(loader) if hasattr(h, "__dict__")]
        self.attributes = [(h, dict(h.__dict__)) for h in holders]
        self.python = random.getstate()
        self.numpy = np.random.get_state()
        self.torch = torch.get_rng_state()

    def restore(self) -> None:
        for generator, state in self.generators:
            generator.set_state(state)
        for holder, saved in self.attributes:
            # (DataLoader's __setattr__ refuses some attributes once it is built: set them as
            # they were, through its __dict__; an iterator made by the draw is dropped)
            attributes = holder.__dict__
            for name in [n for n in attributes if n not in saved]:
                del attributes[name]
            attributes.update(saved)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)


@contextmanager
def _saved(loader: Any) -> Iterator[None]:
    state = LoaderState(loader)
    try:
        yield
    finally:
        state.restore()


def untouched_draw(loader: Any) -> Any:
    """The first batch of ``loader``, with the loader and the global RNGs left as they were;
    raises ``PipelineSetupError`` when drawing it moved something that cannot be put back (a
    second draw gives another batch)."""
    with _saved(loader):
        first = next(iter(loader))
    with _saved(loader):
        again = next(iter(loader))
    if fingerprint(first) != fingerprint(again):
        raise PipelineSetupError(
            "the batch setup draws from the training loader must leave the loader as it was, "
            f"but drawing it again gave another batch (loader: {type(loader).__name__}; its "
            "dataset or sampler keeps a state that moved on); set example_input_array on the "
            "LightningModule and pass balance= or plan=, so that setup draws nothing from the "
            "loader"
        )
    return first
