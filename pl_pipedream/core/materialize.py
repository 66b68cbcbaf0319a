"""Models larger than one process: build on ``meta``, then materialise only this rank's stage.

A LightningModule built in ``configure_model()``, or under ``trainer.init_module(empty_init=
True)``, is built by the strategy on the ``meta`` device (``EmptyBuild.record``): no memory is
taken, and every initialisation the build would have run is written down instead, in order:
each call of a module's ``reset_parameters()`` (or ``_reset_parameters()``, as
``nn.MultiheadAttention`` names it) that wrote a tensor, with the tensors it wrote; and any
other write to a model tensor (``nn.init.normal_`` from a user's ``_init_weights``, ``w.fill_``
in an ``__init__``) or random factory (``nn.Parameter(torch.randn(...))``), which cannot be
replayed. The CPU generator's state at the start of the build is kept.

At setup, ``materialize`` replays that record from that state: the tensors a reset call
touches are created on the rank's device (filled with NaN first), the call runs, and the tensors
of other stages are dropped again as soon as no later call needs them. Every reset call runs,
so the generator advances exactly as in the whole build, while at most the layers of one call
(one layer, for a model whose layers initialise themselves) of another stage are alive at a time.
A call writes only the tensors it wrote in the build: a tensor swapped in afterwards (a tied
weight, ``head.weight = embed.weight``) keeps the value of the call that set it, as in the whole
build, and a tensor that no call set stays NaN and is refused.

So the local stage's values equal those of the whole build with the same seed for every model
whose tensors are all set by their modules' own ``reset_parameters()`` during the build (all of
``torch.nn``'s layers, and user modules that initialise their own tensors there). Refused at
setup, with the fix: initialisation outside a reset method, a tensor no reset set, and a reset
whose module spans several pipeline layers (it would need them all at once). Identity is kept
throughout (``torch.utils.swap_tensors``): ties, optimizers and names see the same objects.

The global generator is left where the whole build would have left it when nothing drew from it
between the build and setup (``configure_model``, which runs just before setup); otherwise it is
left alone.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils import swap_tensors

from pl_pipedream.core.errors import PipelineSetupError

__all__ = ["EmptyBuild", "Reset", "empty_build", "loaded", "materialize", "model_tensors"]

RESET_METHODS = ("reset_parameters", "_reset_parameters")
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_"})
RANDOM_FACTORIES = frozenset(
    {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
     "rand_like", "randn_like", "randint_like"}
)  # fmt: skip


@dataclass
class Reset:
    """One reset call of the build: the module, the method, the storages it wrote (by their
    build-time identity; ``written`` keeps them alive so the identities stay unique)."""

    module: nn.Module
    method: str
    storages: set[int] = field(default_factory=set)
    written: list[Tensor] = field(default_factory=list)
    frame: Any = None  # the call's frame while recording (a second call is a new entry)


@dataclass
class EmptyBuild:
    """What the strategy's empty builds recorded (``record``), replayed by ``materialize``."""

    resets: list[Reset] = field(default_factory=list)
    unreplayable: list[str] = field(default_factory=list)
    rng_state: Tensor | None = None  # the CPU generator at the start of the first build

    def context(
        self,
        connected: bool,
        precision: Callable[[], contextlib.AbstractContextManager[Any]],
        empty_init: bool | None,
        whole: Callable[[bool | None], contextlib.AbstractContextManager[None]],
    ) -> contextlib.AbstractContextManager[object]:
        """The strategy's ``tensor_init_context``: an empty, recorded build in
        ``configure_model()`` (Lightning passes ``empty_init=None`` there, with the module
        connected) and under ``trainer.init_module(empty_init=True)``; ``whole(empty_init)``,
        Lightning's own, otherwise."""
        empty = empty_init if empty_init is not None else connected
        if not empty:
            return whole(empty_init)
        stack = contextlib.ExitStack()
        stack.enter_context(precision())
        stack.enter_context(self.record())
        return stack

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Build on ``meta`` and record every initialisation (see the module docstring)."""
        start, count = torch.random.get_rng_state(), len(self.resets)
        if self.rng_state is None:
            self.rng_state = start
        with torch.device("meta"), _Recorder(self):
            yield
        for reset in self.resets:
            reset.frame = None
        if 0 < count < len(self.resets) and not torch.equal(start, self.rng_state):
            self.unreplayable.append("a second empty build after draws from the generator")

    def note(self, operation: str, written: Tensor | None) -> None:
        """One initialising operation of the build, attributed to its outermost reset call."""
        frame: FrameType | None = sys._getframe(2)
        owner = None
        where = None
        while frame is not None:
            self_ = frame.f_locals.get("self") if frame.f_code.co_name in RESET_METHODS else None
            if isinstance(self_, nn.Module):
                owner = (self_, frame)
            elif where is None and not _inside_torch(frame):
                where = f"{frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno}"
            frame = frame.f_back
        if owner is None:
            self.unreplayable.append(f"{operation} in {where or 'torch'}")
            return
        module, frame = owner
        if not self.resets or self.resets[-1].frame is not frame:
            self.resets.append(Reset(module, frame.f_code.co_name, frame=frame))
        if written is not None:
            self.resets[-1].storages.add(_storage(written))
            self.resets[-1].written.append(written)


class _Recorder(TorchFunctionMode):
    """Sees every torch call of the build and notes those that initialise meta tensors."""

    def __init__(self, build: EmptyBuild) -> None:
        super().__init__()
        self.build = build

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        base = name.rsplit(".", 1)[-1]
        result = func(*args, **kwargs)
        target = kwargs.get("tensor", args[0] if args else None)
        writes = getattr(func, "__module__", None) == "torch.nn.init" or (
            name.startswith("torch.Tensor.")
            and base not in NOT_WRITES
            and (base == "__setitem__" or (base.endswith("_") and not base.endswith("__")))
        )
        if writes and isinstance(target, Tensor) and target.is_meta:
            self.build.note(name, target)
        elif base in RANDOM_FACTORIES and isinstance(result, Tensor) and result.is_meta:
            self.build.note(name, None)
        return result


@contextlib.contextmanager
def empty_build() -> Iterator[EmptyBuild]:
    """Outside Lightning: build the model inside the block, on ``meta`` and recorded, then pass
    the record to ``Pipeline(..., empty_build=build)``, which creates only the rank's stage."""
    build = EmptyBuild()
    with build.record():
        yield build


def model_tensors(module: nn.Module) -> list[Tensor]:
    """Every parameter and buffer of ``module``, each once."""
    seen: dict[int, Tensor] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def materialize(
    module: nn.Module,
    layers: nn.Sequential,
    local: Sequence[int],
    device: torch.device,
    build: EmptyBuild,
) -> int:
    """Create and initialise on ``device`` the meta tensors of the layers ``local`` and of the
    state outside the pipeline, by replaying ``build`` (module docstring); the other layers end
    on ``meta``. Returns how many tensors were created here (0 when none was on ``meta``)."""
    names = {id(t): n for n, t in (*module.named_parameters(), *module.named_buffers())}
    in_pipeline = {id(t) for layer in layers for t in model_tensors(layer)}
    keep = {id(t) for i in local for t in model_tensors(layers[i])}
    keep |= {id(t) for t in model_tensors(module) if id(t) not in in_pipeline}
    wanted = [t for t in model_tensors(module) if id(t) in keep and t.is_meta]
    if not wanted:
        return 0
    if build.rng_state is None:
        raise PipelineSetupError(
            "a model on the meta device must be built by the strategy, which records how to "
            f"initialise it (parameter: {names.get(id(wanted[0]), '?')}); build it in "
            "configure_model() or under `with trainer.init_module(empty_init=True):`, or for "
            "Pipeline under `with pl_pipedream.empty_build() as build:` and pass empty_build=build"
        )
    if build.unreplayable:
        raise PipelineSetupError(
            "under an empty build, only initialisation inside a module's reset_parameters() can "
            f"be replayed on the stage that keeps it (outside: {build.unreplayable[0]}"
            f"{f' and {len(build.unreplayable) - 1} more' if len(build.unreplayable) > 1 else ''}"
            "); move it into reset_parameters() of the module whose tensors it sets, or build the "
            "model whole in __init__"
        )
    _check_spans(build.resets, layers)
    storage = {id(t): _storage(t) for t in model_tensors(module) if t.is_meta}
    needs = [[t for t in model_tensors(r.module) if id(t) in storage] for r in build.resets]
    last_use = {id(t): i for i, tensors in enumerate(needs) for t in tensors}
    written: set[int] = set()
    shells: dict[int, Tensor] = {}
    before = torch.random.get_rng_state()
    torch.random.set_rng_state(build.rng_state)
    try:
        for i, reset in enumerate(build.resets):
            for tensor in needs[i]:
                if tensor.is_meta:
                    _create(tensor, device, shells)
            _replay(reset, needs[i], storage, written)
            for tensor in needs[i]:
                if last_use[id(tensor)] == i and id(tensor) not in keep:
                    _drop(tensor, shells)
    finally:
        after = torch.random.get_rng_state()
        unchanged = torch.equal(before, build.rng_state)
        torch.random.set_rng_state(after if unchanged else before)
        build.resets, build.rng_state = [], None
    _check_set(wanted, written, names)
    return len(wanted)


@contextlib.contextmanager
def loaded(layer: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """``layer`` with its meta tensors created on ``device`` for the block (small random values
    drawn without touching the global generator; for profiling one layer at a time), then
    dropped again."""
    created = [t for t in model_tensors(layer) if t.is_meta]
    shells: dict[int, Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for tensor in created:
            _create(tensor, device, shells)
            with torch.no_grad():
                if tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
                else:
                    tensor.zero_()
    try:
        yield layer
    finally:
        for tensor in created:
            _drop(tensor, shells)


def _replay(reset: Reset, tensors: list[Tensor], storage: dict[int, int], written: set) -> None:
    """Run one reset call; tensors it did not write in the build keep their values."""
    kept = [(t, t.detach().clone()) for t in tensors if storage[id(t)] not in reset.storages]
    with torch.no_grad():
        getattr(reset.module, reset.method)()
        for tensor, value in kept:
            tensor.copy_(value)
    written.update(id(t) for t in tensors if storage[id(t)] in reset.storages)


def _check_spans(resets: list[Reset], layers: nn.Sequential) -> None:
    """A reset call must not initialise several pipeline layers: it would need them all."""
    for reset in resets:
        inside = [i for i, layer in enumerate(layers) if _contains(reset.module, layer)]
        if len(inside) > 1:
            raise PipelineSetupError(
                "under an empty build, a reset_parameters() may initialise at most one pipeline "
                f"layer (module: {type(reset.module).__name__}, layers: {inside[:8]}); give each "
                "layer its own reset_parameters() and let the container leave them to it"
            )


def _check_set(wanted: list[Tensor], written: set[int], names: dict[int, str]) -> None:
    for tensor in wanted:
        unset = id(tensor) not in written
        if not unset and tensor.is_floating_point():
            unset = bool(torch.isnan(tensor).any())
        if unset:
            raise PipelineSetupError(
                "under an empty build, every parameter and buffer of this stage must be set by "
                "its module's reset_parameters() during the build (not set: "
                f"{names.get(id(tensor), '?')}); give its module a reset_parameters() that sets "
                "it (through the tensor itself or torch.nn.init), or build the model whole"
            )


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _create(tensor: Tensor, device: torch.device, shells: dict[int, Tensor]) -> None:
    """Give a meta tensor memory on ``device`` in place (same Python object), NaN-filled; its
    meta self is kept in ``shells`` so that ``_drop`` restores it (the same storage identity)."""
    value = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    if value.is_floating_point():
        value.fill_(float("nan"))
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, tensor.requires_grad)
    swap_tensors(tensor, value)
    shells[id(tensor)] = value  # now the meta one


def _drop(tensor: Tensor, shells: dict[int, Tensor]) -> None:
    """Free a tensor's memory in place: it becomes its meta self again."""
    swap_tensors(tensor, shells.pop(id(tensor)))


def _storage(tensor: Tensor) -> int:
    """The identity of ``tensor``'s storage: views and ``.data`` share it."""
    return tensor.untyped_storage()._cdata


def _inside_torch(frame: Any) -> bool:
    filename = frame.f_code.co_filename
    return "/torch/" in filename or "/lightning/" in filename or filename == __file__
