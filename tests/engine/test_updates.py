"""``OptimizerUpdate``: the gradient on ``.grad``, the user's optimizer steps, a stash kept."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pl_pipedream.engine.updates import OptimizerUpdate


def _stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict([("0", nn.Linear(3, 2)), ("2", nn.Linear(2, 1))]))


def test_an_update_steps_like_the_optimizer_and_leaves_a_stash_intact() -> None:
    stage, reference = _stage(), _stage()
    update = OptimizerUpdate(stage, torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gradients = {n: torch.full_like(p, 0.5) for n, p in stage.named_parameters()}
    kept = stage.get_parameter("0.weight").detach()  # a stashed version shares this storage
    before = kept.clone()
    storage = {"0.weight": torch.empty_like(kept)}
    update(gradients, storage)
    for name, param in reference.named_parameters():
        param.grad = gradients[name]
    optimizer.step()
    assert torch.equal(kept, before)  # the stash's storage untouched
    assert stage.get_parameter("0.weight").data_ptr() == storage["0.weight"].data_ptr()
    for name, param in reference.named_parameters():
        assert torch.equal(stage.get_parameter(name), param), name
        assert stage.get_parameter(name).grad is None  # zeroed for the next update
    assert update.updates == 1


def test_a_stage_without_an_optimizer_only_moves_storage() -> None:
    stage = _stage()
    update = OptimizerUpdate(stage, None)
    kept = stage.get_parameter("2.bias").detach()
    storage = {"2.bias": torch.empty_like(kept)}
    assert update({}, storage) == kept.numel() * kept.element_size()
    assert torch.equal(stage.get_parameter("2.bias"), kept)
    assert stage.get_parameter("2.bias").data_ptr() == storage["2.bias"].data_ptr()


def test_under_a_loss_scale_an_inf_skips_the_step_and_the_scale_backs_off() -> None:
    from pl_pipedream.core.precision import share_found_inf
    from tests.runtime.distributed import one_rank_group

    with one_rank_group():
        stage = _stage()
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.zeros(()))
        share_found_inf(scaler, torch.device("cpu"))
        update = OptimizerUpdate(stage, torch.optim.SGD(stage.parameters(), lr=0.1), scaler)
        before = {n: p.detach().clone() for n, p in stage.named_parameters()}
        gradients = {n: torch.full_like(p, 4.0) for n, p in stage.named_parameters()}
        gradients["2.bias"] = torch.full_like(gradients["2.bias"], float("inf"))
        update(gradients, {})
        for name, param in stage.named_parameters():
            assert torch.equal(param, before[name]), name  # skipped on every parameter
        assert scaler.get_scale() == 2.0
        gradients = {n: torch.full_like(p, 2.0) for n, p in stage.named_parameters()}
        update(gradients, {})  # unscaled by 2: a gradient of 1, stepped
        for name, param in stage.named_parameters():
            assert torch.allclose(param, before[name] - 0.1), name
        nothing = OptimizerUpdate(stage, None, scaler)  # a stage without parameters agrees too
        nothing({}, {})
        assert scaler.get_scale() == 2.0  # (grows only after 2000 clean steps)
