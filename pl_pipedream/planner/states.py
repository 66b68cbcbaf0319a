"""The states of PipeDream's dynamic program: the legal cuts of a layer graph.

For a chain, a cut falls after any layer. For a branchy graph (ResNet, GNMT) a cut is an
antichain: a set of nodes no one of which precedes another, so that a stage boundary through it
leaves every earlier node on one side (SOSP'19, section 3.1, "antichain DAG"). The states are
found as PipeDream finds them: start from the first source, repeatedly advance one node of the
*augmented* antichain (the antichain plus every earlier node whose output is still needed past
it) to one of its successors, and join each state to the states it advances to. The DP then
treats the states in a topological order of that DAG.

Every set of nodes is a Python ``int`` used as a bit set over the nodes' topological positions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pl_pipedream.profile.graph import Node, Profile

__all__ = [
    "MAX_STATES",
    "PlanningGraph",
    "State",
    "StateSpaceError",
    "planning_graph",
]

MAX_STATES = 4000


class StateSpaceError(ValueError):
    """The graph has too many legal cuts for the planner to enumerate."""


@dataclass(frozen=True)
class State:
    """One cut: everything in ``members`` (a bit set of nodes) runs before it."""

    antichain: tuple[int, ...]
    augmented: tuple[int, ...]
    members: int


@dataclass(frozen=True)
class PlanningGraph:
    """A profile prepared for planning: nodes in topological order and the DP's states.

    ``ancestors[j]`` is the bit set of states from which state ``j`` is reachable in the
    antichain DAG. ``inputs`` are the profile's input nodes (always placed on the first stage);
    ``dropped`` are unused output selectors (``__getitem__`` sinks) placed with their producer.
    ``cuts`` says how the states were found: ``"antichain"`` (every legal cut, as PipeDream) or
    ``"topological"`` (only the prefixes of one topological order).
    """

    nodes: tuple[Node, ...]
    states: tuple[State, ...]
    ancestors: tuple[int, ...]
    inputs: tuple[str, ...]
    dropped: tuple[tuple[str, str], ...]
    cuts: str = "antichain"

    def members(self, state_set: int) -> list[str]:
        return [self.nodes[i].node_id for i in _bits(state_set)]


def planning_graph(
    profile: Profile, max_states: int = MAX_STATES, cuts: str = "antichain"
) -> PlanningGraph:
    """Remove input sources and unused ``__getitem__`` sinks, then enumerate the states.

    Inputs cost nothing and always live on the first stage; selectors of an output that nothing
    reads cannot be cut usefully. Both are PipeDream's own preprocessing.

    ``cuts="antichain"`` enumerates every legal cut and raises ``StateSpaceError`` past
    ``max_states``; ``cuts="topological"`` uses only the prefixes of one topological order (one
    state per layer: fast for any graph, but it may miss the best cut of a branchy graph).
    """
    if cuts not in ("antichain", "topological"):
        raise StateSpaceError(
            f"cuts must be 'antichain' or 'topological' (cuts: {cuts!r}); pick one of the two"
        )
    succ = profile.successors()
    pred = profile.predecessors()
    inputs = [
        n.node_id for n in profile.nodes if not pred[n.node_id] and n.desc.startswith("Input")
    ]
    removed = set(inputs)
    kept_succ = {i: [s for s in succ[i] if s not in removed] for i in succ if i not in removed}
    kept_pred = {i: [p for p in pred[i] if p not in removed] for i in pred if i not in removed}
    dropped = []
    for node in profile.nodes:
        node_id = node.node_id
        if node_id in removed or kept_succ[node_id]:
            continue
        if node.desc.startswith("__getitem__"):
            owner = kept_pred[node_id][0] if kept_pred[node_id] else ""
            dropped.append((node_id, owner))
    for node_id, _ in dropped:
        removed.add(node_id)
    kept = Profile(
        tuple(n for n in profile.nodes if n.node_id not in removed),
        tuple((a, b) for a, b in profile.edges if a not in removed and b not in removed),
    )
    if not kept.nodes:
        raise StateSpaceError("a profile needs at least one layer besides its inputs")
    if cuts == "topological":
        return _prefixes(kept, tuple(inputs), tuple(dropped))
    return _enumerate(kept, tuple(inputs), tuple(dropped), max_states)


def _prefixes(
    kept: Profile, inputs: tuple[str, ...], dropped: tuple[tuple[str, str], ...]
) -> PlanningGraph:
    """One state per prefix of a topological order; its outputs are the prefix's live nodes."""
    order = kept.topological_order()
    index = {node_id: i for i, node_id in enumerate(order)}
    succ = kept.successors()
    last_use = [max((index[s] for s in succ[node_id]), default=-1) for node_id in order]
    states = []
    for k in range(len(order)):
        live = tuple(i for i in range(k + 1) if last_use[i] > k or i == k)
        states.append(State((k,), live, (1 << (k + 1)) - 1))
    ancestors = tuple((1 << k) - 1 for k in range(len(order)))
    nodes = tuple(kept.node(node_id) for node_id in order)
    return PlanningGraph(nodes, tuple(states), ancestors, inputs, dropped, "topological")


def _bits(mask: int) -> list[int]:
    """The positions of a bit set's ones, lowest first (the binary digits read backwards)."""
    return [i for i, bit in enumerate(reversed(bin(mask)[2:])) if bit == "1"]


def _enumerate(
    kept: Profile, inputs: tuple[str, ...], dropped: tuple[tuple[str, str], ...], max_states: int
) -> PlanningGraph:
    file_order = {n.node_id: i for i, n in enumerate(kept.nodes)}
    order = kept.topological_order()
    index = {node_id: i for i, node_id in enumerate(order)}
    nodes = tuple(kept.node(node_id) for node_id in order)
    succ_lists = kept.successors()
    pred_lists = kept.predecessors()
    succ = [[index[s] for s in succ_lists[node_id]] for node_id in order]
    succ_mask = [sum(1 << s for s in out) for out in succ]
    anc = [0] * len(order)
    for i, node_id in enumerate(order):
        for p in pred_lists[node_id]:
            anc[i] |= anc[index[p]] | (1 << index[p])
    desc = [0] * len(order)
    for i in reversed(range(len(order))):
        for s in succ[i]:
            desc[i] |= desc[s] | (1 << s)

    augmented_of: dict[tuple[int, ...], tuple[int, ...]] = {}

    def augment(antichain: tuple[int, ...]) -> tuple[int, ...]:
        known = augmented_of.get(antichain)
        if known is None:
            known = augmented_of[antichain] = _augment(antichain)
        return known

    # still_needed[a]: the ancestors of node a whose outputs some node outside a and its
    # ancestors still reads; they depend on a alone, so they are found once per node.
    still_needed: dict[int, int] = {}

    def _augment(antichain: tuple[int, ...]) -> tuple[int, ...]:
        extra = 0
        for a in antichain:
            if a not in still_needed:
                before = anc[a]
                closed = before | (1 << a)
                still_needed[a] = sum(1 << p for p in _bits(before) if succ_mask[p] & ~closed)
            extra |= still_needed[a]
        return tuple(sorted(set(_bits(extra)) | set(antichain)))

    def deaugment(candidates: list[int]) -> tuple[int, ...]:
        present = 0
        for c in candidates:
            present |= 1 << c
        return tuple(sorted({c for c in candidates if not desc[c] & present}))

    sources = [index[n.node_id] for n in kept.nodes if not pred_lists[n.node_id]]
    first = min(sources, key=lambda i: file_order[order[i]])
    start = (first,)
    states: dict[tuple[int, ...], int] = {start: 0}
    edges: list[list[int]] = [[]]
    queue: deque[tuple[int, ...]] = deque([start])
    expanded: set[tuple[int, ...]] = set()
    while queue:
        antichain = queue.popleft()
        if antichain in expanded:
            continue
        expanded.add(antichain)
        augmented = augment(antichain)
        present = 0
        for a in augmented:
            present |= 1 << a
        for x in augmented:
            for y in succ[x]:
                if y in antichain or desc[y] & present:
                    continue
                nxt = deaugment([y if z == x else z for z in augmented])
                if nxt not in states:
                    if len(states) >= max_states:
                        raise StateSpaceError(
                            f"the graph has more legal cuts than the planner enumerates "
                            f"(states: more than {max_states}); plan over the prefixes of one "
                            "topological order instead (plan(..., cuts='topological'), or "
                            "'pl-pipedream plan --cuts topological'), or merge parallel "
                            "branches into single layers in the profile"
                        )
                    states[nxt] = len(states)
                    edges.append([])
                edges[states[antichain]].append(states[nxt])
                queue.append(nxt)
    return _finish(nodes, anc, states, edges, augment, inputs, dropped)


def _finish(nodes, anc, states, edges, augment, inputs, dropped) -> PlanningGraph:  # type: ignore[no-untyped-def]
    number = len(states)
    into = [0] * number
    for outs in edges:
        for b in outs:
            into[b] += 1
    order: list[int] = []
    ready = [s for s in range(number) if into[s] == 0]
    while ready:
        current = ready.pop(0)
        order.append(current)
        for b in edges[current]:
            into[b] -= 1
            if into[b] == 0:
                ready.append(b)
    position = {s: i for i, s in enumerate(order)}
    by_id = {v: k for k, v in states.items()}
    state_list = []
    for s in order:
        antichain = by_id[s]
        augmented = augment(antichain)
        members = 0
        for a in augmented:
            members |= anc[a] | (1 << a)
        state_list.append(State(antichain, augmented, members))
    ancestors = [0] * number
    for s in order:
        i = position[s]
        for b in edges[s]:
            ancestors[position[b]] |= ancestors[i] | (1 << i)
    everything = (1 << len(nodes)) - 1
    if state_list[-1].members != everything:
        raise StateSpaceError(
            "the last cut of a profile must follow every layer (the graph has several "
            "unconnected parts); join them or profile them separately"
        )
    return PlanningGraph(nodes, tuple(state_list), tuple(ancestors), inputs, dropped)
