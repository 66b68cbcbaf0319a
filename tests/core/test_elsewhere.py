"""Other stages' parameters in user code: their metadata may be read, but computing with them stops
with an error naming the parameter, the stage that holds it and what to use instead."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.elsewhere import HeldElsewhere, mark_other_stages
from pl_pipedream.core.errors import OtherStageParameterError
from pl_pipedream.planner.plan import Plan
from tests.strategy.test_lightning_features import Net, loader, trainer


def cut() -> Net:
    """Stage 0 of [3, 3] on rank 0: layers 3..5 on meta, marked."""
    model = Net()
    for layer in model.net[3:]:
        layer.to("meta")
    assert mark_other_stages(model, model.net, Plan.from_balance([3, 3]), 0) == 2
    return model


def test_metadata_reads_pass_and_give_plain_meta_tensors() -> None:
    model = cut()
    weight = model.net[4].weight
    assert isinstance(weight, HeldElsewhere) and isinstance(weight, nn.Parameter)
    assert (weight.shape, weight.numel(), weight.dtype, weight.device.type) == (
        (3, 8),
        24,
        torch.float32,
        "meta",
    )
    assert weight.requires_grad and weight.is_leaf and weight.grad is None
    assert torch.is_floating_point(weight) and weight.size(0) == 3 and weight.dim() == 2
    assert type(model.state_dict()["net.4.weight"]) is torch.Tensor
    assert type(weight.detach()) is torch.Tensor
    torch.optim.Adam(model.parameters(), lr=0.1)
    copy.deepcopy(model)
    assert model.net[0].weight.device.type == "cpu"  # this stage's own: untouched
    (model.net[0].weight ** 2).sum()


@pytest.mark.parametrize("compute", [lambda p: p.pow(2).sum(), lambda p: p * 2, torch.norm])
def test_computing_with_another_stages_parameter_names_it_and_the_fix(compute) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OtherStageParameterError) as error:
        compute(cut().net[4].weight)
    text = str(error.value)
    assert "(parameter: 'net.4.weight', held by stage 1 (rank 1), used on rank 0 (stage 0)" in text
    assert "use the optimizer's weight_decay=..." in text


class L2(Net):
    """An L2 term over every parameter of the LightningModule in training_step."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        return loss + 1e-4 * sum(p.pow(2).sum() for p in self.parameters())


@pytest.mark.slow
def test_an_l2_term_over_all_parameters_stops_fit_naming_the_parameter() -> None:
    strategy = PipeDreamStrategy(balance=[3, 3], start_method="fork", timeout=30)
    run = trainer(devices=2, strategy=strategy, enable_model_summary=True)
    with pytest.raises(Exception) as error:
        run.fit(L2(), loader(2))
    text = str(error.value)
    assert "(parameter: 'net.0.weight', held by stage 0 (rank 0), used on rank 1 (stage 1)" in text
    assert "meta tensors" not in text
