"""The DP's states: the legal cuts of a layer graph, found as PipeDream finds them.

Graphs here are small enough to list every cut by hand. Bit sets are over the kept nodes in
topological order.
"""

from __future__ import annotations

import pytest

from pl_pipedream.planner.states import StateSpaceError, planning_graph
from pl_pipedream.profile.graph import Node, Profile


def node(node_id: str, desc: str = "Linear", output: float = 1.0) -> Node:
    return Node(node_id, desc, 1.0, 2.0, (output,), 0.0)


def diamond() -> Profile:
    """input -> a -> (b, c) -> d -> d[0]: one branch point, one join, an unused selector."""
    return Profile(
        (
            node("in", "Input0"),
            node("a"),
            node("b"),
            node("c"),
            node("d"),
            node("d0", "__getitem__(0)"),
        ),
        (("in", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "d0")),
    )


def test_a_chain_has_one_state_per_layer() -> None:
    graph = planning_graph(Profile.chain([1, 1, 1, 1], [2, 2, 2, 2], [10, 20, 30, 40], [0] * 4))
    assert [n.node_id for n in graph.nodes] == ["layer0", "layer1", "layer2", "layer3"]
    assert [state.antichain for state in graph.states] == [(0,), (1,), (2,), (3,)]
    assert [state.augmented for state in graph.states] == [(0,), (1,), (2,), (3,)]
    assert [graph.members(state.members) for state in graph.states] == [
        ["layer0"],
        ["layer0", "layer1"],
        ["layer0", "layer1", "layer2"],
        ["layer0", "layer1", "layer2", "layer3"],
    ]
    # state j is reachable from every earlier state
    assert graph.ancestors == (0b0, 0b1, 0b11, 0b111)
    assert (graph.inputs, graph.dropped, graph.cuts) == ((), (), "antichain")


def test_inputs_and_unused_selectors_are_set_aside() -> None:
    graph = planning_graph(diamond())
    assert [n.node_id for n in graph.nodes] == ["a", "b", "c", "d"]
    assert graph.inputs == ("in",)
    assert graph.dropped == (("d0", "d"),)  # placed with its producer


def test_a_diamond_has_every_antichain_as_a_state() -> None:
    """After a: the cut through b alone, through c alone, through both, and after d."""
    graph = planning_graph(diamond())
    a, b, c, d = 0, 1, 2, 3
    assert [state.antichain for state in graph.states] == [(a,), (b,), (c,), (b, c), (d,)]
    assert [graph.members(state.members) for state in graph.states] == [
        ["a"],
        ["a", "b"],
        ["a", "c"],
        ["a", "b", "c"],
        ["a", "b", "c", "d"],
    ]
    # A cut through b alone still carries a's output, which c needs later; likewise for c.
    assert graph.states[1].augmented == (a, b)
    assert graph.states[2].augmented == (a, c)
    assert graph.states[4].augmented == (d,)
    # (b) and (c) are unrelated; (b, c) follows both; (d) follows everything.
    assert graph.ancestors == (0b0, 0b1, 0b1, 0b111, 0b1111)


def test_topological_cuts_are_the_prefixes_of_one_order() -> None:
    graph = planning_graph(diamond(), cuts="topological")
    assert graph.cuts == "topological"
    assert [n.node_id for n in graph.nodes] == ["a", "b", "c", "d"]
    assert [graph.members(state.members) for state in graph.states] == [
        ["a"],
        ["a", "b"],
        ["a", "b", "c"],
        ["a", "b", "c", "d"],
    ]
    # the live outputs at each prefix: a is still needed after b, not after c
    assert [state.augmented for state in graph.states] == [(0,), (0, 1), (1, 2), (3,)]
    assert graph.ancestors == (0b0, 0b1, 0b11, 0b111)
    assert (graph.inputs, graph.dropped) == (("in",), (("d0", "d"),))


def test_too_many_cuts_raise_with_the_way_out() -> None:
    with pytest.raises(StateSpaceError, match=r"states: more than 3\).*cuts='topological'"):
        planning_graph(diamond(), max_states=3)
    assert len(planning_graph(diamond(), max_states=5).states) == 5
    assert len(planning_graph(diamond(), max_states=3, cuts="topological").states) == 4


def test_unknown_cuts_are_refused() -> None:
    with pytest.raises(StateSpaceError, match=r"cuts: 'prefix'"):
        planning_graph(diamond(), cuts="prefix")


def test_a_profile_of_only_inputs_is_refused() -> None:
    with pytest.raises(StateSpaceError, match="at least one layer besides its inputs"):
        planning_graph(Profile((node("in", "Input0"),)))


def test_unconnected_parts_are_refused() -> None:
    two_chains = Profile((node("a"), node("b"), node("x"), node("y")), (("a", "b"), ("x", "y")))
    with pytest.raises(StateSpaceError, match="unconnected parts"):
        planning_graph(two_chains)
