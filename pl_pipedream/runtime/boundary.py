"""What crosses a stage boundary: any structure of tensors, flattened into one message.

A layer of the pipeline may return a tensor, or tuples, lists, dicts and namedtuples of tensors
(nested), with ``None`` and Python scalars (int, float, bool, str) riding along; the next layer
gets the same object as its one argument, as in ``nn.Sequential``. To travel, the object is
flattened into its tensors, in order, and a *structure*: a short JSON text that describes the
containers and holds the non-tensor leaves. A lone tensor has no structure (``None``), so the
common case costs nothing beyond the tensor itself.

Anything else (a module, an arbitrary object, a sparse tensor, a dtype the channel does not
carry) cannot cross; ``flatten`` raises ``CrossingError`` naming where in the object it sits.
"""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from typing import Any

import torch

from pl_pipedream.runtime.frames import SUPPORTED_DTYPES

__all__ = ["CrossingError", "explain", "flatten", "unflatten"]

_SCALARS = (int, float, bool, str)


class CrossingError(TypeError):
    """A value that cannot travel between stages; ``where`` locates it inside the object."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}")
        self.where = where
        self.what = what


def flatten(value: Any) -> tuple[list[torch.Tensor], bytes | None]:
    """The tensors of ``value`` in order, and its structure (``None`` for a lone tensor)."""
    if isinstance(value, torch.Tensor):
        _check_tensor(value, "output")
        return [value], None
    tensors: list[torch.Tensor] = []
    spec = _describe(value, tensors, "output")
    return tensors, json.dumps(spec, separators=(",", ":")).encode()


def explain(error: CrossingError, stage: torch.nn.Module, describe: str) -> str:
    """The message for an output of ``stage`` that cannot cross to the next stage: it names
    the stage's last layer (by its index in ``configure_pipeline()``), the rank and stage
    (``describe``), and the value."""
    children = list(stage.named_children())
    name, layer = children[-1] if children else ("?", stage)
    return (
        f"what crosses a stage boundary must be tensors, None, int, float, bool or str, in "
        f"tuples, lists or dicts (layer {name}: {type(layer).__name__}, on {describe}, returned "
        f"{error.where}: {error.what}); return only such values from the layers of "
        "configure_pipeline() (keep modules and other objects as attributes of a layer; make "
        "tensors dense, of a dtype among torch.float32/64/16, bfloat16, int8-64, uint8, bool)"
    )


def unflatten(tensors: list[torch.Tensor], structure: bytes | None) -> Any:
    """The object ``flatten`` took apart, rebuilt around ``tensors``."""
    if structure is None:
        if len(tensors) != 1:
            raise ValueError(
                f"a message without a structure holds one tensor (tensors: {len(tensors)}); "
                "the sender and the receiver run different versions of pl_pipedream"
            )
        return tensors[0]
    feed = iter(tensors)
    return _build(_parse(structure), feed)


def _check_tensor(tensor: torch.Tensor, where: str) -> None:
    if tensor.layout != torch.strided:
        raise CrossingError(where, f"a {tensor.layout} tensor (only dense tensors cross)")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise CrossingError(where, f"a tensor of dtype {tensor.dtype}")


def _describe(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """The JSON description of ``value``; its tensors are appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        _check_tensor(value, where)
        tensors.append(value)
        return "t"
    if value is None or isinstance(value, _SCALARS):
        return {"c": value}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        kind = type(value)
        if "<locals>" in kind.__qualname__:
            raise CrossingError(where, f"a namedtuple defined inside a function ({kind.__name__})")
        fields = zip(value._fields, value, strict=True)
        items = [_describe(v, tensors, f"{where}.{f}") for f, v in fields]
        return {"n": f"{kind.__module__}:{kind.__qualname__}", "i": items}
    if isinstance(value, (tuple, list)):
        items = [_describe(v, tensors, f"{where}[{k}]") for k, v in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if type(value) is dict:
        pairs = []
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise CrossingError(where, f"a dict key of type {type(key).__name__}")
            pairs.append([key, _describe(item, tensors, f"{where}[{key!r}]")])
        return {"dict": pairs}
    raise CrossingError(where, f"an object of type {type(value).__name__}")


@lru_cache(maxsize=64)
def _parse(structure: bytes) -> Any:
    """A structure's description (training repeats a few structures: parse each once)."""
    return json.loads(structure)


def _build(spec: Any, tensors: Any) -> Any:
    if spec == "t":
        return next(tensors)
    if "c" in spec:
        return spec["c"]
    if "tuple" in spec:
        return tuple(_build(s, tensors) for s in spec["tuple"])
    if "list" in spec:
        return [_build(s, tensors) for s in spec["list"]]
    if "dict" in spec:
        return {key: _build(s, tensors) for key, s in spec["dict"]}
    return _namedtuple(spec["n"])(*(_build(s, tensors) for s in spec["i"]))


@lru_cache(maxsize=64)
def _namedtuple(name: str) -> Any:
    module, _, qualname = name.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found
