"""The rules a schedule must keep, one function each; each returns a ``Problem`` or None.

``validate`` runs them in order and turns the first problem into a ``ScheduleError``. Over a
schedule that holds only some ranks' lists (``Schedule.scope``), each rule judges what those
lists hold: a message to or from a rank outside the scope is taken as matched, and a stage is
checked whole only if all of its replicas are held (module ``scope``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from pl_pipedream.schedule import rules
from pl_pipedream.schedule.actions import (
    COMPUTE,
    MESSAGES,
    RECVS,
    SENDS,
    Action,
    ActionKind,
    Schedule,
    collective_key,
    message_key,
)
from pl_pipedream.schedule.problem import Cell, Problem
from pl_pipedream.schedule.progress import Progress
from pl_pipedream.schedule.segments import segment_indices
from pl_pipedream.schedule.split_checks import (
    Key,
    cells_of,
    check_split_counts,
    check_split_order,
    check_split_versions,
)
from pl_pipedream.schedule.version_checks import check_versions

__all__ = ["CHECKS", "Problem"]

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD
_PEER_STAGE = {  # which neighbouring stage each message goes to or comes from
    ActionKind.SEND_ACTIVATION: 1,
    ActionKind.RECV_ACTIVATION: -1,
    ActionKind.SEND_GRAD: -1,
    ActionKind.RECV_GRAD: 1,
}


def _actions(schedule: Schedule) -> Iterator[tuple[int, int, Action]]:
    for rank in schedule.held_ranks:
        for pos, action in enumerate(schedule.actions[rank]):
            yield rank, pos, action


def _linked(schedule: Schedule, action: Action) -> bool:
    """A message whose peer's list is held, so its partner can be looked for."""
    return schedule.holds(action.peer)


def check_shape(schedule: Schedule) -> Problem | None:
    """One list per worker, and every action tagged with its own rank and stage."""
    plan = schedule.plan
    if schedule.num_ranks != plan.num_workers:
        return Problem(
            f"a schedule has one action list per worker (lists: {schedule.num_ranks}, workers: "
            f"{plan.num_workers}); build it from the same plan"
        )
    replica_of: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> its stages' replicas
    for stage in plan.stages:
        for replica, rank in enumerate(stage.ranks):
            replica_of[rank][stage.index] = replica
    for rank, pos, action in _actions(schedule):
        if action.rank != rank or replica_of[rank].get(action.stage, -1) != action.replica:
            return Problem(
                f"an action must name the rank, stage and replica whose list holds it (rank "
                f"{rank}: {action!r}); rebuild the schedule",
                ((rank, pos),),
            )
        problem = _check_placement(schedule, action)
        if problem is not None:
            return Problem(problem, ((rank, pos),))
    return None


def _check_placement(schedule: Schedule, action: Action) -> str | None:
    """Compute and messages go to the replica that round robin (1F1B-RR) gives the minibatch."""
    plan, kind = schedule.plan, action.kind
    if kind in COMPUTE or kind in MESSAGES:
        i = action.minibatch
        if i is None or not 0 <= i < schedule.num_minibatches:
            return (
                f"a minibatch index must lie in 0..{schedule.num_minibatches - 1} "
                f"(action {action}: minibatch {i}); build with the schedule's counts"
            )
        if action.batch != i // schedule.microbatches:
            return (
                f"minibatch i belongs to batch i // m (action {action}: batch {action.batch}); "
                "tag it with its batch"
            )
        if rules.rank_of(plan.stages[action.stage], i) != action.rank:
            return (
                f"minibatch i runs on replica i mod r_s of each stage (action {action} on rank "
                f"{action.rank}, expected rank {rules.rank_of(plan.stages[action.stage], i)}); "
                "move it to that rank's list"
            )
    if kind in COMPUTE and action.version is None:
        return f"a forward or backward names its weight version (action {action!r}); set one"
    if kind in MESSAGES:
        other = action.stage + _PEER_STAGE[kind]
        if not 0 <= other < plan.num_stages:
            return (
                f"a message goes to a neighbouring stage (action {action}: stage {other}); drop it"
            )
        expected = rules.rank_of(plan.stages[other], action.minibatch)  # type: ignore[arg-type]
        if action.peer != expected:
            return (
                f"a message goes to the replica that serves the minibatch (action {action}: "
                f"peer {action.peer}, expected {expected}); use rank_of(stage, minibatch)"
            )
    if kind is ActionKind.ALLREDUCE and plan.stages[action.stage].replicas == 1:
        return f"only a replicated stage averages gradients (action {action}: replicas 1); drop it"
    if kind in (ActionKind.ALLREDUCE, ActionKind.STEP) and action.version is None:
        return f"an update names the version it produces (action {action!r}); set one"
    return None


def check_pairs(schedule: Schedule) -> Problem | None:
    """Each minibatch runs forward then backward once per stage, same rank, same version (in a
    mode that splits the backward, the input half stands for it here; ``split_checks`` checks
    the weight half)."""
    plan = schedule.plan
    backward_kind = ActionKind.BACKWARD_INPUT if schedule.sync.splits_backward else _B
    seen = cells_of(schedule, COMPUTE | MESSAGES)
    for stage in plan.stages:
        if not all(schedule.holds(rank) for rank in stage.ranks):
            continue
        for i in range(schedule.num_minibatches):
            forwards, backwards = seen[(_F, stage.index, i)], seen[(backward_kind, stage.index, i)]
            if len(forwards) != 1 or len(backwards) != 1:
                return Problem(
                    f"every minibatch has one forward and one backward at every stage (stage "
                    f"{stage.index}, minibatch {i}: forwards {len(forwards)}, backwards "
                    f"{len(backwards)}); forward-only schedules are not supported",
                    tuple(forwards + backwards),
                )
            (rank, f_pos), (_, b_pos) = forwards[0], backwards[0]
            forward, backward = schedule.actions[rank][f_pos], schedule.actions[rank][b_pos]
            if b_pos < f_pos or forward.version != backward.version:
                return Problem(
                    f"a backward follows its forward with the same weights (stage {stage.index}, "
                    f"minibatch {i}: {forward} at {f_pos}, {backward} at {b_pos}); stash the "
                    "forward's version for the backward",
                    ((rank, f_pos), (rank, b_pos)),
                )
            problem = _check_wrapping(schedule, seen, stage.index, i, f_pos, b_pos)
            if problem is not None:
                return problem
    return _check_batch_order(schedule)


def _check_wrapping(
    schedule: Schedule,
    seen: dict[Key, list[Cell]],
    stage: int,
    i: int,
    f_pos: int,
    b_pos: int,
) -> Problem | None:
    """Receive before the compute that needs it, send after the compute that makes it."""
    last = schedule.plan.num_stages - 1
    needs = [
        (ActionKind.RECV_ACTIVATION, stage > 0, f_pos, -1),
        (ActionKind.SEND_ACTIVATION, stage < last, f_pos, 1),
        (ActionKind.RECV_GRAD, stage < last, b_pos, -1),
        (ActionKind.SEND_GRAD, stage > 0, b_pos, 1),
    ]
    for kind, wanted, compute_pos, side in needs:
        cells = seen[(kind, stage, i)]
        where = "before" if side < 0 else "after"
        if wanted and (len(cells) != 1 or (cells[0][1] - compute_pos) * side <= 0):
            rank = schedule.plan.stages[stage].ranks[i % schedule.plan.stages[stage].replicas]
            return Problem(
                f"each forward and backward has one {kind.name} {where} it on its rank (stage "
                f"{stage}, minibatch {i}: found {len(cells)}); put the message {where} the compute",
                tuple(cells) or ((rank, compute_pos),),
            )
    return None


def _check_batch_order(schedule: Schedule) -> Problem | None:
    """Every forward of batch t comes before any forward of batch t + 1 on each rank."""
    for rank in schedule.held_ranks:
        batch = 0
        for pos, action in enumerate(schedule.actions[rank]):
            if action.kind is _F and action.batch is not None:
                if action.batch < batch:
                    return Problem(
                        f"forwards keep batch order on each rank (rank {rank}: {action} after a "
                        f"forward of batch {batch}); the runtime cuts lists at batch boundaries",
                        ((rank, pos),),
                    )
                batch = action.batch
    return None


def check_messages(schedule: Schedule) -> Problem | None:
    """Every send has exactly one receive on its peer and every receive one send."""
    sends: dict[tuple[object, ...], list[Cell]] = defaultdict(list)
    recvs: dict[tuple[object, ...], list[Cell]] = defaultdict(list)
    for rank, pos, action in _actions(schedule):
        if action.kind in SENDS and _linked(schedule, action):
            sends[message_key(action)].append((rank, pos))  # type: ignore[index]
        elif action.kind in RECVS and _linked(schedule, action):
            recvs[message_key(action)].append((rank, pos))  # type: ignore[index]
    for mine, theirs, what, fix in (
        (sends, recvs, "send", "add the receive on the peer"),
        (recvs, sends, "receive", "add the send on the peer"),
    ):
        for key, cells in mine.items():
            if len(cells) != len(theirs.get(key, [])):
                rank, pos = cells[0]
                action = schedule.actions[rank][pos]
                return Problem(
                    f"every {what} needs exactly one matching partner on its peer (rank {rank}: "
                    f"{action} x{len(cells)}, partners on rank {action.peer}: "
                    f"{len(theirs.get(key, []))}); {fix}",
                    tuple(cells),
                )
    return None


def check_link_order(schedule: Schedule) -> Problem | None:
    """Each link (sender, receiver, activations or gradients) delivers in the order it was sent:
    the runtime's channel pairs a link's receives with its sends first come, first served."""
    sent: dict[tuple[object, ...], list[Cell]] = defaultdict(list)
    taken: dict[tuple[object, ...], list[Cell]] = defaultdict(list)
    for rank, pos, action in _actions(schedule):
        if action.kind in MESSAGES and _linked(schedule, action):
            tensor, _, source, target, _ = message_key(action)  # type: ignore[misc]
            (sent if action.kind in SENDS else taken)[(source, target, tensor)].append((rank, pos))
    for link, sends in sent.items():
        receives = taken.get(link, [])
        for (s_rank, s_pos), (r_rank, r_pos) in zip(sends, receives, strict=False):
            send, receive = schedule.actions[s_rank][s_pos], schedule.actions[r_rank][r_pos]
            if message_key(send) != message_key(receive):
                return Problem(
                    f"a link's messages are received in the order they are sent (rank "
                    f"{s_rank} -> rank {r_rank}: {send} is sent when {receive} is taken); "
                    "order the receives as their sends",
                    ((s_rank, s_pos), (r_rank, r_pos)),
                )
    return None


def check_deadlock(schedule: Schedule) -> Problem | None:
    """Blocking receives, unbounded sends: some rank can always move until all lists end."""
    progress = Progress(schedule)
    progress.run_all()
    if not progress.stuck:
        return None
    waiting = ", ".join(f"rank {r}: {schedule.actions[r][p]}" for r, p in progress.stuck)
    return Problem(
        f"the schedule must not deadlock (stuck at {waiting}); reorder so that each receive's "
        "send can run first",
        progress.stuck,
    )


def check_segments(schedule: Schedule) -> Problem | None:
    """Inside Lightning step t no rank waits for an action another rank runs in a later step."""
    segment = segment_indices(schedule)
    sends: dict[tuple[object, ...], int] = {}
    groups: dict[tuple[object, ...], list[Cell]] = defaultdict(list)
    for rank, pos, action in _actions(schedule):
        if action.kind in SENDS:
            sends[message_key(action)] = segment[rank][pos]  # type: ignore[index]
        elif action.kind is ActionKind.ALLREDUCE:
            groups[collective_key(action)].append((rank, pos))  # type: ignore[index]
    for rank, pos, action in _actions(schedule):
        if not (action.kind in RECVS and _linked(schedule, action)):
            continue
        if sends[message_key(action)] > segment[rank][pos]:  # type: ignore[index]
            return Problem(
                f"a receive in Lightning step t needs its send in step t or earlier (rank {rank}: "
                f"{action} in step {segment[rank][pos]}, send in step "
                f"{sends[message_key(action)]}); move the send earlier",  # type: ignore[index]
                ((rank, pos),),
            )
    for cells in groups.values():
        if len({segment[rank][pos] for rank, pos in cells}) > 1:
            steps = [segment[rank][pos] for rank, pos in cells]
            return Problem(
                f"the replicas of an ALLREDUCE meet in the same Lightning step (steps: {steps}); "
                "use microbatches that the replicas share evenly",
                tuple(cells),
            )
    return None


CHECKS = (
    check_shape,
    check_messages,
    check_link_order,
    check_split_counts,
    check_pairs,
    check_split_order,
    check_split_versions,
    check_versions,
    check_deadlock,
    check_segments,
)
