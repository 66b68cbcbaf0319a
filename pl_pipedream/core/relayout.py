"""Move a drained pipeline to another plan in memory: layers, tied weights, optimizer state.

Every rank calls ``relayout`` at the same step, once no minibatch is in flight (a drain: the
stashes are empty, replicas and tied copies are bit-identical). Each tensor of the pipeline's
layers (parameters, buffers, a tied weight once) that a rank's new stage holds and its old stage
did not travels point to point from the first replica of the first old stage that held it, with
each optimizer's per-parameter state (SGD's momentum, Adam's moments and step) keyed by the
parameter's name (as ``core.named_state`` keys a checkpoint's): the in-memory form of saving a
checkpoint and resuming it under the new plan (``core.resume``). The replicas of a new stage
receive the same values. The layers a rank no longer holds go to ``meta`` and are marked as
other stages' (``core.elsewhere``); each optimizer keeps its object and its groups' settings,
its groups now hold the new stage's parameters (by the names ``configure_optimizers`` put in
each group: ``group_names``), and its state of the parameters that left is dropped.

The exchanges run pair by pair in one order on every rank (lower rank sends first), so neither
gloo nor NCCL, whose sends may wait for their receive, can deadlock. Every receive waits at most
``timeout``; a rank whose exchange fails tells every other rank which peer was lost (in place
of its next message), and a closing round, in which each rank tells every other that it is done
and which plan it moved to, makes every rank fail naming the lost rank, even one that had no
tensor to exchange with it. Nothing local changes before that round has succeeded.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from pl_pipedream.core.elsewhere import mark_other_stages
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.materialize import model_tensors
from pl_pipedream.core.stage import LocalStage, cut_stage
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime import ranks
from pl_pipedream.runtime.boundary import flatten, unflatten
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.frames import Message, PeerError
from pl_pipedream.runtime.tags import Tag

__all__ = ["Moved", "check_plans", "moves", "relayout"]

Moves = dict[tuple[int, int], list[str]]  # (sender, receiver) -> the state names it sends


@dataclass(frozen=True)
class Moved:
    """What ``relayout`` did on this rank."""

    local: LocalStage  # this rank's new stage (core.stage.cut_stage under the new plan)
    seconds: float  # wall time of the move on this rank
    bytes_received: int  # tensor bytes this rank received


def relayout(
    root: nn.Module,
    layers: nn.Sequential,
    local: LocalStage,
    plan: Plan,
    new_plan: Plan,
    rank: int,
    optimizers: Sequence[Optimizer],
    group_names: Sequence[Sequence[Sequence[str]]],
    device: torch.device,
    timeout: float,
    *,
    group: dist.ProcessGroup | None = None,
) -> Moved:
    """Every rank, on drained weights: move from ``plan`` to ``new_plan`` (module docstring).
    ``group_names[k][g]``: the names of the parameters of group g of ``optimizers[k]`` over
    the whole module, in order (``core.named_state.group_names`` before the optimizers were
    cut to the stage); ``group``: the process group of the ranks (default: the default one)."""
    start = time.monotonic()
    check_plans(plan, new_plan, len(layers))
    if local.stage != plan.stage_of_rank(rank):
        raise PipelineSetupError(
            f"relayout starts from the stage this rank holds under the old plan (rank: {rank}, "
            f"stage held: {local.stage.index}, the plan's: {plan.stage_of_rank(rank).index}); "
            "pass the plan the stage was cut under"
        )
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]  # Lightning's wrapper
    if len(group_names) != len(optimizers):
        raise PipelineSetupError(
            f"relayout needs the parameter names of every optimizer's groups (optimizers: "
            f"{len(optimizers)}, group names: {len(group_names)}); record them with "
            "core.named_state.group_names before the optimizers are cut to the stage"
        )
    names = _first_names(root)
    layer_names = [[names[id(t)] for t in model_tensors(layer)] for layer in layers]
    tensors = {names[id(t)]: t for layer in layers for t in model_tensors(layer)}
    transfers = moves(plan, new_plan, layer_names)
    describe = ranks.describe(rank, new_plan.stage_of_rank(rank).index)
    channel = Channel(rank, device, timeout, describe, group)
    exchange = _Exchange(channel, rank, new_plan)
    try:
        received = exchange.run(transfers, tensors, optimizers)
        exchange.finish()
    finally:
        channel.close(flush=False)
    _install(root, received, device)
    new_local = cut_stage(root, layers, new_plan, rank)
    mark_other_stages(root, layers, new_plan, rank)
    _regroup(root, optimizers, group_names, received)
    nbytes = sum(t.nbytes for t in received["tensors"].values())
    nbytes += sum(t.nbytes for state in received["state"] for t in _state_tensors(state))
    return Moved(new_local, time.monotonic() - start, nbytes)


def moves(plan: Plan, new_plan: Plan, layer_names: Sequence[Sequence[str]]) -> Moves:
    """Which state names each rank sends to each other (``layer_names[i]``: the names of layer
    i's tensors, a tied one under the same name in every layer): a name goes to each rank whose
    new stage holds it and whose old stage did not, from the first replica of the first old
    stage that held it. The same answer on every rank, in rank order."""

    def held(p: Plan, stage: int) -> list[str]:
        names: dict[str, None] = {}
        for node in sorted(p.stages[stage].nodes, key=int):
            names.update(dict.fromkeys(layer_names[int(node)]))
        return list(names)

    old = [held(plan, s.index) for s in plan.stages]
    source: dict[str, int] = {}
    for stage, names in zip(plan.stages, old, strict=True):
        for name in names:
            source.setdefault(name, stage.ranks[0])
    transfers: Moves = {}
    for rank in range(new_plan.num_workers):
        before = set(old[plan.stage_of_rank(rank).index])
        for name in held(new_plan, new_plan.stage_of_rank(rank).index):
            if name not in before:
                transfers.setdefault((source[name], rank), []).append(name)
    return dict(sorted(transfers.items()))


NOTICE = 10.0  # seconds a notice that a rank was lost waits to leave


class _Exchange:
    """The messages of one move on one rank: the tensors, then the closing round."""

    def __init__(self, channel: Channel, rank: int, new_plan: Plan) -> None:
        self.channel = channel
        self.rank = rank
        self.world = new_plan.num_workers
        layout = [(s.nodes, s.ranks) for s in new_plan.stages]  # what the move depends on
        self.digest = zlib.crc32(repr(layout).encode())
        self.shape = new_plan.shape

    def run(
        self, transfers: Moves, tensors: dict[str, Tensor], optimizers: Sequence[Optimizer]
    ) -> dict[str, Any]:
        """Send what this rank's old stage holds to the ranks that need it, and receive what
        its new stage needs: pair by pair, the lower rank first."""
        received: dict[str, Any] = {"tensors": {}, "state": [{} for _ in optimizers], "cpu": {}}
        for low, high in _pairs(self.world, self.rank):
            peer = high if self.rank == low else low
            for sender, receiver in [(low, high), (high, low)]:
                names = transfers.get((sender, receiver))
                if not names:
                    continue
                if sender == self.rank:
                    self._exchange(peer, _payload(names, tensors, optimizers))
                else:
                    _merge(received, self._exchange(peer, None, "the moved layers"))
        return received

    def finish(self) -> None:
        """The closing round: each rank tells every other it is done, and with which plan."""
        self.channel.timeout *= 2  # a peer may first wait its timeout for a lost one
        for low, high in _pairs(self.world, self.rank):
            peer = high if self.rank == low else low
            for sender in (low, high):
                if sender == self.rank:
                    self._exchange(peer, {"done": self.digest})
                elif self._exchange(peer, None, "that it has moved").get("done") != self.digest:
                    raise PipelineSetupError(
                        f"every rank moves to the same new plan ({self.channel.describe} "
                        f"moved to {self.shape}; {ranks.describe(peer)} to another); "
                        "decide the new plan once and give every rank the same one"
                    )
        self.channel.flush()

    def _exchange(self, peer: int, payload: dict[str, Any] | None, what: str = "") -> Any:
        """Send ``payload`` to ``peer``, or (None) receive what ``peer`` sends; on a failure,
        or a report that a rank was lost, tell the other ranks who was lost and raise."""
        try:
            if payload is not None:
                tensors, structure = flatten(payload)
                message = Message(tensors, structure=structure)
                self.channel.send(message, peer, Tag.RELAYOUT, "the moved layers")
                return None
            message = self.channel.recv(peer, Tag.RELAYOUT, what)
        except PeerError as error:
            self._tell_lost(peer)
            raise PeerError(self._lost_text(peer, str(error))) from None
        got = unflatten(message.tensors, message.structure)
        if "lost" in got:
            self._tell_lost(int(got["lost"]))
            raise PeerError(self._lost_text(int(got["lost"]), f"told by {ranks.describe(peer)}"))
        return got

    def _tell_lost(self, lost: int) -> None:
        for peer in range(self.world):
            if peer not in (self.rank, lost):
                try:
                    tensors, structure = flatten({"lost": lost})
                    message = Message(tensors, structure=structure)
                    self.channel.send(message, peer, Tag.RELAYOUT, "which rank was lost")
                except PeerError:
                    pass  # that peer is gone too: it cannot be told
        timeout, self.channel.timeout = self.channel.timeout, min(self.channel.timeout, NOTICE)
        try:
            self.channel.flush()  # the notices leave before this rank raises (and may exit)
        except PeerError:
            pass  # a peer that stopped waiting for this rank is told nothing more
        finally:
            self.channel.timeout = timeout

    def _lost_text(self, lost: int, detail: str) -> str:
        return (
            f"every rank must take part in moving the pipeline to a new plan until it is done "
            f"({self.channel.describe} moving to {self.shape}: {ranks.describe(lost)} was lost "
            f"during the move: {detail}); restart from the last checkpoint, which still loads"
        )


def _pairs(world: int, rank: int) -> list[tuple[int, int]]:
    """The pairs of ranks this rank belongs to, in the one order every rank walks them."""
    return [(a, b) for a in range(world) for b in range(a + 1, world) if rank in (a, b)]


def _payload(
    names: list[str], tensors: dict[str, Tensor], optimizers: Sequence[Optimizer]
) -> dict[str, Any]:
    """The tensors ``names`` and each optimizer's state of them (with where each state tensor
    lives: Adam keeps ``step`` on the CPU)."""
    state: list[dict[str, Any]] = []
    cpu: dict[str, list[str]] = {}
    for optimizer in optimizers:
        own: dict[str, Any] = {}
        for name in names:
            entry = optimizer.state.get(tensors[name]) if name in tensors else None
            if entry:
                own[name] = dict(entry)
                cpu[name] = [
                    k for k, v in entry.items() if isinstance(v, Tensor) and v.device.type == "cpu"
                ]
        state.append(own)
    return {"tensors": {n: tensors[n].detach() for n in names}, "state": state, "cpu": cpu}


def _merge(received: dict[str, Any], got: dict[str, Any]) -> None:
    """Keep a message's tensors as tensors of their own (not views into its frame)."""
    for name, tensor in got["tensors"].items():
        received["tensors"][name] = tensor.clone()
    for mine, theirs in zip(received["state"], got["state"], strict=True):
        for name, entry in theirs.items():
            mine[name] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
    received["cpu"].update(got["cpu"])


def _install(root: nn.Module, received: dict[str, Any], device: torch.device) -> None:
    """The received tensors replace their ``meta`` placeholders everywhere in ``root`` (a
    tensor used under several names stays one object)."""
    named = dict(_every_name(root))
    fresh: dict[int, Tensor] = {}
    for name, value in received["tensors"].items():
        old = named[name]
        if tuple(value.shape) != tuple(old.shape) or value.dtype != old.dtype:
            raise PipelineSetupError(
                f"a moved tensor keeps its shape and dtype (tensor: {name}, received "
                f"{list(value.shape)} {value.dtype}, here {list(old.shape)} {old.dtype}); every "
                "rank must build the same model"
            )
        value = value.to(device)
        fresh[id(old)] = nn.Parameter(value, old.requires_grad) if _is_param(old) else value
    for sub in root.modules():
        for slots in (sub._parameters, sub._buffers):
            for key, tensor in list(slots.items()):
                if tensor is not None and id(tensor) in fresh:
                    slots[key] = fresh[id(tensor)]  # type: ignore[assignment]


def _regroup(
    root: nn.Module,
    optimizers: Sequence[Optimizer],
    group_names: Sequence[Sequence[Sequence[str]]],
    received: dict[str, Any],
) -> None:
    """Each optimizer's groups hold the parameters this rank holds now, in the recorded order;
    the state of those that left is dropped, that of those that came is set."""
    params = {n: p for n, p in root.named_parameters(remove_duplicate=False)}
    for optimizer, state, groups in zip(optimizers, received["state"], group_names, strict=True):
        if len(groups) != len(optimizer.param_groups):
            raise PipelineSetupError(
                f"relayout needs the names of each of an optimizer's parameter groups (groups: "
                f"{len(optimizer.param_groups)}, named: {len(groups)}); record "
                "core.named_state.group_names of every optimizer before cutting it"
            )
        for group, names in zip(optimizer.param_groups, groups, strict=True):
            kept: dict[int, nn.Parameter] = {}
            for name in names:
                found = params.get(name)
                if found is not None and not found.is_meta:
                    kept.setdefault(id(found), found)
            group["params"] = list(kept.values())
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for gone in [p for p in optimizer.state if id(p) not in held]:
            del optimizer.state[gone]
        for name, entry in state.items():
            param = params[name]
            on_cpu = set(received["cpu"].get(name, ()))
            optimizer.state[param] = {
                k: (v.cpu() if k in on_cpu else v.to(param.device)) if isinstance(v, Tensor) else v
                for k, v in entry.items()
            }


def check_plans(plan: Plan, new_plan: Plan, count: int) -> None:
    """Raise unless ``new_plan`` places the same ``count`` layers on the same ranks as ``plan``."""
    if new_plan.num_workers != plan.num_workers:
        raise PipelineSetupError(
            f"a pipeline moves to a plan over the same ranks (workers: {plan.num_workers}, new "
            f"plan's: {new_plan.num_workers}); plan for {plan.num_workers} workers, or save a "
            "checkpoint and resume it in a run with the new number of processes"
        )
    placed = sorted(int(node) for s in new_plan.stages for node in s.nodes)
    if placed != list(range(count)):
        raise PipelineSetupError(
            f"the new plan must place each of the {count} layers on exactly one stage (placed: "
            f"{placed[:12]}{'...' if len(placed) > 12 else ''}); plan over the same layers"
        )


def _every_name(root: nn.Module) -> list[tuple[str, Tensor]]:
    params = root.named_parameters(remove_duplicate=False)
    return [*params, *root.named_buffers(remove_duplicate=False)]


def _first_names(root: nn.Module) -> dict[int, str]:
    """Each tensor's first name (``named_parameters()``'s, as ``group_names`` records)."""
    names: dict[int, str] = {}
    for name, tensor in _every_name(root):
        names.setdefault(id(tensor), name)
    return names


def _is_param(tensor: Tensor) -> bool:
    return isinstance(tensor, nn.Parameter)


def _state_tensors(state: dict[str, Any]) -> list[Tensor]:
    return [v for entry in state.values() for v in entry.values() if isinstance(v, Tensor)]
