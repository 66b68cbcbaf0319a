"""The re-plan check (core/replanner.py): its options, when it is due, the same decision on every
rank from their timelines, the history line of a move, and a plan that does not fit memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pl_pipedream.core.replanner import Replanner, check_replan_options, same_layout
from pl_pipedream.planner.measured import RankTimes
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import Decision
from pl_pipedream.planner.speeds import plan_time, plan_with_speeds
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Node, Profile
from pl_pipedream.runtime.timeline import TimelineEvent
from tests.runtime.distributed import one_rank_group, run

IDS = ["0", "1", "2", "3"]
TOPOLOGY = Topology.flat(2, 1e12)


def profile(parameter_bytes: float = 4.0) -> Profile:
    nodes = tuple(Node(n, n, 1.0, 2.0, (4.0,), parameter_bytes) for n in IDS)
    return Profile(nodes, tuple(zip(IDS, IDS[1:], strict=False)))


def timeline(rank: int, forward_ms: float, backward_ms: float, count: int = 4) -> list:
    out, clock = [], 0.0
    for i in range(count):
        out.append(TimelineEvent(rank, f"F{i}", "FORWARD", clock, clock + forward_ms / 1e3))
        clock += forward_ms / 1e3
        out.append(TimelineEvent(rank, f"B{i}", "BACKWARD", clock, clock + backward_ms / 1e3))
        clock += backward_ms / 1e3
    return out


@pytest.mark.parametrize(
    ("mode", "every", "threshold", "message"),
    [
        ("on", 50, 0.05, "replan must be one of off, auto (replan: 'on')"),
        ("auto", 0, 0.05, "replan_every must be a positive number of steps (replan_every: 0)"),
        ("auto", 2.5, 0.05, "(replan_every: 2.5)"),
        ("auto", 50, -0.1, "replan_threshold must be a fraction >= 0 (replan_threshold: -0.1)"),
        ("auto", 50, True, "(replan_threshold: True)"),
    ],
)
def test_bad_options_are_refused_naming_the_fix(
    mode: object, every: object, threshold: object, message: str
) -> None:
    with pytest.raises(ValueError, match="for example") as error:
        check_replan_options(mode, every, threshold)
    assert message in str(error.value)
    with pytest.raises(ValueError, match="Replanner"):
        Replanner(mode, every, threshold, topology=None, memory=None, profile=None, history=None)  # type: ignore[arg-type]


def test_off_is_never_due_and_times_nothing() -> None:
    replanner = Replanner("off", 1, topology=None, memory=None, profile=None, history=None)
    layer = nn.Linear(2, 2)
    replanner.watch({"0": layer})
    assert not layer._forward_hooks and not layer._forward_pre_hooks
    assert not any(replanner.due(step) for step in range(200))
    assert replanner.check(50, Plan.from_balance([4]), [], 0) is None


def test_auto_is_due_every_so_many_steps_and_watches_its_layers() -> None:
    replanner = Replanner("auto", 3, topology=None, memory=None, profile=None, history=None)
    assert [s for s in range(10) if replanner.due(s)] == [3, 6, 9]
    assert [s for s in range(10) if replanner.starts(s)] == [1]  # the first step: warm-up
    replanner.moved(6, 0.1)  # the step after a move is not measured either
    assert [s for s in range(20) if replanner.due(s)] == [9, 12, 15, 18]
    assert [s for s in range(20) if replanner.starts(s)] == [7]
    layer = nn.Linear(2, 3)
    replanner.watch({"0": layer})
    layer(torch.zeros(5, 2))
    assert replanner._sizes["0"] == (4.0 * (6 + 3), 4.0 * 15)
    replanner.unwatch()
    assert not layer._forward_hooks


def test_one_rank_keeps_its_plan() -> None:
    plan = Plan.from_balance([4])
    replanner = Replanner(
        "auto", 1, topology=Topology.flat(1, 1e9), memory=None, profile=None, history=None
    )
    with one_rank_group():
        decision = replanner.check(2, plan, timeline(0, 4.0, 8.0), 0)
    assert decision is not None and not decision.move and decision.plan == plan


def _two_ranks(rank: int, world: int, history: str, memory: float | None, size: float) -> list:
    """Rank 1 runs as fast as rank 0 at the first check, then three times slower."""
    plan = Plan.from_balance([2, 2])
    replanner = Replanner(
        "auto", 2, topology=TOPOLOGY, memory=memory, profile=None, history=Path(history)
    )
    layers = {n: nn.Linear(1, 1) for n in plan.stage_of_rank(rank).nodes}
    replanner.watch(layers)
    replanner._sizes = {n: (size, 4.0) for n in layers}
    first = replanner.check(2, plan, timeline(rank, 2.0, 4.0), rank)
    slow = 3.0 if rank == 1 else 1.0
    second = replanner.check(4, plan, timeline(rank, 2.0 * slow, 4.0 * slow), rank)
    replanner.moved(4, 0.25)
    replanner.close()
    return [first, second]


def test_every_rank_gets_the_same_decision_and_rank_zero_writes_the_move(tmp_path: Path) -> None:
    history = tmp_path / "logs" / "pipedream_plan_history.jsonl"
    results = run(2, _two_ranks, str(history), None, 4.0)
    assert all(status == "ok" for status, _ in results.values()), results
    (first0, second0), (first1, second1) = results[0][1], results[1][1]
    assert first0 == first1 and second0 == second1
    assert not first0.move  # the first check is the reference: nothing is slower than it yet
    assert second0.move
    assert [s.nodes for s in second0.plan.stages] == [("0", "1", "2"), ("3",)]
    lines = history.read_text().splitlines()
    assert len(lines) == 1  # one line per move, written once (rank 0)
    line = json.loads(lines[0])
    assert line["step"] == 4 and line["seconds"] == 0.25
    assert same_layout(Plan.from_dict(line["old_plan"]), Plan.from_balance([2, 2]))
    assert Plan.from_dict(line["new_plan"]) == second0.plan
    assert line["measured_ms"]["1"] == pytest.approx({"forward": 6.0, "backward": 12.0})
    assert line["speeds"][0] > line["speeds"][1]
    assert line["predicted_ms"]["new"] < line["predicted_ms"]["current"]


def test_a_faster_plan_that_does_not_fit_memory_is_skipped_with_a_warning(
    tmp_path: Path,
) -> None:
    # 3 layers of 1000 bytes on rank 0 (one minibatch stashed) hold more than 2500 bytes; 2 fit.
    results = run(2, _two_ranks, str(tmp_path / "h.jsonl"), 2500.0, 1000.0)
    assert all(status == "ok" for status, _ in results.values()), results
    second = results[0][1][1]
    assert not second.move
    assert any("does not fit the memory per worker" in w for w in second.warnings)
    assert not (tmp_path / "h.jsonl").exists()


def test_same_layout_ignores_predicted_times() -> None:
    a = Plan.from_balance([2, 2])
    assert same_layout(a, Plan.from_balance([2, 2]))
    assert not same_layout(a, Plan.from_balance([3, 1]))


def _small_gain(rank: int, world: int, slowdowns: list[float]) -> list:
    """Rank 1 as fast as rank 0 at the first check, then ``slowdowns`` at the next checks."""
    plan = Plan.from_balance([2, 2])
    replanner = Replanner("auto", 2, topology=TOPOLOGY, memory=None, profile=None, history=None)
    layers = {n: nn.Linear(1, 1) for n in plan.stage_of_rank(rank).nodes}
    replanner.watch(layers)
    replanner._sizes = {n: (4.0, 4.0) for n in layers}
    decisions = [replanner.check(2, plan, timeline(rank, 2.0, 4.0), rank)]
    for i, slow in enumerate(slowdowns):
        factor = slow if rank == 1 else 1.0
        step = 4 + 2 * i
        decisions.append(replanner.check(step, plan, timeline(rank, 2 * factor, 4 * factor), rank))
        if decisions[-1].move:
            break
    replanner.close()
    return [d.move for d in decisions]


def test_a_small_gain_moves_only_when_the_next_check_finds_it_again() -> None:
    """Rank 1 at 1.6x: 0-2|3 beats 0-1|2-3 by about 7%, more than the 5% threshold but within
    noise on a loaded machine. Seen once it is held; seen twice it moves; gone by the next check,
    nothing moves."""
    results = run(2, _small_gain, [1.6, 1.6])
    assert all(status == "ok" for status, _ in results.values()), results
    assert results[0][1] == results[1][1] == [False, False, True]
    results = run(2, _small_gain, [1.6, 1.0, 1.6])
    assert all(status == "ok" for status, _ in results.values()), results
    assert results[0][1] == [False, False, False, False]


SLOW_IDS = [str(i) for i in range(16)]
FOUR = Topology.flat(4, 1e9)
TRUE_SPEEDS = [0.25, 1.0, 1.0, 1.0]  # rank 0: 3 ms more per layer of 1 ms


def _truth() -> Profile:
    nodes = tuple(Node(n, n, 1 / 3, 2 / 3, (1024.0,), 4096.0) for n in SLOW_IDS)
    return Profile(nodes, tuple(zip(SLOW_IDS, SLOW_IDS[1:], strict=False)))


def _gathered(plan: Plan) -> list:
    """Every rank's per-layer times on ``plan``, as ``check`` gathers them: rank 0 takes 1 ms
    more forward and 2 ms more backward per layer."""
    out = []
    for rank in range(4):
        nodes = plan.stage_of_rank(rank).nodes
        slow = 1 / TRUE_SPEEDS[rank]
        times = RankTimes(rank, {n: slow / 3 for n in nodes}, {n: 2 * slow / 3 for n in nodes})
        out.append((times, {n: (4096.0, 1024.0) for n in nodes}))
    return out


def _checks(count: int) -> list[tuple[Plan, Decision, str]]:
    """Rank 0's part of ``count`` checks of a 4-rank ``flush`` run of 16 equal layers from the
    equal split, rank 0 slow from the start and no profile: (plan checked, decision, report)."""
    plan = Plan.from_balance([4, 4, 4, 4], SLOW_IDS)
    replanner = Replanner(
        "auto", 1, topology=FOUR, memory=None, profile=None, history=None, microbatches=4
    )
    out = []
    for step in range(2, 2 + count):
        answer = replanner._decide(step, plan, _gathered(plan), FOUR)
        replanner.profile = answer[2]
        out.append((plan, answer[0], answer[3] if len(answer) > 3 else ""))
        plan = answer[0].plan
    return out


def test_a_rank_slow_from_the_start_is_never_moved_to_a_slower_plan() -> None:
    """The first check's reference reads rank 0's layers as costly; data parallelism, which
    gives rank 0 every layer, is slower on the true costs and must not be chosen. Each move is
    faster on the true costs than the plan it leaves, and the run ends at the best plan."""
    truth = _truth()

    def true_time(plan: Plan) -> float:
        return plan_time(plan, truth, FOUR, TRUE_SPEEDS)

    checks = _checks(5)
    for plan, decision, _ in checks:
        if decision.move:
            assert true_time(decision.plan) < true_time(plan), decision.render()
    assert not checks[0][1].move  # a gain under both readings small enough to wait a check
    last = checks[-1][1].plan
    assert last.layout == "0|1-5|6-10|11-15"
    best = plan_with_speeds(truth, FOUR, TRUE_SPEEDS, microbatches=4)
    assert true_time(last) == pytest.approx(true_time(best))


def test_every_check_reports_what_it_measured_and_decided() -> None:
    reports = [report for _, _, report in _checks(3)]
    assert all("\n" not in r and r.startswith("re-plan check at step") for r in reports)
    assert "measured 16 | 4 | 4 | 4 ms per microbatch" in reports[0]
    assert "speeds ?, 1.00, 1.00, 1.00 (rank 0: a slow rank or costly layers" in reports[0]
    assert "kept 0-3|4-7|8-11|12-15" in reports[0]
    assert "holding a move to 0|1-5|6-10|11-15 until the next check finds it again" in reports[0]
    assert "move to 0|1-5|6-10|11-15" in reports[1]
    assert "kept 0|1-5|6-10|11-15" in reports[2]
