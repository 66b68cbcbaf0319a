"""Clipping by a norm: over the stage, and over every rank (here one rank, a replica counted
once per replica, a tied gradient left out of the count but scaled)."""

from __future__ import annotations

import torch

from pl_pipedream.core.clipping import clip_global_norm, clip_stage_norm
from tests.runtime.distributed import one_rank_group


def test_the_stage_norm_is_clipped_as_torch_clips_it() -> None:
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    expected = [g.clone() for g in grads]
    params = [torch.nn.Parameter(g.clone()) for g in expected]
    for p, g in zip(params, expected, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert clip_stage_norm(grads, 1.0) == 5.0
    for got, param in zip(grads, params, strict=True):
        assert torch.allclose(got, param.grad)
    small = [torch.tensor([0.3, 0.4])]
    assert abs(clip_stage_norm(small, 1.0) - 0.5) < 1e-7 and torch.equal(
        small[0], torch.tensor([0.3, 0.4])
    )


def test_the_global_norm_counts_replicas_once_and_ties_where_counted() -> None:
    tied = torch.tensor([6.0, 8.0])  # counted by another stage: scaled, not counted here
    own = torch.tensor([3.0, 4.0])
    with one_rank_group():
        norm = clip_global_norm([own, tied], [own], 1.0, 1, torch.device("cpu"))
    assert norm == 5.0
    assert torch.allclose(own, torch.tensor([0.6, 0.8]), atol=1e-6)
    assert torch.allclose(tied, torch.tensor([1.2, 1.6]), atol=1e-6)
    replicated = torch.tensor([3.0, 4.0])
    with one_rank_group():  # two replicas hold this gradient: it counts half on each
        norm = clip_global_norm([replicated], [replicated], 100.0, 2, torch.device("cpu"))
    assert abs(norm - (25.0 / 2) ** 0.5) < 1e-9
