"""runtime.precision: the forward context and the backward seed of a stage."""

from __future__ import annotations

import torch

from pl_pipedream.runtime.precision import StagePrecision


def test_full_precision_enters_nothing_and_seeds_as_autograd_does() -> None:
    plain = StagePrecision()
    with plain.forward():
        assert not torch.is_autocast_enabled("cpu")
    loss = torch.tensor(2.0)
    assert plain.seed(loss, 1.0) is None  # autograd's own seed of 1
    assert torch.equal(plain.seed(loss, 0.25), torch.tensor(0.25))


def test_the_forward_context_is_fresh_for_each_forward() -> None:
    mixed = StagePrecision(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    for _ in range(2):  # a context manager object can be entered once: one per forward
        with mixed.forward():
            out = torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3))
        assert out.dtype == torch.bfloat16


def test_a_loss_scale_multiplies_every_seed() -> None:
    scaled = StagePrecision(scale=lambda seed: seed * 1024.0)
    loss = torch.tensor(3.0)
    assert torch.equal(scaled.seed(loss, 1.0), torch.tensor(1024.0))
    assert torch.equal(scaled.seed(loss, 0.5), torch.tensor(512.0))
