"""Planning at setup: rank 0 profiles the layers, plans for the topology, every rank follows.

The sample is the first stage's input for one microbatch of the first training batch (or the
module's ``example_input_array``), so the profile measures what one minibatch costs. Without a
topology, the link between ranks 0 and 1 is measured with a few round trips and the cluster is
taken as one level of that bandwidth. Rank 0 sends the plan (or its error) to the others, so a
failure on rank 0 stops every rank with the same message instead of a hang.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.measure import profile_layers

__all__ = ["measure_bandwidth", "plan_at_setup"]

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
    num_microbatches: int = 1,
) -> tuple[Plan, float]:
    """Profile on rank 0, plan, and broadcast; returns the plan and the seconds it took.

    Replicas of a stage share each batch's microbatches round robin, so every replica count
    must divide ``num_microbatches``; when the best plan breaks that, a straight pipeline is
    planned instead and the plan says why (``meta["note"]``).
    """
    start = time.perf_counter()
    if topology is not None and topology.num_workers != dist.get_world_size():
        raise ValueError(
            f"the topology must have one worker per process (topology workers: "
            f"{topology.num_workers}, devices: {dist.get_world_size()}); use "
            f"Trainer(devices={topology.num_workers}) or a topology of {dist.get_world_size()} "
            "workers"
        )
    if topology is None:
        topology = Topology.flat(dist.get_world_size(), measure_bandwidth(device))
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            profile = profile_layers(layers, sample, device=device)
            planned = make_plan(profile, topology)
            if any(num_microbatches % stage.replicas for stage in planned.stages):
                best = planned.shape
                planned = make_plan(profile, topology, straight=True)
                planned.meta["note"] = (
                    f"the best plan ({best}) replicates stages, but replicas must divide the "
                    f"microbatches per batch ({num_microbatches}); planned a straight pipeline. "
                    "Use PipeDreamStrategy(microbatches=...) with a multiple of the replica counts "
                    "to allow replication."
                )
            box[0] = _by_layer_index(planned).to_dict()
        except Exception as error:  # noqa: BLE001 - every rank must learn of it
            box[0] = {"error": f"{type(error).__name__}: {error}"}
    dist.broadcast_object_list(box, src=0)
    result = box[0]
    if "error" in result:
        raise RuntimeError(f"automatic planning failed on rank 0: {result['error']}")
    return Plan.from_dict(result), time.perf_counter() - start


def _by_layer_index(plan: Plan) -> Plan:
    """Profile nodes ``layer{k}`` become the pipeline indices ``"k"`` the strategy uses."""
    stages = tuple(
        replace(stage, nodes=tuple(node.removeprefix("layer") for node in stage.nodes))
        for stage in plan.stages
    )
    return replace(plan, stages=stages)
