"""The orders of several stages per rank: golden lists on small cases, every count validated,
one update per stage and batch right after its last weight gradient."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import ActionKind, ScheduleError, SyncMode, build, simulate, validate
from pl_pipedream.schedule.chunked import interleaved_order, zbv_order
from pl_pipedream.schedule.memory import minibatches_in_flight


def compact(tokens: list[tuple[str, int, int]]) -> str:
    return " ".join(f"{stage}{kind}{j}" for kind, stage, j in tokens)


def test_interleaved_golden_two_ranks_two_chunks() -> None:
    # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; microbatches go in pairs per chunk
    assert compact(interleaved_order(2, 2, 4, 0)) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    )
    assert compact(interleaved_order(2, 2, 4, 1)) == (
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    )


def test_zbv_golden_two_ranks() -> None:
    # rank 0 holds stages 0 and 3 (both ends of the V), rank 1 stages 1 and 2 (its turn)
    assert compact(zbv_order(2, 4, 0)) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3"
    )
    assert compact(zbv_order(2, 4, 1)) == (
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3"
    )


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_every_interleaved_schedule_validates(p: int, v: int) -> None:
    plan = Plan.from_balance([1] * (p * v), placement="interleaved", num_ranks=p)
    for m in (p, 2 * p, 3 * p):
        for batches in (1, 3):
            validate(build(plan, "interleaved", batches, m))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_zbv_schedule_validates(p: int) -> None:
    plan = Plan.from_balance([1] * (2 * p), placement="v", num_ranks=p)
    for m in range(1, 2 * p + 3):
        for batches in (1, 3):
            validate(build(plan, "zbv", batches, m))


@pytest.mark.parametrize(("placement", "sync"), [("interleaved", "interleaved"), ("v", "zbv")])
def test_each_stage_steps_once_per_batch_after_its_last_weight_gradient(
    placement: str, sync: str
) -> None:
    plan = Plan.from_balance([1] * 6, placement=placement, num_ranks=3)
    schedule = build(plan, sync, 2, 6)
    grads = {ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT}
    for actions in schedule.actions:
        for stage in {a.stage for a in actions}:
            own = [a for a in actions if a.stage == stage and a.kind in grads | {ActionKind.STEP}]
            steps = [n for n, a in enumerate(own) if a.kind is ActionKind.STEP]
            assert steps == [6, 13]  # six weight gradients of batch 0, its step, then batch 1
            assert [own[n].version for n in steps] == [1, 2]


def test_the_turn_of_the_v_is_a_hand_over_on_one_rank() -> None:
    plan = Plan.from_balance([1] * 4, placement="v")
    schedule = build(plan, "zbv", 1, 3)
    turn = [a for a in schedule.actions[1] if a.peer == 1]
    assert {(a.kind, a.stage) for a in turn} == {
        (ActionKind.SEND_ACTIVATION, 1),
        (ActionKind.RECV_ACTIVATION, 2),
        (ActionKind.SEND_GRAD, 2),
        (ActionKind.RECV_GRAD, 1),
    }


def test_a_chunked_list_out_of_order_is_refused() -> None:
    plan = Plan.from_balance([1] * 4, placement="interleaved")
    schedule = build(plan, "interleaved", 1, 2)
    rank0 = list(schedule.actions[0])
    first = next(n for n, a in enumerate(rank0) if a.kind is ActionKind.FORWARD and a.stage == 2)
    rank0.insert(0, rank0.pop(first))  # stage 2's forward before its input arrives
    broken = replace(schedule, actions=(tuple(rank0), schedule.actions[1]))
    with pytest.raises(ScheduleError, match="RECV_ACTIVATION before it"):
        validate(broken)


def test_activations_in_flight_per_stage_are_the_built_schedules() -> None:
    for placement, mode in (("interleaved", SyncMode.INTERLEAVED), ("v", SyncMode.ZBV)):
        plan = Plan.from_balance([1] * 6, placement=placement, num_ranks=3)
        counts = tuple(minibatches_in_flight(plan, mode, 6, s) for s in range(6))
        assert counts == simulate(build(plan, mode, 3, 6)).peak_in_flight
        if mode is SyncMode.ZBV:
            assert counts == (6, 5, 4, 3, 2, 1)
