"""Walks over nested tensors: the one place that knows which containers hold tensors.

A batch, a layer's output or a value crossing a stage boundary may be a tensor, or tuples,
lists, dicts and namedtuples of tensors (nested), with other values riding along. Every module
that visits the tensors of such a value calls these functions, so that all agree on what is a
container and in which order its tensors come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_tensors", "tensors"]


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with ``function`` applied to every tensor inside it; the rest is kept."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(map_tensors(function, item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(function, item) for item in value)
    if isinstance(value, dict):
        return type(value)((key, map_tensors(function, item)) for key, item in value.items())
    return value


def tensors(value: Any, sort_keys: bool = False) -> list[torch.Tensor]:
    """The tensors inside ``value``, in the order ``map_tensors`` visits them; with
    ``sort_keys``, a dict's in the order of its keys (as strings), whatever order it was built
    in (for a fingerprint that two ranks compare)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        keys = sorted(value, key=str) if sort_keys else value
        return [t for key in keys for t in tensors(value[key], sort_keys)]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors(item, sort_keys)]
    return []
