"""Resuming a checkpoint into one rank's stage, under whatever plan this run chose.

A checkpoint holds the weights and the optimizer state under the LightningModule's names
(``core.checkpoint``, ``core.named_state``), so the plan that saved it is information only:
once its stage is cut, every rank loads the weights of the names its stage holds, reading only
the shards that hold them (``Resume.load_stage``), and once the optimizers are cut down to the
stage's parameters, the optimizer state of those names. A Lightning checkpoint file from one
device (optimizer state by position over the whole module, in ``configure_optimizers``' order)
is loaded whole before setup, its positions named with the order recorded at setup
(``Resume.record``).

A checkpoint of the first sharded format keys each stage's optimizer state by position over
that stage's parameters: it resumes under its own layout only (``check_layout``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pl_pipedream.core import checkpoint as sharded
from pl_pipedream.core import named_state
from pl_pipedream.core.errors import CheckpointError, PipelineSetupError
from pl_pipedream.core.pretrained import WeightsFile
from pl_pipedream.planner.plan import Plan

__all__ = ["Resume", "check_layout", "check_state_names", "optimizer_states", "shapes_of"]


def check_layout(saved: Plan, plan: Plan) -> None:
    """Raise unless ``plan`` places layers and replicas as the ``saved`` plan did (what a
    checkpoint keyed by position needs)."""
    layout = [(s.nodes, s.replicas) for s in saved.stages]
    if layout != [(s.nodes, s.replicas) for s in plan.stages]:
        raise PipelineSetupError(
            f"a checkpoint whose optimizer state is keyed by position resumes only under the "
            f"plan that saved it (saved: {saved.shape} with layers "
            f"{[list(s.nodes) for s in saved.stages]}, now: {plan.shape} with layers "
            f"{[list(s.nodes) for s in plan.stages]}); resume it once with "
            f"Trainer(devices={saved.num_workers}) and PipeDreamStrategy(plan=Plan.from_dict("
            "json.load(open('<checkpoint>/pipeline.json'))['plan'])) and save again: a "
            "checkpoint saved now keys it by name and resumes under any plan; or load only "
            "the weights with consolidate_checkpoint()"
        )


def optimizer_states(saved: sharded.Shards, plan: Plan, stage: int) -> list[dict[str, Any]]:
    """The optimizer states ``stage`` saved in a checkpoint keyed by position, once ``plan``
    is checked against the saved one."""
    meta, shards = saved
    check_layout(Plan.from_dict(meta["plan"]), plan)
    return shards[stage]["optimizer_states"]


def check_state_names(
    model: dict[str, torch.Tensor], saved: Mapping[str, Sequence[int]], strict: bool = True
) -> None:
    """Raise one error listing every name the checkpoint (``saved``: name -> shape) lacks or
    has beyond the model (``strict`` only) and every shape that differs."""
    problems = []
    if strict:
        missing = [name for name in model if name not in saved]
        unexpected = [name for name in saved if name not in model]
        problems += [f"missing: {_listed(missing)}"] if missing else []
        problems += [f"unexpected: {_listed(unexpected)}"] if unexpected else []
    shapes = [
        f"{name} {list(saved[name])} in the checkpoint, {list(tensor.shape)} in the model"
        for name, tensor in model.items()
        if name in saved and tuple(saved[name]) != tuple(tensor.shape)
    ]
    problems += [f"shapes: {_listed(shapes)}"] if shapes else []
    if problems:
        raise CheckpointError(
            f"a checkpoint resumes into the model that saved it: the same state names and "
            f"shapes ({'; '.join(problems)}); resume with the model and configure_model() of "
            "the saving run, or load the matching weights yourself with "
            "consolidate_checkpoint() and load_state_dict(strict=False)"
        )


def shapes_of(state: Mapping[str, Any]) -> dict[str, list[int]]:
    """The shape of each tensor of a ``state_dict``."""
    return {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _listed(items: Sequence[str], most: int = 8) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return f"[{', '.join(items[:most])}]{more}"


@dataclass
class Resume:
    """What a rank keeps to save and resume: the sharded checkpoint being resumed (its
    description and the shards read so far; none for a Lightning checkpoint file, or no
    resume), and each optimizer's parameter names, group by group, as ``configure_optimizers``
    built it (``record``).

    A checkpoint whose records list each shard's state shapes is read lazily: Lightning gets
    stage 0's shard (loops, callbacks, schedulers) before setup, the names are checked against
    the description, and once the stage is cut each rank reads only the shards that hold its
    names (``load_stage``). Older checkpoints are read whole before setup."""

    path: Path | None = None
    meta: dict[str, Any] | None = None  # pipeline.json
    shards: dict[int, dict[str, Any]] = field(default_factory=dict)  # read so far, by stage
    groups: list[list[list[str]]] = field(default_factory=list)  # per optimizer, per group
    names: dict[int, str] = field(default_factory=dict)  # parameter id -> its (first) name
    plan: Plan | None = None  # this run's, and this rank's stage in it (``check_plan``)
    stage: int = 0

    @property
    def saved_plan(self) -> Plan | None:
        return Plan.from_dict(self.meta["plan"]) if self.meta is not None else None

    @property
    def keyed_by_position(self) -> bool:
        """A sharded checkpoint whose optimizer state is keyed by position (the first format)."""
        return self.meta is not None and not sharded.is_keyed_by_name(list(self.shards.values()))

    @property
    def lazy(self) -> bool:
        """Whether the weights come per stage at setup (``load_stage``): the records list the
        shards' names, and the optimizer states are keyed by name."""
        shapes = self.meta is not None and sharded.state_shapes(self.meta) is not None
        return shapes and not self.keyed_by_position

    def read(self, path: str | Path, read_file: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Lightning's checkpoint dict from ``path``: of a sharded checkpoint, stage 0's shard
        (``lazy``) or every stage's merged; else what ``read_file`` reads."""
        self.forget()
        if not sharded.is_sharded(path):
            return read_file()
        self.path, self.meta = Path(path), sharded.read_description(path)
        self._read([0])
        if self.lazy:
            return dict(self.shards[0])
        self._read(range(len(self.meta["shards"])))
        return sharded.merged_checkpoint([self.shards[k] for k in sorted(self.shards)])

    def forget(self) -> None:
        """No checkpoint is being resumed."""
        self.path, self.meta, self.shards = None, None, {}

    def check_model(
        self, model: dict[str, torch.Tensor], checkpoint: dict[str, Any], strict: bool
    ) -> bool:
        """Check the checkpoint's names and shapes against ``model``'s state; whether its
        ``state_dict`` is to be loaded now (else ``load_stage`` loads it at setup)."""
        if self.lazy:
            saved = {name: shape for name, (_, shape) in self._holders().items()}
            check_state_names(model, saved, strict)
            return False
        check_state_names(model, shapes_of(checkpoint["state_dict"]), strict)
        return True

    def load_stage(self, module: nn.Module) -> None:
        """Load the state this rank holds (every tensor not on ``meta``), reading only the
        shards that hold it (a name's first shard, as ``merge_states``)."""
        if not self.lazy:
            return
        holders = self._holders()
        sources = {
            name: holders[name][0]
            for name, tensor in module.state_dict(keep_vars=True).items()
            if not tensor.is_meta and name in holders
        }
        self._read(sorted(set(sources.values())))
        state = {name: self.shards[k]["state_dict"][name] for name, k in sources.items()}
        module.load_state_dict(state, strict=False)

    def weights(self) -> WeightsFile:
        """The checkpoint's state as a weights file (``core.pretrained``) for a module built
        empty, whose stage is created from it: the names and shapes the records list, each
        value read from the first shard holding it (a shard read when first needed)."""
        assert self.lazy
        holders = self._holders()
        shapes = {name: torch.empty(shape, device="meta") for name, (_, shape) in holders.items()}

        def reader() -> Callable[[str], torch.Tensor]:
            def read(name: str) -> torch.Tensor:
                self._read([holders[name][0]])
                return self.shards[holders[name][0]]["state_dict"][name]

            return read

        return WeightsFile(shapes, reader)

    def _holders(self) -> dict[str, tuple[int, list[int]]]:
        """Each state name the records list: the first shard holding it (as ``merge_states``
        takes it) and its shape."""
        assert self.meta is not None
        holders: dict[str, tuple[int, list[int]]] = {}
        for k, names in enumerate(sharded.state_shapes(self.meta) or []):
            for name, shape in names.items():
                holders.setdefault(name, (k, shape))
        return holders

    def check_plan(self, plan: Plan, stage: int) -> None:
        """At setup, once the plan is chosen: a checkpoint keyed by position needs its own.
        Keeps ``plan`` and this rank's ``stage`` for ``load_optimizers``."""
        self.plan, self.stage = plan, stage
        saved = self.saved_plan
        if saved is not None and self.keyed_by_position:
            check_layout(saved, plan)

    def record(self, module: nn.Module, optimizers: Sequence[Any]) -> None:
        """The names of every optimizer's parameters, group by group, before the optimizers
        are cut down to the stage's parameters."""
        self.name_parameters(module)
        self.groups = [self._local(optimizer) for optimizer in optimizers]

    def name_parameters(self, module: nn.Module) -> None:
        """Name ``module``'s parameters as they are now (again after a re-plan created the
        parameters of the layers that came to this rank: ``core.relayout``)."""
        self.names = {id(param): name for name, param in module.named_parameters()}

    def state_of(self, optimizers: Sequence[Any], optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s state keyed by name: what this rank's shard holds."""
        index = [id(o) for o in optimizers].index(id(_unwrapped(optimizer)))
        optimizer = _unwrapped(optimizer)
        return named_state.to_named(
            optimizer.state_dict(), self.groups[index], self._local(optimizer)
        )

    def load_optimizers(self, checkpoint: dict[str, Any], optimizers: Sequence[Any]) -> None:
        """Each optimizer takes the state of the parameters it holds now. A checkpoint from
        before the first step that saved no optimizer (``pl-pipedream checkpoint from-torch``'s)
        leaves them as ``configure_optimizers`` made them: no step has given them state."""
        if not checkpoint.get("optimizer_states") and checkpoint.get("global_step") == 0:
            return
        if self.keyed_by_position:
            assert self.plan is not None and self.meta is not None, "check_plan() comes first"
            saved = (self.meta, [self.shards[k] for k in sorted(self.shards)])
            states = optimizer_states(saved, self.plan, self.stage)
        elif self.lazy:  # the shards this stage read hold its parameters' states
            read = [self.shards[k].get("optimizer_states", []) for k in sorted(self.shards)]
            states = [named_state.merge(each) for each in zip(*read, strict=True)]
        else:
            states = checkpoint["optimizer_states"]
        if len(states) != len(optimizers):
            raise CheckpointError(
                f"a checkpoint resumes with as many optimizers as it saved (saved: "
                f"{len(states)}, configure_optimizers: {len(optimizers)}); return the "
                "optimizers the saving run returned"
            )
        for number, (optimizer, state) in enumerate(zip(optimizers, states, strict=True)):
            optimizer = _unwrapped(optimizer)
            if self.keyed_by_position:
                optimizer.load_state_dict(state)
                continue
            if not named_state.is_named(state):  # one device's: by position over the module
                state = named_state.to_named(state, self.groups[number], self.groups[number])
            optimizer.load_state_dict(named_state.to_positional(state, self._local(optimizer)))

    def _read(self, stages: Any) -> None:
        assert self.path is not None and self.meta is not None
        for stage in stages:
            if stage not in self.shards:
                self.shards[stage] = sharded.read_shard(self.path, self.meta, stage)

    def _local(self, optimizer: Any) -> list[list[str]]:
        return named_state.group_names(_unwrapped(optimizer).param_groups, self.names)


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper that keeps it as ``_optimizer`` (Lightning's)."""
    return getattr(optimizer, "_optimizer", optimizer)
