"""Profiles read and write losslessly (PipeDream's graph.txt and our JSON) and reject bad graphs."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from importlib.resources import as_file
from pathlib import Path

import pytest

from pl_pipedream.profile.graph import Node, Profile, ProfileError
from pl_pipedream.published import profile_file, profile_names

GOOD_LINE = (
    "node1 -- Linear(4, 4) -- forward_compute_time=1.5, backward_compute_time=2.5, "
    "activation_size=64.0, parameter_size=80.0"
)


@pytest.fixture(params=profile_names())
def pipedream_file(request: pytest.FixtureRequest) -> Iterator[Path]:
    with as_file(profile_file(request.param)) as path:
        yield path


def assert_same_graph(left: Profile, right: Profile) -> None:
    assert [n.node_id for n in left.nodes] == [n.node_id for n in right.nodes]
    assert left.nodes == right.nodes  # descs, times, activation tuples, parameters, stage ids
    assert left.edges == right.edges
    assert left.batch_size == right.batch_size


# ----- PipeDream's files ----------------------------------------------------------------------


def test_graph_txt_round_trip_is_identical(pipedream_file: Path) -> None:
    profile = Profile.load(pipedream_file)
    again = Profile.from_graph_txt(profile.to_graph_txt())
    assert_same_graph(profile, again)
    assert again.to_graph_txt() == profile.to_graph_txt()


def test_json_round_trip_is_identical(pipedream_file: Path, tmp_path: Path) -> None:
    profile = Profile.load(pipedream_file)
    path = tmp_path / "profile.json"
    profile.save(path)
    again = Profile.load(path)
    assert_same_graph(profile, again)
    assert again.meta == profile.meta


def test_file_values_are_read_as_written(pipedream_file: Path) -> None:
    profile = Profile.load(pipedream_file)
    node_lines = [ln for ln in pipedream_file.read_text().splitlines() if ln and ln[0] != "\t"]
    edge_lines = [ln for ln in pipedream_file.read_text().splitlines() if ln.startswith("\t")]
    assert len(profile.nodes) == len(node_lines)
    assert len(profile.edges) == len(edge_lines)
    first = node_lines[0].split(" -- ")
    assert profile.nodes[0].node_id == first[0]
    assert profile.nodes[0].desc == first[1]


def test_topological_order_respects_every_edge(pipedream_file: Path) -> None:
    profile = Profile.load(pipedream_file)
    position = {node_id: i for i, node_id in enumerate(profile.topological_order())}
    assert len(position) == len(profile.nodes)
    assert all(position[src] < position[dst] for src, dst in profile.edges)


def test_stage_ids_and_several_activations_round_trip() -> None:
    profile = Profile.chain(
        [1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [8.0, (16.0, 4.0, 4.0), 8.0], [0, 4, 0]
    )
    staged = profile.with_nodes(
        dataclasses.replace(node, stage_id=i // 2) for i, node in enumerate(profile.nodes)
    )
    again = Profile.from_graph_txt(staged.to_graph_txt())
    assert [n.stage_id for n in again.nodes] == [0, 0, 1]
    assert again.nodes[1].activation_bytes == (16.0, 4.0, 4.0)
    assert_same_graph(staged, again)
    assert_same_graph(staged, Profile.from_json(staged.to_json()))


def test_json_keeps_batch_size_and_meta() -> None:
    profile = Profile.chain([1.0], [2.0], [3.0], [4.0], batch_size=32, meta={"device": "cpu"})
    again = Profile.from_json(profile.to_json())
    assert again.batch_size == 32
    assert again.meta == {"device": "cpu"}


# ----- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_line",
    [
        "node2 -- ReLU -- forward_compute_time=abc, backward_compute_time=0.1, "
        "activation_size=4.0, parameter_size=0.0",  # not a number
        "node2 -- ReLU -- forward_compute_time=0.1, activation_size=4.0, parameter_size=0.0",
        "node2 -- ReLU",  # no metadata
        "node2 -- ReLU -- forward_compute_time 0.1",  # no '='
        "\tnode1 node2",  # edge without ' -- '
    ],
    ids=["not-a-number", "missing-field", "no-metadata", "no-equals", "bad-edge"],
)
def test_malformed_line_names_file_and_line(bad_line: str, tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    path.write_text(f"{GOOD_LINE}\n{bad_line}\n")
    with pytest.raises(ProfileError, match=r"graph\.txt, line 2"):
        Profile.load(path)


def test_cycle_raises_and_names_file(tmp_path: Path) -> None:
    line2 = GOOD_LINE.replace("node1", "node2")
    path = tmp_path / "cycle.txt"
    path.write_text(f"{GOOD_LINE}\n{line2}\n\tnode1 -- node2\n\tnode2 -- node1\n")
    with pytest.raises(ProfileError, match=r"acyclic.*cycle\.txt"):
        Profile.load(path)


def test_cycle_raises_when_built_directly() -> None:
    nodes = tuple(Node(f"n{i}", "L", 1.0, 1.0, (1.0,), 0.0) for i in range(3))
    with pytest.raises(ProfileError, match="acyclic"):
        Profile(nodes, (("n0", "n1"), ("n1", "n2"), ("n2", "n1")))


def test_edge_to_unknown_node_raises() -> None:
    nodes = (Node("a", "L", 1.0, 1.0, (1.0,), 0.0),)
    with pytest.raises(ProfileError, match="unknown node: b"):
        Profile(nodes, (("a", "b"),))


def test_duplicate_node_ids_raise() -> None:
    node = Node("a", "L", 1.0, 1.0, (1.0,), 0.0)
    with pytest.raises(ProfileError, match="unique"):
        Profile((node, node))


def test_empty_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("\n")
    with pytest.raises(ProfileError, match="at least one node"):
        Profile.load(path)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("forward_compute_time", "-0.5"),
        ("backward_compute_time", "nan"),
        ("activation_size", "-4.0"),
        ("parameter_size", "inf"),
    ],
)
def test_negative_or_non_finite_costs_are_refused_naming_the_node(
    field: str, value: str, tmp_path: Path
) -> None:
    line2 = GOOD_LINE.replace("node1", "node2")
    start = line2.index(field + "=") + len(field) + 1
    end = min(i for i in (line2.find(",", start), len(line2)) if i >= 0)
    path = tmp_path / "graph.txt"
    path.write_text(f"{GOOD_LINE}\n{line2[:start]}{value}{line2[end:]}\n\tnode1 -- node2\n")
    with pytest.raises(ProfileError) as caught:
        Profile.load(path)
    message = str(caught.value)
    assert "finite and non-negative" in message and "node: node2" in message, message
    assert "graph.txt" in message, message


def test_nodes_without_edges_are_refused_naming_them(tmp_path: Path) -> None:
    line2 = GOOD_LINE.replace("node1", "node2")
    path = tmp_path / "graph.txt"
    path.write_text(f"{GOOD_LINE}\n{line2}\n")
    with pytest.raises(ProfileError, match=r"nodes without edges: \['node1', 'node2'\]"):
        Profile.load(path)
    single = Profile.from_graph_txt(GOOD_LINE + "\n")  # one node needs no edge
    assert len(single.nodes) == 1


# ----- chains ---------------------------------------------------------------------------------


def test_chain_names_layers_and_links_them_in_order() -> None:
    profile = Profile.chain(
        [1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], descs=["a", "b", "c"], batch_size=8
    )
    assert [n.node_id for n in profile.nodes] == ["layer0", "layer1", "layer2"]
    assert profile.edges == (("layer0", "layer1"), ("layer1", "layer2"))
    assert profile.nodes[1] == Node("layer1", "b", 2.0, 5.0, (8.0,), 11.0)
    assert profile.batch_size == 8
    assert profile.is_chain()


def test_chain_default_descs() -> None:
    profile = Profile.chain([1, 2], [1, 2], [1, 2], [1, 2])
    assert [n.desc for n in profile.nodes] == ["Layer0", "Layer1"]


def test_chain_rejects_lists_of_different_lengths() -> None:
    with pytest.raises(ProfileError, match="one value per layer"):
        Profile.chain([1, 2], [1, 2], [1], [1, 2])
    with pytest.raises(ProfileError, match="descs 1"):
        Profile.chain([1, 2], [1, 2], [1, 2], [1, 2], descs=["only one"])


def test_is_chain_does_not_depend_on_file_order() -> None:
    chain = Profile.chain([1] * 6, [1] * 6, [1] * 6, [1] * 6)
    shuffled = list(chain.nodes)
    random.Random(0).shuffle(shuffled)
    assert [n.node_id for n in shuffled] != [n.node_id for n in chain.nodes]
    assert Profile(tuple(shuffled), chain.edges).is_chain()


def test_is_chain_is_false_for_branches_skips_and_disconnected_nodes() -> None:
    nodes = tuple(Node(f"n{i}", "L", 1.0, 1.0, (1.0,), 0.0) for i in range(3))
    assert Profile(nodes[:1]).is_chain()
    assert not Profile(nodes[:2]).is_chain()  # two nodes, no edge: built directly, allowed
    four = nodes + (Node("n3", "L", 1.0, 1.0, (1.0,), 0.0),)
    assert not Profile(four, (("n0", "n1"), ("n2", "n3"))).is_chain()  # two pieces
    assert not Profile(nodes, (("n0", "n1"), ("n0", "n2"))).is_chain()  # branch
    assert not Profile(nodes, (("n0", "n1"), ("n1", "n2"), ("n0", "n2"))).is_chain()  # skip
    assert Profile(nodes, (("n2", "n0"), ("n0", "n1"))).is_chain()  # path n2 -> n0 -> n1
