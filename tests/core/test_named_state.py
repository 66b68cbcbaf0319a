"""Optimizer state keyed by parameter name: saved by the stages of one layout, loaded by the
stages of another, it equals one optimizer over the whole model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.core import named_state
from pl_pipedream.core.errors import CheckpointError


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))


def names_of(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def adam(module: nn.Module) -> torch.optim.Adam:
    """Two groups, as configure_optimizers might build them: weights and biases."""
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in module.named_parameters() if n.endswith("bias")]
    return torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 0.5}], lr=0.1)


def trained(module: nn.Module, steps: int = 3) -> torch.optim.Adam:
    optimizer = adam(module)
    for _ in range(steps):
        module(torch.ones(2, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def keep(optimizer: torch.optim.Optimizer, layers: list[nn.Module]) -> None:
    """What ``placement.keep_local_parameters`` does: each group keeps these layers' params."""
    local = {id(p) for layer in layers for p in layer.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in local]
    for param in [p for p in optimizer.state if id(p) not in local]:
        del optimizer.state[param]  # a rank never holds the state of another stage's params


def stage_states(module: nn.Sequential, stages: list[list[int]]) -> list[dict]:
    """Each stage's named state, as its rank saves it: an optimizer over the whole module
    cut down to the stage's layers (their state equal to the whole optimizer's)."""
    whole = trained(module)
    names = names_of(module)
    full = named_state.group_names(whole.param_groups, names)
    states = []
    for layers in stages:
        optimizer = adam(module)
        optimizer.load_state_dict(whole.state_dict())
        keep(optimizer, [module[i] for i in layers])
        local = named_state.group_names(optimizer.param_groups, names)
        states.append(named_state.to_named(optimizer.state_dict(), full, local))
    return states


def test_the_named_form_lists_every_groups_full_names_and_the_state_by_name() -> None:
    module = model()
    state = stage_states(module, [[0, 1], [2]])[1]
    assert named_state.is_named(state)
    assert state["param_groups"][0]["params"] == ["0.weight", "1.weight", "2.weight"]
    assert state["param_groups"][1]["lr"] == 0.5
    assert sorted(state["state"]) == ["2.bias", "2.weight"]
    assert float(state["state"]["2.weight"]["step"]) == 3.0


def test_two_stages_saved_resume_on_three_as_the_whole_optimizer() -> None:
    module = model()
    merged = named_state.merge(stage_states(module, [[0, 1], [2]]))
    reference = model()
    whole = trained(reference)
    expected = {name: whole.state[param] for name, param in reference.named_parameters()}
    params, names = dict(module.named_parameters()), names_of(module)
    for layer in range(3):  # three stages of one layer each
        optimizer = adam(module)
        keep(optimizer, [module[layer]])
        local = named_state.group_names(optimizer.param_groups, names)
        optimizer.load_state_dict(named_state.to_positional(merged, local))
        assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.5]
        for name in [name for group in local for name in group]:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(optimizer.state[params[name]][key], expected[name][key])


def test_one_devices_positional_state_round_trips_through_names() -> None:
    module = model()
    optimizer = trained(module)
    full = named_state.group_names(optimizer.param_groups, names_of(module))
    named = named_state.to_named(optimizer.state_dict(), full, full)
    back = named_state.to_positional(named, full)
    assert back["param_groups"] == optimizer.state_dict()["param_groups"]
    for index, value in optimizer.state_dict()["state"].items():
        assert torch.equal(back["state"][index]["exp_avg"], value["exp_avg"])


def test_a_tie_saved_by_two_holders_resumes_once() -> None:
    first = {"keyed_by": "name", "param_groups": [{"params": ["w"]}], "state": {"w": {"m": 1}}}
    second = {"keyed_by": "name", "param_groups": [{"params": ["w"]}], "state": {"w": {"m": 1}}}
    assert named_state.merge([first, second])["state"] == {"w": {"m": 1}}


def test_a_parameter_in_another_group_is_refused() -> None:
    named = {
        "keyed_by": "name",
        "param_groups": [{"params": ["a"]}, {"params": ["b"]}],
        "state": {},
    }
    with pytest.raises(CheckpointError) as error:
        named_state.to_positional(named, [["a", "b"], []])
    assert (
        "each parameter must sit in the optimizer's parameter group that saved it (group 0, "
        "not in the checkpoint's group: ['b']); build the parameter groups"
    ) in str(error.value)


def test_another_number_of_groups_is_refused() -> None:
    named = {"keyed_by": "name", "param_groups": [{"params": ["a"]}], "state": {}}
    with pytest.raises(CheckpointError, match=r"\(the optimizer: 2 groups, the checkpoint: 1\)"):
        named_state.to_positional(named, [["a"], []])
