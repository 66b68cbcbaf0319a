"""A token's actions: the compute wrapped in its messages to the neighbouring stages' ranks."""

from __future__ import annotations

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import Action, SyncMode
from pl_pipedream.schedule.wrap import place, wrap


def actions(plan: Plan, sync: SyncMode, rank: int, stage: int, token: tuple[str, int]) -> str:
    out: list[Action] = []
    wrap(plan, sync, 2, place(plan, rank, stage), token, out)
    return " ".join(str(action) for action in out)


def test_a_forward_and_a_backward_are_wrapped_in_their_messages() -> None:
    plan = Plan.from_balance([1, 1, 1])
    assert actions(plan, SyncMode.FLUSH, 1, 1, ("F", 3)) == "1<a3@0 1F3v1 1>a3@2"
    assert actions(plan, SyncMode.FLUSH, 1, 1, ("B", 3)) == "1<g3@2 1B3v1 1>g3@0"
    assert actions(plan, SyncMode.ZERO_BUBBLE, 1, 1, ("I", 3)) == "1<g3@2 1I3v1 1>g3@0"
    assert actions(plan, SyncMode.ZERO_BUBBLE, 1, 1, ("W", 3)) == "1W3v1"
    assert actions(plan, SyncMode.FLUSH, 0, 0, ("F", 0)) == "0F0v0 0>a0@1"


def test_an_update_is_a_step_after_an_allreduce_on_replicated_stages() -> None:
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    out: list[Action] = []
    wrap(plan, SyncMode.FLUSH, 2, place(plan, 0, 0), ("B", 0), out)
    wrap(plan, SyncMode.FLUSH, 2, place(plan, 0, 0), ("U", 1), out)
    assert [str(a) for a in out[-2:]] == ["0Av1", "0Sv1"]


def test_stages_on_one_rank_hand_over_to_the_rank_itself() -> None:
    plan = Plan.from_balance([1] * 4, placement="v")  # rank 1 holds stages 1 and 2
    assert actions(plan, SyncMode.ZBV, 1, 1, ("F", 0)) == "1<a0@0 1F0v0 1>a0@1"
    assert actions(plan, SyncMode.ZBV, 1, 2, ("F", 0)) == "2<a0@1 2F0v0 2>a0@0"
    interleaved = Plan.from_balance([1] * 4, placement="interleaved")  # rank 0: stages 0, 2
    assert actions(interleaved, SyncMode.INTERLEAVED, 0, 2, ("B", 1)) == "2<g1@1 2B1v0 2>g1@1"
