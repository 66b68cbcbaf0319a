"""Automatic planning on a process group: profiled on rank 0, planned, shared with every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream import Pipeline
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.planning import plan_at_setup, plan_profile
from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.schedule.modes import SyncMode
from tests.engine.test_pipeline import M, make_batches, make_model, one_device, sgd
from tests.runtime.distributed import one_rank_group


def test_plan_at_setup_profiles_and_plans_over_the_layer_indices() -> None:
    layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with one_rank_group():
        plan, seconds = plan_at_setup(layers, torch.ones(2, 4), None, torch.device("cpu"))
    assert plan.num_workers == 1 and seconds > 0
    assert [stage.nodes for stage in plan.stages] == [("0", "1", "2")]


def test_plan_at_setup_needs_a_topology_of_the_world_size() -> None:
    layers = nn.Sequential(nn.Linear(4, 2))
    with one_rank_group(), pytest.raises(ValueError, match=r"topology workers: 2, processes: 1\)"):
        plan_at_setup(layers, torch.ones(2, 4), Topology.flat(2, 1e9), torch.device("cpu"))


def test_a_failure_on_rank_zero_reaches_every_rank_as_one_error() -> None:
    layers = nn.Sequential(nn.Linear(4, 2))
    with one_rank_group(), pytest.raises(RuntimeError, match="automatic planning failed on rank 0"):
        plan_at_setup(layers, torch.ones(2, 3), None, torch.device("cpu"))  # wrong width


def six_equal_layers() -> Profile:
    return Profile.chain([10.0] * 6, [20.0] * 6, [1e6] * 6, [4e6] * 6)


def test_setup_plans_the_best_plan_whose_replicas_divide_the_microbatches() -> None:
    """Four workers: the best plan is 2-2; three microbatches do not admit it. The plan is the
    best admitted one (1-3, 0.90x), not a straight pipeline (1-1-1-1, 0.78x), and says what
    it would need."""
    topology = Topology.flat(4, 1e10)
    chosen = plan_profile(six_equal_layers(), topology, microbatches=3)
    assert chosen.shape == "1-3"
    assert chosen.slowest_stage_time < plan(six_equal_layers(), topology, True).slowest_stage_time
    assert "microbatches=4 admits the 2-2 plan" in chosen.meta["advice"]
    assert plan_profile(six_equal_layers(), topology, microbatches=4).shape == "2-2"


def test_a_model_built_empty_is_planned_straight_and_says_why() -> None:
    chosen = plan_profile(six_equal_layers(), Topology.flat(4, 1e10), 4, empty=True)
    assert chosen.shape == "1-1-1-1"
    assert "built empty" in chosen.meta["note"]
    assert "replicated stages (ruled out: the model was built empty)" in chosen.meta["advice"]


CHUNKED = [("zbv", None, "v", 8), ("interleaved", None, "interleaved", 8)]


@pytest.mark.parametrize(
    ("sync", "chunks", "placement", "stages"), [*CHUNKED, ("interleaved", 3, "interleaved", 12)]
)
def test_a_chunked_mode_is_planned_with_its_stages_per_rank(
    sync: str, chunks: int | None, placement: str, stages: int
) -> None:
    layers = Profile.chain([1.0] * 24, [2.0] * 24, [1e3] * 24, [1e3] * 24)
    mode, topology = SyncMode(sync), Topology.flat(4, 1e10)
    chosen = plan_profile(layers, topology, 4, None, mode, chunks_per_rank=chunks)
    assert (chosen.placement, chosen.num_stages, chosen.num_workers) == (placement, stages, 4)
    assert {stage.compute_ms for stage in chosen.stages} == {72.0 / stages}  # 24 equal layers
    assert chosen.slowest_stage_time == pytest.approx(0.072 / 4)  # a rank's share of the model


def test_a_chunked_plan_that_does_not_fit_the_memory_is_refused() -> None:
    """On a GPU the limit is the free memory even without memory=: the plan is checked."""
    layers = Profile.chain([1.0] * 4, [2.0] * 4, [1e6] * 4, [4e6] * 4)
    with pytest.raises(PipelineSetupError, match=r"^a rank holds every one of its stages"):
        plan_profile(layers, Topology.flat(2, 1e10), 2, 1e6, SyncMode.ZBV)
    assert plan_profile(layers, Topology.flat(2, 1e10), 2, 1e9, SyncMode.ZBV).placement == "v"


@pytest.mark.parametrize(("sync", "chunks"), [("zbv", None), ("interleaved", 3)])
def test_a_whole_chunked_pipeline_planned_from_an_example_equals_one_device(
    sync: str, chunks: int | None
) -> None:
    """No balance=: rank 0 profiles and plans its chunks (on one rank, every stage is its)."""
    inputs = make_batches()[0][0]
    example = inputs[: len(inputs) // M]  # one microbatch of the first layer's input
    with one_rank_group():
        with Pipeline(
            make_model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=M,
            example_input=example, chunks_per_rank=chunks,
        ) as pipeline:  # fmt: skip
            assert pipeline.plan.num_stages == (chunks or 2) and len(pipeline.local.stages) > 1
            assert [s.nodes[0] for s in pipeline.plan.stages][0] == "0"  # layer indices
            losses = [pipeline.train_step(batch).item() for batch in make_batches()]
            weights = pipeline.state_dict()["model"]
    expected_losses, expected = one_device(make_batches())
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    for name, tensor in expected.items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-6), name
