"""Resuming from a sharded checkpoint equals the uninterrupted run (async drains at epoch end)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pl_pipedream import PipeDreamStrategy
from tests.strategy.test_lightning_features import Net, loader, trainer


def strategy() -> PipeDreamStrategy:
    return PipeDreamStrategy(
        sync="async", balance=[3, 3], microbatches=2, start_method="spawn", timeout=60
    )


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path) -> None:
    straight = Net(optimizer="adam")
    trainer(devices=2, strategy=strategy(), max_epochs=2).fit(straight, loader(2))

    first = Net(optimizer="adam")
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run = trainer(devices=2, strategy=strategy(), max_epochs=1, callbacks=[saver])
    run.fit(first, loader(2))
    last = tmp_path / "last.ckpt"
    assert (last / "pipeline.json").is_file()

    resumed = Net(optimizer="adam")
    with torch.no_grad():  # only a real restore can undo this
        for param in resumed.parameters():
            param.add_(1.0)
    trainer(devices=2, strategy=strategy(), max_epochs=2).fit(resumed, loader(2), ckpt_path=last)
    for key, tensor in straight.state_dict().items():
        diff = (resumed.state_dict()[key] - tensor).abs().max().item()
        assert diff <= 1e-6, f"{key}: {diff}"
