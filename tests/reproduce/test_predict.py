"""``reproduce.predict``: each row planned on its part of the cluster and its epochs simulated."""

from __future__ import annotations

import pytest

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.published import load_profile
from pl_pipedream.reproduce.epochs import epochs
from pl_pipedream.reproduce.predict import cluster_topology, predict, render_config
from pl_pipedream.reproduce.table import ReproduceError, Row

CLUSTER_A_4X4 = Topology.from_lists([4, 4], [1.2e10, 1.25e9])  # PCIe in a server, 10 Gbps out


def test_the_rows_fill_their_clusters_innermost_first() -> None:
    """1 server of cluster A is PCIe only; cluster C is one flat level."""
    assert cluster_topology("A", 1, 4) == Topology.from_lists([4], [1.2e10])
    assert cluster_topology("A", 4, 4) == CLUSTER_A_4X4
    assert cluster_topology("B", 2, 8) == Topology.from_lists([8, 2], [1.5e11, 3.125e9])
    assert cluster_topology("C", 4, 1) == Topology.from_lists([4], [5e9])


def test_an_unknown_cluster_or_a_part_of_a_server_is_refused() -> None:
    with pytest.raises(ReproduceError, match=r"\(cluster: Z\); add cluster_z.yaml"):
        cluster_topology("Z", 1, 4)
    with pytest.raises(ReproduceError, match=r"servers x GPUs: 1x1"):
        cluster_topology("A", 1, 1)


@pytest.mark.parametrize(
    ("balance", "replicas", "expected"),
    [([3], [16], "16 (DP)"), ([1, 1, 1], [1, 1, 1], "straight"), ([2, 1], [15, 1], "15-1")],
)
def test_configs_are_written_as_the_paper_writes_them(balance, replicas, expected) -> None:
    assert render_config(Plan.from_balance(balance, replicas=replicas)) == expected


def test_a_row_is_the_planner_on_its_published_profile_and_its_epochs() -> None:
    row = Row("VGG-16", "A", 4, 4, "15-1", 5.28)
    (outcome,) = predict([row], profiles=None)
    expected = plan(load_profile("vgg16"), CLUSTER_A_4X4)
    assert outcome.plan == expected
    assert outcome.epochs == epochs(expected, 1_281_167, 64)
    assert outcome.own_plan is None and outcome.own_predicted is None  # no cache: not asked
    assert outcome.ratio == pytest.approx(outcome.epochs.pipedream_speedup / 5.28)
    assert outcome.to_dict()["our_config"] == render_config(expected)


def test_a_model_without_a_published_profile_is_planned_from_nothing() -> None:
    (outcome,) = predict([Row("AWD-LM", "A", 1, 4, "straight", 4.25)], profiles=None)
    assert (outcome.plan, outcome.epochs, outcome.predicted, outcome.ratio) == (None,) * 4
