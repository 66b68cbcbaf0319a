"""The memory a plan may use: sizes parsed, the planner's limit lowered until the sync mode's
stages fit, and the smallest memory that would fit named when none does."""

from __future__ import annotations

import pytest

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.memory_limit import (
    MemoryFit,
    check_ranks_fit,
    need,
    parse_memory,
    plan_within,
    planner_bytes,
)
from pl_pipedream.core.replanner import Replanner
from pl_pipedream.planner.chunk_plan import plan_chunks
from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan, PlanError, Stage
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.schedule.memory import kept_bytes
from pl_pipedream.schedule.memory import stage_bytes as mode_bytes
from pl_pipedream.schedule.modes import SyncMode

MiB = 2**20


def test_memory_sizes_parse_and_bad_ones_are_refused() -> None:
    assert parse_memory(None) is None
    assert parse_memory(1024) == 1024
    assert parse_memory("8GiB") == 8 * 2**30
    assert parse_memory("512 MB") == 512e6
    assert parse_memory("3kib") == 3072
    for bad in ("lots", "8 parsecs", 0, "-1GiB"):
        with pytest.raises(ValueError, match="memory must be"):
            parse_memory(bad)


def profile() -> Profile:
    """Four equal layers, the second with large weights: the best split by time is 2-2, but
    its first stage stashes ceil(1 / 1) x (weights + activations) = 43 MiB. Every layer outputs
    1 MiB: on two stages each holds 3 MiB of frames (two messages in flight, one receive
    posted ahead; ``schedule.memory.frame_bytes``)."""
    return Profile.chain(
        [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [MiB] * 4, [MiB, 40 * MiB, MiB, MiB]
    )


def make(memory: float | None) -> Plan:
    return make_plan(profile(), Topology.flat(2, 1e12), straight=True, memory=memory)


ASYNC = (SyncMode.ASYNC, 4)  # plan_within's sync and microbatches


def stage_bytes(plan: Plan, stage: Stage, recompute: bool = False) -> float:
    """What a stage of ``plan`` needs in ``async`` with 4 microbatches per batch."""
    return mode_bytes(plan, SyncMode.ASYNC, 4, stage.index, recompute)


def test_a_memory_limit_makes_the_planner_pick_another_plan() -> None:
    free = make(None)
    first = free.stages[0]
    assert first.nodes == ("layer0", "layer1") and first.activation_bytes == 2 * MiB
    assert planner_bytes(free, first) == 46 * MiB  # the planner's figure
    # two versions, two minibatches in flight, 3 MiB of frames
    assert stage_bytes(free, first) == 2 * 43 * MiB + 3 * MiB
    limited = plan_within(make, 50 * MiB, 47 * MiB, *ASYNC)
    assert [s.nodes for s in limited.stages] == [("layer0",), ("layer1", "layer2", "layer3")]
    assert [stage_bytes(limited, s) for s in limited.stages] == [7 * MiB, 48 * MiB]


def test_no_plan_fits_names_the_smallest_memory_that_does() -> None:
    with pytest.raises(PipelineSetupError, match="the smallest that fits") as caught:
        plan_within(make, 10 * MiB, 47 * MiB, *ASYNC)
    message = str(caught.value)
    assert "recompute=True" in message and "more devices" in message
    need = float(message.split("the smallest that fits: ")[1].split(" bytes")[0])
    # the best split's largest stage: layers 1-3, weights and activations of one minibatch,
    # and its frames
    assert 48 * MiB <= need <= 48 * MiB * 1.002
    assert plan_within(make, need, 47 * MiB, *ASYNC).num_stages == 2
    with pytest.raises(PipelineSetupError):
        plan_within(make, need * 0.995, 47 * MiB, *ASYNC)  # and a little less does not fit
    with pytest.raises(PlanError):  # no limit, no search: the planner's own error
        plan_within(
            lambda m: make_plan(profile(), Topology.flat(9, 1e12), True, m), None, 1, *ASYNC
        )


def test_with_recompute_a_plan_fits_where_none_did() -> None:
    """Activations dominate: without recomputation the best any split does is 63 MiB (layer 0,
    then layers 1-3) and 60 MiB of frames (20 MiB messages); with it the first stage of the
    2-2 split keeps its two minibatches' inputs and one replay's activations, 44 MiB, and the
    same frames."""

    def make_wide(memory: float | None) -> Plan:
        wide = Profile.chain([1.0] * 4, [2.0] * 4, [20 * MiB] * 4, [MiB] * 4)
        return make_plan(wide, Topology.flat(2, 1e12), straight=True, memory=memory)

    with pytest.raises(PipelineSetupError, match="recompute=True") as caught:
        plan_within(make_wide, 110 * MiB, 84 * MiB, *ASYNC)
    need = float(str(caught.value).split("the smallest that fits: ")[1].split(" bytes")[0])
    assert 123 * MiB <= need <= 123 * MiB * 1.002
    recomputed = plan_within(make_wide, 110 * MiB, 84 * MiB, *ASYNC, recompute=True)
    assert [len(s.nodes) for s in recomputed.stages] == [2, 2]
    assert [stage_bytes(recomputed, s, True) for s in recomputed.stages] == [104 * MiB, 102 * MiB]


def test_vertical_sync_is_refused_a_plan_that_async_fits() -> None:
    """Under ``vertical_sync`` the last stage keeps the input stage's versions too: layers 1-3
    (42 MiB of weights) twice, 87 MiB, where ``async`` keeps them once, 45 MiB (3 MiB of frames
    each). The 2-2 split then fits best, at 2 x 41 + 2 x 2 + 3 = 89 MiB."""
    fitted = plan_within(make, 50 * MiB, 47 * MiB, SyncMode.ASYNC, 4)
    assert [len(s.nodes) for s in fitted.stages] == [1, 3]
    with pytest.raises(PipelineSetupError, match="sync: vertical_sync") as caught:
        plan_within(make, 50 * MiB, 47 * MiB, SyncMode.VERTICAL_SYNC, 4)
    need = float(str(caught.value).split("the smallest that fits: ")[1].split(" bytes")[0])
    assert 89 * MiB <= need <= 89 * MiB * 1.002
    kept = plan_within(make, need, 47 * MiB, SyncMode.VERTICAL_SYNC, 4)
    assert [len(s.nodes) for s in kept.stages] == [2, 2]


def test_a_chunked_plan_is_checked_by_the_sum_of_each_ranks_stages() -> None:
    """A rank holds both stages of its V: weights plus the activations each keeps in flight."""
    chain = Profile.chain([1.0] * 4, [2.0] * 4, [1 * MiB] * 4, [4 * MiB] * 4)
    plan = plan_chunks(chain, Topology.flat(2, 1e9), "v")
    sync = SyncMode.ZBV
    need = [sum(kept_bytes(plan, sync, 4, s.index) for s in plan.stages_of_rank(r)) for r in (0, 1)]
    assert min(need) > 8 * MiB  # more than one stage's weights and activation
    check_ranks_fit(plan, max(need), sync, 4)
    with pytest.raises(PipelineSetupError) as error:
        check_ranks_fit(plan, max(need) - 1, sync, 4)
    rank = need.index(max(need))
    assert str(error.value).startswith(
        f"a rank holds every one of its stages, and rank {rank}'s need more than the memory per "
        "device (memory: "
    )
    assert "sync: zbv); use more devices, recompute=True or a smaller batch" in str(error.value)


# 4 layers of 16 MiB of weights and 4 MiB of activations, one per rank, 4 microbatches: what
# each mode keeps, the one figure setup fits, re-planning is bound by and the report states.
FOUR_LAYERS = Profile.chain([1.0] * 4, [2.0] * 4, [4 * MiB] * 4, [16 * MiB] * 4)
NEEDS = {"async": 100, "vertical_sync": 112, "flush": 64, "gpipe": 72}


@pytest.mark.parametrize(("mode", "mib"), list(NEEDS.items()))
def test_setup_and_re_planning_hold_a_plan_to_one_memory_rule(mode: str, mib: int) -> None:
    plan = make_plan(FOUR_LAYERS, Topology.flat(4, 1e9), straight=True)
    assert [len(s.nodes) for s in plan.stages] == [1, 1, 1, 1]
    sync = SyncMode(mode)
    assert need(plan, sync, 4) == pytest.approx(mib * MiB, rel=0.02)
    replanner = Replanner(
        "auto",
        1,
        topology=None,
        memory=need(plan, sync, 4),
        profile=None,
        history=None,
        sync=sync,
        microbatches=4,
    )
    assert replanner.fit == MemoryFit(need(plan, sync, 4), sync, 4)
    assert replanner.fit.fits(plan)
    assert not MemoryFit(need(plan, sync, 4) - 1, sync, 4).fits(plan)
