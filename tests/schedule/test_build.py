"""The builder: golden lists for small cases and the update rules of every mode.

The version oracle below restates docs/guide.md's table (straight pipelines) and the 1F1B-RR rules
(replicated stages) independently of ``rules.py``.
"""

from __future__ import annotations

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import CONTIGUOUS_MODES, ActionKind, Schedule, build, validate

K = ActionKind


def lists(schedule: Schedule) -> list[str]:
    return [" ".join(str(action) for action in actions) for actions in schedule.actions]


def test_golden_async_two_stages_four_minibatches() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", num_batches=4, microbatches=1)
    assert lists(schedule) == [
        "0F0v0 0>a0@1 0F1v0 0>a1@1 0<g0@1 0B0v0 0Sv1 0F2v1 0>a2@1 0<g1@1 0B1v0 0Sv2 "
        "0F3v2 0>a3@1 0<g2@1 0B2v1 0Sv3 0<g3@1 0B3v2 0Sv4",
        "1<a0@0 1F0v0 1B0v0 1>g0@0 1Sv1 1<a1@0 1F1v1 1B1v1 1>g1@0 1Sv2 "
        "1<a2@0 1F2v2 1B2v2 1>g2@0 1Sv3 1<a3@0 1F3v3 1B3v3 1>g3@0 1Sv4",
    ]


def test_golden_async_replicated_two_one() -> None:
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    assert lists(build(plan, "async", 2, 2)) == [
        "0F0v0 0>a0@2 0F2v0 0>a2@2 0<g0@2 0B0v0 0Av1 0Sv1 0<g2@2 0B2v0 0Av2 0Sv2",
        "0F1v0 0>a1@2 0F3v0 0>a3@2 0<g1@2 0B1v0 0Av1 0Sv1 0<g3@2 0B3v0 0Av2 0Sv2",
        "1<a0@0 1F0v0 1B0v0 1>g0@0 1Sv1 1<a1@1 1F1v1 1B1v1 1>g1@1 1Sv2 "
        "1<a2@0 1F2v2 1B2v2 1>g2@0 1Sv3 1<a3@1 1F3v3 1B3v3 1>g3@1 1Sv4",
    ]


def test_golden_gpipe_and_flush() -> None:
    plan = Plan.from_balance([1, 1])
    assert lists(build(plan, "gpipe", 1, 2)) == [
        "0F0v0 0>a0@1 0F1v0 0>a1@1 0<g0@1 0B0v0 0<g1@1 0B1v0 0Sv1",
        "1<a0@0 1F0v0 1<a1@0 1F1v0 1B0v0 1>g0@0 1B1v0 1>g1@0 1Sv1",
    ]
    assert lists(build(plan, "flush", 2, 2))[1] == (
        "1<a0@0 1F0v0 1B0v0 1>g0@0 1<a1@0 1F1v0 1B1v0 1>g1@0 1Sv1 "
        "1<a2@0 1F2v1 1B2v1 1>g2@0 1<a3@0 1F3v1 1B3v1 1>g3@0 1Sv2"
    )


def test_golden_2bw_steps_once_per_batch_without_flushing() -> None:
    rank0 = lists(build(Plan.from_balance([1, 1]), "2bw", 3, 2))[0]
    assert rank0 == (
        "0F0v0 0>a0@1 0F1v0 0>a1@1 0<g0@1 0B0v0 0F2v0 0>a2@1 0<g1@1 0B1v0 0Sv1 "
        "0F3v0 0>a3@1 0<g2@1 0B2v0 0F4v1 0>a4@1 0<g3@1 0B3v0 0Sv2 "
        "0F5v1 0>a5@1 0<g4@1 0B4v1 0<g5@1 0B5v1 0Sv3"
    )


def oracle_version(plan: Plan, sync: str, m: int, stage: int, i: int) -> int:
    """docs/guide.md's table for straight plans; the 1F1B-RR rules for replicated ones."""
    p, t = plan.num_stages, i // m
    if sync == "2bw":
        return max(0, t - 1)
    if sync in ("flush", "gpipe", "zero_bubble"):
        return t
    if plan.straight:
        return max(0, i - (p - 1 - stage)) if sync == "async" else max(0, i - (p - 1))
    r, w = plan.stages[stage].replicas, plan.stages[stage].warmup
    if sync == "async":
        return max(0, i // r - w)
    r0, w0 = plan.stages[0].replicas, plan.stages[0].warmup
    return (r0 * max(0, i // r0 - w0)) // r


def oracle_update(plan: Plan, sync: str, m: int, stage: int, i: int) -> int:
    if sync in ("async", "vertical_sync"):
        return i // plan.stages[stage].replicas + 1
    return i // m + 1


def cases(plan: Plan) -> list[tuple[str, int, int]]:
    m = 2 * plan.num_stages  # a multiple of every replica count here, and >= stages for 2bw
    return [(sync, t, m) for sync in CONTIGUOUS_MODES for t in (1, 3)] + [("async", 5, 2)]


def test_versions_and_updates_follow_the_rules(plan: Plan) -> None:
    for sync, num_batches, m in cases(plan):
        schedule = build(plan, sync, num_batches, m)
        validate(schedule)
        for actions in schedule.actions:
            steps = 0
            for action in actions:
                if action.kind is K.STEP:
                    steps += 1
                    assert action.version == steps
                elif action.kind in (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT):
                    i, s = action.minibatch, action.stage
                    assert action.version == oracle_version(plan, sync, m, s, i), (sync, action)
                    assert action.version <= steps
                    if action.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):  # into the next step
                        assert oracle_update(plan, sync, m, s, i) == steps + 1
            stage = plan.stages[actions[0].stage]
            per_minibatch = sync in ("async", "vertical_sync")
            total = num_batches * m // stage.replicas if per_minibatch else num_batches
            assert steps == total


def test_straight_async_versions_match_design_table() -> None:
    schedule = build(Plan.from_balance([1, 1, 1, 1]), "async", 6, 1)
    for actions in schedule.actions:
        for action in actions:
            if action.kind is K.FORWARD:
                assert action.version == max(0, action.minibatch - (3 - action.stage))


def test_replicas_take_minibatches_round_robin_and_reply_to_the_same_replica(plan: Plan) -> None:
    schedule = build(plan, "async", 2, 4)
    for actions in schedule.actions:
        for action in actions:
            if action.minibatch is None:
                continue
            stage = plan.stages[action.stage]
            assert action.rank == stage.ranks[action.minibatch % stage.replicas]
            if action.peer is not None:
                step = 1 if action.kind in (K.SEND_ACTIVATION, K.RECV_GRAD) else -1
                other = plan.stages[action.stage + step]
                assert action.peer == other.ranks[action.minibatch % other.replicas]


def test_allreduce_only_among_replicas_before_each_step(plan: Plan) -> None:
    schedule = build(plan, "async", 2, 4)
    for actions in schedule.actions:
        stage = plan.stages[actions[0].stage]
        for before, action in zip(actions, actions[1:], strict=False):
            if action.kind is K.STEP:
                replicated = before.kind is K.ALLREDUCE and before.version == action.version
                assert replicated == (stage.replicas > 1)


def test_every_forward_of_a_batch_precedes_the_next_batch(plan: Plan) -> None:
    for sync in CONTIGUOUS_MODES:
        for actions in build(plan, sync, 3, 4).actions:
            batches = [a.batch for a in actions if a.kind is K.FORWARD]
            assert batches == sorted(batches)
