"""When a running pipeline re-plans: the check every ``every`` steps, collective and the same on
every rank, from the stage times the executor's timeline measured.

At a check each rank turns its timeline since the last check into per-layer milliseconds
(``core.stage_clock.rank_times``: the stage's mean forward and backward per minibatch, split
among its layers by their own forward times, timed by a ``LayerClock`` on the layers it holds),
every rank's times are gathered to every rank (one ``all_gather_object``), rank 0 builds the
cost model (``planner.measured``) and decides (``planner.replan.decide``), and broadcasts the
``Decision``, so every rank acts on the same one (an error on rank 0 reaches every rank).

The measured times are compared with ``profile`` when one is given (its node ids the plan's).
Without one (a ``balance=`` or ``plan=`` given, or a profile taken by another clock), the first
check is the reference: its measured times become the profile, with each layer's parameter bytes
(from its shapes, ``meta`` too) and output bytes (its first output after ``watch``), and every
rank taken as speed 1 then; later checks read a rank or a layer slower than that reference.
A rank slow from the start then reads as costly layers. So while some rank holds only layers it
held when the reference was taken, the check also weighs the reading that takes a rank's
difference from the others as the rank's (``planner.measured.rank_reading``, every layer
profiled alike): a move must pay under both. Where the two readings give such a rank speeds
more than ``AGREE`` apart, its speed is not known, and a move that gives it work it does not do
now waits for the next check to find it again (``planner.replan.confirm``). The first check can
already move, when the plan given is slower than the measured costs call for under both
readings.

The first step, and the first step after a move, are not measured (first calls, new process
groups and message sizes cost more): at the step ``starts`` names, the front end drops the
timeline so far and calls ``reset``; the next check is due at a multiple of ``every`` after it.

``mode="off"`` costs nothing: ``due`` is False and the timeline is not recorded (the front end
passes ``on`` as ``record_timeline``). Each move is one JSON line in ``history``
(``pipedream_plan_history.jsonl``, beside ``pipedream_plan.json``): step, old and new plan,
measured per-rank stage milliseconds, the speeds, predicted times, and the seconds the move took
(``moved``). A better plan that does not fit memory comes back in ``Decision.warnings``. A move
of a small gain waits for the next check to find the same plan (``planner.replan.confirm``).
Every check leaves one line in ``report`` (what it measured and decided, ``kept`` included),
which the front end logs on rank 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from pl_pipedream.core.memory_limit import MemoryFit, gather_memory
from pl_pipedream.core.planning import measure_bandwidth
from pl_pipedream.core.replan_record import check_report, history_line
from pl_pipedream.core.stage import find_ties
from pl_pipedream.core.stage_clock import LayerClock, rank_times
from pl_pipedream.planner.measured import RankTimes, measured_model, rank_reading
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import Decision, confirm, decide, new_work
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Node, Profile
from pl_pipedream.runtime.timeline import TimelineEvent
from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "HISTORY_NAME",
    "REPLAN_MODES",
    "Replanner",
    "check_replan_options",
    "create_replanner",
    "same_layout",
    "tied_straight",
]

REPLAN_MODES = ("off", "auto")
HISTORY_NAME = "pipedream_plan_history.jsonl"
DEFAULT_HORIZON = 1000  # minibatches over which a move must pay for itself
AGREE = 0.25  # two readings of a rank's speed within 25% of each other agree


def check_replan_options(mode: Any, every: Any, threshold: Any, call: str = "Pipeline") -> None:
    """Raise ``ValueError`` for a bad ``replan``, ``replan_every`` or ``replan_threshold``."""
    if mode not in REPLAN_MODES:
        raise ValueError(
            f"replan must be one of {', '.join(REPLAN_MODES)} (replan: {mode!r}); for example "
            f'{call}(..., replan="auto")'
        )
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(
            f"replan_every must be a positive number of steps (replan_every: {every!r}); for "
            f"example {call}(..., replan_every=50)"
        )
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(
            f"replan_threshold must be a fraction >= 0 (replan_threshold: {threshold!r}); for "
            f"example {call}(..., replan_threshold=0.05): move when 5% faster"
        )


def same_layout(a: Plan, b: Plan) -> bool:
    """Whether two plans put the same layers on the same ranks."""
    return [(s.nodes, s.ranks) for s in a.stages] == [(s.nodes, s.ranks) for s in b.stages]


class Replanner:
    """The re-plan check of one rank; every rank makes one with the same arguments.

    ``topology``: the cluster (None: one level at the bandwidth between ranks 0 and 1, measured
    at the first check); ``memory``: bytes per worker a plan must fit by what ``sync`` keeps
    with ``recompute`` (``core.memory_limit.MemoryFit``, setup's rule; None: no limit);
    ``profile``: the layer costs the speeds are read against (None: the first check's);
    ``history``: the JSON-lines file of moves (None: kept in ``records`` only); ``horizon``:
    minibatches over which a move must pay (default 1000); ``plan_options``: ``decide``'s
    (``microbatches``, ``straight``, ``cuts``, ``move_bandwidth``, ``state_factor``)."""

    def __init__(
        self,
        mode: str = "off",
        every: int = 50,
        threshold: float = 0.05,
        *,
        topology: Topology | None,
        memory: float | None,
        profile: Profile | None,
        history: Path | None,
        horizon: int | None = None,
        sync: SyncMode = SyncMode.FLUSH,
        recompute: bool = False,
        **plan_options: Any,
    ) -> None:
        check_replan_options(mode, every, threshold, "Replanner")
        self.mode, self.every, self.threshold = mode, every, float(threshold)
        self.on = mode == "auto"  # checks run, so the timeline must be recorded
        self.topology, self.memory, self.profile = topology, memory, profile
        microbatches = plan_options.get("microbatches") or 1
        self.fit = MemoryFit(memory, sync, microbatches, recompute) if memory is not None else None
        self.history = Path(history) if history is not None else None
        self.horizon = horizon or DEFAULT_HORIZON
        self.plan_options = plan_options
        self.records: list[dict[str, Any]] = []  # one per move, as written to ``history``
        self._pending: dict[str, Any] | None = None  # the last move's line, until ``moved``
        self._clock: LayerClock | None = None
        self._sizes: dict[str, tuple[float, float]] = {}  # layer: (parameter, output) bytes
        self._handles: list[RemovableHandle] = []
        self._from = 1  # measured: the steps after this one
        self._proposed: Plan | None = None  # rank 0: a smaller gain's plan, held for a check
        self._reference: Plan | None = None  # rank 0: the plan the measured reference ran
        self.report = ""  # the last check: what it measured and decided (one line)

    def due(self, step: int) -> bool:
        """Whether ``step`` (batches trained) is a check: every ``every`` steps once some are
        measured, when on."""
        return self.mode == "auto" and step > self._from and step % self.every == 0

    def starts(self, step: int) -> bool:
        """Whether measuring starts after ``step``: the front end then drops the timeline so
        far and calls ``reset`` (the first step, and the first one after a move)."""
        return self.mode == "auto" and step == self._from

    def reset(self) -> None:
        """Forget the layer times so far."""
        if self._clock is not None:
            self._clock.reset()

    def watch(self, layers: Mapping[str, nn.Module]) -> None:
        """Time the forwards of this rank's layers (named as the plan's nodes) from now on, and
        note each one's parameter and output bytes; call again after each move."""
        self.unwatch()
        if not self.on:
            return
        self._clock = LayerClock(layers)
        for name, layer in layers.items():
            parameters = sum(p.numel() * p.element_size() for p in layer.parameters())
            self._sizes[name] = (float(parameters), self._sizes.get(name, (0.0, 0.0))[1])
            self._handles.append(layer.register_forward_hook(self._output_bytes(name)))

    def unwatch(self) -> None:
        if self._clock is not None:
            self._clock.remove()
            self._clock = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _output_bytes(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object, output: object) -> None:
            tensors = output if isinstance(output, (tuple, list)) else [output]
            size = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            self._sizes[name] = (self._sizes[name][0], float(size))

        return hook

    def check(
        self, step: int, plan: Plan, timeline: Sequence[TimelineEvent], rank: int
    ) -> Decision | None:
        """Every rank at the same step when ``due``: the decision, the same on every rank
        (None when not due). ``timeline``: this rank's actions since the last check."""
        if not self.due(step):
            return None
        nodes = list(plan.stage_of_rank(rank).nodes)
        shares = self._clock.shares() if self._clock is not None else None
        forwards = sum(1 for e in timeline if e.rank == rank and e.kind == "FORWARD")
        reference = self.profile or _unit_profile(plan)
        mine = rank_times(timeline, nodes, reference, rank, max(forwards, 1), shares)
        if self._clock is not None:
            self._clock.reset()
        sizes = {n: self._sizes.get(n, (0.0, 0.0)) for n in nodes}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, sizes))
        topology = self.topology or _measured_topology(plan)
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = self._decide(step, plan, gathered, topology)
            except Exception as error:  # noqa: BLE001 - every rank must learn of it
                box[0] = f"{type(error).__name__}: {error}"
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise RuntimeError(f"the re-plan check of step {step} failed on rank 0: {box[0]}")
        decision, line, profile, self.report = box[0]
        self.topology, self.profile = topology, profile
        self._flush()
        if decision.move:
            self._pending = line
        return decision

    def _decide(
        self, step: int, plan: Plan, gathered: Sequence[Any], topology: Topology
    ) -> tuple[Decision, dict[str, Any], Profile, str]:
        """Rank 0: the model from every rank's times, the decision, its history line and the
        check's report."""
        times = [t for t, _ in gathered]
        if self.profile is None:
            self._reference = plan
        profile = self.profile or _reference(plan, times, [s for _, s in gathered])
        model = measured_model(profile, times, plan.num_workers)
        by_rank = rank_reading(profile, times, plan.num_workers)
        unseen = _unseen(self._reference, plan)
        unknown = tuple(r for r in unseen if abs(by_rank.speeds[r] / model.speeds[r] - 1) > AGREE)
        others = (by_rank,) if unseen else ()
        options = {k: v for k, v in self.plan_options.items() if v is not None}
        decision = decide(
            plan,
            model,
            topology,
            self.fit,
            threshold=self.threshold,
            horizon=self.horizon,
            readings=others,
            **options,
        )
        if decision.move and same_layout(decision.plan, plan):
            decision = Decision(
                False, plan, decision.current_time, decision.current_time, 0.0, decision.warnings
            )
        at_once = not new_work(plan, decision.plan, unknown)
        decision, self._proposed = confirm(plan, decision, self._proposed, self.threshold, at_once)
        line = history_line(step, plan, times, model, decision)
        report = check_report(step, times, model, unknown, decision, self._proposed)
        return decision, line, profile, report

    def moved(self, step: int, seconds: float) -> None:
        """The move after ``step`` took ``seconds``: its history line is completed and written,
        and the step after it is not measured."""
        self._from = step + 1
        if self._pending is not None:
            self._pending["seconds"] = float(seconds)
        self._flush()

    def close(self) -> None:
        """Write a pending line and remove the hooks."""
        self._flush()
        self.unwatch()

    def _flush(self) -> None:
        line, self._pending = self._pending, None
        if line is None:
            return
        self.records.append(line)
        if self.history is not None and dist.get_rank() == 0:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            with self.history.open("a") as file:
                file.write(json.dumps(line) + "\n")


def _unseen(reference: Plan | None, plan: Plan) -> tuple[int, ...]:
    """The ranks whose speed the measurements cannot yet tell from their layers' costs: with a
    measured reference, those that hold only layers they held when it was taken."""
    if reference is None:
        return ()
    return tuple(
        r
        for r in range(plan.num_workers)
        if set(plan.stage_of_rank(r).nodes) <= set(reference.stage_of_rank(r).nodes)
    )


def _unit_profile(plan: Plan) -> Profile:
    """Every layer at 1 ms forward and backward: ``rank_times`` then splits a stage's time by
    the ``LayerClock``'s shares (backward as forward), or equally without them."""
    nodes = [n for s in plan.stages for n in s.nodes]
    return Profile(tuple(Node(n, n, 1.0, 1.0, (0.0,), 0.0) for n in nodes))


def _reference(
    plan: Plan, times: Sequence[RankTimes], sizes: Sequence[Mapping[str, tuple[float, float]]]
) -> Profile:
    """A chain profile of the plan's layers at their measured costs (mean over a replicated
    stage's ranks) and noted sizes: the first check's times taken as speed 1."""
    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    for t in times:
        for n in t.forward_ms:
            forward.setdefault(n, []).append(t.forward_ms[n])
            backward.setdefault(n, []).append(t.backward_ms.get(n, 0.0))
    size = {n: s for mine in sizes for n, s in mine.items()}
    ids = [n for s in plan.stages for n in s.nodes]
    nodes = tuple(
        Node(
            n,
            f"layer {n}",
            math.fsum(forward.get(n, [0.0])) / len(forward.get(n, [0.0])),
            math.fsum(backward.get(n, [0.0])) / len(backward.get(n, [0.0])),
            (size.get(n, (0.0, 0.0))[1],),
            size.get(n, (0.0, 0.0))[0],
        )
        for n in ids
    )
    return Profile(nodes, tuple(zip(ids, ids[1:], strict=False)))


def _measured_topology(plan: Plan) -> Topology:
    """One level at the bandwidth measured between ranks 0 and 1 (every rank calls it)."""
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device("cuda")
    return Topology.flat(plan.num_workers, measure_bandwidth(device))


def create_replanner(
    mode: str,
    every: int,
    threshold: float,
    *,
    history: Path | None,
    topology: Topology | None,
    memory: float | None,
    device: torch.device,
    microbatches: int,
    sync: SyncMode,
    recompute: bool,
    straight: bool,
) -> Replanner:
    """The rank's ``Replanner``, as every front end makes it (every rank at the same point):
    with ``"auto"`` the memory limit gathered (``memory``, else a GPU's free memory: the
    smallest over the ranks) and, without a topology, the link between ranks 0 and 1 measured,
    so that no check pays for either. ``straight``: only plans without replicas can train
    (``tied_straight``)."""
    limit = None
    if mode == "auto":
        limit = gather_memory(device, memory)
        if topology is None:
            topology = Topology.flat(dist.get_world_size(), measure_bandwidth(device))
    return Replanner(
        mode,
        every,
        threshold,
        topology=topology,
        memory=limit,
        profile=None,  # the first check's times are the reference
        history=history,
        sync=sync,
        recompute=recompute,
        microbatches=microbatches,
        straight=straight,
    )


def tied_straight(sync: SyncMode, module: nn.Module, layers: nn.Sequential) -> bool:
    """Whether only straight plans can train ``layers``: tied parameters (layers sharing one,
    wherever they are cut) in the per-minibatch modes (``runtime.ties.check_ties``)."""
    if not sync.updates_per_minibatch:
        return False
    return bool(find_ties(module, layers, Plan.from_balance([1] * len(layers))))
