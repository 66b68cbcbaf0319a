"""Reading a rank's action list: the fields each action must carry, when each weight version is
last used, and which receives can be posted ahead (``run_posting_ahead`` runs a list so).

The executor runs its actions one by one, but two decisions need the whole list (the loaded
actions and the next steps' as far as they are known): a weight version may be released once no
later action uses it (``last_uses``), and a receive posted early lets its bytes move while the
rank computes (``receives_ahead``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pl_pipedream.runtime.channel import Channel, Link
from pl_pipedream.runtime.tags import Tag
from pl_pipedream.schedule.actions import COMPUTE, Action, ActionKind

__all__ = [
    "RECEIVES",
    "ExecutorError",
    "batch_of",
    "last_uses",
    "minibatch_of",
    "peer_of",
    "receives_ahead",
    "run_posting_ahead",
    "version_of",
]

# The receive actions and the tag of what each receives.
RECEIVES = {ActionKind.RECV_ACTIVATION: Tag.ACTIVATION, ActionKind.RECV_GRAD: Tag.GRAD}
_COMPUTE = COMPUTE  # a split backward's halves use the forward's version too


class ExecutorError(RuntimeError):
    """A stage could not run an action; the message names the rank, stage and action."""


def last_uses(actions: Sequence[Action], weight_prediction: bool) -> dict[int, int]:
    """For each weight version, the position of the last action in ``actions`` that uses it
    (with ``weight_prediction``, a forward on version v also reads v - 1)."""
    last: dict[int, int] = {}
    for index, action in enumerate(actions):
        if action.kind in _COMPUTE and action.version is not None:
            last[action.version] = index
            if weight_prediction and action.kind is ActionKind.FORWARD:
                last[action.version - 1] = index  # W_(v-1) of the prediction
    return last


def minibatch_of(action: Action) -> int:
    """The minibatch of a message or compute action (the schedule gives every one of them)."""
    value = action.minibatch
    if value is None:
        raise _missing("minibatch", action)
    return value


def peer_of(action: Action) -> int:
    """The other rank of a message action."""
    value = action.peer
    if value is None:
        raise _missing("peer", action)
    return value


def batch_of(action: Action) -> int:
    """The Lightning batch a message or compute action belongs to."""
    value = action.batch
    if value is None:
        raise _missing("batch", action)
    return value


def version_of(action: Action) -> int:
    """The weights' version a compute action uses."""
    value = action.version
    if value is None:
        raise _missing("version", action)
    return value


def _missing(field: str, action: Action) -> ExecutorError:
    """The error for an action without ``field`` (each accessor checks inline: they run
    several times per action)."""
    return ExecutorError(
        f"a {action.kind.name} action must name its {field} (action: {action}); "
        "run a schedule made by schedule.build"
    )


def receives_ahead(actions: Sequence[Action]) -> tuple[list[Link], dict[int, Link]]:
    """The links (peer, tag) that ``actions`` receive from, and, for each receive that has a
    successor on its link, that link keyed by the receive's position: once a receive is
    done, the next one on its link can be posted. A posted receive takes the link's next
    message, whichever action awaits it, so posting early never changes what is received."""
    last: dict[Link, int] = {}
    following: dict[int, Link] = {}
    for position, action in enumerate(actions):
        if action.kind in RECEIVES:
            link = (peer_of(action), RECEIVES[action.kind])
            if link in last:
                following[last[link]] = link
            last[link] = position
    return list(last), following


def run_posting_ahead(
    actions: Sequence[Action],
    lookahead: Sequence[Action],
    channel: Channel,
    run: Callable[[Action, int], None],
) -> None:
    """``run(action, position)`` for each of ``actions`` in order, the first receive of each
    link of ``actions`` and ``lookahead`` posted on ``channel`` at once and each later one as
    soon as the receive before it on its link is done (``receives_ahead``). A link from the
    rank to itself (``runtime.chunks``) is not the channel's and is not posted."""
    first, following = receives_ahead((*actions, *lookahead))
    for peer, tag in first:
        if peer != channel.rank:
            channel.expect(peer, tag)
    for position, action in enumerate(actions):
        run(action, position)
        link = following.get(position)
        if link is not None and link[0] != channel.rank:
            channel.expect(*link)
