"""Cutting a LightningModule down to one rank's stage: names, shared state, ``meta`` placement,
and the tie it finds, which the planner and the runtime take as it is."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.stage import cut_stage, pipeline_layers
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import Tie, with_tied_traffic
from pl_pipedream.runtime.tied_versions import TiedVersions


class Model(nn.Module):
    """Four pipeline layers plus state outside the pipeline (a parameter and a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.decoder = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.temperature = nn.Parameter(torch.ones(1))
        self.register_buffer("calls", torch.zeros(1))

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(*self.encoder, self.decoder, self.head)


def test_module_without_configure_pipeline() -> None:
    with pytest.raises(PipelineSetupError, match="has no configure_pipeline"):
        pipeline_layers(nn.Linear(2, 2))


class Returns(nn.Module):
    def __init__(self, layers: object) -> None:
        super().__init__()
        self.own = nn.Linear(2, 2)
        self.layers = layers

    def configure_pipeline(self) -> object:
        return self.layers


def test_configure_pipeline_must_return_a_non_empty_sequential() -> None:
    with pytest.raises(PipelineSetupError, match=r"\(returned: list\)"):
        pipeline_layers(Returns([nn.Linear(2, 2)]))
    with pytest.raises(PipelineSetupError, match=r"\(returned: Sequential of 0\)"):
        pipeline_layers(Returns(nn.Sequential()))


class Fresh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.own = nn.Linear(2, 2)

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.own, nn.ReLU())  # a new ReLU, not an attribute


def test_every_layer_must_be_a_submodule() -> None:
    module = Fresh()
    with pytest.raises(PipelineSetupError, match=r"\(layer 1: ReLU\); assign it"):
        pipeline_layers(module)


def test_pipeline_layers_are_the_modules_own() -> None:
    module = Model()
    layers = pipeline_layers(module)
    assert [id(m) for m in layers] == [
        id(module.encoder[0]),
        id(module.encoder[1]),
        id(module.decoder),
        id(module.head),
    ]


def test_cut_stage_keeps_the_stage_and_moves_the_other_layers_to_meta() -> None:
    module = Model()
    layers = pipeline_layers(module)
    local = cut_stage(module, layers, Plan.from_balance([2, 2]), rank=1)
    assert local.stage.index == 1
    assert list(local.module._modules) == ["2", "3"]
    assert local.names == {
        "2.weight": "decoder.weight",
        "2.bias": "decoder.bias",
        "3.weight": "head.weight",
        "3.bias": "head.bias",
    }
    assert sorted(local.shared) == ["calls", "temperature"]
    assert {p.device.type for p in module.encoder.parameters()} == {"meta"}
    assert module.encoder[1].running_mean.device.type == "meta"
    assert {p.device.type for p in module.head.parameters()} == {"cpu"}
    assert module.temperature.device.type == "cpu"


def test_cut_stage_names_buffers_of_its_layers() -> None:
    module = Model()
    local = cut_stage(module, pipeline_layers(module), Plan.from_balance([2, 2]), rank=0)
    assert local.names["1.running_mean"] == "encoder.1.running_mean"
    assert local.names["0.weight"] == "encoder.0.weight"


def test_the_plan_must_place_every_layer_once() -> None:
    module = Model()
    with pytest.raises(PipelineSetupError, match=r"each of the 4 layers .* \(placed: \['0', '1'"):
        cut_stage(module, pipeline_layers(module), Plan.from_balance([1, 1]), rank=0)


def test_a_rank_outside_the_plan_is_a_setup_error() -> None:
    module = Model()
    with pytest.raises(PipelineSetupError):
        cut_stage(module, pipeline_layers(module), Plan.from_balance([2, 2]), rank=2)


def test_state_dict_uses_the_modules_names_and_stage_zero_adds_the_shared_state() -> None:
    plan = Plan.from_balance([2, 2])
    reference = Model().state_dict()
    states = []
    for rank in (0, 1):
        module = Model()
        states.append(cut_stage(module, pipeline_layers(module), plan, rank).state_dict(module))
    first, last = states
    assert sorted(last) == ["decoder.bias", "decoder.weight", "head.bias", "head.weight"]
    assert "temperature" in first and "calls" in first and "head.weight" not in first
    assert sorted({**first, **last}) == sorted(reference)
    for name, tensor in {**first, **last}.items():
        assert tensor.device.type == "cpu" and not tensor.requires_grad
        assert torch.equal(tensor, reference[name]), name


class Tied(nn.Module):
    """Three layers, the last using the first's weight: a tie between stages 0 and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.middle = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)
        self.last.weight = self.first.weight

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.first, self.middle, self.last)


TIE = Tie(
    names=("first.weight", "last.weight"),
    stages=(0, 2),
    stage_names=("0.weight", "2.weight"),
    stage_ranks=((0, 1), (3,)),
    nbytes=4 * 4 * 4,
)


def test_every_rank_cuts_the_same_tie_and_holds_it_under_its_name() -> None:
    plan = Plan.from_balance([1, 1, 1], replicas=[2, 1, 1])
    for rank in range(plan.num_workers):
        module = Tied()
        local = cut_stage(module, pipeline_layers(module), plan, rank)
        assert local.ties == [TIE]
        name = TIE.name_on(rank)
        assert name == {0: "0.weight", 1: "0.weight", 3: "2.weight"}.get(rank)
        held = dict(local.module.named_parameters())
        assert name is None or held[name] is module.first.weight
        assert local.ties_counted_elsewhere() == ({"2.weight"} if rank == 3 else set())


def test_the_planner_and_the_runtime_take_the_cut_tie_as_it_is() -> None:
    plan = Plan.from_balance([1, 1, 1])
    module = Tied()
    local = cut_stage(module, pipeline_layers(module), plan, rank=2)
    (tie,) = local.ties
    priced = with_tied_traffic(replace(plan, slowest_stage_time=0.01), local.ties, 1e9)
    assert priced.meta["tied"].startswith(f"stages [0, 2]: {tie.nbytes} B")
    channel: Any = None  # never used: building TiedVersions sends nothing
    versions = TiedVersions(local.ties, 2, local.module, channel, 2, "rank 2 (stage 2)")
    assert [held.tie for held in versions.held] == [tie] and versions.held[0].tie is tie
    assert versions.names == {"2.weight"}
