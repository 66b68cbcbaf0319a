"""Choosing the plan at setup: given, resumed, from ``balance``, or profiled and planned.

Automatic planning: rank 0 profiles the layers, plans for the topology, every rank follows.

The sample is the first stage's input for one microbatch of the first training batch (or the
module's ``example_input_array``), so the profile measures what one minibatch costs. Without a
topology, the link between ranks 0 and 1 is measured with a few round trips and the cluster is
taken as one level of that bandwidth. Rank 0 sends the plan (or its error) to the others, so a
failure on rank 0 stops every rank with the same message instead of a hang. A model built empty
(``core.materialize``) is profiled one layer at a time, each created, timed and freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.materialize import loaded, model_tensors
from pl_pipedream.core.stage import find_ties, pipeline_layers
from pl_pipedream.planner.advice import advise
from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import with_tied_traffic
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.profile.measure import profile_layers, profile_layers_one_at_a_time
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.batches import first_stage_input, slice_batch
from pl_pipedream.strategy.forward_check import check_forward, forward_is_checked
from pl_pipedream.strategy.lightning_patches import first_training_batch
from pl_pipedream.strategy.memory_report import gather_memory, plan_within

__all__ = [
    "SetupPlanner",
    "announce",
    "choose_plan",
    "first_sample",
    "measure_bandwidth",
    "plan_at_setup",
    "plan_automatically",
    "plan_profile",
    "sample_input",
]


def choose_plan(
    given: Plan | None,
    balance: list[int] | None,
    previous: Plan | None,
    resumed: Plan | None,
    num_layers: int,
    world_size: int,
    plan_automatically: Callable[[], Plan],
) -> Plan:
    """The plan this setup uses, in order of precedence: the one passed to the strategy, the
    one an earlier setup used (a validate/test/predict after fit keeps the training layout),
    one from ``balance``, the one a resumed checkpoint saved when it has as many workers as
    there are processes, else an automatic one. A checkpoint resumes under any plan
    (``core.resume``): the plan that saved it is only the default."""
    if given is not None and balance is not None:
        raise PipelineSetupError("pass either balance= or plan= to PipeDreamStrategy, not both")
    if given is not None:
        plan = given
    elif previous is not None:
        plan = previous
    elif balance is not None:
        plan = Plan.from_balance(balance, [str(i) for i in range(num_layers)])
    elif resumed is not None and resumed.num_workers == world_size:
        plan = resumed
    else:
        plan = plan_automatically()
    if plan.num_workers != world_size:
        saved = (
            f", the checkpoint's plan: {resumed.shape} on {resumed.num_workers} workers"
            if resumed is not None
            else ""
        )
        resume = (
            "; a checkpoint resumes under any plan: leave out balance= and plan= to plan "
            f"for {world_size} automatically"
            if resumed is not None
            else ""
        )
        raise PipelineSetupError(
            f"the plan needs one process per worker (plan workers: {plan.num_workers}, "
            f"devices: {world_size}{saved}); use Trainer(devices={plan.num_workers}) or a "
            f"plan for {world_size} workers{resume}"
        )
    return plan


def plan_automatically(
    trainer: Any,
    module: Any,
    topology: Topology | None,
    microbatches: int,
    to_device: Callable[[Any], Any],
    sample: Any = None,
    memory: float | None = None,
    recompute: bool = False,
    sync: SyncMode = SyncMode.ASYNC,
) -> tuple[Plan, float]:
    """Rank 0 profiles one microbatch of the first batch (``sample`` when rank 0 already took
    it) and plans; every rank gets the plan. Returns it with the seconds it took; rank 0 prints
    it and writes it beside the logs. ``memory`` is fitted by what ``sync`` keeps."""
    if dist.get_rank() == 0 and sample is None:
        sample = sample_input(trainer, module, microbatches, to_device)
    device = trainer.strategy.root_device
    limit = gather_memory(device, memory)  # strategy.memory_report
    layers = pipeline_layers(module)
    plan, seconds = plan_at_setup(
        layers, sample, topology, device, microbatches, limit, recompute, sync
    )
    announce(trainer, plan, seconds)
    return plan, seconds


def sample_input(
    trainer: Any, module: Any, microbatches: int, to_device: Callable[[Any], Any]
) -> Any:
    """One microbatch of the first stage's input: from the first training batch, else from
    ``example_input_array``."""
    batch = first_training_batch(trainer)
    if batch is not None:
        return first_stage_input(module, slice_batch(to_device(batch), microbatches)[0])
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise PipelineSetupError(
            "planning at setup needs a sample input: fit with a training dataloader, set "
            "example_input_array on the LightningModule, or pass balance= or plan="
        )
    return to_device(_one_argument(example))


def _one_argument(example: Any) -> Any:
    """The first layer's one argument from ``example_input_array``, read as Lightning reads it
    (``model(*example)`` for a tuple, ``model(**example)`` for a dict, else ``model(example)``)."""
    if isinstance(example, tuple) and len(example) == 1:
        return example[0]
    if isinstance(example, (tuple, dict)):
        given = f"a tuple of {len(example)}" if isinstance(example, tuple) else "a dict"
        raise PipelineSetupError(
            f"the first layer of a pipeline takes one argument, but example_input_array gives "
            f"forward several (example_input_array: {given}); set it to the one value the first "
            "layer takes, wrapped in a 1-tuple if that value is itself a tuple: ((a, b),)"
        )
    return example


def first_sample(
    trainer: Any, module: Any, microbatches: int, to_device: Callable[[Any], Any]
) -> Any | None:
    """``sample_input``, or None when there is none; the global RNG is left as it was (a
    shuffling loader's first ``iter`` draws from it), so taking the sample changes nothing."""
    with torch.random.fork_rng(devices=[]):
        try:
            return sample_input(trainer, module, microbatches, to_device)
        except PipelineSetupError:
            return None


def announce(trainer: Any, plan: Plan, seconds: float) -> None:
    """Print the plan and write it beside the logs (rank 0 only)."""
    if dist.get_rank() != 0:
        return
    note = f"\n{plan.meta['note']}" if plan.meta.get("note") else ""
    rank_zero_info(f"PipeDream plan ({seconds:.1f} s to profile and plan):\n{plan.render()}{note}")
    # trainer.log_dir broadcasts from rank 0: only rank 0 is here, so ask the logger itself.
    folder = Path(getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pipedream_plan.json").write_text(plan.to_json())


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
) -> tuple[Plan, float]:
    """Profile on rank 0, plan, and broadcast; returns the plan and the seconds it took.

    The plan is ``plan_profile``'s: every replica count divides ``microbatches``. A model built
    empty is profiled one layer at a time and planned straight: a replica would hold its stage
    whole again. ``memory`` (bytes per worker) rules out plans whose stages do not fit what
    ``sync`` keeps (``schedule.memory``; with ``recompute`` stages keep inputs instead of
    activations).
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
            empty = any(t.is_meta for t in model_tensors(layers))
            profile = _profile(layers, sample, device, empty)
            planned = plan_profile(profile, topology, microbatches, memory, sync, recompute, empty)
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
) -> Plan:
    """The fastest plan whose replica counts divide ``microbatches`` (``planner.admission``:
    replicas share a batch's microbatches round robin), fitting ``memory`` by what ``sync``
    keeps; straight for a model built empty. A plan predicted slower than data parallelism says
    what it would need (``plan.meta["advice"]``, printed with the plan)."""
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


@dataclass
class SetupPlanner:
    """What a strategy knows at setup about where the plan comes from (``choose_plan``'s
    sources in order), and what automatic planning needs."""

    given: Plan | None
    balance: list[int] | None
    previous: Plan | None
    resumed: Plan | None
    topology: Topology | None
    microbatches: int
    world_size: int
    to_device: Callable[[Any], Any]
    memory: float | None = None  # bytes per rank on CPU (strategy.memory_report)
    recompute: bool = False  # stages keep inputs only: the memory the plan must fit
    seconds: float = 0.0  # spent profiling and planning, when planned automatically
    sync: SyncMode = SyncMode.ASYNC  # what each stage keeps: the memory the plan must fit

    def plan(self, trainer: Any, module: Any, layers: nn.Sequential) -> Plan:
        """Rank 0 takes one sample when ``forward`` is to be checked or the plan profiled;
        ``forward`` is checked against ``layers`` on it, then the plan chosen (every rank)."""
        sample = None
        planned = any(s is not None for s in (self.given, self.balance, self.previous))
        if dist.get_rank() == 0 and (
            forward_is_checked(module, layers) or not (planned or self.resumed is not None)
        ):
            sample = first_sample(trainer, module, self.microbatches, self.to_device)
        check_forward(module, layers, sample)

        def automatically() -> Plan:
            plan, self.seconds = plan_automatically(
                trainer,
                module,
                self.topology,
                self.microbatches,
                self.to_device,
                sample,
                self.memory,
                self.recompute,
                self.sync,
            )
            return plan

        sources = (self.given, self.balance, self.previous, self.resumed)
        return choose_plan(*sources, len(layers), self.world_size, automatically)
