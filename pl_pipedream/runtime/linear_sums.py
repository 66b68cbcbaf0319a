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

The capture has a fixed cost (the mode sees every torch call of the forward, and each fused
layer runs a Python autograd function): about 50 us of CPU per layer and microbatch, more than
the pass it saves over a gradient of 100 K elements on CPU, or of a few million on a GPU.
``pays`` says whether a stage's weights are large enough for it (``fused_from``: the measured
break-even by device, docs/fixed-cost.md).

A split backward (zero bubble) holds the products back instead: captured with ``HeldProducts``,
a fused call's backward computes the input's gradient only and keeps its output gradient and
input rows; ``HeldProducts.add_into`` later adds ``g^T x`` (and the bias's row sums) into the
sums with the same GEMMs. The weight half then costs the weight share of a backward, no walk of
the graph again. Each held call also takes ``HeldProducts.anchor``, a tensor that requires a
gradient, as an input: autograd runs a node only when it leads to a tensor asked for, and a
Linear whose input needs no gradient (the first stage's first layer) leads only to its weight,
so the input half asks for the anchor too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.overrides import TorchFunctionMode

__all__ = [
    "FUSED_FROM_ACCELERATOR",
    "FUSED_FROM_CPU",
    "HeldProducts",
    "LinearGradientSums",
    "fused_from",
    "pays",
]

# The fewest elements of a weight for fusing to pay: the break-even measured on a 2-core CPU
# (between 100 K and 200 K) and on an H100 (between 1 M and 16 M), docs/fixed-cost.md.
FUSED_FROM_CPU = 1 << 17
FUSED_FROM_ACCELERATOR = 1 << 22


def fused_from(device: torch.device) -> int:
    """The default threshold of ``pays`` for weights on ``device``."""
    return FUSED_FROM_CPU if device.type == "cpu" else FUSED_FROM_ACCELERATOR


def pays(params: Iterable[torch.Tensor], min_elements: int | None = None) -> bool:
    """Whether fusing is worth its fixed cost for a stage of ``params``: one of its 2-D weights
    (those ``F.linear`` may be called with) that require a gradient has ``min_elements`` or
    more elements (None: ``fused_from`` its device). ``min_elements`` 0 says yes always."""
    if min_elements is not None and min_elements <= 0:
        return True
    return any(
        p.dim() == 2
        and p.requires_grad
        and p.numel() >= (fused_from(p.device) if min_elements is None else min_elements)
        for p in params
    )


class LinearGradientSums:
    """Sums of Linear weight and bias gradients over several backward passes, fused into the GEMMs.

    A name's sum is allocated by the first backward that writes it after ``take`` and handed
    over by the next ``take``.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}  # written since the last take(), in order

    def capture(
        self, tensors: Mapping[str, torch.Tensor], held: HeldProducts | None = None
    ) -> _CaptureLinear:
        """A context in which ``F.linear`` calls on ``tensors`` (matched by identity) are fused.

        A call is fused when its weight is among ``tensors`` and requires grad; its bias is summed
        too if it is among ``tensors``, otherwise its gradient flows through autograd as usual.
        Other calls run unchanged. With ``held``, a fused call's products wait in ``held``
        until ``held.add_into(self)``.
        """
        return _CaptureLinear(self, tensors, held)

    def take(self) -> dict[str, torch.Tensor]:
        """The sums written since the last ``take`` (name -> tensor), now the caller's."""
        sums, self._sums = self._sums, {}
        return sums

    @property
    def pending(self) -> bool:
        """Whether some sum was written since the last ``take``."""
        return bool(self._sums)

    def add_linear(
        self, weight_name: str, bias_name: str | None, rows: torch.Tensor, inputs: torch.Tensor
    ) -> None:
        """Add one Linear call's weight gradient ``rows^T inputs`` (output gradient rows, input
        rows) and, for a captured bias, its bias gradient (the rows' sum)."""
        self.add_product(weight_name, rows.t(), inputs)
        if bias_name is not None:
            self.add_row_sum(bias_name, rows)

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


class HeldProducts:
    """The weight-gradient products of one backward's fused Linear calls, held for later.

    Each entry is (weight name, bias name or None, output gradient rows, input rows); ``anchor``
    is the tensor every held call takes as an input (see the module docstring), made on the
    first call's device.
    """

    def __init__(self) -> None:
        self.anchor: torch.Tensor | None = None
        self.products: list[tuple[str, str | None, torch.Tensor, torch.Tensor]] = []

    def anchor_on(self, device: torch.device) -> torch.Tensor | None:
        """The anchor, made on ``device`` by the first call; None on another device."""
        if self.anchor is None:
            self.anchor = torch.zeros((), device=device, requires_grad=True)
        return self.anchor if self.anchor.device == device else None

    def add_linear(
        self, weight_name: str, bias_name: str | None, rows: torch.Tensor, inputs: torch.Tensor
    ) -> None:
        """Hold one Linear call's products (``LinearGradientSums.add_linear`` adds them later)."""
        self.products.append((weight_name, bias_name, rows, inputs))

    def add_into(self, sums: LinearGradientSums) -> None:
        """Add every held product into ``sums``, in the order the backward made them, and
        forget them."""
        for product in self.products:
            sums.add_linear(*product)
        self.products = []


def _matches(buffer: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> bool:
    return buffer.shape == shape and buffer.dtype == like.dtype and buffer.device == like.device


class _CaptureLinear(TorchFunctionMode):
    """Sends fusable ``F.linear`` calls on captured weights through ``_SummedLinear``.

    ``F.linear`` is ``torch._C._nn.linear`` itself, and a mode sees it as that one object. While
    the handler runs, the mode is off, so the calls it makes do not come back to it.
    """

    def __init__(
        self,
        sums: LinearGradientSums,
        tensors: Mapping[str, torch.Tensor],
        held: HeldProducts | None = None,
    ) -> None:
        super().__init__()
        self.sums = sums
        self.held = held
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
        if self.held is None:
            return _SummedLinear.apply(input, weight, bias, None, self.sums, weight_name, bias_name)
        anchor = self.held.anchor_on(weight.device)
        if anchor is None:
            return F.linear(input, weight, bias)
        return _SummedLinear.apply(input, weight, bias, anchor, self.held, weight_name, bias_name)

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
    """``F.linear`` whose backward returns the input's gradient and hands the weight (and a
    captured bias) gradient's products to ``target``: a ``LinearGradientSums``, which adds them
    into its sums at once, or a ``HeldProducts``, which holds them for the weight half.

    The input ``(*, in_features)`` is flattened to rows for the weight gradient ``g^T x``, which
    ``addmm_`` writes straight into the sum. ``anchor`` is None, or ``HeldProducts``' anchor
    (see the module docstring); it gets no gradient. ``forward`` takes the context itself: with a
    separate ``setup_context``, every ``apply`` binds its arguments to the signature through
    ``inspect`` (about 40 us per call, measured here: a fixed cost per layer and microbatch).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        anchor: torch.Tensor | None,
        target: LinearGradientSums | HeldProducts,
        weight_name: str,
        bias_name: str | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.target = target  # type: ignore[attr-defined]
        ctx.names = (weight_name, bias_name)  # type: ignore[attr-defined]
        return F.linear(input, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        weight_name, bias_name = ctx.names
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        ctx.target.add_linear(weight_name, bias_name, rows, input.reshape(-1, input.shape[-1]))
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if bias_name is None and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_input, None, grad_bias, None, None, None, None
