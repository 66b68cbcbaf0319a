"""Automatic planning on a process group, for any front end: profile on rank 0, plan, share.

Rank 0 profiles the layers on one sample (one microbatch of the first stage's input), plans
for the topology and sends the plan, or its error, to every rank, so that a failure on rank 0
stops every rank with the same message instead of a hang. Without a topology, the link between
ranks 0 and 1 is measured with a few round trips and the cluster is taken as one level of that
bandwidth. A model built empty (``core.materialize``) is profiled one layer at a time, each
created, timed and freed, and planned straight. A memory limit is fitted by what the sync mode
keeps (``core.memory_limit``). A chunked sync mode (several stages per rank) gets a plan of
``chunks_per_rank`` stages per rank placed as it needs (``planner.chunk_plan``), checked against
the memory limit rather than fitted to it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.core.materialize import loaded, model_tensors
from pl_pipedream.core.memory_limit import check_ranks_fit, plan_within
from pl_pipedream.core.stage import find_ties
from pl_pipedream.planner.advice import advise
from pl_pipedream.planner.chunk_plan import plan_chunks
from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import with_tied_traffic
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.profile.measure import profile_layers, profile_layers_one_at_a_time
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["measure_bandwidth", "plan_at_setup", "plan_profile"]

PROBE_BYTES = 4 * 1024 * 1024


def measure_bandwidth(device: torch.device, repeats: int = 4) -> float:
    """Bytes/s between ranks 0 and 1 from timed round trips (every rank must call it)."""
    world = dist.get_world_size()
    result = torch.zeros(1, dtype=torch.float64, device=device)
    if world > 1 and dist.get_rank() < 2:
        payload = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32, device=device)
        peer = 1 - dist.get_rank()
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            if dist.get_rank() == 0:
                dist.send(payload, peer)
                dist.recv(payload, peer)
            else:
                dist.recv(payload, peer)
                dist.send(payload, peer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        best = min(times[1:])
        result[0] = 2 * PROBE_BYTES / best
    dist.broadcast(result, src=0)
    return float(result[0]) if result[0] > 0 else 1e10


def plan_at_setup(
    layers: nn.Sequential,
    sample: Any,
    topology: Topology | None,
    device: torch.device,
    microbatches: int = 1,
    memory: float | None = None,
    recompute: bool = False,
    sync: SyncMode = SyncMode.ASYNC,
    chunks_per_rank: int | None = None,
) -> tuple[Plan, float]:
    """Profile on rank 0, plan, and broadcast; returns the plan and the seconds it took.

    The plan is ``plan_profile``'s: every replica count divides ``microbatches``. A model built
    empty is profiled one layer at a time and planned straight: a replica would hold its stage
    whole again. ``memory`` (bytes per worker) rules out plans whose stages do not fit what
    ``sync`` keeps (``schedule.memory``; with ``recompute`` stages keep inputs instead of
    activations). A chunked ``sync`` gets ``chunks_per_rank`` stages per rank (default 2).
    """
    start = time.perf_counter()
    if topology is not None and topology.num_workers != dist.get_world_size():
        raise ValueError(
            f"the topology must have one worker per process (topology workers: "
            f"{topology.num_workers}, processes: {dist.get_world_size()}); start "
            f"{topology.num_workers} processes (Trainer(devices={topology.num_workers}), torchrun "
            f"--nproc_per_node {topology.num_workers}) or give a topology of "
            f"{dist.get_world_size()} workers"
        )
    if topology is None:
        topology = Topology.flat(dist.get_world_size(), measure_bandwidth(device))
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            empty = any(t.is_meta for t in model_tensors(layers))
            profile = _profile(layers, sample, device, empty)
            sizes = (microbatches, memory, sync, recompute, empty, chunks_per_rank)
            planned = plan_profile(profile, topology, *sizes)
            planned = _count_ties(_by_layer_index(planned), layers, topology)
            advice = planned.meta.get("advice") or advise(planned, None, microbatches)
            if advice:  # the tied parameters' traffic can make a plan slower than DP
                planned.meta["advice"] = advice
            box[0] = planned.to_dict()
        except Exception as error:  # noqa: BLE001 - every rank must learn of it
            box[0] = {"error": f"{type(error).__name__}: {error}"}
    dist.broadcast_object_list(box, src=0)
    result = box[0]
    if "error" in result:
        raise RuntimeError(f"automatic planning failed on rank 0: {result['error']}")
    return Plan.from_dict(result), time.perf_counter() - start


def plan_profile(
    profile: Profile,
    topology: Topology,
    microbatches: int,
    memory: float | None = None,
    sync: SyncMode = SyncMode.ASYNC,
    recompute: bool = False,
    empty: bool = False,
    chunks_per_rank: int | None = None,
) -> Plan:
    """The fastest plan whose replica counts divide ``microbatches`` (``planner.admission``:
    replicas share a batch's microbatches round robin), fitting ``memory`` by what ``sync``
    keeps; straight for a model built empty. A plan predicted slower than data parallelism says
    what it would need (``plan.meta["advice"]``, printed with the plan). A chunked ``sync``
    gets ``chunks_per_rank`` (default 2) stages per rank, its slowest stage as short as the cut
    allows (``planner.chunk_plan``), and ``memory`` only checks it (``check_ranks_fit``)."""
    if sync.chunked:
        chunks = sync.chunks_per_rank(chunks_per_rank)
        chunked = plan_chunks(profile, topology, sync.placement, chunks)
        if memory is not None:
            check_ranks_fit(chunked, memory, sync, microbatches, recompute)
        return chunked
    total = sum(n.parameter_bytes + n.output_bytes for n in profile.nodes)
    make = lambda m: make_plan(profile, topology, empty, m, microbatches=microbatches)  # noqa: E731
    planned = plan_within(make, memory, total, sync, microbatches, recompute)
    if empty:
        planned.meta["note"] = (
            "the model was built empty (core.materialize): planned a straight pipeline, since "
            "each replica of a stage holds a whole copy of that stage"
        )
        if planned.meta.get("advice"):
            because = "the model was built empty"
            planned.meta["advice"] = advise(planned, None, microbatches, because) or ""
    return planned


def _profile(layers: nn.Sequential, sample: Any, device: torch.device, empty: bool) -> Profile:
    """Every layer's costs; a model built empty (``core.materialize``) is never whole on
    rank 0 either: each layer is created, timed and freed in turn."""
    if empty:
        load = lambda layer: loaded(layer, device)  # noqa: E731
        return profile_layers_one_at_a_time(layers, sample, load, device=device)
    return profile_layers(layers, sample, device=device)


def _count_ties(plan: Plan, layers: nn.Sequential, topology: Topology) -> Plan:
    """The plan with the gradient all-reduce of each tied parameter counted
    (``planner.ties``, at the outermost level's bandwidth)."""
    return with_tied_traffic(plan, find_ties(layers, layers, plan), topology.levels[-1].bandwidth)


def _by_layer_index(plan: Plan) -> Plan:
    """Profile nodes ``layer{k}`` become the pipeline indices ``"k"`` the strategy uses."""
    stages = tuple(
        replace(stage, nodes=tuple(node.removeprefix("layer") for node in stage.nodes))
        for stage in plan.stages
    )
    return replace(plan, stages=stages)
