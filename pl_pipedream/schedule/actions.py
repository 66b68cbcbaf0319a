"""A schedule as data: per-rank lists of actions that print compactly.

Each rank runs its own list in order. A compute action (forward, backward) carries the weight
version it uses, so weight stashing (PipeDream, SOSP'19 section 3.3) can be checked without running
anything; a ``STEP`` carries the version it produces (the stage's update count after it).

Compact strings, with ``s`` the stage, ``i`` the global minibatch index, ``v`` a version and
``r`` the peer rank:

======================  ===========  ==================================================
kind                    string       meaning
======================  ===========  ==================================================
``FORWARD``             ``sFivv``    stage s runs the forward pass of minibatch i (version v)
``BACKWARD``            ``sBivv``    stage s runs the backward pass of minibatch i (version v)
``BACKWARD_INPUT``      ``sIivv``    the input-gradient half of that backward (split modes)
``BACKWARD_WEIGHT``     ``sWivv``    its weight-gradient half, later, on the same weights
``SEND_ACTIVATION``     ``s>ai@r``   stage s sends minibatch i's output activation to rank r
``RECV_ACTIVATION``     ``s<ai@r``   stage s receives minibatch i's input activation from rank r
``SEND_GRAD``           ``s>gi@r``   stage s sends the gradient of its input to rank r
``RECV_GRAD``           ``s<gi@r``   stage s receives the gradient of its output from rank r
``ALLREDUCE``           ``sAvv``     the replicas of stage s average the gradients of update v
``STEP``                ``sSvv``     stage s applies update v (its weights become version v)
======================  ===========  ==================================================

So ``1F5v3`` is stage 1's forward of minibatch 5 with version 3 and ``1>a5@2`` sends that
forward's output to rank 2.

A mode that splits the backward (``SyncMode.splits_backward``) runs ``BACKWARD_INPUT`` where the
others run ``BACKWARD``: it computes the gradient of the stage's input, which is sent upstream at
once, and ``BACKWARD_WEIGHT`` computes the weight gradient later, into a bubble (zero-bubble
pipeline parallelism, Qi et al., ICLR'24).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["BUSY_KINDS", "Action", "ActionKind", "Schedule", "ScheduleError"]


class ScheduleError(ValueError):
    """A schedule that breaks one of the rules the runtime relies on.

    ``cells`` holds the (rank, action index) of the failing actions, as marked in the message's
    table.
    """

    def __init__(self, message: str, cells: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__(message)
        self.cells = cells


class ActionKind(str, enum.Enum):
    """What one entry of a rank's list does."""

    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    BACKWARD_INPUT = "BACKWARD_INPUT"
    BACKWARD_WEIGHT = "BACKWARD_WEIGHT"
    SEND_ACTIVATION = "SEND_ACTIVATION"
    RECV_ACTIVATION = "RECV_ACTIVATION"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"


# Every compute action; the ones that send a gradient upstream (the whole backward or its input
# half); the ones that give a weight gradient to an update (the whole backward or its weight half).
COMPUTE = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)
INPUT_GRADS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT})
WEIGHT_GRADS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT})
SENDS = frozenset({ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRAD})
RECVS = frozenset({ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRAD})
MESSAGES = SENDS | RECVS
# The messages that cross to the next stage's side: an activation sent on, a gradient received.
_UPWARD = frozenset({ActionKind.SEND_ACTIVATION, ActionKind.RECV_GRAD})
UPDATES = frozenset({ActionKind.ALLREDUCE, ActionKind.STEP})
# The kinds during which a rank works; the rest of its time is bubble, waiting for messages and
# all-reduces included (the simulator's and the runtime's measured bubbles alike). A kind's name
# is in it too: ActionKind is a str enum, so "FORWARD" in BUSY_KINDS holds.
BUSY_KINDS = COMPUTE | {ActionKind.STEP}

_SYMBOL = {
    ActionKind.FORWARD: "F",
    ActionKind.BACKWARD: "B",
    ActionKind.BACKWARD_INPUT: "I",
    ActionKind.BACKWARD_WEIGHT: "W",
    ActionKind.SEND_ACTIVATION: ">a",
    ActionKind.RECV_ACTIVATION: "<a",
    ActionKind.SEND_GRAD: ">g",
    ActionKind.RECV_GRAD: "<g",
    ActionKind.ALLREDUCE: "A",
    ActionKind.STEP: "S",
}


@dataclass(frozen=True, slots=True)
class Action:
    """One entry of one rank's list; see the module docstring for the string form.

    ``minibatch`` is the global index ``i = t * m + j`` (None for ``ALLREDUCE`` and ``STEP``),
    ``batch`` the Lightning batch ``t`` it belongs to (for an update: the batch whose backward
    passes complete it), ``version`` the weights a compute action uses or the version an update
    produces (None for messages), ``peer`` the other rank of a message (None otherwise).
    """

    kind: ActionKind
    rank: int
    stage: int
    replica: int
    minibatch: int | None = None
    batch: int | None = None
    version: int | None = None
    peer: int | None = None

    def __str__(self) -> str:
        symbol = _SYMBOL[self.kind]
        if self.kind in COMPUTE:
            return f"{self.stage}{symbol}{self.minibatch}v{self.version}"
        if self.kind in MESSAGES:
            return f"{self.stage}{symbol}{self.minibatch}@{self.peer}"
        return f"{self.stage}{symbol}v{self.version}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Action:
        return cls(**{**data, "kind": ActionKind(data["kind"])})


def message_key(action: Action) -> tuple[str, int | None, int, int, int] | None:
    """What pairs a send with its receive: tensor, minibatch, source rank, destination rank,
    and the lower stage of the two it joins (a rank of several stages, module ``chunked``,
    exchanges one minibatch's tensors with the same peer at more than one boundary)."""
    kind = action.kind
    if kind not in MESSAGES:
        return None
    tensor = "a" if kind in (ActionKind.SEND_ACTIVATION, ActionKind.RECV_ACTIVATION) else "g"
    peer = -1 if action.peer is None else action.peer
    lower = action.stage if kind in _UPWARD else action.stage - 1
    if kind in SENDS:
        return (tensor, action.minibatch, action.rank, peer, lower)
    return (tensor, action.minibatch, peer, action.rank, lower)


def collective_key(action: Action) -> tuple[int, int | None] | None:
    """What joins the replicas' ``ALLREDUCE`` actions into one collective: stage and update."""
    if action.kind is not ActionKind.ALLREDUCE:
        return None
    return (action.stage, action.version)


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one plan, sync mode and number of batches.

    ``actions[r]`` is rank r's list; minibatch ``i`` belongs to Lightning batch
    ``i // microbatches``. ``sync`` may be given as the mode's name; it is stored as the
    ``SyncMode``. ``scope`` names the ranks whose lists were built (None: every rank): the other
    lists are left empty, and the checks take what passes between a held rank and one outside
    the scope as given, since that rank's own checks see it (module ``scope``).
    """

    sync: SyncMode
    plan: Plan
    num_batches: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    scope: frozenset[int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync", SyncMode.parse(self.sync))
        if self.scope is not None:
            object.__setattr__(self, "scope", frozenset(self.scope))

    def holds(self, rank: int | None) -> bool:
        """Whether ``rank``'s list was built (a rank of no list, None, is never held)."""
        if rank is None:
            return False
        return self.scope is None or rank in self.scope

    @property
    def held_ranks(self) -> tuple[int, ...]:
        """The ranks whose lists were built, in order."""
        if self.scope is None:
            return tuple(range(self.num_ranks))
        return tuple(sorted(self.scope))

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_minibatches(self) -> int:
        return self.num_batches * self.microbatches

    def to_dict(self) -> dict[str, Any]:
        return {
            "sync": self.sync.value,
            "plan": self.plan.to_dict(),
            "num_batches": self.num_batches,
            "microbatches": self.microbatches,
            "actions": [[action.to_dict() for action in rank] for rank in self.actions],
            "scope": None if self.scope is None else sorted(self.scope),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        return cls(
            sync=SyncMode.parse(data["sync"]),
            plan=Plan.from_dict(dict(data["plan"])),
            num_batches=int(data["num_batches"]),
            microbatches=int(data["microbatches"]),
            actions=tuple(
                tuple(Action.from_dict(action) for action in rank) for rank in data["actions"]
            ),
            scope=None if data.get("scope") is None else frozenset(data["scope"]),
        )
