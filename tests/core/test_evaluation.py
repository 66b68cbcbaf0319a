"""``ForwardPipe`` on one rank: the stage's layers without gradients, ``finish`` on the last
stage, in the context given; a second replica does nothing; one rank keeps its own result.
(Several ranks: tests/engine/test_pipeline.py and tests/strategy/test_evaluation.py.)"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from pl_pipedream.core.evaluation import ForwardPipe
from pl_pipedream.core.stage import cut_stage
from pl_pipedream.planner.plan import Plan


def one_stage(replicas: int = 1, rank: int = 0) -> tuple[nn.Sequential, ForwardPipe]:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    plan = Plan.from_balance([3], replicas=[replicas])
    local = cut_stage(layers, layers, plan, rank)
    return layers, ForwardPipe(plan, local, channel=None, rank=rank)  # type: ignore[arg-type]


def test_the_last_stage_finishes_on_the_output_without_gradients() -> None:
    layers, pipe = one_stage()
    x = torch.randn(5, 4)
    entered = []

    @contextmanager
    def context():  # type: ignore[no-untyped-def]
        entered.append(True)
        yield

    def finish(output: torch.Tensor) -> torch.Tensor:
        assert not output.requires_grad
        return output.sum(dim=1)

    result = pipe.forward(lambda: x, finish, "the test activations", context)
    assert torch.allclose(result, layers(x).sum(dim=1))
    assert entered == [True]
    assert pipe.to_every_rank(result, "the test result") is result  # one rank: the last stage
    assert pipe.metrics_source == 0


def test_only_the_first_replica_of_a_stage_runs() -> None:
    _, pipe = one_stage(replicas=2, rank=1)
    assert not pipe.evaluates
    assert pipe.forward(lambda: torch.randn(2, 4), lambda out: out, "the test activations") is None
