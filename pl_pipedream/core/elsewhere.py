"""Other stages' parameters on this rank: they may be looked at, never computed with.

After ``cut_stage`` the layers of other stages are on the ``meta`` device here, and code that
computes with their parameters (an L2 term over ``self.parameters()`` in ``training_step``)
would get meta tensors and fail much later, deep inside the executor, with "Tensor.item() cannot
be called on meta tensors". ``mark_other_stages`` replaces each such parameter by a
``HeldElsewhere`` parameter (same shape, dtype, ``requires_grad``, still on ``meta``) whose first
computation raises ``OtherStageParameterError`` naming the parameter, the stage and ranks that
hold it, and what to use instead.

What may still be read (Lightning's model summary, the optimizers' constructors, ``state_dict``,
``.to()``/``.detach()`` giving plain meta tensors): the metadata (``shape``, ``size()``,
``dtype``, ``device``, ``numel()``, ``requires_grad``, ``is_leaf``, ``grad``, ...), and the
operations in ``METADATA``; every other torch function or tensor method raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import resolve_name
from torch.utils._pytree import tree_leaves

from pl_pipedream.core.errors import OtherStageParameterError
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.ranks import describe

__all__ = ["HeldElsewhere", "mark_other_stages"]

METADATA = frozenset(
    {
        # properties (read and, for the first ones, set)
        "requires_grad", "grad", "data", "names",
        "shape", "dtype", "device", "is_leaf", "grad_fn", "layout", "ndim", "is_meta", "is_cuda",
        "is_cpu", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize", "nbytes",
        "output_nr", "retains_grad", "_base", "_version", "_backward_hooks",
        "_post_accumulate_grad_hooks", "is_xpu", "is_mps",
        # methods that only read metadata, or copy the tensor as a plain one
        "size", "dim", "numel", "nelement", "ndimension", "element_size", "is_floating_point",
        "is_complex", "is_signed", "is_contiguous", "stride", "storage_offset", "get_device",
        "is_pinned", "is_shared", "dim_order", "requires_grad_", "detach", "to",
        "_has_compatible_shallow_copy_type", "register_hook", "register_post_accumulate_grad_hook",
        "__len__", "__repr__", "__format__", "__hash__", "__reduce_ex__", "__deepcopy__",
        "__setstate__", "__getstate__",
    }
)  # fmt: skip


class HeldElsewhere(nn.Parameter):
    """A parameter of another stage (on ``meta`` here) that raises when computed with."""

    parameter_name: str = "?"  # set on each instance by mark_other_stages
    holder: str = "another stage"
    here: str = "this rank"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        base = name.removesuffix(".__get__").removesuffix(".__set__").rsplit(".", 1)[-1]
        if base not in METADATA:
            held = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, HeldElsewhere))
            raise OtherStageParameterError(held.explain(name))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def explain(self, operation: str) -> str:
        return (
            "under PipeDreamStrategy, code on a rank may compute only with its own stage's "
            "parameters and those outside configure_pipeline(); the others are on the meta device "
            f"there (parameter: {self.parameter_name!r}, held by {self.holder}, used on "
            f"{self.here}, operation: {operation}); for weight decay use the optimizer's "
            "weight_decay=..., or compute the term in a layer of the stage that holds the parameter"
        )


def mark_other_stages(module: nn.Module, layers: nn.Sequential, plan: Plan, rank: int) -> int:
    """Replace every parameter of ``layers`` that is on ``meta`` (another stage's) by a
    ``HeldElsewhere`` naming it; a parameter reachable under several names stays one object.
    Returns how many parameters were marked."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    here = plan.stages_of_rank(rank)[0]
    describe_here = describe(rank, here.index)
    marked: dict[int, HeldElsewhere] = {}
    for index, layer in enumerate(layers):
        stage = next(s for s in plan.stages if str(index) in s.nodes)
        ranks = ", ".join(str(r) for r in stage.ranks)
        holder = f"stage {stage.index} (rank{'s' if len(stage.ranks) > 1 else ''} {ranks})"
        for param in layer.parameters():
            if param.is_meta and id(param) not in marked and id(param) in names:
                held = HeldElsewhere(param.data, param.requires_grad)
                held.parameter_name, held.holder = names[id(param)], holder
                held.here = describe_here
                marked[id(param)] = held
    for sub in module.modules():
        for key, current in list(sub._parameters.items()):
            if current is not None and id(current) in marked:
                sub._parameters[key] = marked[id(current)]
    return len(marked)
