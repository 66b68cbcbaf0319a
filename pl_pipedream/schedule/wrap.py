"""One compute token of one rank turned into its actions: the compute wrapped in its messages.

A forward is wrapped as receive activation, forward, send activation; a backward (or the input
half of a split one) as receive gradient, backward, send gradient; a weight half stands alone;
an update ``("U", u)`` is ``ALLREDUCE`` (replicated stages only) then ``STEP``. Messages go to the
replica that serves the minibatch at the neighbouring stage (1F1B-RR, SOSP'19 section 3.2); when
that stage sits on the same rank (the turn of a V, module ``chunked``), the message goes from
the rank to itself and is a hand-over in its own memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["Place", "place", "wrap"]

_INPUT_GRAD = {"B": ActionKind.BACKWARD, "I": ActionKind.BACKWARD_INPUT}


@dataclass(frozen=True)
class Place:
    """Where a rank's tokens of one stage run: the fields every action carries, and the
    neighbouring stages that messages go to (None at either end of the pipeline)."""

    here: dict[str, int]
    replicas: int
    before: Stage | None
    after: Stage | None


def place(plan: Plan, rank: int, stage_index: int) -> Place:
    """The ``Place`` of ``rank``'s tokens at ``stage_index``."""
    stage = plan.stages[stage_index]
    return Place(
        here={"rank": rank, "stage": stage_index, "replica": stage.ranks.index(rank)},
        replicas=stage.replicas,
        before=None if stage_index == 0 else plan.stages[stage_index - 1],
        after=None if stage_index == plan.num_stages - 1 else plan.stages[stage_index + 1],
    )


def wrap(
    plan: Plan,
    sync: SyncMode,
    microbatches: int,
    where: Place,
    token: tuple[str, int],
    out: list[Action],
) -> None:
    """Append to ``out`` (the rank's list so far) the actions of ``token`` at ``where``."""
    kind, index = token
    here = where.here
    if kind == "U":
        batch = out[-1].batch  # the backward that closes the update
        if where.replicas > 1:
            out.append(Action(ActionKind.ALLREDUCE, batch=batch, version=index, **here))
        out.append(Action(ActionKind.STEP, batch=batch, version=index, **here))
        return
    version = rules.weight_version(plan, sync, microbatches, here["stage"], index)
    tagged = {**here, "minibatch": index, "batch": index // microbatches}
    if kind == "W":
        out.append(Action(ActionKind.BACKWARD_WEIGHT, version=version, **tagged))
        return
    if kind == "F":
        receive, compute, send = _FORWARD
        source, target = where.before, where.after
    else:
        receive, compute, send = ActionKind.RECV_GRAD, _INPUT_GRAD[kind], ActionKind.SEND_GRAD
        source, target = where.after, where.before
    if source is not None:
        out.append(Action(receive, peer=rules.rank_of(source, index), **tagged))
    out.append(Action(compute, version=version, **tagged))
    if target is not None:
        out.append(Action(send, peer=rules.rank_of(target, index), **tagged))


_FORWARD = (ActionKind.RECV_ACTIVATION, ActionKind.FORWARD, ActionKind.SEND_ACTIVATION)
