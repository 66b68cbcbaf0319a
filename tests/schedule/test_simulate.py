"""The simulator's golden numbers: bubbles of flushed pipelines, steady async, 1F1B-RR balance."""

from __future__ import annotations

import dataclasses

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import ScheduleError, build, simulate


def balanced(p: int) -> dict[str, list[float]]:
    return {"forward_ms": [1.0] * p, "backward_ms": [2.0] * p}


@pytest.mark.parametrize("sync", ["gpipe", "flush"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_flushed_bubble_is_p_minus_1_over_m_plus_p_minus_1(sync: str, p: int, m: int) -> None:
    result = simulate(build(Plan.from_balance([1] * p), sync, 1, m), **balanced(p))
    assert result.total_ms == pytest.approx(3.0 * (m + p - 1), abs=1e-9)
    for bubble in result.bubble:
        assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)


# Closed forms of the idle time per rank and flushed batch, with F and B a stage's forward and
# whole backward and W the weight-gradient share of B (I = B - W the input half): 1F1B idles
# (p - 1)(F + B); ZB-H1 moves the W steps into the drain and idles (p - 1)(F + B - 2W) once
# m >= p and W <= min(F, I) (Qi et al., ICLR'24, section 3), with the same peak activations.
TIMES = [(1.0, 2.0, 0.5), (1.0, 2.0, 0.25), (1.0, 1.0, 0.5), (2.0, 3.0, 1.0 / 3.0), (1.5, 4.0, 0.3)]


def idle(result) -> list[float]:  # type: ignore[no-untyped-def]
    return [b * result.total_ms for b in result.bubble]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 6, 8, 16])
@pytest.mark.parametrize(("forward", "backward", "share"), TIMES)
def test_the_bubbles_match_the_closed_forms(
    p: int, m: int, forward: float, backward: float, share: float
) -> None:
    plan, weight = Plan.from_balance([1] * p), backward * share
    assert weight <= min(forward, backward - weight)
    times = {"forward_ms": [forward] * p, "backward_ms": [backward] * p, "weight_share": share}
    for batches in (1, 3):
        flush = simulate(build(plan, "flush", batches, m), **times)
        zero = simulate(build(plan, "zero_bubble", batches, m), **times)
        busy = batches * m * (forward + backward)
        one_f_one_b = batches * (p - 1) * (forward + backward)
        zb_h1 = batches * (p - 1) * (forward + backward - 2 * weight)
        assert flush.total_ms == pytest.approx(busy + one_f_one_b, abs=1e-9)
        assert zero.total_ms == pytest.approx(busy + zb_h1, abs=1e-9)
        assert idle(flush) == pytest.approx([one_f_one_b] * p, abs=1e-9)
        assert idle(zero) == pytest.approx([zb_h1] * p, abs=1e-9)
        assert max(zero.peak_in_flight) == max(flush.peak_in_flight) == p


def test_the_weight_share_splits_the_backward_and_is_checked() -> None:
    plan = Plan.from_balance([1, 1])
    whole = simulate(build(plan, "zero_bubble", 1, 4), forward_ms=[1.0] * 2, backward_ms=[2.0] * 2)
    assert whole.total_ms == pytest.approx(4 * 3.0 + 1.0)  # default share 0.5: W = 1
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"\(weight_share: {share}\); for example 0.5"):
            simulate(build(plan, "zero_bubble", 1, 4), weight_share=share)


@pytest.mark.parametrize("sync", ["async", "vertical_sync", "2bw"])
def test_async_steady_state_has_no_bubble(sync: str) -> None:
    result = simulate(build(Plan.from_balance([1] * 4), sync, 40, 4), **balanced(4))
    assert result.time_per_minibatch_ms == pytest.approx(3.0, abs=1e-9)
    assert result.throughput == pytest.approx(1e3 / 3.0)
    assert max(result.steady_bubble) == pytest.approx(0.0, abs=1e-9)
    assert max(result.bubble) > 0  # warm-up and drain are not free


def test_unbalanced_pipeline_runs_at_its_slowest_stage() -> None:
    schedule = build(Plan.from_balance([1, 1, 1]), "async", 40, 2)
    result = simulate(schedule, forward_ms=[1.0, 2.0, 1.0], backward_ms=[2.0, 4.0, 2.0])
    assert result.time_per_minibatch_ms == pytest.approx(6.0, abs=1e-9)
    assert result.steady_bubble[1] == pytest.approx(0.0, abs=1e-9)
    assert result.steady_bubble[0] == pytest.approx(0.5, abs=1e-9)


def test_replicated_slow_stage_balances() -> None:
    """2-1: stage 0 is twice as slow as stage 1 but has two replicas."""
    schedule = build(Plan.from_balance([1, 1], replicas=[2, 1]), "async", 40, 2)
    result = simulate(schedule, forward_ms=[2.0, 1.0], backward_ms=[4.0, 2.0])
    assert result.time_per_minibatch_ms == pytest.approx(3.0, abs=1e-9)
    assert max(result.steady_bubble) == pytest.approx(0.0, abs=1e-9)


def test_peaks_of_activations_and_versions() -> None:
    straight = simulate(build(Plan.from_balance([1] * 4), "async", 8, 2), **balanced(4))
    assert straight.peak_in_flight == (4, 3, 2, 1)  # p - s activations at stage s
    assert straight.peak_versions == (4, 3, 2, 1)  # w_s + 1 weight versions
    gpipe = simulate(build(Plan.from_balance([1] * 4), "gpipe", 2, 8), **balanced(4))
    assert gpipe.peak_in_flight == (8, 8, 8, 8)
    assert gpipe.peak_versions == (1, 1, 1, 1)
    two_bw = simulate(build(Plan.from_balance([1] * 4), "2bw", 4, 4), **balanced(4))
    assert max(two_bw.peak_versions) == 2


def test_transfers_and_allreduce_cost_time() -> None:
    plan = Plan.from_balance([1, 1])
    stages = tuple(dataclasses.replace(s, output_bytes=1e6) for s in plan.stages)
    plan = dataclasses.replace(plan, stages=stages)
    free = simulate(build(plan, "gpipe", 1, 2), **balanced(2))
    slow = simulate(build(plan, "gpipe", 1, 2), bandwidth=1e9, **balanced(2))  # 1 ms a message
    assert slow.total_ms == pytest.approx(free.total_ms + 2.0)
    replicated = build(Plan.from_balance([1, 1], replicas=[2, 1]), "flush", 1, 2)
    base = simulate(replicated, **balanced(2))
    reduced = simulate(replicated, allreduce_ms=5.0, **balanced(2))
    assert reduced.total_ms == pytest.approx(base.total_ms + 5.0)


def test_spans_and_summary() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 4, 2)
    result = simulate(schedule, **balanced(2))
    assert [len(s) for s in result.spans] == [len(a) for a in schedule.actions]
    assert all(start <= end for rank in result.spans for start, end in rank)
    text = result.describe()
    for words in ("time per minibatch", "throughput", "bubble", "peak activations"):
        assert words in text


def test_deadlock_raises() -> None:
    flush, gpipe = (build(Plan.from_balance([1, 1]), sync, 1, 2) for sync in ("flush", "gpipe"))
    first = flush.actions[0]  # F0 >a0 F1 >a1 <g0 B0 <g1 B1 S
    waits_early = first[:2] + first[4:6] + first[2:4] + first[6:]  # <g0 before >a1
    stuck = dataclasses.replace(flush, actions=(waits_early, gpipe.actions[1]))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(stuck, **balanced(2))


# Several stages per rank: each rank's forward F and whole backward B split evenly over its
# chunks (F / v and B / v per stage). Interleaved 1F1B (Megatron-LM, SC'21 section 2.2) idles
# (p - 1)(F + B) / v per rank and flushed batch whenever m is a multiple of p. Its rank r holds
# at most min(m v, 2 (p - 1 - r) + (v - 1) p + 1) chunk activations (each 1/v of a stage's).
def chunked(placement: str, p: int, v: int, forward: float, backward: float) -> Plan:
    plan = Plan.from_balance([1] * (p * v), placement=placement, num_ranks=p)
    stages = tuple(
        dataclasses.replace(s, forward_ms=forward / v, backward_ms=backward / v)
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize(("forward", "backward", "share"), TIMES)
def test_interleaved_idles_p_minus_1_times_f_plus_b_over_v(
    p: int, v: int, forward: float, backward: float, share: float
) -> None:
    plan = chunked("interleaved", p, v, forward, backward)
    for m in (p, 2 * p, 4 * p):
        for batches in (1, 3):
            result = simulate(build(plan, "interleaved", batches, m))
            busy = batches * m * (forward + backward)
            bubble = batches * (p - 1) * (forward + backward) / v
            assert result.total_ms == pytest.approx(busy + bubble, abs=1e-9)
            assert idle(result) == pytest.approx([bubble] * p, abs=1e-9)
            assert result.rank_in_flight == tuple(
                min(m * v, 2 * (p - 1 - r) + (v - 1) * p + 1) for r in range(p)
            )


# ZB-V (Qi et al., ICLR'24 section 6) in its ideal case: per chunk F / 2 = I = W (so a rank's
# B = 2F, weight share 1/2) and m >= 2p - 1. No rank ever waits once its first input has
# arrived, batch after batch (each rank's weight halves of batch t fill the wait for batch t + 1),
# so the run takes T m (F + B) plus, once, the last rank's wait for its first input, (p - 1)
# chunk forwards: every rank idles exactly (p - 1) F / 2 per run, (p - 1) F / (2 T) per batch.
# Every rank holds at most 2p chunk activations, p stages' worth: 1F1B's peak.
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("forward", [1.0, 2.5])
def test_zbv_idles_only_its_first_fill_in_the_ideal_case(p: int, forward: float) -> None:
    plan = chunked("v", p, 2, forward, 2 * forward)
    for m in (2 * p - 1, 2 * p, 4 * p):
        for batches in (1, 3):
            result = simulate(build(plan, "zbv", batches, m), weight_share=0.5)
            fill = (p - 1) * forward / 2
            assert result.total_ms == pytest.approx(batches * m * 3 * forward + fill, abs=1e-9)
            assert idle(result) == pytest.approx([fill] * p, abs=1e-9)
            assert result.rank_in_flight == (2 * p,) * p


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize(("forward", "backward", "share"), TIMES)
def test_zbv_idles_less_than_1f1b_on_the_same_work(
    p: int, forward: float, backward: float, share: float
) -> None:
    flat = dataclasses.replace(
        Plan.from_balance([1] * p),
        stages=tuple(
            dataclasses.replace(s, forward_ms=forward, backward_ms=backward)
            for s in Plan.from_balance([1] * p).stages
        ),
    )
    v_plan = chunked("v", p, 2, forward, backward)
    for m in (2 * p, 4 * p):
        one_f_one_b = simulate(build(flat, "flush", 3, m))
        zbv = simulate(build(v_plan, "zbv", 3, m), weight_share=share)
        assert zbv.total_ms < one_f_one_b.total_ms
