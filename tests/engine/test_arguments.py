"""``Pipeline``'s argument checks: each bad value refused as "<rule> (<name>: <value>); <fix>"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.engine.arguments import (
    check_arguments,
    check_automatic,
    check_built_optimizer,
    check_options,
    choose_plan,
    pipeline_of,
)
from pl_pipedream.engine.options import option_defaults
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.schedule.modes import SyncMode


def sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1)


def test_a_list_of_layers_becomes_one_sequential() -> None:
    first, second = nn.Linear(2, 2), nn.ReLU()
    layers = pipeline_of([first, second])
    assert isinstance(layers, nn.Sequential) and layers[0] is first and layers[1] is second
    given = nn.Sequential(first)
    assert pipeline_of(given) is given


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (
            nn.Linear(2, 2),
            r"^layers must be an nn.Sequential or a list of nn.Module, .*\(layers: "
            r"Linear\); for example Pipeline\(nn.Sequential\(",
        ),
        ([], r"^layers must hold at least one layer \(layers: 0 layers\); pass"),
    ],
)
def test_bad_layers(layers: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipeline_of(layers)


def options(**given: object) -> dict[str, object]:
    """Every option of a Pipeline at its default, but ``given``."""
    return {**option_defaults(), **given}


def test_good_options_give_the_mode() -> None:
    check_arguments(nn.functional.mse_loss, sgd)
    assert check_options(options(sync="async", microbatches=2, divergence="off")) is SyncMode.ASYNC


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            (None, sgd),
            r"^loss_fn must be a function of \(output, targets\) "
            r"returning the loss tensor \(loss_fn: NoneType\); for example",
        ),
        (
            (nn.functional.mse_loss, "sgd"),
            r"^optimizer must be a function that builds an optimizer from the "
            r"stage's parameters, .*\(optimizer: str\); for example Pipeline\(\.\.\., "
            r"optimizer=lambda params: torch.optim.SGD\(params, lr=0.1\)\)",
        ),
    ],
)
def test_bad_arguments(arguments: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_arguments(*arguments)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"divergence": "loud"},
            r"^divergence must be one of error, strict, warn, off \(divergence: 'loud'\); for "
            r'example Pipeline\(\.\.\., divergence="warn"\)',
        ),
        (
            {"microbatches": 0},
            r"^microbatches must be a positive integer \(microbatches: 0\); for example",
        ),
        (
            {"microbatches": True},
            r"^microbatches must be a positive integer \(microbatches: True\)",
        ),
        (
            {"timeout": 0},
            r"^timeout must be a positive number of seconds \(timeout: 0\); for example",
        ),
        (
            {"sync": "sync"},
            r"^sync must be one of async, .*\(sync: 'sync'\); for example "
            r"Pipeline\(\.\.\., sync='flush'\)",
        ),
        ({"replan": "yes"}, r"^replan must be one of off, auto \(replan: 'yes'\)"),
        ({"divergence_patience": 9}, r"divergence_patience: 9, divergence_window: 5\)"),
        ({"preempt_signals": ("SIGNOPE",)}, r"^preempt_signals must name signals"),
        ({"weight_prediction": True}, r"^the staleness corrections apply to sync 'async'"),
        ({"memory": "lots"}, r"^memory must be a number of bytes"),
    ],
)
def test_bad_options(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_options(options(**given))


def test_a_built_optimizer_must_hold_the_layers_parameters_and_no_state() -> None:
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    check_built_optimizer(torch.optim.SGD(layers.parameters(), lr=0.1), layers)
    other = torch.optim.SGD([*layers.parameters(), *nn.Linear(2, 2).parameters()], lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"^an optimizer given built must hold only the layers' parameters and no state "
        r"yet \(optimizer: SGD with 2 parameters not in layers\); build it over "
        r"layers.parameters\(\) before any step",
    ):
        check_built_optimizer(other, layers)
    stepped = torch.optim.SGD(layers.parameters(), lr=0.1, momentum=0.9)
    layers(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"\(optimizer: SGD with state from earlier steps\)"):
        check_built_optimizer(stepped, layers)


def test_balance_becomes_a_plan_with_a_rank_per_stage() -> None:
    plan = choose_plan([2, 1], None, 3, 2)
    assert plan == Plan.from_balance([2, 1])
    given = Plan.from_balance([1, 2])
    assert choose_plan(None, given, 3, 2) is given


def test_a_plan_runs_in_the_modes_of_its_placement() -> None:
    chunked = Plan.from_balance([1] * 4, placement="interleaved")
    with pytest.raises(ValueError) as error:
        choose_plan(None, chunked, 4, 2)
    assert str(error.value) == (
        "sync='flush' runs plans placed 'contiguous', and this plan is placed 'interleaved' "
        "(2 stage(s) per rank); use Pipeline(..., sync='interleaved') for this plan, or a plan "
        "placed 'contiguous': Plan.from_balance([...], placement='contiguous')"
    )
    assert choose_plan(None, chunked, 4, 2, sync=SyncMode.INTERLEAVED) is chunked
    with pytest.raises(ValueError, match=r"^sync='zbv' runs plans placed 'v', and this plan is"):
        choose_plan(None, chunked, 4, 2, sync=SyncMode.ZBV)


def test_balance_is_placed_as_the_chunked_mode_asks() -> None:
    plan = choose_plan([1, 1, 1, 1], None, 4, 2, sync=SyncMode.ZBV)
    assert plan == Plan.from_balance([1, 1, 1, 1], placement="v", num_ranks=2)
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (1,), (0,)]


@pytest.mark.parametrize(
    ("explicit", "example", "topology", "memory", "message"),
    [
        (
            True,
            torch.ones(1),
            None,
            None,
            r"^example_input= only serves automatic planning, which a layout given by hand "
            r"replaces \(example_input: given, balance: \[1, 2\]\); leave out balance=/plan= "
            r"so that the planner chooses a layout, leave out example_input=$",
        ),
        (
            True,
            None,
            Topology.flat(2, 1e9),
            "1GiB",
            r"^topology=, memory= only serve .* leave out topology=, memory=, or add "
            r'replan="auto", whose plans they bound$',
        ),
        (
            False,
            None,
            None,
            "1GiB",
            r"^automatic planning profiles the layers on one microbatch of the first layer's "
            r"input \(example_input: None\); pass Pipeline\(\.\.\., example_input=x\)",
        ),
        (
            False,
            torch.ones(1),
            Topology.flat(3, 1e9),
            None,
            r"\(topology workers: 3, world size: 2\); launch 3 processes",
        ),
    ],
)
def test_what_only_automatic_planning_uses_is_refused_elsewhere(
    explicit: bool, example: object, topology: object, memory: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_automatic([1, 2] if explicit else None, None, example, topology, memory, 2)


def test_without_a_layout_the_plan_is_made_automatically() -> None:
    automatic = Plan.from_balance([1, 2])
    assert choose_plan(None, None, 3, 2, lambda: automatic) is automatic


@pytest.mark.parametrize(
    ("balance", "plan", "world", "message"),
    [
        (
            None,
            None,
            2,
            r"^the pipeline's layout must be given as balance= or plan=, or planned from "
            r"example_input= \(none given\); for example Pipeline\(\.\.\., balance=\[2, 1\]\)",
        ),
        ([2, 1], Plan.from_balance([2, 1]), 2, r"\(both given\)"),
        (
            [2, 2],
            None,
            2,
            r"^balance must give each stage at least one layer and place every "
            r"layer once \(layers: 3, balance: \[2, 2\]\); give positive counts that sum to 3",
        ),
        ([3, 0], None, 2, r"\(layers: 3, balance: \[3, 0\]\)"),
        (None, "plan.json", 2, r"^plan must be a pl_pipedream.Plan \(plan: str\); build one"),
        (
            [1, 1, 1],
            None,
            2,
            r"^the plan must have one worker per process of the group \(plan's "
            r"workers: 3, world size: 2\); launch 3 processes \(torchrun --nproc_per_node 3\)",
        ),
    ],
)
def test_bad_layouts(balance: object, plan: object, world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_plan(balance, plan, 3, world)  # type: ignore[arg-type]


def test_topology_and_memory_bound_replanning_beside_a_given_layout() -> None:
    topology = Topology.flat(2, 1e9)
    given = Plan.from_balance([1, 2])
    check_automatic(None, given, None, topology, "1GiB", 2, replanning=True)
    with pytest.raises(ValueError, match=r"^example_input= only serves automatic planning"):
        check_automatic(None, given, torch.zeros(1), topology, None, 2, replanning=True)
    with pytest.raises(ValueError, match=r"\(memory: '1GiB', plan: given\).*add replan="):
        check_automatic(None, given, None, None, "1GiB", 2)


def test_chunks_per_rank_must_give_the_plan_its_stages_per_rank() -> None:
    plan = choose_plan([1] * 6, None, 6, 2, sync=SyncMode.INTERLEAVED, chunks=3)
    assert plan.chunks_per_rank == 3
    with pytest.raises(ValueError, match=r"\(chunks_per_rank: 2, plan: 6 stages on 2 ranks\); gi"):
        choose_plan([1] * 6, None, 6, 2, sync=SyncMode.INTERLEAVED, chunks=2)


def test_pipeline_refuses_a_chunks_per_rank_its_mode_would_ignore() -> None:
    """Checked before the pipeline joins anything; the fixes quote Pipeline's call."""
    from pl_pipedream import Pipeline
    from tests.runtime.distributed import one_rank_group

    layers = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with one_rank_group():
        with pytest.raises(ValueError, match=r"use Pipeline\(\.\.\., sync='interleaved', chunks_"):
            Pipeline(layers, nn.functional.mse_loss, sgd, sync="flush", chunks_per_rank=2)
        with pytest.raises(ValueError, match=r"^sync='zbv' places two stages on each rank"):
            Pipeline(layers, nn.functional.mse_loss, sgd, sync="zbv", chunks_per_rank=4)
        with pytest.raises(ValueError, match=r"\(memory: 1073741824 bytes, sync: 'zbv'\); leave"):
            Pipeline(
                layers, nn.functional.mse_loss, sgd, sync="zbv", memory="1GiB",
                example_input=torch.ones(1, 2),
            )  # fmt: skip


def test_pipeline_takes_the_divergence_thresholds_and_refuses_bad_ones() -> None:
    """As ``PipeDreamStrategy`` does: when a loss has given back its progress is the user's."""
    from pl_pipedream import Pipeline
    from tests.runtime.distributed import one_rank_group

    layers = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with one_rank_group():
        with pytest.raises(ValueError, match=r"divergence_patience: 6, divergence_window: 5\)"):
            Pipeline(layers, nn.functional.mse_loss, sgd, balance=[2], divergence_patience=6)
        with Pipeline(
            layers, nn.functional.mse_loss, sgd, balance=[2], divergence_rise=0.5,
            divergence_patience=2, divergence_window=4,
        ) as pipeline:  # fmt: skip
            watch = pipeline.losses.watch
            assert watch is not None and (watch.rise, watch.patience, watch.window) == (0.5, 2, 4)
