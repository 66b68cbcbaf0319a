"""data.resumable: a training loader that a mid-epoch checkpoint resumes exactly."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from pl_pipedream.data.resumable import ResumableLoader


def loader() -> ResumableLoader:
    data = TensorDataset(torch.arange(20))
    return ResumableLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
    )


def order(batches: list) -> list[int]:
    return [int(v) for (b,) in batches for v in b]


def test_a_resumed_loader_gives_the_rest_of_the_interrupted_epoch_then_the_next() -> None:
    whole = loader()
    epochs = [order(list(whole)) for _ in range(2)]
    cut = loader()
    it = iter(cut)
    given = order([next(it), next(it)])
    resumed = loader()
    resumed.load_state_dict(cut.state_dict())
    assert given + order(list(resumed)) == epochs[0]
    assert order(list(resumed)) == epochs[1]


def test_without_a_generator_the_state_counts_batches_only() -> None:
    plain = ResumableLoader(TensorDataset(torch.arange(8)), batch_size=2)
    it = iter(plain)
    next(it)
    state = plain.state_dict()
    assert state["given"] == 1 and state["began"] is None
    again = ResumableLoader(TensorDataset(torch.arange(8)), batch_size=2)
    again.load_state_dict(state)
    assert order(list(again)) == [2, 3, 4, 5, 6, 7]
