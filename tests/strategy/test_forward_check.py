"""``forward`` against ``configure_pipeline()`` at setup: a forward that does more than the pipeline
stops every rank with an error saying only the pipeline runs; one that agrees passes."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.strategy.forward_check import check_forward, forward_difference
from tests.runtime.distributed import one_rank_group
from tests.strategy.test_lightning_features import Net, loader, trainer


class Scaled(Net):
    """forward does more than the pipeline: it scales the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.net(x)


class DropoutPipeline(Net):
    """forward equals the pipeline, which has dropout: eval mode and one RNG state."""

    def __init__(self) -> None:
        super().__init__()
        self.net[5] = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.configure_pipeline()(x)


class NoForward(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 3))

    def configure_pipeline(self) -> nn.Sequential:
        return self.net


class Raises(Net):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(x) * mask


class Pair(Net):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x), x


class InPlace(Net):
    """The first layer doubles its input in place; forward is the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.net.insert(0, Doubled())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.configure_pipeline()(x)


class Doubled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


class Both(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class HandsOnATuple(Net):
    """Layer 2 returns a tuple that layer 3 (a Linear) cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.net.insert(2, Both())


SAMPLE = torch.randn(4, 6)


def test_a_first_layer_working_in_place_gets_a_copy_of_the_sample_each_time() -> None:
    # Before, forward and the pipeline ran on one tensor: the second saw it doubled twice and
    # the check reported a forward that "computes something else"; and planning's sample changed.
    sample = SAMPLE.clone()
    model = InPlace()
    assert forward_difference(model, model.configure_pipeline(), sample) is None
    assert torch.equal(sample, SAMPLE)


def verdict(module: nn.Module) -> str | None:
    return forward_difference(module, module.configure_pipeline(), SAMPLE)


def test_a_forward_that_equals_the_pipeline_passes_and_modes_are_restored() -> None:
    model = DropoutPipeline()
    model.train()
    assert verdict(Net()) is None
    assert verdict(model) is None
    assert all(sub.training for sub in model.modules())


@pytest.mark.parametrize(
    ("model", "detail"),
    [
        (Scaled(), "output: values differ by up to"),
        (Raises(), "Raises.forward raised TypeError"),
        (Pair(), "output: forward returned a tuple, the pipeline a tensor of shape (4, 3)"),
    ],
)
def test_a_forward_that_differs_is_named_with_the_fix(model: nn.Module, detail: str) -> None:
    text = verdict(model)
    assert text is not None and detail in text
    assert text.startswith("only the layers of configure_pipeline() run under PipeDreamStrategy")
    assert "`return self.configure_pipeline()(x)`" in text


def test_every_rank_raises_rank_zeros_verdict_and_undefined_forward_is_not_checked() -> None:
    with one_rank_group():
        with pytest.raises(PipelineSetupError, match="Scaled.forward computes something else"):
            check_forward(Scaled(), Scaled().configure_pipeline(), SAMPLE)
        check_forward(Net(), Net().configure_pipeline(), SAMPLE)
        model = NoForward()
        check_forward(model, model.configure_pipeline(), SAMPLE)  # nothing to compare
        scaled = Scaled()
        scaled.net[4].to("meta")  # a later setup: other stages' layers are on meta
        check_forward(scaled, scaled.configure_pipeline(), SAMPLE)


def test_a_layer_that_cannot_take_the_tuple_before_it_names_the_boundary_on_every_rank() -> None:
    model = HandsOnATuple()
    with one_rank_group():
        with pytest.raises(PipelineSetupError) as caught:
            check_forward(model, model.configure_pipeline(), SAMPLE)
    text = str(caught.value)
    assert text.startswith(
        "each layer of the pipeline takes the previous layer's output as its one argument, as "
        "in nn.Sequential (layer 3: Linear, after layer 2: Both, on rank 0 at setup (the forward "
        "check, before the pipeline is cut into stages); passed: tuple(Tensor(4, 8) float32, "
        "Tensor(4, 8) float32); TypeError: linear(): argument"
    )
    assert type(caught.value.__cause__.__cause__) is TypeError  # torch's, chained on rank 0


def test_a_layer_that_raises_otherwise_stops_every_rank_too() -> None:
    model = Net()
    model.net[2] = nn.Linear(5, 8)  # takes 5 features, gets 8
    with one_rank_group():
        with pytest.raises(PipelineSetupError) as caught:
            check_forward(model, model.configure_pipeline(), SAMPLE)
    assert str(caught.value).startswith(
        "the layers of configure_pipeline() must run on one microbatch of the first stage's "
        "input (rank 0 at setup (the forward check, before the pipeline is cut into stages): "
        "RuntimeError: mat1 and mat2"
    )
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.slow
def test_a_forward_that_does_more_stops_fit_on_every_rank() -> None:
    strategy = PipeDreamStrategy(balance=[3, 3], start_method="fork", timeout=30)
    with pytest.raises(Exception, match=r"Scaled.forward computes something else \(checked at"):
        trainer(devices=2, strategy=strategy).fit(Scaled(), loader(2))
