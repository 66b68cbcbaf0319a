"""How many messages a rank can have sent on a link that its peer has not yet received.

A message is in flight from its ``SEND`` until the peer's matching ``RECV`` has run. The count
here is the worst case over every timing the schedule allows, not one simulated run: when a rank
runs its ``k``-th send on a link (k from 0), the peer has surely run only the receives on that
link that happen before that send: those linked to it by a chain of each rank's own order,
messages (a receive after its send) and ``ALLREDUCE`` meetings, the dependencies ``Progress``
states. Every other receive of the link may still be ahead of the peer, so ``k + 1 - (those
receives)`` messages can be in flight then; the link's count is the most of that over its sends.

``sends_in_flight`` follows every chain through the whole schedule. ``sends_in_flight_between``
reads two ranks' lists alone, which is exact when every chain from the peer back to the rank
ends with a message from the peer to the rank, as in a straight pipeline (a chain that leaves
the peer for another stage must come back through the peer itself); it costs one pass over the
two lists.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from pl_pipedream.schedule.actions import (
    RECVS,
    SENDS,
    Action,
    ActionKind,
    Schedule,
    message_key,
)
from pl_pipedream.schedule.progress import Progress

__all__ = [
    "Outgoing",
    "every_rank_sends_in_flight",
    "sends_in_flight",
    "sends_in_flight_between",
]

Outgoing = tuple[int, str]  # (peer rank, "a" activations or "g" gradients): one sending link


def sends_in_flight(schedule: Schedule, rank: int) -> dict[Outgoing, int]:
    """For each link ``rank`` sends on, the most of its messages in flight at once."""
    return _every_count(schedule, [rank], _known_before(schedule, [rank]))[0]


def every_rank_sends_in_flight(schedule: Schedule) -> list[dict[Outgoing, int]]:
    """``sends_in_flight`` of every rank, from one pass over the schedule."""
    ranks = list(range(schedule.num_ranks))
    return _every_count(schedule, ranks, _known_before(schedule, ranks))


def _every_count(
    schedule: Schedule, ranks: Sequence[int], known: dict[int, list[list[int]]]
) -> list[dict[Outgoing, int]]:
    actions, out = schedule.actions, []
    for rank in ranks:
        counts: dict[Outgoing, int] = {}
        for peer in sorted({_link(a)[0] for a in actions[rank] if a.kind in SENDS}):
            seen = [clock[peer] for clock in known[rank]]
            counts |= _counts(actions[rank], actions[peer], rank, peer, seen)
        out.append(counts)
    return out


def sends_in_flight_between(
    actions: Sequence[Action], peer_actions: Sequence[Action], rank: int, peer: int
) -> dict[Outgoing, int]:
    """``sends_in_flight`` of ``rank``'s links to ``peer`` from the two lists alone (exact when
    every chain from the peer to the rank ends with a message between them)."""
    sent_at = {message_key(a): pos for pos, a in enumerate(peer_actions) if a.kind in SENDS}
    known, latest = [], -1
    for action in actions:
        known.append(latest)
        if action.kind in RECVS and action.peer == peer:
            latest = max(latest, sent_at[message_key(action)])
    return _counts(actions, peer_actions, rank, peer, known)


def _counts(
    actions: Sequence[Action],
    peer_actions: Sequence[Action],
    rank: int,
    peer: int,
    known: Sequence[int],
) -> dict[Outgoing, int]:
    """The counts of ``rank``'s links to ``peer``, ``known[pos]`` being the last position of
    the peer's list that surely has run when ``rank`` starts its action ``pos``."""
    counts: dict[Outgoing, int] = {}
    for tensor in ("a", "g"):
        received = [
            pos
            for pos, a in enumerate(peer_actions)
            if a.kind in RECVS and a.peer == rank and _tensor(a) == tensor
        ]
        sent = 0
        for pos, action in enumerate(actions):
            if action.kind in SENDS and _link(action) == (peer, tensor):
                sent += 1
                done = bisect.bisect_right(received, known[pos])
                counts[(peer, tensor)] = max(counts.get((peer, tensor), 0), sent - done)
    return counts


def _tensor(action: Action) -> str:
    key = message_key(action)
    assert key is not None  # a message action
    return key[0]


def _link(send: Action) -> Outgoing:
    assert send.peer is not None  # the builder names every message's peer
    return (send.peer, _tensor(send))


def _known_before(schedule: Schedule, ranks: Sequence[int]) -> dict[int, list[list[int]]]:
    """For each of ``ranks`` and each of its actions, the last position of every rank's list
    that surely has run when it starts that action (-1: none): one pass over the schedule in
    an order its dependencies allow, each rank carrying what it knows (a vector clock)."""
    progress = Progress(schedule)
    width = schedule.num_ranks
    known = [[-1] * width for _ in range(width)]
    mailbox: dict[object, list[int]] = {}
    before: dict[int, list[list[int]]] = {rank: [] for rank in ranks}
    moved = True
    while moved:
        moved = False
        for r in range(width):
            while progress.ready(r):
                action, movers = progress.next(r), progress.movers(r)
                assert action is not None  # ready
                for m in movers:
                    if m in before:
                        before[m].append(list(known[m]))
                if action.kind in RECVS:
                    got = mailbox.pop(message_key(action))
                    known[r] = [max(a, b) for a, b in zip(known[r], got, strict=True)]
                elif action.kind is ActionKind.ALLREDUCE:
                    met = [max(column) for column in zip(*(known[m] for m in movers), strict=True)]
                    for m in movers:
                        known[m] = list(met)
                for m in movers:
                    known[m][m] = progress.position[m]
                if action.kind in SENDS:
                    mailbox[message_key(action)] = list(known[r])
                progress.advance(r)
                moved = True
    return before
