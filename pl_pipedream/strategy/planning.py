"""Choosing the plan at setup: given, resumed, from ``balance``, or profiled and planned.

Automatic planning (``core.planning``) needs a sample: the first stage's input for one
microbatch of the first training batch, or the module's ``example_input_array``, so the profile
measures what one minibatch costs. Rank 0 prints the plan and writes it beside the logs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_pipedream.core.arguments import check_placement
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.memory_limit import gather_memory
from pl_pipedream.core.planning import plan_at_setup
from pl_pipedream.core.stage import pipeline_layers
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.batches import first_stage_input, slice_batch
from pl_pipedream.strategy.forward_check import check_forward, forward_is_checked
from pl_pipedream.strategy.lightning_patches import first_training_batch

__all__ = [
    "SetupPlanner",
    "announce",
    "choose_plan",
    "elastic",
    "first_sample",
    "plan_automatically",
    "plan_folder",
    "sample_input",
    "write_plan",
]


def choose_plan(
    given: Plan | None,
    balance: list[int] | None,
    previous: Plan | None,
    resumed: Plan | None,
    num_layers: int,
    world_size: int,
    plan_automatically: Callable[[], Plan],
    sync: SyncMode = SyncMode.FLUSH,
    chunks: int | None = None,
) -> Plan:
    """The plan this setup uses, in order of precedence: the one passed to the strategy, the
    one an earlier setup used (a validate/test/predict after fit keeps the training layout),
    one from ``balance``, the one a resumed checkpoint saved when it has as many workers as
    there are processes, else an automatic one. A checkpoint resumes under any plan
    (``core.resume``): the plan that saved it is only the default. ``chunks``: the
    ``chunks_per_rank`` given, which the plan must have."""
    if given is not None and balance is not None:
        raise PipelineSetupError("pass either balance= or plan= to PipeDreamStrategy, not both")
    if given is not None:
        plan = given
    elif previous is not None:
        plan = previous
    elif balance is not None:
        ids = [str(i) for i in range(num_layers)]
        plan = Plan.from_balance(balance, ids, placement=sync.placement, num_ranks=world_size)
    elif (
        resumed is not None
        and resumed.num_workers == world_size
        and resumed.placement == sync.placement
        and chunks in (None, resumed.chunks_per_rank)
    ):
        plan = resumed
    else:
        plan = plan_automatically()
    check_placement(plan, sync, "PipeDreamStrategy(sync='{sync}')", chunks)
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
    chunks: int | None = None,
) -> tuple[Plan, float]:
    """Rank 0 profiles one microbatch of the first batch (``sample`` when rank 0 already took
    it) and plans; every rank gets the plan. Returns it with the seconds it took; rank 0 prints
    it and writes it beside the logs. ``memory`` is fitted by what ``sync`` keeps; a chunked
    ``sync`` gets ``chunks`` stages per rank (None: 2)."""
    if dist.get_rank() == 0 and sample is None:
        sample = sample_input(trainer, module, microbatches, to_device)
    device = trainer.strategy.root_device
    limit = gather_memory(device, memory)  # core.memory_limit
    layers = pipeline_layers(module)
    plan, seconds = plan_at_setup(
        layers, sample, topology, device, microbatches, limit, recompute, sync, chunks
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
    write_plan(trainer, plan)


def plan_folder(trainer: Any) -> Path:
    """Where ``pipedream_plan.json`` goes: the logger's directory, else the root directory."""
    # trainer.log_dir broadcasts from rank 0: only rank 0 may be here, so ask the logger itself.
    return Path(getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir)


def write_plan(trainer: Any, plan: Plan) -> None:
    """Write ``plan`` to ``pipedream_plan.json`` beside the logs (call on rank 0)."""
    folder = plan_folder(trainer)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pipedream_plan.json").write_text(plan.to_json())


def elastic(resumed: Plan, world_size: int) -> Plan | None:
    """The resumed checkpoint's plan when it has a worker per process; else None, said on
    rank 0: a run restarted on another number of processes plans afresh for its own."""
    if resumed.num_workers == world_size:
        return resumed
    rank_zero_info(
        f"PipeDreamStrategy: the checkpoint's plan ({resumed.shape} on {resumed.num_workers} "
        f"workers) is for another number of processes ({world_size}): planning afresh for "
        f"{world_size}"
    )
    return None


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
    chunks: int | None = None  # chunks_per_rank given: stages per rank of a chunked mode

    def plan(self, trainer: Any, module: Any, layers: nn.Sequential) -> Plan:
        """Rank 0 takes one sample when ``forward`` is to be checked or the plan profiled;
        ``forward`` is checked against ``layers`` on it, then the plan chosen (every rank)."""
        sample = None
        planned = any(s is not None for s in (self.given, self.balance, self.previous))
        if not planned and self.resumed is not None:
            self.resumed = elastic(self.resumed, self.world_size)
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
                self.chunks,
            )
            return plan

        sources = (self.given, self.balance, self.previous, self.resumed)
        world = self.world_size
        return choose_plan(*sources, len(layers), world, automatically, self.sync, self.chunks)
