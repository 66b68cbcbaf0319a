"""The checks ``Pipeline`` runs on its arguments before it joins anything: each refusal states
the rule, the value given and a call that works (``"<rule> (<name>: <value>); <fix>"``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer

from pl_pipedream.core.arguments import (
    check_chunk_options,
    check_placement,
    check_planning_options,
)
from pl_pipedream.core.divergence import DIVERGENCE_ACTIONS, DivergenceWatch
from pl_pipedream.core.memory_limit import parse_memory
from pl_pipedream.core.preemption import parse_signals
from pl_pipedream.core.replanner import check_replan_options
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.staleness import check_corrections
from pl_pipedream.schedule.modes import SyncMode

CALL = "Pipeline(..., {args})"  # how a fix is written for a Pipeline user
# The options ``check_options`` reads: every front end takes them under these names.
CHECKED = (
    "sync",
    "microbatches",
    "timeout",
    "divergence",
    "divergence_rise",
    "divergence_patience",
    "divergence_window",
    "preempt_signals",
    "replan",
    "replan_every",
    "replan_threshold",
    "balance",
    "plan",
    "memory",
    "chunks_per_rank",
    "weight_prediction",
    "lr_warmup_per_delay",
    "delay_lr_updates",
)
WARN = 'divergence="warn"'

__all__ = [
    "CALL",
    "CHECKED",
    "batch_pair",
    "check_arguments",
    "check_automatic",
    "check_built_optimizer",
    "check_options",
    "choose_plan",
    "pipeline_of",
]


def pipeline_of(layers: Any) -> nn.Sequential:
    """``layers`` as one ``nn.Sequential`` (a list of modules is wrapped, in order)."""
    if isinstance(layers, (list, tuple)) and all(isinstance(m, nn.Module) for m in layers):
        layers = nn.Sequential(*layers)
    if not isinstance(layers, nn.Sequential):
        raise ValueError(
            f"layers must be an nn.Sequential or a list of nn.Module, in the order the batch "
            f"flows through them (layers: {type(layers).__name__}); for example "
            "Pipeline(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), ...)"
        )
    if len(layers) == 0:
        raise ValueError(
            "layers must hold at least one layer (layers: 0 layers); pass the model's layers, "
            "for example Pipeline([nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)], ...)"
        )
    return layers


def check_arguments(loss_fn: Any, optimizer: Any) -> None:
    """Raise for a loss function or an optimizer a pipeline cannot use."""
    if not callable(loss_fn):
        raise ValueError(
            f"loss_fn must be a function of (output, targets) returning the loss tensor "
            f"(loss_fn: {type(loss_fn).__name__}); for example Pipeline(..., "
            "loss_fn=nn.functional.cross_entropy)"
        )
    if not isinstance(optimizer, Optimizer) and not callable(optimizer):
        raise ValueError(
            f"optimizer must be a function that builds an optimizer from the stage's parameters, "
            f"or an optimizer over the layers' parameters, which each rank cuts down to its "
            f"stage's (optimizer: {type(optimizer).__name__}); for example Pipeline(..., "
            "optimizer=lambda params: torch.optim.SGD(params, lr=0.1))"
        )


def check_options(options: Mapping[str, Any], call: str = CALL) -> SyncMode:
    """Raise for a bad plain option of a ``Pipeline`` (``options``: its keyword arguments by
    name, each one given or at its default); every fix is written in ``call``'s spelling, the
    front end's, with the arguments in ``{args}``. Nothing here needs a process group, so a
    front end checks its options when it is made. Returns the sync mode."""
    microbatches, timeout = options["microbatches"], options["timeout"]
    example = lambda args: call.format(args=args)  # noqa: E731
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(
            f"microbatches must be a positive integer (microbatches: {microbatches!r}); for "
            f"example {example('microbatches=4')}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(
            f"timeout must be a positive number of seconds (timeout: {timeout!r}); for example "
            f"{example('timeout=300')}"
        )
    if options["divergence"] not in DIVERGENCE_ACTIONS:
        raise ValueError(
            f"divergence must be one of {', '.join(DIVERGENCE_ACTIONS)} (divergence: "
            f"{options['divergence']!r}); for example {example(WARN)}"
        )
    DivergenceWatch(
        options["divergence_rise"], options["divergence_patience"], options["divergence_window"]
    )
    try:
        mode = SyncMode.parse(options["sync"])
    except ValueError:
        choices = ", ".join(m.value for m in SyncMode)
        flush = example(f"sync='{SyncMode.FLUSH}'")
        raise ValueError(
            f"sync must be one of {choices} (sync: {options['sync']!r}); for example {flush}"
        ) from None
    parse_signals(options["preempt_signals"])
    replan = (options["replan"], options["replan_every"], options["replan_threshold"])
    check_replan_options(*replan, call.split("(")[0])
    given = (options["balance"], options["plan"], options["replan"] == "auto")
    memory = parse_memory(options["memory"])
    check_chunk_options(mode, options["chunks_per_rank"], memory, *given, call)
    corrections = (options["weight_prediction"], options["lr_warmup_per_delay"])
    check_corrections(mode, *corrections, delay_lr_updates=options["delay_lr_updates"])
    return mode


def check_built_optimizer(optimizer: Optimizer, layers: nn.Sequential) -> None:
    """A built optimizer is cut down to each stage's parameters: it must hold the layers'
    parameters only, and no state yet (a step taken before the cut is not the pipeline's)."""
    own = {id(p) for p in layers.parameters()}
    strangers = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if strangers or optimizer.state:
        rule = f"{strangers} parameters not in layers" if strangers else "state from earlier steps"
        raise ValueError(
            f"an optimizer given built must hold only the layers' parameters and no state yet "
            f"(optimizer: {type(optimizer).__name__} with {rule}); build it over "
            "layers.parameters() before any step, or pass a function: "
            "optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
        )


def choose_plan(
    balance: Sequence[int] | None,
    plan: Plan | None,
    num_layers: int,
    world_size: int,
    automatically: Callable[[], Plan] | None = None,
    sync: SyncMode = SyncMode.FLUSH,
    chunks: int | None = None,
) -> Plan:
    """The plan to run: ``plan`` as given, one built from ``balance`` (layers per stage, one
    rank per stage, or placed as ``sync``'s chunks: ``planner.chunks``), or ``automatically()``
    (profiled and planned, when ``example_input`` was given); checked against the layers, the
    process group, ``sync`` and ``chunks`` (the ``chunks_per_rank`` given)."""
    if balance is not None and plan is not None:
        raise ValueError(
            "the pipeline's layout must be given once, as balance= or plan= (both given); "
            "for example Pipeline(..., balance=[2, 1]) (layers per stage, one stage per rank)"
        )
    if balance is None and plan is None:
        if automatically is None:
            raise ValueError(
                "the pipeline's layout must be given as balance= or plan=, or planned from "
                "example_input= (none given); for example Pipeline(..., balance=[2, 1]) (layers "
                "per stage, one stage per rank) or Pipeline(..., example_input=x) with x one "
                "microbatch of the first layer's input"
            )
        plan = automatically()
    if balance is not None:
        counts = list(balance)
        if not all(isinstance(c, int) and c >= 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"balance must give each stage at least one layer and place every layer once "
                f"(layers: {num_layers}, balance: {counts}); give positive counts that sum to "
                f"{num_layers}"
            )
        plan = Plan.from_balance(counts, placement=sync.placement, num_ranks=world_size)
    assert plan is not None
    if not isinstance(plan, Plan):
        raise ValueError(
            f"plan must be a pl_pipedream.Plan (plan: {type(plan).__name__}); build one with "
            "pl_pipedream.plan(...), Plan.from_balance([...]) or Plan.from_json(text)"
        )
    check_placement(plan, sync, "Pipeline(..., sync='{sync}')", chunks)
    if plan.num_workers != world_size:
        raise ValueError(
            f"the plan must have one worker per process of the group (plan's workers: "
            f"{plan.num_workers}, world size: {world_size}); launch {plan.num_workers} "
            f"processes (torchrun --nproc_per_node {plan.num_workers}) or give a plan for "
            f"{world_size}"
        )
    return plan


def check_automatic(
    balance: Any,
    plan: Any,
    example_input: Any,
    topology: Any,
    memory: Any,
    world_size: int,
    replanning: bool = False,
) -> None:
    """``example_input``, ``topology`` and ``memory`` serve automatic planning: beside a
    ``balance`` or ``plan`` they are refused (``core.arguments.check_planning_options``), except
    ``topology`` and ``memory`` when the pipeline re-plans (they bound its plans too); a topology
    must have one worker per process."""
    check_planning_options({"example_input": example_input}, balance, plan, False)
    check_planning_options({"topology": topology, "memory": memory}, balance, plan, replanning)
    explicit = balance is not None or plan is not None
    if not explicit and example_input is None and (topology is not None or memory is not None):
        raise ValueError(
            "automatic planning profiles the layers on one microbatch of the first layer's input "
            "(example_input: None); pass Pipeline(..., example_input=x)"
        )
    if topology is not None and topology.num_workers != world_size:
        raise ValueError(
            f"the topology must have one worker per process of the group (topology workers: "
            f"{topology.num_workers}, world size: {world_size}); launch "
            f"{topology.num_workers} processes or give a topology of {world_size} workers"
        )


def batch_pair(piece: Any) -> tuple[Any, Any]:
    """A batch ``(inputs, targets)`` as its two parts, or the error naming the form."""
    if isinstance(piece, (tuple, list)) and len(piece) == 2:
        return piece[0], piece[1]
    raise ValueError(
        f"a Pipeline batch must be a pair (inputs, targets) (batch: {type(piece).__name__}"
        f"{f' of {len(piece)}' if isinstance(piece, (tuple, list)) else ''}); pass "
        "train_step((inputs, targets)): the first layer takes inputs, loss_fn takes targets"
    )
