"""One compute token of one rank turned into its actions: the compute wrapped in its messages.

A forward is wrapped as receive activation, forward, send activation; a backward (or the input
half of a split one) as receive gradient, backward, send gradient; a weight half stands alone;
an update ``("U", u)`` is ``ALLREDUCE`` (replicated stages only) then ``STEP``. Messages go to the
replica that serves the minibatch at the neighbouring stage (1F1B-RR, SOSP'19 section 3.2); when
that stage sits on the same rank (the turn of a V, module ``chunked``), the message goes from
the rank to itself and is a hand-over in its own memory.
"""

from __future__ import annotations

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["wrap"]

_INPUT_GRAD = {"B": ActionKind.BACKWARD, "I": ActionKind.BACKWARD_INPUT}


def wrap(
    plan: Plan,
    sync: SyncMode,
    microbatches: int,
    rank: int,
    stage_index: int,
    token: tuple[str, int],
    out: list[Action],
) -> None:
    """Append to ``out`` (rank's list so far) the actions of ``token`` at ``stage_index``."""
    kind, index = token
    stage = plan.stages[stage_index]
    here = {"rank": rank, "stage": stage_index, "replica": stage.ranks.index(rank)}
    if kind == "U":
        batch = out[-1].batch  # the backward that closes the update
        if stage.replicas > 1:
            out.append(Action(ActionKind.ALLREDUCE, batch=batch, version=index, **here))
        out.append(Action(ActionKind.STEP, batch=batch, version=index, **here))
        return
    before = None if stage_index == 0 else plan.stages[stage_index - 1]
    after = None if stage_index == plan.num_stages - 1 else plan.stages[stage_index + 1]
    version = rules.weight_version(plan, sync, microbatches, stage_index, index)
    tagged = {**here, "minibatch": index, "batch": index // microbatches}
    if kind == "W":
        out.append(Action(ActionKind.BACKWARD_WEIGHT, version=version, **tagged))
        return
    if kind == "F":
        receive, compute, send = (
            ActionKind.RECV_ACTIVATION,
            ActionKind.FORWARD,
            ActionKind.SEND_ACTIVATION,
        )
        source, target = before, after
    else:
        receive, compute, send = ActionKind.RECV_GRAD, _INPUT_GRAD[kind], ActionKind.SEND_GRAD
        source, target = after, before
    if source is not None:
        out.append(Action(receive, peer=rules.rank_of(source, index), **tagged))
    out.append(Action(compute, version=version, **tagged))
    if target is not None:
        out.append(Action(send, peer=rules.rank_of(target, index), **tagged))
