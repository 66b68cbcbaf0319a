"""Linear layers' weight and bias gradients summed over backward passes inside the GEMMs.

When one update averages the gradients of several microbatches (flush, GPipe, 2BW), autograd
computes each Linear layer's weight gradient ``g^T x`` into a fresh tensor and the caller then
adds it into a running sum: one more pass of reads and writes over the whole gradient per
microbatch. Here the running sum is the GEMM's output instead: the first backward after ``take``
computes a new tensor, as autograd would, and every later one adds into it inside the GEMM
(``addmm_``, beta=1). ``take`` hands the sums over for good: whoever receives them (an
optimizer's ``.grad``, Lightning's gradient handover) may keep them.

Inside ``capture``, a torch function mode sends each ``F.linear`` call whose weight is a captured
tensor through ``_SummedLinear``. Its backward returns the input's gradient as usual and None
for the captured weight and bias, whose gradients go into the sums. A call that cannot be fused
exactly (autocast, mixed dtypes or devices, grad disabled, tensor subclasses, saved-tensor hooks
such as activation checkpointing, whose recomputation would not go through the mode) runs
unchanged; hooks marked as passing every tensor through (``_hooks_pass_through``) do not stop it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.overrides import TorchFunctionMode

__all__ = ["LinearGradientSums"]


class LinearGradientSums:
    """Sums of Linear weight and bias gradients over several backward passes, fused into the GEMMs.

    A name's sum is allocated by the first backward that writes it after ``take`` and handed
    over by the next ``take``.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}  # written since the last take(), in order

    def capture(self, tensors: Mapping[str, torch.Tensor]) -> _CaptureLinear:
        """A context in which ``F.linear`` calls on ``tensors`` (matched by identity) are fused.

        A call is fused when its weight is among ``tensors`` and requires grad; its bias is summed
        too if it is among ``tensors``, otherwise its gradient flows through autograd as usual.
        Other calls run unchanged.
        """
        return _CaptureLinear(self, tensors)

    def take(self) -> dict[str, torch.Tensor]:
        """The sums written since the last ``take`` (name -> tensor), now the caller's."""
        sums, self._sums = self._sums, {}
        return sums

    @property
    def pending(self) -> bool:
        """Whether some sum was written since the last ``take``."""
        return bool(self._sums)

    def add_product(self, name: str, left: torch.Tensor, right: torch.Tensor) -> None:
        """Add ``left @ right`` into the sum ``name`` (start it if there is none)."""
        held = self._held(name, (left.shape[0], right.shape[1]), left)
        if held is None:
            self._sums[name] = torch.mm(left, right)
        else:
            held.addmm_(left, right)

    def add_row_sum(self, name: str, rows: torch.Tensor) -> None:
        """Add the sum of ``rows`` over its first dimension into the sum ``name``."""
        held = self._held(name, (rows.shape[1],), rows)
        if held is None:
            self._sums[name] = rows.sum(0)
        else:
            held.add_(rows.sum(0))

    def _held(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``name`` so far, if any; it must match the gradient about to be added."""
        held = self._sums.get(name)
        if held is not None and not _matches(held, shape, like):
            raise ValueError(
                "a gradient sum changed shape, dtype or device before take() "
                f"(name: {name}, sum: {tuple(held.shape)} {held.dtype} {held.device}, "
                f"gradient: {shape} {like.dtype} {like.device}); call take() between them"
            )
        return held


def _matches(buffer: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> bool:
    return buffer.shape == shape and buffer.dtype == like.dtype and buffer.device == like.device


class _CaptureLinear(TorchFunctionMode):
    """Sends fusable ``F.linear`` calls on captured weights through ``_SummedLinear``.

    ``F.linear`` is ``torch._C._nn.linear`` itself, and a mode sees it as that one object. While
    the handler runs, the mode is off, so the calls it makes do not come back to it.
    """

    def __init__(self, sums: LinearGradientSums, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.sums = sums
        self.tensors = tensors  # kept alive, so no other tensor can take one of their ids
        self.names = {id(tensor): name for name, tensor in tensors.items()}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return self._linear(*args, **kwargs)
        return func(*args, **kwargs)

    def _linear(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight_name = self._name(weight)
        if weight_name is None or not _fusable(input, weight, bias):
            return F.linear(input, weight, bias)
        bias_name = self._name(bias)
        return _SummedLinear.apply(input, weight, bias, self.sums, weight_name, bias_name)

    def _name(self, tensor: torch.Tensor | None) -> str | None:
        if tensor is None or not tensor.requires_grad:
            return None
        return self.names.get(id(tensor))


def _fusable(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``_SummedLinear`` computes exactly what ``F.linear`` and autograd would.

    Autocast is checked for the input's device type: ``torch.is_autocast_enabled()`` without an
    argument only reports CUDA autocast, and is False under ``torch.autocast("cpu")``.
    """
    tensors = (input, weight) if bias is None else (input, weight, bias)
    return (
        torch.is_grad_enabled()
        and _hooks_pass_through(torch._C._autograd._top_saved_tensors_default_hooks(False))
        and weight.dim() == 2
        and input.dim() >= 1
        and not torch.is_autocast_enabled(input.device.type)
        and all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors)
        and all(t.dtype == weight.dtype and t.device == weight.device for t in tensors)
    )


def _hooks_pass_through(hooks: Any) -> bool:
    """No saved-tensor hooks, or hooks that only look: their pack function carries
    ``passes_through = True`` and returns each tensor as it is (``runtime.recompute``'s counting
    of activations in flight); fusing under them saves what autograd would."""
    return hooks is None or getattr(hooks[0], "passes_through", False) is True


class _SummedLinear(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight (and bias) gradients into ``sums``.

    The input ``(*, in_features)`` is flattened to rows for the weight gradient
    ``g^T x``, which ``addmm_`` writes straight into the sum. ``forward`` takes the context
    itself: with a separate ``setup_context``, every ``apply`` binds its arguments to the
    signature through ``inspect`` (about 40 us per call, measured here: a fixed cost per layer and
    microbatch).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        sums: LinearGradientSums,
        weight_name: str,
        bias_name: str | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.sums = sums  # type: ignore[attr-defined]
        ctx.names = (weight_name, bias_name)  # type: ignore[attr-defined]
        return F.linear(input, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        weight_name, bias_name = ctx.names
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        ctx.sums.add_product(weight_name, rows.t(), input.reshape(-1, input.shape[-1]))
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if bias_name is not None:
            ctx.sums.add_row_sum(bias_name, rows)
        elif ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_input, None, grad_bias, None, None, None
